"""Tonight's figures judged against their history series, with the regressed part named and the verdict recorded."""
from __future__ import annotations

import statistics
from datetime import datetime, timezone
from typing import Any, Callable

from pydantic import BaseModel

from draftline.config import RegressionConfig
from draftline.errors import ConfigError, DraftlineError
from draftline.eval_result import EvalResult
from draftline.schedule import falls_below
from draftline.regression.history import (
    CAUSE_TITLES, SCHEMA, Cause, Figures, Finding, History, HistoryRecord, Status, _fmt, figures_of,
)

EVENT_NAME = "draftline.regression.detected"
GAP_METRIC = "acceptance over the training estimate"
ESTIMATE_FIGURE = "training's offline estimate"


class RegressionDetected(DraftlineError):
    """Tonight's evaluation is worse than history beyond the configured thresholds; the message names it."""


# ---------------------------------------------------------------------------------------------- verdict


class EngineVerdict(BaseModel):
    """Tonight's figures of one engine against its history series."""

    engine: str
    status: Status
    figures: Figures
    last_good: Figures | None = None
    last_good_at: str | None = None
    median: dict[str, float] = {}
    median_runs: int = 0
    findings: list[Finding] = []
    causes: list[Cause] = []
    notes: list[str] = []

    @property
    def regressed(self) -> bool:
        return self.status in ("regressed", "failed")

    def message(self) -> str:
        f = self.figures
        who = f"{self.engine} {f.engine_version or ''}".strip()
        if self.status == "skipped":
            return f"{who}: skipped ({f.reason}); nothing compared"
        if self.status == "baseline":
            return (f"{who}: first comparable run, recorded as the baseline (mean acceptance length "
                    f"{_fmt(f.acceptance_length)}, speedup {_fmt_points(f.speedup, 'x')})")
        if self.status == "pass":
            return (f"{who}: no regression against {self.median_runs} good run(s) (mean acceptance length "
                    f"{_fmt(f.acceptance_length)}, last good {_fmt(self.last_good.acceptance_length if self.last_good else None)})")
        title = " + ".join(CAUSE_TITLES[c.kind] for c in self.causes)
        if self.status == "failed":
            return f"{who} failed ({title}): " + " | ".join(c.explanation for c in self.causes)
        kinds = {c.kind for c in self.causes}
        # Throughput findings are the news only when acceptance held; otherwise they follow from it.
        primary = [x for x in self.findings if x.concurrency is None or kinds <= {"engine-performance"}]
        follow = [x for x in self.findings if x not in primary]
        parts = [x.sentence() for x in primary]
        if follow:
            parts.append("with it " + ", ".join(x.short() for x in follow))
        text = f"{who} regressed ({title})" + (": " + "; ".join(parts) if parts else "")
        if self.causes:
            text += ". Why: " + " | ".join(c.explanation for c in self.causes)
        return text


class Verdict(BaseModel):
    """Tonight's verdict over every configured engine."""

    schema_version: str = SCHEMA
    checked_at: str
    target: str
    lineage: str
    drafter: str
    engines: list[EngineVerdict]

    @property
    def regressed(self) -> bool:
        return any(e.regressed for e in self.engines)

    def message(self) -> str:
        head = (f"Regression of drafter {self.drafter} (lineage {self.lineage}) on target {self.target}"
                if self.regressed else f"No regression of drafter {self.drafter} on target {self.target}")
        return head + ". " + " ".join(e.message().rstrip(".") + "." for e in self.engines)

    def event_payload(self, report_uri: str | None = None) -> dict[str, Any]:
        """The figures an alert needs, small enough for a Prefect event."""
        engines = {}
        for e in self.engines:
            f = e.figures
            engines[e.engine] = {
                "status": e.status, "engine_version": f.engine_version,
                "causes": [c.kind for c in e.causes], "cause_sentences": [c.sentence() for c in e.causes],
                "mean_acceptance_length": f.acceptance_length,
                "reference_acceptance_length": f.reference_acceptance_length, "parity": f.parity,
                "offline_acceptance_length": f.offline_acceptance_length, "offline_estimate": f.offline_estimate,
                "acceptance_over_offline": f.acceptance_over_offline,
                "speedup": {str(k): v for k, v in f.speedup.items()},
                "throughput": {str(k): v for k, v in f.throughput.items()},
                "schedule": [list(r) for r in f.schedule] if f.schedule else None,
                "schedule_speedup": {str(c.concurrency): c.speedup for c in f.schedule_comparisons},
                "last_good_at": e.last_good_at,
                "last_good": ({"engine_version": e.last_good.engine_version,
                               "mean_acceptance_length": e.last_good.acceptance_length,
                               "reference_acceptance_length": e.last_good.reference_acceptance_length,
                               "parity": e.last_good.parity,
                               "offline_acceptance_length": e.last_good.offline_acceptance_length,
                               "acceptance_over_offline": e.last_good.acceptance_over_offline,
                               "speedup": {str(k): v for k, v in e.last_good.speedup.items()}}
                              if e.last_good else None),
                "findings": [{"metric": x.metric, "concurrency": x.concurrency, "new": x.new,
                              "last_good": x.last_good, "median": x.median, "limit": x.limit,
                              "sentence": x.sentence()} for x in e.findings],
            }
        causes = sorted({c.kind for e in self.engines for c in e.causes})
        return {"verdict": "regressed" if self.regressed else "pass", "message": self.message(),
                "target": self.target, "drafter": self.drafter, "lineage": self.lineage, "causes": causes,
                "engines": engines, "report": report_uri, "checked_at": self.checked_at}


