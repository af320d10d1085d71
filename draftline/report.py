"""Turns EvalResults into the report in the store: a markdown page with PNG plots, readable without draftline."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from draftline.engines.sglang_findings import sglang_overlap_finding, sglang_prefill_graph_finding
from draftline.errors import ConfigError
from draftline.eval_result import EvalResult, timestamp
from draftline.layout import report_prefix, trace_stats_key, training_record_key
from draftline.parity import logged_aux_layers
from draftline.schedule_report import SCHEDULE_PLOT, plot_schedule, schedule_markdown


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _status(r: EvalResult) -> str:
    reason = r.reason or ""
    return reason if reason.startswith(r.status) else f"{r.status}: {reason}"


def slowdown_findings(r: EvalResult) -> list[str]:
    """Why EAGLE-3 made an engine slower at some concurrency when the drafter itself is not at fault (parity fine):
    what the engine's own timings say, per slower point. Empty when nothing got slower or acceptance is suspect."""
    # Parity not measured (a reference that accepts almost nothing) says nothing about the drafter either.
    if r.status != "ok" or not r.parity or r.parity.integration_suspected or r.parity.value is None:
        return []
    slow = [p for p in r.points if p.speedup < 1.0]
    if not slow:
        return []
    out = [f"Acceptance matches the reference decoder (parity {r.parity.value:.2f}), so the drafter earns its tokens: "
           "the time goes to the engine's own cost of speculation."]
    for p in slow:
        tau = p.acceptance.mean_acceptance_length if p.acceptance else None
        parts = [f"concurrency {p.concurrency}: {p.speedup:.2f}x"]
        b_ttft, s_ttft = p.baseline.ttft_mean_s, p.speculative.ttft_mean_s
        if b_ttft and s_ttft and s_ttft > 1.5 * b_ttft:
            parts.append(f"time to first token {s_ttft / b_ttft:.1f}x the baseline's ({b_ttft * 1e3:.1f} -> "
                         f"{s_ttft * 1e3:.1f} ms): each request's prefill with the drafter costs more, which short "
                         "answers cannot amortise")
        b_tpot, s_tpot = p.baseline.tpot_mean_s, p.speculative.tpot_mean_s
        burst = [name for name, m in (("baseline", p.baseline), ("EAGLE-3", p.speculative))
                 if m.ttft_mean_s and m.ttft_mean_s > 0.5 * m.latency_mean_s]
        if burst:
            # A server that sends a response's tokens together leaves no per-token time to compare.
            parts.append(f"the {' and '.join(burst)} server sent most of each response at once (time to first token "
                         "over half the latency), so time per output token cannot say what a step costs")
        elif b_tpot and s_tpot and tau and s_tpot > b_tpot / tau:
            parts.append(f"a verification step (TPOT x acceptance length = {s_tpot * tau * 1e3:.2f} ms for "
                         f"{tau:.2f} tokens) takes {s_tpot * tau / b_tpot:.1f} baseline steps ({b_tpot * 1e3:.2f} ms)")
        out.append("; ".join(parts) + ".")
    if r.engine == "sglang":
        out += sglang_overlap_finding(r)
    return out


def engine_log_findings(r: EvalResult) -> list[str]:
    """What the servers' own logs said that bears on the figures (EvalResult.server_log_facts), whatever the
    speedup and parity: the aux layers vLLM fed the drafter, SGLang's prefills without CUDA graphs."""
    logged = logged_aux_layers(r)
    return ([logged[0] + "."] if logged else []) + sglang_prefill_graph_finding(r)


def _identity_cells(r: EvalResult) -> str:
    """The first cells of every report row: what its figures belong to."""
    return (f"| {r.engine} | {r.engine_version or 'not installed'} | {r.hardware} | {r.target_label()} | "
            f"{r.drafter_label().removeprefix('drafter ')} | {r.prompt_set} ")


