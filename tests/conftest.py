"""Shared pytest setup: every module in tests/fixtures/ is a fixture plugin, so helpers add fixtures without editing this file."""
from pathlib import Path

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}" for p in (Path(__file__).parent / "fixtures").glob("*.py") if p.stem != "__init__"
)