def _fmt_points(points: dict[int, float], unit: str = "") -> str:
    if not points:
        return "n/a"
    return ", ".join(f"{v:.2f}{unit}@c{k}" for k, v in sorted(points.items()))


def _drop(old: float | None, new: float | None) -> float | None:
    if old is None or new is None or old <= 0:
        return None
    return (old - new) / old


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------- judging


def _comparable(current: Figures, past: Figures) -> bool:
    return (past.status == "ok" and past.prompt_set_sha256 == current.prompt_set_sha256
            and past.num_speculative_tokens == current.num_speculative_tokens)


Getter = Callable[[Figures], "float | None"]


def _watched(current: Figures, cfg: RegressionConfig) -> list[tuple[str, int | None, Getter, float, bool]]:
    """(metric, concurrency, getter, allowed relative drop, needs the same hardware) for every watched figure."""
    out: list[tuple[str, int | None, Getter, float, bool]] = [
        ("mean acceptance length", None, lambda f: f.acceptance_length, cfg.max_acceptance_drop, False),
        ("reference acceptance length", None, lambda f: f.reference_acceptance_length, cfg.max_acceptance_drop,
         False),
        (GAP_METRIC, None, lambda f: f.acceptance_over_offline, cfg.max_estimate_gap_drop, False),
    ]
    for c in sorted(current.speedup):
        out.append(("speedup", c, lambda f, c=c: f.speedup.get(c), cfg.max_speedup_drop, True))
    for c in sorted(current.throughput):
        out.append(("EAGLE-3 throughput (tok/s)", c, lambda f, c=c: f.throughput.get(c), cfg.max_throughput_drop,
                    True))
    return out


def _estimate_kind(f: Figures) -> str | None:
    """How a record's training estimate was made; records older than `offline_estimate` were per-step."""
    return f.offline_estimate or ("per-step" if f.offline_acceptance_length is not None else None)


DEFAULT_PARITY_FLOOR = 0.8


def parity_floor(current: Figures, cfg: RegressionConfig) -> float:
    """The parity below which tonight fails: the configured number, or with "auto" the threshold tonight's evaluation
    set for this target (measured from what wrong layers cost and how far parity moves without a fault)."""
    if cfg.parity_floor != "auto":
        return float(cfg.parity_floor)
    return current.parity_threshold if current.parity_threshold is not None else DEFAULT_PARITY_FLOOR