def _spread(median: float, low: float, high: float, repeats: int, spec: str = ".1f", unit: str = "") -> str:
    """"175.5 (170.2-180.9)"; the median alone after one repeat."""
    if repeats < 2:
        return f"{median:{spec}}{unit}"
    return f"{median:{spec}}{unit} ({low:{spec}}{unit}-{high:{spec}}{unit})"


def _pair(base: float | None, spec: float | None, fmt: str = ".3f") -> str:
    return f"{_fmt(base, fmt)} / {_fmt(spec, fmt)}"


def measurement_sentence(results: list[EvalResult]) -> str:
    """How the throughput table was measured: the warm-up wave left out, and the repeats behind each figure."""
    counts: dict[int, list[str]] = {}
    for r in results:
        if r.status == "ok" and r.points:
            counts.setdefault(min(p.repeats for p in r.points), []).append(r.engine)

    def said(n: int) -> str:
        return "one repeat: no spread" if n == 1 else f"{n} repeats, median (min-max)"

    if len(counts) > 1:
        repeats = "; ".join(f"{', '.join(engines)}: {said(n)}" for n, engines in sorted(counts.items()))
    else:
        repeats = said(next(iter(counts), 1))
    return ("Each concurrency point sends one unmeasured warm-up wave (one request per slot) to the server, then "
            "measures the same requests (requests x repeats) again on that server; the warm-up is excluded from "
            f"every figure. Throughput and speedup: {repeats}; the speedup range goes from the slowest EAGLE-3 repeat "
            "over the fastest baseline repeat to the fastest over the slowest. Latency and time to first token (TTFT) "
            "percentiles are over every measured request; output tokens are per repeat.")


