"""The report's section on speculation by load: each engine's k sweep as one picture, its schedule, and how it served."""
from __future__ import annotations

import textwrap
from pathlib import Path

from draftline.eval_result import EvalResult
from draftline.layout import export_prefix
from draftline.schedule import (
    ENGINE_NAMES, NOT_RUN_ON_SGLANG, SERVE_FOLDER, Schedule, falls_below, schedule_summary, served_here, sglang_settings,
    sweep_ks,
)

SCHEDULE_PLOT = "schedule_sweep.png"
# The share of no speculation's tokens per second below which a verified point is called slower in the report; the
# nightly's own limit is regression.max_schedule_shortfall.
REPORT_SHORTFALL = 0.0


def with_schedule(results: list[EvalResult]) -> list[EvalResult]:
    return [r for r in results if r.status == "ok" and r.schedule is not None and r.sweep]


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _verified_cell(s: Schedule, concurrency: int) -> str:
    c = next((c for c in s.comparisons if c.concurrency == concurrency), None)
    if c is None:
        return "n/a"
    cell = _x(c.speedup)
    if s.repeats > 1:
        cell += f" ({_x(c.speedup_min)}-{_x(c.speedup_max)})"
    return cell + (" **slower than no speculation**" if falls_below(c, REPORT_SHORTFALL) else "")


def _how_verified(s: Schedule) -> str:
    v = s.verification
    if v is None:
        return "Not verified."
    if v.source == "server":
        return ("Verified by serving: a server of its own was started with the schedule and measured at every "
                "concurrency point in this run, like the sweep's servers.")
    return f"Verified on the sweep's servers: {v.why_sweep}."


def applied_sentence(r: EvalResult) -> str | None:
    """What the schedule server's own log and counters say about the schedule it ran: the ranges it took and the
    draft tokens it proposed per step at each load (k where every step drafted k)."""
    s = r.schedule
    if (s.verification is None or s.verification.source != "server") and s.rejected is None:
        return None
    name = ENGINE_NAMES.get(r.engine, r.engine)
    parts = []
    logged = (r.server_log_facts.get("schedule") or {}).get("speculative_schedule")
    if logged is not None:
        ranges = s.rejected.ranges if s.rejected is not None else s.ranges
        same = [tuple(x) for x in logged] == [tuple(x) for x in ranges]
        parts.append(f"{name}'s log shows its schedule server started with {logged}"
                     + ("" if same else f", not the derived {[list(x) for x in ranges]}"))
    served = s.rejected.verification if s.rejected is not None else s.verification
    drafted = [(p.concurrency, p.k, p.draft_tokens_per_draft) for p in served.points
               if p.draft_tokens_per_draft is not None and served.source == "server"]
    if drafted:
        parts.append("its counters show " + ", ".join(
            f"{d:.2f} draft tokens per step at concurrency {c} (the schedule's k there: {k})" for c, k, d in drafted))
    if not parts:
        return None
    return "; ".join(parts) + (". A load's batch shrinks as its requests finish, so a point also drafts at the k of "
                               "smaller batch sizes.")


