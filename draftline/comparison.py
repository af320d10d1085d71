"""Drafters side by side: each engine's differences in acceptance and speedup with their spread, and a one-line verdict."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from draftline.eval_result import EvalResult

# Below this relative difference in accepted draft tokens per step two drafters count as alike even when the engine's
# repeats agree exactly: greedy requests repeat identically, yet batching moves acceptance by a few percent between
# concurrencies (parity's own noise sources), so a zero spread does not make a 1% difference real.
SAME_WITHIN = 0.03
# A drafter accepting fewer draft tokens per step than this gives no base for a percentage.
MIN_ACCEPTED = 0.02
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


@dataclass(frozen=True)
class DrafterFigures:
    """One drafter's figures in one engine, as the comparison reads them from its EvalResult."""

    engine: str  # as the verdict names it: "vLLM", "SGLang"
    status: str = "ok"
    reason: str | None = None
    accepted: float | None = None  # accepted draft tokens per step over every point (mean acceptance length - 1)
    accepted_low: float | None = None  # the least and most of the engine's repeats and concurrency points
    accepted_high: float | None = None
    parity: float | None = None
    parity_threshold: float | None = None
    parity_suspected: bool | None = None  # None: parity not measured
    speedups: list[tuple[int, float, float | None, float | None]] = field(default_factory=list)  # (c, median, min, max)

    @property
    def measured(self) -> bool:
        return self.status == "ok" and self.accepted is not None

    @property
    def spread(self) -> float:
        if self.accepted_low is None or self.accepted_high is None:
            return 0.0
        return self.accepted_high - self.accepted_low


def figures_of(result: EvalResult) -> DrafterFigures:
    """A drafter's figures in one engine from its EvalResult (parity filled in by the report)."""
    name = ENGINE_NAMES.get(result.engine, result.engine)
    if result.status != "ok" or result.acceptance is None or result.acceptance.mean_acceptance_length is None:
        return DrafterFigures(engine=name, status=result.status if result.status != "ok" else "no acceptance",
                              reason=result.reason or "the engine reported no acceptance")
    accepted = result.acceptance.mean_acceptance_length - 1.0
    runs = [a.mean_acceptance_length - 1.0 for p in result.points for a in (p.acceptance_runs or [p.acceptance])
            if a is not None and a.mean_acceptance_length is not None]
    parity = result.parity
    suspected = None
    if parity is not None and (parity.value is not None or parity.integration_fault):
        suspected = parity.integration_suspected
    return DrafterFigures(
        engine=name, accepted=accepted, accepted_low=min(runs + [accepted]), accepted_high=max(runs + [accepted]),
        parity=parity.value if parity else None, parity_threshold=parity.threshold if parity else None,
        parity_suspected=suspected,
        speedups=[(p.concurrency, p.speedup, p.speedup_min, p.speedup_max) for p in result.points])


# ---- the verdict ----------------------------------------------------------------------------------------------------
def _where(engines: list[str], total: int) -> str:
    if len(engines) == total and total == 2:
        return "both engines"
    if len(engines) == total and total > 2:
        return f"all {total} engines"
    return " and ".join(engines)


def relative_difference(a: DrafterFigures, b: DrafterFigures) -> tuple[float | None, bool]:
    """(B's accepted draft tokens per step over A's, minus one; whether that is within the run-to-run spread).
    None when A accepts too little to be a base."""
    if a.accepted < MIN_ACCEPTED:
        return None, abs(b.accepted - a.accepted) <= max(a.spread, b.spread, MIN_ACCEPTED)
    change = b.accepted / a.accepted - 1.0
    tolerance = max(a.spread / a.accepted, b.spread / a.accepted, SAME_WITHIN)
    return change, abs(change) <= tolerance


def verdict(a_name: str, b_name: str, engines: dict[str, tuple[DrafterFigures, DrafterFigures]]) -> str:
    """One line on B against A over the engines: how many more or fewer draft tokens B accepts, and whether parity
    holds for both (where both fall below the reference in an engine, the engine is at fault, not the drafters)."""
    measured = {e: ab for e, ab in engines.items() if ab[0].measured and ab[1].measured}
    if not measured:
        why = "; ".join(f"{a.engine}: {a_name} {a.reason or a.status}" if not a.measured else
                        f"{b.engine}: {b_name} {b.reason or b.status}" for a, b in engines.values())
        return f"no engine measured both {a_name} and {b_name} ({why})" if why else \
            f"no engine measured {a_name} and {b_name}"
    names = {e: ab[0].engine for e, ab in measured.items()}
    clauses = []
    engine_fault = [e for e, (a, b) in measured.items() if a.parity_suspected and b.parity_suspected]
    if engine_fault:
        clauses.append(f"both fall below the reference in {_where([names[e] for e in engine_fault], 0)}: the engine, "
                       "not the drafters")
    rest = {e: ab for e, ab in measured.items() if e not in engine_fault}
    if rest:
        clauses.append(_acceptance_clause(a_name, b_name, rest, names, len(measured)))
        clauses.append(_parity_clause(a_name, b_name, rest, names))
    return "; ".join(c for c in clauses if c)