def report_markdown(results: list[EvalResult], training: dict | None = None, run: str | None = None,
                    traces: dict | None = None, parity_basis: str | None = None) -> str:
    """The report page; `training` is the run's training record (train/metrics.json), None when it has none;
    `traces` the run's trace stats (traces/stats.json), None when it made no traces; `parity_basis` the sentence on
    what parity compared the engines with, when not the reference decoder."""
    run = run or next((r.run for r in results), None)
    lines = ["# Drafter evaluation", ""]
    when = max((r.finished_at or "" for r in results), default="")
    lines += [f"Generated {when or timestamp()} by draftline. Every row names the engine, engine version, hardware, "
              "target, drafter and prompt set its numbers belong to.", ""]
    for r in results:  # a fault the engine's log or preflight proves comes before any figure
        if r.parity and r.parity.integration_fault:
            lines += [f"**{r.parity.integration_fault.capitalize()} ({r.engine} {r.engine_version or ''}).** "
                      f"{r.parity.verdict.split(': ', 2)[-1]}", ""]
        elif r.fault:
            lines += [f"**{r.fault.capitalize()} ({r.engine} {r.engine_version or ''}), refused before serving.** "
                      f"{r.reason}", ""]
    lines += ["## Throughput and acceptance", "", measurement_sentence(results), "",
              "| engine | version | hardware | target | drafter | prompt set | k | concurrency | requests x repeats | "
              "output tokens base / spec | baseline tok/s | EAGLE-3 tok/s | speedup | mean acceptance length | "
              "latency p50 / p90 base (s) | latency p50 / p90 spec (s) | TTFT p50 / p90 base (s) | "
              "TTFT p50 / p90 spec (s) | TPOT base / spec (ms) | greedy outputs identical |",
              "|" + "---|" * 20]
    for r in results:
        ident = _identity_cells(r) + f"| {r.num_speculative_tokens} "
        if r.status != "ok":
            lines.append(ident + f"| {_status(r)} |" + " |" * 12)
            continue
        for p in r.points:
            b, s = p.baseline, p.speculative
            acc = p.acceptance.mean_acceptance_length if p.acceptance else None
            tpot_b = b.tpot_mean_s * 1e3 if b.tpot_mean_s else None
            tpot_s = s.tpot_mean_s * 1e3 if s.tpot_mean_s else None
            same = f"{p.identical_outputs:.0%}" if p.identical_outputs is not None else "n/a (sampling)"
            speedup_range = (p.speedup_min if p.speedup_min is not None else p.speedup,
                             p.speedup_max if p.speedup_max is not None else p.speedup)
            lines.append(
                ident + f"| {p.concurrency} | {b.requests} x {p.repeats} | {b.output_tokens} / {s.output_tokens} | "
                f"{_spread(b.output_tokens_per_s, *p.throughput_range('baseline'), p.repeats)} | "
                f"{_spread(s.output_tokens_per_s, *p.throughput_range('speculative'), p.repeats)} | "
                f"{_spread(p.speedup, *speedup_range, p.repeats, '.2f', 'x')} | {_fmt(acc)} | "
                f"{_pair(b.latency_p50_s, b.latency_p90_s)} | {_pair(s.latency_p50_s, s.latency_p90_s)} | "
                f"{_pair(b.ttft_p50_s, b.ttft_p90_s)} | {_pair(s.ttft_p50_s, s.ttft_p90_s)} | "
                f"{_fmt(tpot_b, '.1f')} / {_fmt(tpot_s, '.1f')} | {same} |")
    lines += ["", "## Server settings", "",
              "Arguments from the evaluation config on top of draftline's launch command for each engine (the "
              "EAGLE-3 server also gets the speculative settings: method EAGLE3, the drafter, k).", "",
              "| engine | version | hardware | target | drafter | prompt set | both servers | EAGLE-3 server only |",
              "|" + "---|" * 8]
    for r in (r for r in results if r.status != "skipped"):  # a skipped engine started no server
        lines.append(_identity_cells(r) + f"| {' '.join(r.server_args) or 'none'} | "
                     f"{' '.join(r.speculative_server_args) or 'none'} |")
    lines += rendering_markdown(results, traces)
    lines += ["", "## Acceptance by draft position and parity with the reference decoder", "",
              "Parity compares accepted draft tokens per verification step (acceptance length minus the bonus "
              "token) of the engine with draftline's reference decoder on the same prompts, drafter and k.", ""]
    if parity_basis:
        lines += [f"**Parity basis.** {parity_basis}", ""]
    lines += ["| engine | version | hardware | target | drafter | prompt set | mean acceptance length | "
              "per-position acceptance | reference length | parity | verdict |",
              "|" + "---|" * 11]
    for r in results:
        ident = _identity_cells(r)
        if r.status != "ok":
            lines.append(ident + f"| {_status(r)} | | | | |")
            continue
        a = r.acceptance
        pp = ", ".join(f"{x:.2f}" for x in a.per_position) if a and a.per_position else \
            "not reported by this engine"
        par = r.parity
        lines.append(ident + f"| {_fmt(a.mean_acceptance_length if a else None)} | {pp} | "
                     f"{_fmt(par.reference_mean_acceptance_length if par else None)} | "
                     f"{_fmt(par.value if par else None)} | {par.verdict if par else 'no reference given'} |")
    powers = [r for r in results if r.parity and r.parity.power]
    if powers:
        lines += ["", "What a parity gap can reveal on this target (the reference decoder fed the drafter neighbouring "
                  "layers):", ""] + [f"- {r.engine} {r.engine_version or ''}: {r.parity.power.sentence}." for r in powers]
    suspected = [r for r in results if r.parity and r.parity.integration_suspected]
    for r in suspected:
        lines += ["", f"### Integration suspected: {r.label()}", "", "Likely causes, most specific first:", ""]
        lines += [f"1. {c}" for c in r.parity.likely_causes]
    for r in results:
        findings = slowdown_findings(r)
        if findings:
            lines += ["", f"### Slower with speculation: {r.label()}", ""] + [f"- {f}" for f in findings]
    for r in results:
        said = engine_log_findings(r)
        if said:
            lines += ["", f"### What the engine's log says: {r.label()}", ""] + [f"- {f}" for f in said]
    for r in results:
        if r.engine_warnings:
            lines += ["", f"### The engine's warnings that bear on these numbers: {r.label()}", "",
                      f"{r.engine} logged these while serving (first sentence of each, once per server):", ""]
            lines += [f"- {w.text} ({_servers(w.servers)})" for w in r.engine_warnings]
    lines += schedule_markdown(results, run)
    lines += training_markdown(training, run)
    said = estimate_sentence(training, results)
    if said:
        lines += ["", said]
    lines += ["", "## Plots", "", "![acceptance by position](acceptance_by_position.png)", "",
              "![throughput and speedup](throughput_speedup.png)", ""]
    if training is not None and training.get("history", {}).get("train"):
        lines += [f"![training curves]({TRAINING_PLOT})", ""]
    lines += ["Raw figures: results.json (one EvalResult per engine).", ""]
    return "\n".join(lines)