def judge(current: Figures, history: list[HistoryRecord], cfg: RegressionConfig) -> EngineVerdict:
    """Tonight's figures of one engine against its series: last good run, rolling median, parity floor."""
    verdict = EngineVerdict(engine=current.engine, status="pass", figures=current)
    if current.status == "skipped":
        verdict.status = "skipped"
        return verdict
    good = [r for r in history if r.good]
    if current.status == "failed" and current.integration_fault:
        verdict.status = "failed"  # refused before serving: the export names other layers than were trained
        verdict.causes = [Cause(kind="aux-layer-ids", explanation=current.integration_fault)]
        return verdict
    if current.status == "failed":
        verdict.status = "failed"
        verdict.causes = [Cause(kind="engine-failure", explanation=(
            f"{current.engine} {current.engine_version or ''}".strip() + f" did not finish the evaluation ({current.reason})"
            + (f"; it last worked on {good[-1].recorded_at} with {good[-1].figures.engine_version}" if good else "")
        ))]
        return verdict
    if current.integration_fault:
        # The engine's own log shows it fed the drafter other layers than it was trained on: a fault tonight,
        # with or without a history to compare with and whatever the acceptance did.
        verdict.causes.append(Cause(kind="aux-layer-ids", explanation=current.integration_fault))
    slower = schedule_shortfall(current, cfg)
    if slower:  # tonight's own measurement, history or not: serving the schedule would cost throughput
        verdict.causes.append(Cause(kind="schedule-below-baseline", explanation=slower))
    comparable = [r for r in good if _comparable(current, r.figures)]
    if len(comparable) < len(good):
        verdict.notes.append(f"{len(good) - len(comparable)} good run(s) used another prompt set or k and are not "
                             "compared")
    floor = parity_floor(current, cfg)
    if current.parity is not None and current.parity < floor:
        verdict.findings.append(Finding(engine=current.engine, metric="parity with the reference decoder",
                                        new=current.parity, limit=floor, floor=True))
    if comparable:
        last = comparable[-1]
        window = comparable[-cfg.median_window:]
        verdict.last_good, verdict.last_good_at, verdict.median_runs = last.figures, last.recorded_at, len(window)
        for metric, conc, get, limit, same_hw in _watched(current, cfg):
            def alike(r: HistoryRecord, same_hw=same_hw, metric=metric) -> bool:
                return ((not same_hw or r.figures.hardware == current.hardware)
                        and (metric != GAP_METRIC or _estimate_kind(r.figures) == _estimate_kind(current)))

            pool = [r for r in window if alike(r)]
            last_rec = next((r for r in reversed(comparable) if alike(r)), None)
            new = get(current)
            old_last = get(last_rec.figures) if last_rec else None
            old_median = _median([get(r.figures) for r in pool])
            if old_median is not None:
                verdict.median[metric if conc is None else f"{metric} @c{conc}"] = old_median
            d_last, d_median = _drop(old_last, new), _drop(old_median, new)
            if any(d is not None and d > limit for d in (d_last, d_median)):
                verdict.findings.append(Finding(
                    engine=current.engine, metric=metric, concurrency=conc, new=new, last_good=old_last,
                    last_good_at=last_rec.recorded_at if last_rec else None, median=old_median,
                    median_runs=len(pool), drop_vs_last_good=d_last, drop_vs_median=d_median, limit=limit,
                ))
        for figure, values in (("parity with the reference decoder", [r.figures.parity for r in window]),
                               (ESTIMATE_FIGURE, [r.figures.offline_acceptance_length for r in window])):
            if _median(values) is not None:
                verdict.median[figure] = _median(values)
        if any(r.figures.hardware != current.hardware for r in window):
            verdict.notes.append("throughput and speedup are compared only with runs on the same hardware "
                                 f"({current.hardware})")
        if last.figures.engine_version != current.engine_version:
            verdict.notes.append(f"engine version changed: {last.figures.engine_version} -> {current.engine_version}")
        if current.offline_acceptance_length is None and any(r.figures.offline_acceptance_length for r in window):
            verdict.notes.append("no training estimate for tonight's drafter (its training record was not found or "
                                 "validated fewer steps than k): the acceptance's gap to it is not compared")
    elif not verdict.findings and not verdict.causes:
        verdict.status = "baseline"
        return verdict
    if verdict.findings:
        verdict.causes += classify(verdict)
    if verdict.causes:
        verdict.status = "regressed"
    return verdict


def schedule_shortfall(current: Figures, cfg: RegressionConfig) -> str | None:
    """Where a schedule by load served on its own server gave fewer tokens per second than no speculation, beyond the
    measured spread and cfg.max_schedule_shortfall, in one sentence: the evaluation's schedule, or the derived one it
    replaced; None where both held at every point."""
    def slower(description: str | None, comparisons: list) -> str | None:
        below = [c for c in comparisons if falls_below(c, cfg.max_schedule_shortfall)]
        if not below:
            return None
        return f"the verified schedule ({description}) served " + "; ".join(
            f"at concurrency {c.concurrency} (k={c.k}) {c.speedup:.2f}x no speculation's tokens per second, "
            f"{c.speedup_max:.2f}x at its fastest repeat" for c in below)

    final = slower(current.schedule_description, current.schedule_comparisons)
    derived = slower(current.schedule_rejected, current.schedule_rejected_comparisons)
    if not final and not derived:
        return None
    text = " and ".join(x for x in (derived, final) if x) + (
        f", more than the allowed -{cfg.max_schedule_shortfall:.0%} below no speculation and beyond the measured spread")
    if derived and not final:
        return text + f"; the evaluation replaced it with {current.schedule_description}, which the export carries"
    return text + "; serve without speculation at that load or derive the schedule again"


