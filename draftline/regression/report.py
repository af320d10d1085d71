"""The comparison page of a night: its markdown table against history, the verdict as JSON and the history plot."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from draftline.config import RegressionConfig
from draftline.regression.history import CAUSE_TITLES, History, HistoryRecord, _fmt
from draftline.regression.judgement import ESTIMATE_FIGURE, GAP_METRIC, Verdict, parity_floor
from draftline.schedule import falls_below

SCHEDULE_METRIC = "verified schedule's speedup"


def _floor_text(cfg: RegressionConfig) -> str:
    return (f"{cfg.parity_floor:.2f}" if cfg.parity_floor != "auto" else
            "the threshold each evaluation set for its target")


def comparison_rows(verdict: Verdict, cfg: RegressionConfig) -> list[dict[str, Any]]:
    """One row per engine and watched figure: tonight, last good, median, change, limit, verdict."""
    rows = []
    for e in verdict.engines:
        f, last = e.figures, e.last_good
        base = {"engine": e.engine, "engine version": f.engine_version or "not installed", "hardware": f.hardware}
        cause = "; ".join(CAUSE_TITLES[c.kind] for c in e.causes)
        if e.status in ("skipped", "failed"):
            rows.append({**base, "figure": "evaluation", "tonight": f.status, "last good": "", "median": "",
                         "change vs last good": "", "limit": "", "verdict": f"{e.status}: {f.reason}",
                         "cause": cause})
            continue
        flagged = {(x.metric, x.concurrency) for x in e.findings}
        acc_limit = f"-{cfg.max_acceptance_drop:.0%}"
        items: list[tuple[str, int | None, float | None, float | None, str]] = [
            ("mean acceptance length", None, f.acceptance_length, last.acceptance_length if last else None, acc_limit),
            (ESTIMATE_FIGURE, None, f.offline_acceptance_length, last.offline_acceptance_length if last else None,
             "not watched"),
            (GAP_METRIC, None, f.acceptance_over_offline, last.acceptance_over_offline if last else None,
             f"-{cfg.max_estimate_gap_drop:.0%}"),
            ("reference acceptance length", None, f.reference_acceptance_length,
             last.reference_acceptance_length if last else None, acc_limit),
            ("parity with the reference decoder", None, f.parity, last.parity if last else None,
             f">= {parity_floor(f, cfg):.2f}" + (f" ({f.parity_threshold_source})" if cfg.parity_floor == "auto"
                                                   and f.parity_threshold_source else "")),
        ]
        items += [("speedup", c, v, last.speedup.get(c) if last else None, f"-{cfg.max_speedup_drop:.0%}")
                  for c, v in sorted(f.speedup.items())]
        items += [("EAGLE-3 throughput (tok/s)", c, v, last.throughput.get(c) if last else None,
                   f"-{cfg.max_throughput_drop:.0%}") for c, v in sorted(f.throughput.items())]
        last_schedule = {c.concurrency: c.speedup for c in last.schedule_comparisons} if last else {}
        slower = {c.concurrency for c in f.schedule_comparisons if falls_below(c, cfg.max_schedule_shortfall)}
        flagged |= {(SCHEDULE_METRIC, c) for c in slower}
        items += [(SCHEDULE_METRIC, c.concurrency, c.speedup, last_schedule.get(c.concurrency),
                   f"not below 1.00 by more than {cfg.max_schedule_shortfall:.0%} and the spread")
                  for c in f.schedule_comparisons]
        for metric, conc, new, old, limit in items:
            med = e.median.get(metric if conc is None else f"{metric} @c{conc}")
            bad = (metric, conc) in flagged
            rows.append({**base, "figure": metric + (f" @ concurrency {conc}" if conc is not None else ""),
                         "tonight": _fmt(new), "last good": _fmt(old), "median": _fmt(med),
                         "change vs last good": f"{(new - old) / old:+.1%}" if new is not None and old else "",
                         "limit": limit,
                         "verdict": "REGRESSED" if bad else ("baseline" if e.status == "baseline" else "ok"),
                         "cause": cause if bad else ""})
    return rows


def comparison_markdown(verdict: Verdict, cfg: RegressionConfig, plot_name: str | None = "history.png") -> str:
    """The comparison page: verdict, causes, the table, notes and the history plot."""
    state = "REGRESSED" if verdict.regressed else "passed"
    lines = [f"# Nightly regression check: {state}", "",
             f"Checked {verdict.checked_at}: drafter {verdict.drafter} (lineage {verdict.lineage}) on target "
             f"{verdict.target}. Limits: acceptance length -{cfg.max_acceptance_drop:.0%}, acceptance over the training "
             f"estimate -{cfg.max_estimate_gap_drop:.0%}, speedup "
             f"-{cfg.max_speedup_drop:.0%}, throughput -{cfg.max_throughput_drop:.0%} against the last good run or "
             f"the median of up to {cfg.median_window} good runs; parity floor {_floor_text(cfg)}.", ""]
    for e in verdict.engines:
        lines.append(f"- **{e.engine}**: {e.message()}")
    schedules = [f"- {e.engine} schedule by load (recorded): {e.figures.schedule_description}" for e in verdict.engines
                 if e.figures.schedule_description]
    if schedules:
        lines += [""] + schedules
    causes = [(e.engine, c) for e in verdict.engines for c in e.causes]
    if causes:
        lines += ["", "## Cause", ""]
        lines += [f"- {engine}: {c.sentence()}" for engine, c in causes]
    rows = comparison_rows(verdict, cfg)
    if rows:
        cols = list(rows[0])
        lines += ["", "## Tonight against history", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r[c]).replace("|", "/") for c in cols) + " |" for r in rows]
    notes = [f"{e.engine}: {n}" for e in verdict.engines for n in e.notes]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    if plot_name:
        lines += ["", f"![history]({plot_name})"]
    return "\n".join(lines) + "\n"


def plot_history(verdict: Verdict, history: dict[str, list[HistoryRecord]], path: Path) -> None:
    """Acceptance length (engine and reference) and speedup over the recorded nights, tonight last."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    for e in verdict.engines:
        if e.figures.status != "ok":
            reason = (e.figures.reason or "")[:60] + ("..." if len(e.figures.reason or "") > 60 else "")
            ax1.plot([], [], " ", label=f"{e.engine}: {e.figures.status} ({reason})")
            continue
        past = [r for r in history.get(e.engine, []) if r.figures.status == "ok"]
        figs = [r.figures for r in past] + [e.figures]
        xs = list(range(-len(past), 1))
        ax1.plot(xs, [f.acceptance_length for f in figs], "o-", label=f"{e.engine} engine")
        ax1.plot(xs, [f.reference_acceptance_length for f in figs], "s--", label=f"{e.engine} run: reference decoder")
        if any(f.offline_acceptance_length is not None for f in figs):
            ax1.plot(xs, [f.offline_acceptance_length for f in figs], "^:", label=f"{e.engine} run: training estimate")
        for c in sorted(e.figures.speedup):
            ax2.plot(xs, [f.speedup.get(c) for f in figs], "o-", label=f"{e.engine} @ concurrency {c}")
        bad = [x for x, r in zip(xs, past) if not r.good]
        if bad:
            ax1.plot(bad, [past[xs.index(x)].figures.acceptance_length for x in bad], "rx", ms=10,
                     label=f"{e.engine}: regressed nights")
        if e.status == "regressed":
            ax1.plot([0], [e.figures.acceptance_length], "r*", ms=14, label=f"{e.engine}: tonight, regressed")
    ax1.set_ylabel("mean acceptance length")
    ax2.set_ylabel("speedup (EAGLE-3 / baseline)")
    ax2.axhline(1.0, color="grey", lw=0.8)
    for ax in (ax1, ax2):
        ax.set_xlabel("night (0 = tonight)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"target {verdict.target}, drafter {verdict.drafter} (lineage {verdict.lineage})", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_comparison(verdict: Verdict, history: History, cfg: RegressionConfig, store, prefix: str) -> dict[str, str]:
    """comparison.md, comparison.json (the verdict) and history.png under `prefix`; returns {name: store key}."""
    import tempfile

    series = {e.engine: history.records(e.figures.target, e.engine, e.figures.lineage) for e in verdict.engines}
    keys = {}
    with tempfile.TemporaryDirectory(prefix="draftline-regression-") as tmp:
        tmp = Path(tmp)
        (tmp / "comparison.md").write_text(comparison_markdown(verdict, cfg))
        (tmp / "comparison.json").write_text(verdict.model_dump_json(indent=2) + "\n")
        plot_history(verdict, series, tmp / "history.png")
        for name in ("comparison.md", "comparison.json", "history.png"):
            keys[name] = f"{prefix.strip('/')}/{name}"
            store.put_file(keys[name], tmp / name)
    return keys