def _acceptance_clause(a_name: str, b_name: str, rest: dict, names: dict, total: int) -> str:
    moves, alike, absolute = {}, [], []
    for e, (a, b) in rest.items():
        change, within = relative_difference(a, b)
        if within:
            alike.append(e)
        elif change is None:
            absolute.append(f"{b_name} accepts {b.accepted:.2f} draft tokens per step and {a_name} {a.accepted:.2f} "
                            f"in {names[e]}")
        else:
            moves[e] = change
    parts = []
    if moves:
        rounded = {e: f"{abs(c):.0%} {'more' if c > 0 else 'fewer'}" for e, c in moves.items()}
        if len(set(rounded.values())) == 1:
            parts.append(f"{b_name} accepts {next(iter(rounded.values()))} tokens than {a_name} in "
                         f"{_where([names[e] for e in moves], total)}")
        else:
            first, *others = moves
            parts.append(f"{b_name} accepts {rounded[first]} tokens than {a_name} in {names[first]}"
                         + "".join(f" and {rounded[e]} in {names[e]}" for e in others))
    parts += absolute
    if alike:
        spread = max(max(rest[e][0].spread, rest[e][1].spread) / rest[e][0].accepted
                     if rest[e][0].accepted >= MIN_ACCEPTED else 0.0 for e in alike)
        same = f"the same within the run-to-run spread (±{max(spread, SAME_WITHIN):.0%})"
        where = _where([names[e] for e in alike], total)
        parts.append(f"{a_name} and {b_name} accept {same} in {where}" if not parts else f"{same} in {where}")
    return ", ".join(parts)


def _parity_clause(a_name: str, b_name: str, rest: dict, names: dict) -> str:
    failing, unmeasured = [], []
    for e, (a, b) in rest.items():
        for name, f in ((a_name, a), (b_name, b)):
            if f.parity_suspected:
                value = f"{f.parity:.2f} < {f.parity_threshold:.2f}" if f.parity is not None else "the engine's log"
                failing.append(f"for {name} in {names[e]} ({value})")
            elif f.parity_suspected is None:
                unmeasured.append(f"for {name} in {names[e]}")
    if not failing and not unmeasured:
        return "parity holds for both"
    said = []
    if failing:
        said.append("parity fails " + " and ".join(failing) + ": that engine misreads the drafter, so compare them "
                    "with the reference decoder there")
    if unmeasured:
        said.append("parity is not measured " + " and ".join(unmeasured))
    return "; ".join(said)


# ---- the report -----------------------------------------------------------------------------------------------------
@dataclass
class Compared:
    """A drafter of the comparison: its label, where it came from and how it was read, its results and reports."""

    label: str
    source: str
    read_said: str
    results: list[EvalResult]
    reference: dict | None  # its reference decoder summary ({"status": "skipped", ...} when skipped)
    report_uri: str | None = None


def _accepted(summary: dict | None) -> float | None:
    if not summary or summary.get("mean_acceptance_length") is None:
        return None
    return float(summary["mean_acceptance_length"]) - 1.0


def _engines(a: Compared, b: Compared) -> dict[str, tuple[DrafterFigures, DrafterFigures]]:
    theirs = {r.engine: r for r in b.results}
    return {r.engine: (figures_of(r), figures_of(theirs[r.engine])) for r in a.results if r.engine in theirs}


def compare(drafters: list[Compared]) -> dict[str, Any]:
    """Every later drafter against the first: {"verdicts": one line each, "pairs": their figures}."""
    first, pairs = drafters[0], []
    for other in drafters[1:]:
        engines = _engines(first, other)
        pairs.append({"a": first.label, "b": other.label, "verdict": verdict(first.label, other.label, engines),
                      "reference_accepted": [_accepted(first.reference), _accepted(other.reference)],
                      "engines": {e: [asdict(a), asdict(b)] for e, (a, b) in engines.items()}})
    return {"verdicts": [f"{p['b']} against {p['a']}: {p['verdict']}" for p in pairs], "pairs": pairs}