def classify(verdict: EngineVerdict) -> list[Cause]:
    """Name the regressed part from which figures fell: parity, the reference decoder, or only throughput."""
    cur, last = verdict.figures, verdict.last_good
    metrics = {f.metric for f in verdict.findings}
    parity_low = "parity with the reference decoder" in metrics
    ref_drop = "reference acceptance length" in metrics
    acc_drop = "mean acceptance length" in metrics
    perf = [f for f in verdict.findings if f.concurrency is not None]
    causes: list[Cause] = []
    version_change = (f"; the engine changed from {last.engine_version} to {cur.engine_version}"
                      if last and last.engine_version != cur.engine_version else "")
    if parity_low or (acc_drop and not ref_drop and cur.reference_acceptance_length is not None):
        detail = (f"{cur.engine} accepts {_fmt(cur.acceptance_length)} tokens per step while the engine-independent "
                  f"reference decoder accepts {_fmt(cur.reference_acceptance_length)} with the same drafter "
                  f"(parity {_fmt(cur.parity)}){version_change}")
        if cur.likely_causes:
            detail += f"; most likely: {cur.likely_causes[0]}"
        causes.append(Cause(kind="integration", explanation=detail))
    if ref_drop:
        changed = []
        if last and last.drafter_fingerprint and cur.drafter_fingerprint and \
                last.drafter_fingerprint != cur.drafter_fingerprint:
            changed.append(f"the drafter files changed ({last.drafter_fingerprint[:12]} -> "
                           f"{cur.drafter_fingerprint[:12]})")
        if last and last.target_fingerprint and cur.target_fingerprint and \
                last.target_fingerprint != cur.target_fingerprint:
            changed.append(f"the target changed ({last.target_fingerprint[:12]} -> {cur.target_fingerprint[:12]})")
        what = "; ".join(changed) if changed else "no file change seen by draftline: compare the drafter's and " \
                                                   "the target's lineage"
        causes.append(Cause(kind="drafter-or-target", explanation=(
            f"the engine-independent reference decoder fell too ({_fmt(last.reference_acceptance_length if last else None)}"
            f" -> {_fmt(cur.reference_acceptance_length)}), so the engine is not to blame; {what}")))
    if acc_drop and not ref_drop and not parity_low and cur.reference_acceptance_length is None:
        causes.append(Cause(kind="unexplained", explanation=(
            "acceptance fell but this run has no reference decoder figure to tell the engine from the drafter")))
    if perf and not causes:
        base = []
        for c, now in sorted(cur.baseline_throughput.items()):
            before = last.baseline_throughput.get(c) if last else None
            if before:
                base.append(f"{before:.1f} -> {now:.1f} tok/s @c{c}")
        base_fell = last and any(
            (_drop(last.baseline_throughput.get(c), v) or 0) > 0.5 * f.limit
            for f in perf for c, v in cur.baseline_throughput.items() if c == f.concurrency)
        where = ("the baseline without the drafter fell as well (" + ", ".join(base) +
                 "): the engine or the machine serves slower overall" if base_fell else
                 "the baseline without the drafter held (" + ", ".join(base) +
                 "): speculative decoding itself got slower in this engine")
        causes.append(Cause(kind="engine-performance", explanation=(
            f"acceptance held ({_fmt(last.acceptance_length if last else None)} -> {_fmt(cur.acceptance_length)}) "
            f"but tokens per second fell{version_change}; {where}")))
    gap = next((f for f in verdict.findings if f.metric == GAP_METRIC), None)
    if gap is not None:
        causes.append(Cause(kind="estimate-gap", explanation=_estimate_gap(
            verdict, gap, ref_drop, parity_low or (acc_drop and not ref_drop))))
    return causes