def _table(r: EvalResult) -> list[str]:
    s = r.schedule
    ks = [k for k in sweep_ks(r.sweep) if k > 0]
    sglang = r.engine == "sglang"
    head = (["concurrency", "no speculation tok/s"] + [f"k={k}" for k in ks]
            + ["schedule k" + (" (steps, topk, draft tokens)" if sglang else ""), "schedule tok/s",
               "schedule speedup", "schedule / best single setting"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {p.concurrency: p for p in r.sweep if p.k == 0}
    by = {(p.k, p.concurrency): p for p in r.sweep}
    for choice in s.choices:
        c = choice.concurrency
        b = base[c]
        cells = [str(c), f"{b.tokens_per_s:.1f}"]
        for k in ks:
            p = by.get((k, c))
            mark = " (chosen)" if k == choice.k else ""
            cells.append(f"{_x(p.tokens_per_s / b.tokens_per_s)}{mark}" if p and b.tokens_per_s else "n/a")
        cmp = next((x for x in s.comparisons if x.concurrency == c), None)
        k = s.k_at(c)
        cells += [f"{k} {sglang_settings(k)}" if sglang else str(k),
                  f"{cmp.tokens_per_s:.1f}" if cmp else "n/a", _verified_cell(s, c),
                  f"{cmp.ratio_to_best_fixed:.2f} ({'off' if cmp.best_fixed_k == 0 else f'k={cmp.best_fixed_k}'})" if cmp else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def break_even(r: EvalResult) -> dict[tuple[int, int], tuple[float, float]]:
    """(k, concurrency) -> (the acceptance length at which k pays at that load, the drafter's there). A speculative
    step yields its acceptance length in tokens where a step without speculation yields one, so its time in such
    steps is its acceptance length over its speedup, and k breaks even at an acceptance length of that much."""
    base = {p.concurrency: p.tokens_per_s for p in r.sweep if p.k == 0}
    out = {}
    for p in r.sweep:
        if p.k > 0 and p.acceptance_length and p.tokens_per_s > 0 and base.get(p.concurrency):
            out[(p.k, p.concurrency)] = (p.acceptance_length * base[p.concurrency] / p.tokens_per_s,
                                         p.acceptance_length)
    return out


def _break_even_table(r: EvalResult) -> list[str]:
    costs = break_even(r)
    if not costs:
        return []
    ks = sorted({k for k, _ in costs})
    lines = ["", "The acceptance length at which each k breaks even (a speculative step's time in steps without "
             "speculation: its acceptance length over its speedup), the drafter's own in brackets. Where the drafter's "
             "is the lower, that k costs more than it saves: a drafter that accepts more, or a cheaper speculative "
             "step on this engine and hardware, would change it.", "",
             "| concurrency | " + " | ".join(f"k={k}" for k in ks) + " |", "|" + "---|" * (len(ks) + 1)]
    for c in sorted({c for _, c in costs}):
        cells = [f"{costs[k, c][0]:.2f} ({costs[k, c][1]:.2f})" if (k, c) in costs else "n/a" for k in ks]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def _no_k_pays(r: EvalResult) -> list[str]:
    """For the terminal: each measured load where every k served slower than no speculation, and how far the k
    closest to paying is from breaking even."""
    costs = break_even(r)
    out = []
    for c in sorted({c for _, c in costs}):
        at_c = {k: cost for (k, cc), cost in costs.items() if cc == c}
        if all(needed > has for needed, has in at_c.values()):
            k, (needed, has) = min(at_c.items(), key=lambda kv: kv[1][0] / kv[1][1])
            out.append(f"  no k pays at concurrency {c}: k={k} breaks even at an acceptance length of {needed:.2f}, "
                       f"the drafter's is {has:.2f}")
    return out


def schedule_markdown(results: list[EvalResult], run: str | None = None) -> list[str]:
    """The section: how schedules are derived, then per engine its schedule, table, verification and command lines."""
    shown = with_schedule(results)
    if not shown:
        return []
    lines = ["", "## Speculation by load", "",
             "Each engine served every k of its sweep (k=0: the target alone) on a server of its own and measured it at "
             "every concurrency point. At each point the schedule takes the fastest k, or the smallest k whose fastest "
             "repeat reaches the fastest one's slowest (a tie within the measured spread goes to the cheaper setting), "
             "and never a k slower than no speculation. Batch sizes between two measured points take the smaller of "
             "their two k; above the last point the last k (the engines carry it forward), which was not measured. "
             "Speedups are each setting's median tokens per second over no speculation's; the schedule's range goes "
             "from its slowest repeat over no speculation's fastest to its fastest over the slowest.", "",
             f"![speedup by k and concurrency]({SCHEDULE_PLOT})"]
    for r in shown:
        s = r.schedule
        name = ENGINE_NAMES.get(r.engine, r.engine)
        lines += ["", f"### {name} {r.engine_version or ''}: {s.describe()}", "",
                  f"{r.label()}. {_how_verified(s)}"]
        if s.repeats < 2:
            lines[-1] += " One measured repeat per point: there is no spread, so only exact ties go to the smaller k."
        applied = applied_sentence(r)
        if applied:
            lines[-1] += " " + applied[0].upper() + applied[1:]
        if s.rejected is not None:
            lines += ["", f"**The derived schedule ({s.rejected.description}) served slower than no speculation on its "
                      "own server**: " + ", ".join(
                          f"{_x(c.speedup)} ({_x(c.speedup_min)}-{_x(c.speedup_max)}) at concurrency {c.concurrency} "
                          f"(k={c.k})" for c in s.rejected.comparisons)
                      + f". {ENGINE_NAMES.get(r.engine, r.engine)} still runs the drafter at each step of a k=0 range "
                      "(to keep its cache in step), so such a range is not the target alone. The table and the lines "
                      "below are the best single setting of the sweep, which replaced it."]
        if s.support_note:
            lines += ["", f"**{s.support_note}**"]
        lines += [""] + _table(r) + _break_even_table(r)
        where = f"`{export_prefix(run or r.run, r.engine)}/{SERVE_FOLDER}/`"
        lines += ["", f"To serve it (also in the {r.engine} export's {where}):", ""]
        for when, command in s.commands:
            lines += [f"- {when}:", "", "  ```", f"  {command}", "  ```"]
        if r.engine == "sglang" and not served_here(s):
            lines += ["", f"{NOT_RUN_ON_SGLANG}."]
    return lines


def summary_lines(results: list[EvalResult]) -> list[str]:
    """For the terminal: each engine's schedule, its verification and the line to serve it."""
    out = []
    for r in with_schedule(results):
        out.append(schedule_summary(r.schedule))
        if r.schedule.support_note:
            out.append(f"  {r.schedule.support_note}")
        out += _no_k_pays(r)
        for when, command in r.schedule.commands:
            out.append(f"  serve ({when}): {command}")
    return out


def schedule_figure(results: list[EvalResult]):
    """Speedup over no speculation of every k of each engine's sweep by concurrency (medians with min-max bars over
    the repeats), the k each schedule chose marked by a ring, and the schedule's own verified speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = with_schedule(results)
    fig, axes = plt.subplots(1, max(1, len(shown)), figsize=(max(7.0, 5.5 * len(shown)), 4.8), layout="constrained",
                             squeeze=False)
    axes = list(axes[0])
    if not shown:
        axes[0].text(0.5, 0.5, "no engine served a k sweep", ha="center", va="center")
    for ax, r in zip(axes, shown):
        base = {p.concurrency: p for p in r.sweep if p.k == 0}
        cs = sorted(base)
        for k in [k for k in sweep_ks(r.sweep) if k > 0]:
            pts = sorted((p for p in r.sweep if p.k == k and p.concurrency in base), key=lambda p: p.concurrency)
            xs = [p.concurrency for p in pts]
            med = [p.tokens_per_s / base[p.concurrency].tokens_per_s for p in pts]
            lo = [p.low / base[p.concurrency].high for p in pts]
            hi = [p.high / base[p.concurrency].low for p in pts]
            ax.errorbar(xs, med, yerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
                        fmt="o-", capsize=3, label=f"k={k}")
            for x, m in zip(xs, med):
                ax.annotate(f"{m:.2f}", (x, m), textcoords="offset points", xytext=(6, 4), fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, label="k=0 (no speculation)")
        chosen = [(ch.concurrency, ch.speedup) for ch in r.schedule.choices]
        ax.plot([x for x, _ in chosen], [y for _, y in chosen], "o", ms=14, mfc="none", mec="red", mew=1.5,
                label="k the schedule chose")
        comps = r.schedule.comparisons
        if comps:
            ax.plot([c.concurrency for c in comps], [c.speedup for c in comps], "kx--",
                    label=f"schedule, verified ({'own server' if r.schedule.verification.source == 'server' else 'sweep servers'})")
            for c in comps:
                ax.annotate(f"{c.speedup:.2f} (k={c.k})", (c.concurrency, c.speedup), textcoords="offset points",
                            xytext=(0, -13), ha="center", fontsize=7)
        if r.schedule.rejected is not None:
            rejected = r.schedule.rejected.comparisons
            ax.plot([c.concurrency for c in rejected], [c.speedup for c in rejected], "+:", color="grey", ms=10,
                    label="derived schedule on its own server (replaced)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        if cs:
            ax.set_xlim(cs[0] / 1.5, cs[-1] * 1.5)
        ax.margins(y=0.2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("speedup over no speculation (median)")
        ax.set_title(f"{ENGINE_NAMES.get(r.engine, r.engine)} {r.engine_version}: {r.schedule.describe()}", fontsize=8,
                     wrap=True)
    context = textwrap.fill("Speedup by k and load: " + "; ".join(dict.fromkeys(
        f"run {r.run!r}, target {r.target}, {r.drafter_label(export=False)}, prompts {r.prompt_set}, {r.hardware}"
        for r in shown)), 90)
    fig.suptitle(f"{context}\nbars: min-max over the repeats", fontsize=9)
    legend = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}
    handles, labels = list(legend.values()), list(legend)
    if handles:  # below the axes (constrained layout makes room), where it cannot cover a point
        fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=7, frameon=False)
    return fig


def plot_schedule(results: list[EvalResult], path: Path) -> bool:
    """Write the picture; False (nothing written) when no engine served a sweep."""
    if not with_schedule(results):
        return False
    import matplotlib.pyplot as plt

    fig = schedule_figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
