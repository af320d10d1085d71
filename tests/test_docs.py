"""The README and the documentation site: their claims that point into the repository hold, the README stays a short
door without dated figures, the site builds without a warning, and the demo's output reaches the docs by its script."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
# The faults the reliability table must cover, each as the start of a row's first cell.
FAULTS = ("engine dies in load", "engine hangs silently in load", "worker killed", "training killed",
          "S3 server restarted mid-upload", "corrupt shard", "wrong S3 credentials", "bad config")
README_MAX_LINES = 150
# A markdown link or image: [text](target); the target up to a space or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def section(text: str, title: str) -> str:
    """The text under `## title`, up to the next level-2 heading."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first markdown table in `text`, as lists of cell texts."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(lines) > 2 and set(lines[1].replace("|", "").split()) == {"---"}, "no table"
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def module_functions(path: Path) -> set[str]:
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_test_the_reliability_table_names_exists():
    rows = table_rows((DOCS / "reliability.md").read_text())
    named = []
    for fault, seen, tests in rows:
        refs = TEST_REF.findall(tests)
        assert refs and seen, f"the row for {fault!r} names no test or says nothing the user sees"
        named += refs
    missing = [f"{path}::{name}" for path, name in named
               if not (ROOT / path).is_file() or name not in module_functions(ROOT / path)]
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
    for fault in FAULTS:
        assert any(row[0].startswith(fault) for row in rows), f"no row for {fault!r}"


def test_the_local_server_block_waits_for_the_api_and_stops_the_workers_before_the_server():
    """docs/prefect.md's block is pasted whole: nothing asks the API before it answers, and the stop ends the
    workers while the server still answers (a worker stopped after its server retries it for half a minute)."""
    text = section((DOCS / "prefect.md").read_text(), "A Prefect server on your machine")
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    start, stop = blocks[0].splitlines(), blocks[-1]
    waits = next(i for i, line in enumerate(start) if "prefect server status --wait" in line)
    asks = next(i for i, line in enumerate(start)
                if re.search(r"prefect (work-pool|deploy|--no-prompt|automation)", line))
    assert waits < asks, "the block uses the API before waiting for it"
    assert stop.index("kill $WORKERS") < stop.index("kill $SERVER"), stop


def test_the_configuration_page_lists_every_example():
    text = section((DOCS / "configuration.md").read_text(), "The examples")
    listed = set(re.findall(r"^- `configs/([\w.-]+\.yaml)`: ", text, re.M))
    assert listed == {p.name for p in (ROOT / "configs").glob("*.yaml")}


def test_the_readme_is_a_short_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_the_readme_has_no_dates():
    # Dated figures go stale in the README: measurements live in benchmarks/RESULTS.md.
    dates = re.findall(r"\b\d{4}-\d{2}-\d{2}\b", README.read_text())
    assert not dates, f"README.md names dates {dates}; put dated measurements in benchmarks/RESULTS.md"


def test_every_relative_link_in_the_readme_points_at_a_file():
    targets = [t for t in LINK.findall(README.read_text()) if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", t)]
    assert targets, "the README links to no page of the docs"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_site_builds_without_a_warning(tmp_path):
    # mkdocs.yml sets strict and turns every doubtful link, anchor or page into a warning, which fails the build.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d",
                           str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "WARNING" not in said, said
    assert (tmp_path / "site" / "quickstart" / "index.html").is_file()
    # The benchmarks page carries benchmarks/RESULTS.md, whose first heading sits under the page's own title.
    first_heading = next(line for line in (ROOT / "benchmarks/RESULTS.md").read_text().splitlines()
                         if line.startswith("# "))
    assert first_heading[2:] in (tmp_path / "site" / "benchmarks" / "index.html").read_text()


def _finished_demo_run(store: Path) -> Path:
    """What a demo run leaves where the script reads: the report's results and plots, the reference's result."""
    from draftline.eval_result import EvalResult

    run = store / "demo"
    report = run / "eval" / "report"
    report.mkdir(parents=True)
    skipped = EvalResult(run="demo", engine="sglang", engine_version=None, status="skipped",
                         reason="skipped: needs a GPU worker with sglang; sglang is not installed in this environment",
                         hardware="cpu", target="demo-llama", target_path="assets/demo-llama", drafter="export/sglang",
                         drafter_path="runs/demo/export/sglang", prompt_set="eval_prompts.jsonl",
                         num_speculative_tokens=3)
    (report / "results.json").write_text(json.dumps([skipped.model_dump(mode="json")]))
    for name in ("acceptance_by_position", "throughput_speedup", "training_curves"):
        (report / f"{name}.png").write_bytes(b"\x89PNG " + name.encode())
    (run / "eval" / "reference").mkdir()
    (run / "eval" / "reference" / "result.json").write_text(json.dumps({"mean_acceptance_length": 2.25,
                                                                        "speedup": 1.5}))
    return run


def test_the_demo_output_script_puts_a_runs_table_and_plots_into_the_docs(tmp_path):
    run = _finished_demo_run(tmp_path / "runs")
    docs = tmp_path / "docs"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run([str(ROOT / "scripts/docs-demo-output.sh"), str(run), str(ROOT / "configs/demo.yaml"),
                           str(docs)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("acceptance_by_position", "throughput_speedup", "training_curves"):
        assert (docs / "assets" / "demo" / f"{name}.png").read_bytes() == b"\x89PNG " + name.encode()
    table = (docs / "snippets" / "demo-final-table.md").read_text()
    assert "generated by scripts/docs-demo-output.sh" in table
    assert "draftline run 'demo': target demo-llama" in table
    assert "reference decoder (torch)" in table and "2.25" in table
    assert "skipped: needs a GPU worker with sglang" in table


def test_the_demo_output_script_refuses_a_run_that_did_not_finish(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run([str(ROOT / "scripts/docs-demo-output.sh"), str(tmp_path / "nothing"),
                           str(ROOT / "configs/demo.yaml"), str(tmp_path / "docs")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "is not a finished run; run make demo first" in done.stderr
    assert not (tmp_path / "docs").exists()
