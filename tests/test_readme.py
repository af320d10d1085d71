"""The README's claims that point into the repository: its reliability table names tests that exist, and its
Configuration section lists every example in configs/."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
# The faults the README's table must cover, each as the start of a row's first cell.
FAULTS = ("engine dies in load", "engine hangs silently in load", "worker killed", "training killed",
          "S3 server restarted mid-upload", "corrupt shard", "wrong S3 credentials", "bad config")


def section(title: str) -> str:
    """The README's text under `## title`, up to the next level-2 heading."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else len(README)]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first markdown table in `text`, as lists of cell texts."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(lines) > 2 and set(lines[1].replace("|", "").split()) == {"---"}, "no table"
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def module_functions(path: Path) -> set[str]:
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_test_the_reliability_table_names_exists():
    rows = table_rows(section("Reliability: faults the tests inject"))
    named = []
    for fault, seen, tests in rows:
        refs = TEST_REF.findall(tests)
        assert refs and seen, f"the row for {fault!r} names no test or says nothing the user sees"
        named += refs
    missing = [f"{path}::{name}" for path, name in named
               if not (ROOT / path).is_file() or name not in module_functions(ROOT / path)]
    assert not missing, f"the README's reliability table names tests that do not exist: {missing}"
    for fault in FAULTS:
        assert any(row[0].startswith(fault) for row in rows), f"no row for {fault!r}"


def test_the_configuration_section_lists_every_example():
    text = section("Configuration")
    listed = set(re.findall(r"^- `configs/([\w.-]+\.yaml)`: ", text, re.M))
    assert listed == {p.name for p in (ROOT / "configs").glob("*.yaml")}