def _estimate_gap(verdict: EngineVerdict, gap: Finding, ref_drop: bool, engine_drop: bool) -> str:
    """Measured and estimated acceptance, the history's ratio, and what the gap means given what else moved."""
    cur, last = verdict.figures, verdict.last_good
    seen = []
    if gap.last_good is not None:
        seen.append(f"{gap.last_good:.2f} at the last good run")
    if gap.median is not None and gap.median_runs > 1:
        seen.append(f"{gap.median:.2f} as the median of {gap.median_runs} good runs")
    text = (f"{cur.engine} accepts {_fmt(cur.acceptance_length)} tokens per step where the training estimated "
            f"{_fmt(cur.offline_acceptance_length)} at k={cur.num_speculative_tokens} (ratio "
            f"{_fmt(cur.acceptance_over_offline)}; the history's ratio was {' and '.join(seen) or 'n/a'})")
    if cur.reference_acceptance_length is not None and cur.offline_acceptance_length:
        text += (f"; the engine-independent reference decoder accepts {cur.reference_acceptance_length:.2f} (ratio "
                 f"{cur.reference_acceptance_length / cur.offline_acceptance_length:.2f})")
    old = last.offline_acceptance_length if last else None
    moved = f"{_fmt(last.acceptance_length if last else None)} -> {_fmt(cur.acceptance_length)}"
    if old is None or cur.offline_acceptance_length is None:
        return text + "; the last good run has no estimate, so the training and the serving cannot be told apart"
    if abs(old - cur.offline_acceptance_length) >= 0.005:
        return text + (f"; the estimate moved {old:.2f} -> {cur.offline_acceptance_length:.2f} while the engine's "
                       f"acceptance went {moved}: this training's validation does not predict serving; compare its "
                       "validation data with the eval prompts, and the aux layers and target it was trained on with "
                       "what the engine serves")
    if last and last.drafter_fingerprint and cur.drafter_fingerprint and \
            last.drafter_fingerprint != cur.drafter_fingerprint:
        return text + (f"; the drafter files changed ({last.drafter_fingerprint[:12]} -> {cur.drafter_fingerprint[:12]}) "
                       "under the same training estimate: the export moved, not the training")
    if ref_drop:
        return text + ("; with the same drafter and estimate, a drop of the reference decoder as well means the prompts "
                       "or the target changed")
    if engine_drop:
        return text + "; with the same drafter and estimate the gap is the engine's, as the parity drop says"
    return text + (f"; with the same drafter and estimate the engine's acceptance slipped ({moved}) by less than the "
                   "acceptance limit but more than the estimate-gap limit")


def judge_all(results: list[EvalResult], history: History, cfg: RegressionConfig,
              fingerprints: dict[str, str] | None = None, lineage: str | None = None,
              drafter: str | None = None, target: str | None = None, target_fingerprint: str | None = None,
              now: datetime | None = None, training_record: dict[str, Any] | bytes | None = None) -> Verdict:
    """The verdict over every engine's result; `fingerprints` maps engine -> digest of the export it loaded, and
    `training_record` is the evaluated drafter's training metrics.json (its offline acceptance estimate)."""
    if not results:
        raise ConfigError("no evaluation results to compare; the nightly evaluation produced none")
    fingerprints = fingerprints or {}
    verdicts = []
    for r in results:
        fig = figures_of(r, fingerprints.get(r.engine), lineage, target, target_fingerprint, training_record)
        verdicts.append(judge(fig, history.records(fig.target, fig.engine, fig.lineage), cfg))
    first = verdicts[0].figures
    return Verdict(checked_at=(now or datetime.now(timezone.utc)).isoformat(), target=first.target,
                   lineage=first.lineage, drafter=drafter or first.drafter, engines=verdicts)


def record(verdict: Verdict, results: list[EvalResult], history: History, accept: bool = False,
           nightly_run: str | None = None, drafter_uri: str | None = None) -> list[str]:
    """Append one record per engine; a regressed run is kept but is not a baseline unless `accept` says so."""
    by_engine = {r.engine: r for r in results}
    keys = []
    for e in verdict.engines:
        good = e.status in ("baseline", "pass") or (accept and e.figures.status == "ok")
        rec = HistoryRecord(
            recorded_at=verdict.checked_at, target=e.figures.target, engine=e.engine, lineage=e.figures.lineage,
            status=e.status, good=good, accepted=accept and e.status == "regressed", figures=e.figures,
            findings=e.findings, causes=e.causes, nightly_run=nightly_run,
            eval_run=by_engine[e.engine].run if e.engine in by_engine else None, drafter_uri=drafter_uri,
            result=by_engine[e.engine].model_dump(mode="json") if e.engine in by_engine else {},
        )
        keys.append(history.append(rec))
    return keys
