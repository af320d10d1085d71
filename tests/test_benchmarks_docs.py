"""benchmarks/RESULTS.md stays a short summary whose files exist, and each benchmark's module docstring stays short."""
from __future__ import annotations

import ast
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = BENCHMARKS / "RESULTS.md"
MAX_RESULTS_LINES = 300
MAX_DOCSTRING_LINES = 12


def _results_text() -> str:
    return RESULTS.read_text(encoding="utf-8")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_results_summary_stays_under_its_line_limit():
    lines = _results_text().splitlines()
    assert len(lines) < MAX_RESULTS_LINES, (
        f"benchmarks/RESULTS.md has {len(lines)} lines; move older runs and explanations to benchmarks/log/")


def test_every_results_file_the_summary_names_exists():
    # Paths are written `results/NAME` (relative to benchmarks/) or `benchmarks/results/NAME`.
    named = set(re.findall(r"(?<![\w/])(?:benchmarks/)?results/([\w.\-/]*[\w\-])", _results_text()))
    assert named, "RESULTS.md names no results file"
    missing = sorted(name for name in named if not (BENCHMARKS / "results" / name).exists())
    assert not missing, f"RESULTS.md names results files that do not exist: {missing}"


def test_the_summary_links_resolve():
    text = _results_text()
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith("#"):
            assert target[1:] in anchors, f"RESULTS.md links to a missing section: {target}"
        else:
            assert (BENCHMARKS / target).exists(), f"RESULTS.md links to a missing file: {target}"


def test_each_benchmark_module_docstring_is_short():
    for module in sorted(BENCHMARKS.glob("*.py")):
        docstring = ast.get_docstring(ast.parse(module.read_text(encoding="utf-8")), clean=False)
        assert docstring, f"{module.name} has no module docstring"
        assert len(docstring.strip().splitlines()) <= MAX_DOCSTRING_LINES, (
            f"{module.name}'s docstring has more than {MAX_DOCSTRING_LINES} lines; details go to benchmarks/RESULTS.md")