def rendering_markdown(results: list[EvalResult], traces: dict | None) -> list[str]:
    """Which chat template and kwargs each side rendered its prompts with: the traces the drafter learned from, and
    each engine's requests."""
    rows = []
    if traces is not None:
        rows.append(("traces", "draftline", traces.get("chat_template")))
    rows += [(f"{r.engine} {r.engine_version or ''}".strip(), None, r.chat_template)
             for r in results if r.status != "skipped" and r.chat_template is not None]
    if not rows:
        return []
    lines = ["", "## Prompt rendering", "", "The chat template and kwargs each side rendered chat prompts with; train and "
             "serve render alike when they match.", "", "| side | rendered by | template | sha256 | kwargs |",
             "|" + "---|" * 5]
    for side, by, said in rows:
        if not said:
            lines.append(f"| {side} | {by or 'n/a'} | not templated | | |")
            continue
        digest = (said.get("sha256") or "")[:12]
        lines.append(f"| {side} | {said.get('rendered_by', by or '')} | {said.get('template')} | {digest} | "
                     f"{json.dumps(said.get('kwargs') or {})} |")
    images = [f"{r.engine}: {r.num_prompts_with_images} of its {r.num_prompts} prompts" for r in results
              if r.num_prompts_with_images and r.status != "skipped"]  # a skipped engine was sent nothing
    if images or (traces or {}).get("images"):
        lines += ["", "Prompts with images (sent to the engines' chat API): " + "; ".join(
            images + ([f"traces: {traces['images']} images"] if (traces or {}).get("images") else [])) + "."]
    return lines


def _servers(servers: list[str]) -> str:
    names = {"baseline": "baseline", "eagle3": "EAGLE-3", "schedule": "schedule"}
    if set(servers) == {"baseline", "eagle3"}:
        return "both servers"
    said = [names.get(s, s) for s in servers]
    joined = said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]
    return f"{joined} server" + ("s" if len(said) > 1 else "")


TRAINING_PLOT = "training_curves.png"


def training_markdown(training: dict | None, run: str | None) -> list[str]:
    """The training section: final figures and what the curves show, or that the run has no training record."""
    where = f"`{training_record_key(run)}`" if run else "the run's train/metrics.json"
    lines = ["", "## Training", ""]
    history = (training or {}).get("history") or {}
    if not history.get("train"):
        return lines + [f"No training record at {where}, so no training curves (a run that evaluates a drafter "
                        "trained elsewhere has none)."]
    train, val = history["train"], history.get("val") or []
    last = train[-1]
    lines += [f"From {where}: {training.get('steps', last['step'])} steps. Final training loss {last['loss']:.3f}, "
              "per-step accuracy (draft step 1 first) " + ", ".join(f"{a:.3f}" for a in last.get("accuracy") or [])
              + "."]
    if val:
        v = val[-1]
        said = (f"Held-out at step {v['step']}: loss {v['loss']:.3f}, per-step accuracy "
                + ", ".join(f"{a:.3f}" for a in v.get("accuracy") or []))
        if v.get("acceptance_length") is not None:
            said += f", acceptance length {v['acceptance_length']:.2f}"
        lines += ["", said + "."]
    return lines