def _range(low: float | None, high: float | None, fmt: str = ".3f") -> str:
    return "" if low is None or high is None or low == high else f" ({low:{fmt}}-{high:{fmt}})"


def comparison_markdown(drafters: list[Compared], compared: dict[str, Any], setting: str) -> str:
    """The comparison page: the verdicts, accepted draft tokens per step and speedup per engine, the drafters."""
    names = " and ".join(d.label for d in drafters)
    lines = [f"# Drafters compared: {names}", ""] + [f"**{v}.**" for v in compared["verdicts"]] + ["", setting, ""]
    by_label = {d.label: d for d in drafters}
    for pair in compared["pairs"]:
        a, b = pair["a"], pair["b"]
        lines += [f"## {b} against {a}", "", "Accepted draft tokens per verification step (acceptance length minus "
                  "the bonus token); in brackets the least and most over the engine's repeats and concurrency points.",
                  "", f"| engine | {a} | {b} | {b} - {a} | relative | parity {a} | parity {b} |", "|" + "---|" * 7]
        ra, rb = pair["reference_accepted"]
        if ra is not None and rb is not None:
            rel = f"{rb / ra - 1:+.0%}" if ra >= MIN_ACCEPTED else ""
            lines.append(f"| reference decoder | {ra:.3f} | {rb:.3f} | {rb - ra:+.3f} | {rel} | | |")
        figures = {e: (DrafterFigures(**fa), DrafterFigures(**fb)) for e, (fa, fb) in pair["engines"].items()}
        for engine, (fa, fb) in figures.items():
            label = _engine_label(by_label[a], engine)
            if not (fa.measured and fb.measured):
                lines.append(f"| {label} | {_cell(fa)} | {_cell(fb)} | | | | |")
                continue
            change, within = relative_difference(fa, fb)
            low, high = fb.accepted_low - fa.accepted_high, fb.accepted_high - fa.accepted_low
            rel = "" if change is None else f"{change:+.0%}" + (" (within the spread)" if within else "")
            lines.append(f"| {label} | {_cell(fa)} | {_cell(fb)} | "
                         f"{fb.accepted - fa.accepted:+.3f}{_range(low, high, '+.3f')} | {rel} | "
                         f"{_parity(fa)} | {_parity(fb)} |")
        lines += ["", "Speedup over the same baseline server (median of the repeats, least to most in brackets):", "",
                  f"| engine | concurrency | {a} | {b} | {b} - {a} |", "|" + "---|" * 5]
        for engine, (fa, fb) in figures.items():
            theirs = {c: (s, lo, hi) for c, s, lo, hi in fb.speedups}
            for c, s, lo, hi in fa.speedups:
                if c not in theirs:
                    continue
                sb, lob, hib = theirs[c]
                diff = _range(lob - hi, hib - lo, "+.2f") if None not in (lo, hi, lob, hib) else ""
                lines.append(f"| {_engine_label(by_label[a], engine)} | {c} | {s:.2f}x{_range(lo, hi, '.2f')} | "
                             f"{sb:.2f}x{_range(lob, hib, '.2f')} | {sb - s:+.2f}{diff} |")
        lines.append("")
    lines += ["## The drafters", ""]
    for d in drafters:
        report = f" Report: {d.report_uri}." if d.report_uri else ""
        lines.append(f"- **{d.label}**: {d.source}, {d.read_said}.{report}")
    return "\n".join(lines) + "\n"


def _engine_label(drafter: Compared, engine: str) -> str:
    result = next((r for r in drafter.results if r.engine == engine), None)
    return f"{engine} {result.engine_version}" if result and result.engine_version else engine


def _cell(f: DrafterFigures) -> str:
    if not f.measured:
        return f.reason or f.status
    return f"{f.accepted:.3f}{_range(f.accepted_low, f.accepted_high)}"


def _parity(f: DrafterFigures) -> str:
    if f.parity is None:
        return "not measured" if f.parity_suspected is None else "fault in the engine's log"
    return f"{f.parity:.2f}" + (" (below threshold)" if f.parity_suspected else "")


def write_comparison(drafters: list[Compared], store, prefix: str, setting: str) -> dict[str, Any]:
    """comparison.md and comparison.json under `prefix`; returns the verdicts and the store keys."""
    compared = compare(drafters)
    keys = {"report.md": f"{prefix}/report.md", "comparison.json": f"{prefix}/comparison.json"}
    store.put_bytes(keys["report.md"], comparison_markdown(drafters, compared, setting).encode())
    store.put_bytes(keys["comparison.json"], (json.dumps(compared, indent=2) + "\n").encode())
    return {**compared, "keys": keys}
