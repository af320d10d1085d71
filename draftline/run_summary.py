"""The pipeline's final table: its rows from the evaluation's results, printed on the terminal or as plain text."""
from __future__ import annotations

from typing import Any

from draftline.config import PipelineConfig
from draftline.layout import report_page_key
from draftline.store import open_store


def _shift_note(reference_summary: dict) -> str:
    kept = [f"{r['kept_share']:.0%} with layers {tuple(r['aux_layer_ids'])}"
            for r in reference_summary.get("aux_shift_acceptance") or [] if r.get("kept_share") is not None]
    return f"; the drafter keeps {' and '.join(kept)} of its accepted tokens" if kept else ""


def summary_rows(results: list, reference_summary: dict | None, basis_said: str | None = None
                 ) -> list[dict[str, Any]]:
    """One row per engine and concurrency, plus the reference decoder: the pipeline's final table."""
    if reference_summary is not None and reference_summary.get("status") == "skipped":
        rows = [{"engine": "reference decoder (torch)", "status": "skipped", "concurrency": None,
                 "acceptance_length": None, "speedup": None, "parity": None, "note": basis_said}]
    elif reference_summary is None:
        rows = [{"engine": "reference decoder (torch)", "status": "not run", "concurrency": None,
                 "acceptance_length": None, "speedup": None, "parity": None,
                 "note": "every engine's export was refused before serving, so there was nothing to compare"}]
    else:
        rows = [{"engine": "reference decoder (torch)", "status": "ok", "concurrency": 1,
                 "acceptance_length": round(reference_summary["mean_acceptance_length"], 3),
                 "speedup": round(reference_summary.get("speedup", float("nan")), 3),
                 "parity": None, "note": "engine-independent ground truth" + _shift_note(reference_summary)}]
    for r in results:
        if r.status != "ok":
            rows.append({"engine": r.engine, "status": r.status, "concurrency": None, "acceptance_length": None,
                         "speedup": None, "parity": None, "note": r.reason})
            continue
        parity = r.parity.value if r.parity else None
        note = r.parity.verdict if r.parity else ""
        for p in r.points:
            rows.append({"engine": f"{r.engine} {r.engine_version}", "status": r.status,
                         "concurrency": p.concurrency,
                         "acceptance_length": round(p.acceptance.mean_acceptance_length, 3) if p.acceptance else None,
                         "speedup": round(p.speedup, 3), "parity": round(parity, 3) if parity is not None else None,
                         "note": note})
    return rows


def report_location(config: PipelineConfig) -> str | None:
    """The store URI of the run's evaluation report, when one was written."""
    store = open_store(config.store.root)
    key = report_page_key(config.run)
    return store.uri(key) if store.exists(key) else None


def print_summary(config: PipelineConfig, report: dict[str, Any], elapsed_s: float | None = None,
                  stage_times: list[dict] | None = None) -> None:
    """The final table on the terminal, each stage's wall time (marking those served from cache), and where the
    artifacts are."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped or logged (CI, make): rich would wrap the notes at 80 columns
        console = Console(width=140)
    _render_summary(console, config, report, elapsed_s, stage_times)


def summary_text(config: PipelineConfig, report: dict[str, Any], elapsed_s: float | None = None,
                 stage_times: list[dict] | None = None) -> str:
    """print_summary's lines as plain text: the last line of a deployed pipeline run's log."""
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=140, color_system=None)
    _render_summary(console, config, report, elapsed_s, stage_times)
    return console.file.getvalue().rstrip()


def _render_summary(console, config: PipelineConfig, report: dict[str, Any], elapsed_s: float | None,
                    stage_times: list[dict] | None) -> None:
    from rich.table import Table

    table = Table(title=f"draftline run {config.run!r}: target {config.target.display_name}")
    for col in ("engine", "status", "concurrency", "acceptance_length", "speedup", "parity", "note"):
        table.add_column(col.replace("_", " "), overflow="fold")
    for row in report["rows"]:
        table.add_row(*("" if row[c] is None else str(row[c]) for c in
                        ("engine", "status", "concurrency", "acceptance_length", "speedup", "parity", "note")))
    console.print(table)
    for line in report.get("schedules") or []:
        console.print(line, soft_wrap=True, markup=False)
    store = open_store(config.store.root)
    console.print(f"artifacts: {store.uri(config.run)}")
    console.print(f"report:    {store.uri(report['report_key'])}")
    if stage_times:
        console.print("stages: " + "; ".join(_stage_time(t) for t in stage_times), soft_wrap=True)
    if elapsed_s is not None:
        console.print(f"pipeline finished in {elapsed_s / 60:.1f} min")


def _stage_time(row: dict) -> str:
    """E.g. "traces 61.2 s", or "traces 1.0 s (cached: nothing recomputed)" when Prefect served every task of it."""
    text = f"{row['stage']} {row['wall_s']:.1f} s"
    if row.get("cached"):
        text += " (cached: nothing recomputed)"
    return text