def estimate_sentence(training: dict | None, results: list[EvalResult]) -> str | None:
    """Training's replayed estimate at the reference decoder's k beside what the reference decoder measured, with
    the estimate's spread over its validation sequences: whether the estimate predicted this evaluation."""
    replayed = (((training or {}).get("final_val") or {}).get("replayed")) or {}
    by_k = replayed.get("acceptance_length_by_k") or []
    ref = next((r for r in results if r.parity and r.parity.reference_mean_acceptance_length), None)
    if ref is None or not 0 < ref.num_speculative_tokens <= len(by_k) or not by_k[ref.num_speculative_tokens - 1]:
        return None
    k = ref.num_speculative_tokens
    estimate, measured = by_k[k - 1], ref.parity.reference_mean_acceptance_length
    interval = (replayed.get("interval_by_k") or [None] * k)[k - 1]
    said = (f"Training's replayed estimate at k = {k}: {estimate:.3f} over {replayed.get('sequences', 'its')} "
            f"validation sequences")
    if interval:
        said += f" ({interval[0]:.3f} to {interval[1]:.3f} as they are resampled)"
    said += f"; the reference decoder measured {measured:.3f} on the eval prompts, {measured / estimate:.3f} of it"
    if not interval:
        return said + "."
    if interval[0] <= measured <= interval[1]:
        return said + ", within the validation sample's own spread."
    return (said + ", outside the validation sample's own spread: the eval prompts are unlike the validation traces "
            "(the prompts of another task or length), or there are too few of them to measure it.")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend_below(fig, axes, ncol: int = 3) -> None:
    """One legend for all the figure's axes, in the margin below them (constrained layout makes room): it cannot
    cover a data point, however the values fall."""
    handles, labels = [], []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    if handles:
        import textwrap

        # A long entry (a skipped engine's reason) gets a line of its own, wrapped to stay inside the figure.
        if any(len(label) > 45 for label in labels):
            ncol = 1
        labels = [textwrap.fill(label, 110) for label in labels]
        fig.legend(handles, labels, loc="outside lower center", ncol=min(ncol, len(handles)), fontsize=7,
                   frameon=False)


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def acceptance_figure(results: list[EvalResult]):
    """Per-position acceptance of each engine beside the reference decoder's, each bar labelled with its value."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.6), layout="constrained")
    shown = [r for r in results if r.status == "ok" and r.acceptance and r.acceptance.per_position]
    width = 0.8 / max(1, len(shown) + 1)
    for i, r in enumerate(shown):
        pp = r.acceptance.per_position
        bars = ax.bar([j + i * width for j in range(len(pp))], pp, width, label=f"{r.engine} {r.engine_version}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    refs = [r for r in shown if r.parity and r.parity.reference_per_position]
    if refs:
        pp = refs[0].parity.reference_per_position
        bars = ax.bar([j + len(shown) * width for j in range(len(pp))], pp, width, label="reference decoder",
                      color="grey")
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    for r in results:
        if r not in shown:
            ax.plot([], [], " ", label=f"{r.engine}: {r.reason or 'no per-position acceptance reported'}")
    groups = len(shown) + (1 if refs else 0)
    k = max([len(r.acceptance.per_position) for r in shown] or [0])
    ax.set_xticks([j + width * (groups - 1) / 2 for j in range(k)], [str(j) for j in range(k)])
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of drafts accepted at this position")
    ax.set_ylim(0, 1.08)  # room for the labels of bars near 1
    ax.set_title("Acceptance by position: " + _plot_context(results, ",\n"), fontsize=9)
    _legend_below(fig, [ax])
    return fig


def plot_acceptance(results: list[EvalResult], path: Path) -> None:
    _save(acceptance_figure(results), path)


def _plot_context(results: list[EvalResult], before_prompts: str = ", ") -> str:
    """What the plotted results belong to: the run, and the drafter by the run that trained it; a field that differs
    between engines (e.g. each engine's own drafter) lists every value."""
    def values(field: str) -> str:
        return " / ".join(dict.fromkeys(str(getattr(r, field)) for r in results))

    drafters = " / ".join(dict.fromkeys(r.drafter_label(export=False).removeprefix("drafter ") for r in results))
    return (f"run {' / '.join(dict.fromkeys(repr(r.run) for r in results))}: target {values('target')}, "
            f"drafter {drafters}{before_prompts}prompts {values('prompt_set')}, {values('hardware')}")


def _errorbar(ax, xs: list, medians: list[float], ranges: list[tuple[float, float]], fmt: str, label: str,
              value_format: str, above: bool) -> None:
    """Medians joined by a line, each with its min-max bar over the repeats and its value written beside it."""
    err = [[m - lo for m, (lo, _) in zip(medians, ranges)], [hi - m for m, (_, hi) in zip(medians, ranges)]]
    ax.errorbar(xs, medians, yerr=err, fmt=fmt, capsize=3, label=label)
    for x, m in zip(xs, medians):
        ax.annotate(format(m, value_format), (x, m), textcoords="offset points", xytext=(0, 7 if above else -12),
                    ha="center", fontsize=7)


def throughput_figure(results: list[EvalResult]):
    """Output tokens per second of both servers and the speedup per concurrency: medians over the repeats with
    min-max bars, each point labelled with its value."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.6), layout="constrained")
    for r in results:
        if r.status != "ok" or not r.points:
            ax1.plot([], [], " ", label=f"{r.engine}: {_status(r)}")
            continue
        cs = [p.concurrency for p in r.points]
        name = f"{r.engine} {r.engine_version}"
        _errorbar(ax1, cs, [p.baseline.output_tokens_per_s for p in r.points],
                  [p.throughput_range("baseline") for p in r.points], "o--", f"{name} baseline", ".0f", False)
        _errorbar(ax1, cs, [p.speculative.output_tokens_per_s for p in r.points],
                  [p.throughput_range("speculative") for p in r.points], "o-", f"{name} EAGLE-3", ".0f", True)
        _errorbar(ax2, cs, [p.speedup for p in r.points],
                  [(p.speedup if p.speedup_min is None else p.speedup_min,
                    p.speedup if p.speedup_max is None else p.speedup_max) for p in r.points],
                  "s-", f"{name} speedup", ".2f", True)
    ax2.axhline(1.0, color="grey", lw=0.8)
    ticks = sorted({p.concurrency for r in results for p in r.points})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        if ticks:
            ax.set_xticks(ticks, [str(c) for c in ticks])
            ax.minorticks_off()
            ax.set_xlim(ticks[0] / 1.5, ticks[-1] * 1.5)
        ax.set_xlabel("concurrency")
        ax.margins(y=0.15)  # room for the value labels
    repeats = sorted({p.repeats for r in results for p in r.points})
    spread = "one repeat: no spread" if repeats in ([], [1]) else "bars: min-max over the repeats"
    ax1.set_ylabel("output tokens / s (median)")
    ax2.set_ylabel("speedup (EAGLE-3 / baseline, median)")
    fig.suptitle(f"{_plot_context(results)}\nwarm-up excluded; {spread}", fontsize=9)
    _legend_below(fig, [ax1, ax2])
    return fig


def plot_throughput(results: list[EvalResult], path: Path) -> None:
    _save(throughput_figure(results), path)


def training_figure(training: dict, run: str):
    """Loss and per-draft-step accuracy over the training steps (held-out evaluations as points), the last value of
    each curve and every held-out point labelled."""
    plt = _pyplot()
    history = training["history"]
    train, val = history["train"], history.get("val") or []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.6), layout="constrained")

    def label_last(ax, xs, ys, color, rank: int = 0) -> None:
        """The curve's last value at its right end; curves ending close together are labelled one above another."""
        ax.annotate(f"{ys[-1]:.2f}", (xs[-1], ys[-1]), textcoords="offset points", xytext=(4, -9 * rank),
                    fontsize=7, color=color, va="center")

    steps = [row["step"] for row in train]
    line, = ax1.plot(steps, [row["loss"] for row in train], "-", lw=1, label="training loss")
    label_last(ax1, steps, [row["loss"] for row in train], line.get_color())
    if val:
        vs = [row["step"] for row in val]
        ax1.plot(vs, [row["loss"] for row in val], "o", color="black", label="held-out loss")
        for x, y in zip(vs, [row["loss"] for row in val]):
            ax1.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7)
    k = max((len(row.get("accuracy") or []) for row in train + val), default=0)
    curves = []
    for i in range(k):
        ys = [row["accuracy"][i] if len(row.get("accuracy") or []) > i else None for row in train]
        line, = ax2.plot(steps, ys, "-", lw=1, label=f"draft step {i + 1} (training)")
        curves.append(([x for x, y in zip(steps, ys) if y is not None], [y for y in ys if y is not None],
                       line.get_color()))
        if val:
            vys = [row["accuracy"][i] for row in val if len(row.get("accuracy") or []) > i]
            vxs = [row["step"] for row in val if len(row.get("accuracy") or []) > i]
            ax2.plot(vxs, vys, "o", color=line.get_color(), label=f"draft step {i + 1} (held-out)")
    for rank, (xs, ys, color) in enumerate(sorted((c for c in curves if c[1]), key=lambda c: -c[1][-1])):
        label_last(ax2, xs, ys, color, rank)
    for row in val:  # one label per held-out evaluation, draft step 1 first, below its points
        acc = row.get("accuracy") or []
        if acc:
            ax2.annotate(" / ".join(f"{a:.2f}" for a in acc), (row["step"], min(acc)), textcoords="offset points",
                         xytext=(0, -12), ha="center", fontsize=7)
    for ax in (ax1, ax2):
        ax.set_xlabel("training step")
        ax.margins(x=0.08, y=0.1)
    ax1.set_ylabel("loss")
    ax2.set_ylabel("accuracy (draft token = target's next token)\nheld-out labels: draft step 1 / 2 / ...")
    ax2.set_ylim(0, 1.05)
    fig.suptitle(f"Training of the drafter of run {run!r} ({len(train)} steps)", fontsize=9)
    _legend_below(fig, [ax1, ax2], ncol=4)
    return fig


def read_training(store, run: str) -> dict | None:
    """The run's training record (`<run>/train/metrics.json`), None when the run has none (a nightly that
    evaluates a drafter trained elsewhere)."""
    key = training_record_key(run)
    if store is None or not store.exists(key):
        return None
    return json.loads(store.get_bytes(key))


def write_report(results: list[EvalResult], store, run: str, parity_basis: str | None = None) -> dict[str, str]:
    """report.md, the PNG plots (training curves when the run has a training record) and results.json under
    `<run>/eval/report/`; returns {file name: store key}. `parity_basis`: as report_markdown takes it."""
    if not results:
        raise ConfigError("no evaluation results to report; run at least one engine first")
    prefix = report_prefix(run)
    training = read_training(store, run)
    traces = json.loads(store.get_bytes(trace_stats_key(run))) if store.exists(trace_stats_key(run)) else None
    keys = {}
    with tempfile.TemporaryDirectory(prefix="draftline-report-") as tmp:
        tmp = Path(tmp)
        (tmp / "report.md").write_text(report_markdown(results, training, run, traces, parity_basis=parity_basis))
        (tmp / "results.json").write_text(json.dumps([r.model_dump(mode="json") for r in results], indent=2))
        plot_acceptance(results, tmp / "acceptance_by_position.png")
        plot_throughput(results, tmp / "throughput_speedup.png")
        names = ["report.md", "results.json", "acceptance_by_position.png", "throughput_speedup.png"]
        if plot_schedule(results, tmp / SCHEDULE_PLOT):
            names.append(SCHEDULE_PLOT)
        if training is not None and (training.get("history") or {}).get("train"):
            _save(training_figure(training, run), tmp / TRAINING_PLOT)
            names.append(TRAINING_PLOT)
        for name in names:
            keys[name] = f"{prefix}/{name}"
            store.put_file(keys[name], tmp / name)
    return keys
