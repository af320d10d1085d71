"""Nightly regression: an append-only history of evaluation figures per (target, engine, drafter lineage) in the
store, and a verdict that compares tonight's figures with the last good run and a rolling median, naming the cause.

The cause is told apart with the reference decoder, which does not depend on any engine:
- parity drop: the engine accepts less than the reference on the same drafter -> integration (engine or export);
- reference drop: the reference accepts less too -> the drafter or the target changed;
- throughput-only drop: acceptance held, the tokens per second fell -> engine (or machine) performance;
- estimate gap: the engine's acceptance over the training's offline estimate fell -> what the drafter validated on
  no longer predicts what it is served with.
"""
from __future__ import annotations

import json
import re
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ValidationError

from draftline.config import RegressionConfig
from draftline.errors import ConfigError, DraftlineError
from draftline.evaluate import EvalResult

SCHEMA = "draftline-regression/1"
EVENT_NAME = "draftline.regression.detected"

CauseKind = Literal["aux-layer-ids", "integration", "drafter-or-target", "engine-performance", "engine-failure", "unexplained",
                    "estimate-gap"]
CAUSE_TITLES: dict[str, str] = {
    "aux-layer-ids": "integration: aux-layer ids",
    "integration": "parity drop: integration (engine or export)",
    "drafter-or-target": "reference drop: the drafter or the target changed",
    "engine-performance": "throughput-only drop: engine performance",
    "engine-failure": "the engine failed to serve",
    "unexplained": "acceptance drop that draftline cannot attribute",
    "estimate-gap": "acceptance fell away from the training estimate",
}
GAP_METRIC = "acceptance over the training estimate"
ESTIMATE_FIGURE = "training's offline estimate"
Status = Literal["baseline", "pass", "regressed", "skipped", "failed"]


class RegressionDetected(DraftlineError):
    """Tonight's evaluation is worse than history beyond the configured thresholds; the message names it."""


# ---------------------------------------------------------------------------------------------- figures


class Figures(BaseModel):
    """The figures of one engine's evaluation that the nightly watches, with what makes two runs comparable."""

    engine: str
    engine_version: str | None = None
    status: Literal["ok", "skipped", "failed"]
    reason: str | None = None
    hardware: str
    target: str
    drafter: str
    lineage: str
    drafter_fingerprint: str | None = None  # digest of the exported drafter files, when known
    target_fingerprint: str | None = None  # draftline.target.target_fingerprint of the served target, when known
    prompt_set: str
    prompt_set_sha256: str | None = None
    num_speculative_tokens: int
    acceptance_length: float | None = None
    reference_acceptance_length: float | None = None
    parity: float | None = None
    # The threshold the evaluation held parity to, and where it came from ("measured" for this target, "config",
    # "default"); None in records older than it.
    parity_threshold: float | None = None
    parity_threshold_source: str | None = None
    # The training's offline estimate of mean acceptance length for this drafter at this k, and the engine's measured
    # mean acceptance length over it; None where the training record is unknown (and in records older than both).
    offline_acceptance_length: float | None = None
    # How that estimate was made ("replayed" or "per-step", see offline_estimate): ratios of different kinds are not
    # compared. None in records older than it, which were all per-step.
    offline_estimate: str | None = None
    acceptance_over_offline: float | None = None
    per_position: list[float] | None = None
    speedup: dict[int, float] = {}
    throughput: dict[int, float] = {}  # EAGLE-3 output tokens per second, by concurrency
    baseline_throughput: dict[int, float] = {}  # without the drafter, by concurrency
    likely_causes: list[str] = []  # from the evaluation's parity check
    integration_fault: str | None = None  # the parity verdict when the engine's log proved a fault (aux-layer ids)


def lineage_name(lineage: dict[str, Any] | None, fallback: str) -> str:
    """The drafter lineage a history series follows: the training run named in draftline.json, else `fallback`."""
    for key in ("lineage", "training_run", "run", "name"):
        value = (lineage or {}).get(key)
        if isinstance(value, str) and value:
            return value
    return fallback


def offline_estimate(training_record: dict[str, Any] | bytes | str | None, k: int | None = None
                     ) -> tuple[float | None, str | None]:
    """The training's offline estimate of mean acceptance length at the engine's depth `k`, and its kind, from its
    record (`<run>/train/metrics.json`, as a dict or its bytes). "replayed": the reference decoder's draft schedule
    replayed on validation traces (final_val.replayed, recorded per drafted depth), which predicts decoding; else
    "per-step": final_val's per-TTT-step accuracies over the first `k` steps, which assume independent hits and
    overstate it (training validates `train.ttt_steps` steps, so its own acceptance_length is for a deeper draft
    than k=3). (None, None) without a record or a validation, or when `k` is deeper than the training validated."""
    if training_record is None:
        return None, None
    record = json.loads(training_record) if isinstance(training_record, (bytes, str)) else training_record
    final = record.get("final_val") or {}
    accuracy = final.get("accuracy")
    if not accuracy or (k is not None and k > len(accuracy)):
        return None, None
    by_k = (final.get("replayed") or {}).get("acceptance_length_by_k") or []
    depth = len(accuracy) if k is None else k
    if depth <= len(by_k) and by_k[depth - 1] is not None:
        return float(by_k[depth - 1]), "replayed"
    from draftline.drafter.ttt import acceptance_length  # the training's own definition of the estimate

    return acceptance_length([float(a) for a in accuracy[:k]]), "per-step"


def offline_acceptance_length(training_record: dict[str, Any] | bytes | str | None, k: int | None = None
                              ) -> float | None:
    """The value of `offline_estimate`."""
    return offline_estimate(training_record, k)[0]


def figures_of(result: EvalResult, drafter_fingerprint: str | None = None, lineage: str | None = None,
               target: str | None = None, target_fingerprint: str | None = None,
               training_record: dict[str, Any] | bytes | None = None) -> Figures:
    """The watched figures of one EvalResult; `lineage` and `target` name its history series when given, and
    `training_record` (the evaluated drafter's training metrics.json) gives the offline estimate."""
    acc = result.acceptance
    parity = result.parity
    measured = acc.mean_acceptance_length if acc else None
    offline, estimate_kind = offline_estimate(training_record, result.num_speculative_tokens)
    return Figures(
        engine=result.engine, engine_version=result.engine_version, status=result.status, reason=result.reason,
        hardware=result.hardware, target=target or result.target, drafter=result.drafter,
        lineage=lineage or lineage_name(result.drafter_lineage, result.drafter), drafter_fingerprint=drafter_fingerprint,
        target_fingerprint=target_fingerprint,
        prompt_set=result.prompt_set, prompt_set_sha256=result.prompt_set_sha256,
        num_speculative_tokens=result.num_speculative_tokens,
        acceptance_length=measured,
        reference_acceptance_length=parity.reference_mean_acceptance_length if parity else None,
        parity=parity.value if parity else None,
        parity_threshold=parity.threshold if parity else None,
        parity_threshold_source=parity.power.threshold_source if parity and parity.power else None,
        offline_acceptance_length=offline, offline_estimate=estimate_kind,
        acceptance_over_offline=measured / offline if measured is not None and offline else None,
        per_position=acc.per_position if acc else None,
        speedup={p.concurrency: p.speedup for p in result.points},
        throughput={p.concurrency: p.speculative.output_tokens_per_s for p in result.points},
        baseline_throughput={p.concurrency: p.baseline.output_tokens_per_s for p in result.points},
        likely_causes=list(parity.likely_causes) if parity else [],
        integration_fault=(parity.verdict.removeprefix(f"{parity.integration_fault}: ")
                           if parity and parity.integration_fault else
                           result.reason if result.fault == "integration: aux-layer ids" else None),
    )


# ---------------------------------------------------------------------------------------------- verdict


class Finding(BaseModel):
    """One watched figure that fell beyond its limit."""

    engine: str
    metric: str
    concurrency: int | None = None
    new: float
    last_good: float | None = None
    last_good_at: str | None = None
    median: float | None = None
    median_runs: int = 0
    drop_vs_last_good: float | None = None  # relative, 0.3 = 30 % lower
    drop_vs_median: float | None = None
    limit: float  # relative drop allowed, or the absolute floor for parity
    floor: bool = False

    def sentence(self) -> str:
        where = f" at concurrency {self.concurrency}" if self.concurrency is not None else ""
        if self.floor:
            return f"{self.engine} {self.metric}{where} is {self.new:.2f}, below the floor {self.limit:.2f}"
        olds = []
        if self.last_good is not None:
            olds.append(f"{self.last_good:.2f} (last good run {_when(self.last_good_at)})")
        if self.median is not None and self.median_runs > 1:
            olds.append(f"{self.median:.2f} (median of {self.median_runs} good runs)")
        return (f"{self.engine} {self.metric}{where} fell from {' / '.join(olds)} to {self.new:.2f}: "
                f"-{self.drop:.0%}, more than the allowed -{self.limit:.0%}")

    @property
    def drop(self) -> float:
        return max((d for d in (self.drop_vs_last_good, self.drop_vs_median) if d is not None), default=0.0)

    def short(self) -> str:
        where = f" @c{self.concurrency}" if self.concurrency is not None else ""
        old = self.last_good if self.last_good is not None else self.median
        return f"{self.metric}{where} {_fmt(old)} -> {self.new:.2f} (-{self.drop:.0%})"


def _when(iso: str | None) -> str:
    if not iso:
        return "unknown"
    return datetime.fromisoformat(iso).astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


class Cause(BaseModel):
    kind: CauseKind
    explanation: str

    def sentence(self) -> str:
        return f"{CAUSE_TITLES[self.kind]}: {self.explanation}"


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


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


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


# ---------------------------------------------------------------------------------------------- history


class HistoryRecord(BaseModel):
    """One engine's nightly evaluation as kept in the history (append-only; never rewritten)."""

    schema_version: str = SCHEMA
    recorded_at: str
    target: str
    engine: str
    lineage: str
    status: Status
    good: bool  # may serve as the reference of later nights
    accepted: bool = False  # a user declared this run the new baseline despite the verdict
    figures: Figures
    findings: list[Finding] = []
    causes: list[Cause] = []
    nightly_run: str | None = None  # the Prefect flow run, when there is one
    eval_run: str | None = None  # the store run holding the full evaluation
    drafter_uri: str | None = None
    result: dict[str, Any] = {}  # the full EvalResult, so the history stands on its own


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "unnamed"


def _stamp(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")


class History:
    """Records at `<prefix>/<target>/<engine>/<lineage>/<UTC timestamp>.json`, oldest first by name."""

    def __init__(self, store, prefix: str = "history"):
        prefix = prefix.strip("/")
        if not prefix or ".." in prefix.split("/"):
            raise ConfigError(f"history prefix {prefix!r} is not a usable store prefix; use e.g. 'history'")
        self.store, self.prefix = store, prefix

    def series(self, target: str, engine: str, lineage: str) -> str:
        return f"{self.prefix}/{_slug(target)}/{_slug(engine)}/{_slug(lineage)}"

    def records(self, target: str, engine: str, lineage: str) -> list[HistoryRecord]:
        series = self.series(target, engine, lineage)
        out = []
        for key in self.store.list(series + "/"):
            if not key.endswith(".json") or key.rsplit("/", 1)[0] != series:
                continue
            try:
                record = HistoryRecord.model_validate_json(self.store.get_bytes(key))
            except ValidationError as exc:
                first = exc.errors()[0]
                raise ConfigError(
                    f"history record {self.store.uri(key)} is not a {SCHEMA} record ({'.'.join(map(str, first['loc']))}: "
                    f"{first['msg']}); move it out of {series}/ or delete it"
                ) from None
            out.append(record)
        return out

    def append(self, record: HistoryRecord) -> str:
        """Store a record under a new key (a second record in the same microsecond gets a suffix)."""
        series = self.series(record.target, record.engine, record.lineage)
        stamp = _stamp(datetime.fromisoformat(record.recorded_at))
        key, n = f"{series}/{stamp}.json", 1
        while self.store.exists(key):
            key, n = f"{series}/{stamp}-{n}.json", n + 1
        self.store.put_bytes(key, (record.model_dump_json(indent=2) + "\n").encode())
        return key


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


def _floor_text(cfg: RegressionConfig) -> str:
    return (f"{cfg.parity_floor:.2f}" if cfg.parity_floor != "auto" else
            "the threshold each evaluation set for its target")


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


class ProductionDrafter(BaseModel):
    """The drafter the nightly evaluates: one export per engine format, found under one store URI."""

    uri: str
    exports: dict[str, str]  # format -> prefix of that export in the pipeline's store (what the evaluation reads)
    fingerprints: dict[str, str]  # format -> sha256 over the export's weights and config, to tell a changed drafter
    lineage: dict[str, Any] = {}  # draftline.json of the first export


def _prefix_within(store, uri: str) -> str | None:
    """`uri` as a prefix of `store` when it lies inside it, else None."""
    root = store.uri("")
    if uri.startswith("s3://") or root.startswith("s3://"):
        root, uri = root.rstrip("/"), uri.rstrip("/")
        if uri == root:
            return ""
        return uri[len(root) + 1:] if uri.startswith(root + "/") else None
    try:
        rel = Path(uri).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return None
    return "" if rel == "." else rel


def _fingerprint(source, fmt: str, keys: list[str]) -> str:
    """Digest of an export's files except its lineage note (re-exporting the same weights keeps the digest)."""
    import hashlib

    manifest = source.read_manifest(fmt)
    entries = {e.key: e.sha256 for e in manifest} if manifest else {}
    digest = hashlib.sha256()
    for key in sorted(k for k in keys if k.startswith(fmt + "/")):
        name = key[len(fmt) + 1:]
        if name in ("manifest.json", "draftline.json"):
            continue
        digest.update(f"{name}:{entries.get(key) or source.hash_object(key).sha256}\n".encode())
    return digest.hexdigest()


def production_drafter(uri: str, formats: list[str], store, run: str) -> ProductionDrafter:
    """Find the exports under `uri` (`<format>/config.json`) and fingerprint them; exports outside the pipeline's
    `store` are copied to `<run>/export/` there, so the evaluation reads them like its own and the night keeps them."""
    from draftline.store import copy_tree, open_store

    source = open_store(uri)
    keys = source.list("")
    present = sorted({k.split("/", 1)[0] for k in keys if k.count("/") == 1 and k.endswith("/config.json")})
    if not present:
        raise ConfigError(f"drafter {uri} holds no engine export (a folder such as vllm/ with config.json); pass the "
                          "exports folder that the export stage wrote, e.g. ./runs/demo/export")
    missing = [f for f in formats if f not in present]
    if missing:
        raise ConfigError(f"drafter {uri} has no {', '.join(missing)} export but eval.engines lists "
                          f"{', '.join(missing)}; export that format (export.formats) or remove the engine")
    inside = _prefix_within(store, uri)
    exports = {}
    for fmt in present:
        if inside is not None and source.read_manifest(fmt) is not None:
            exports[fmt] = f"{inside}/{fmt}" if inside else fmt
            continue
        # Elsewhere, or without the manifest the evaluation verifies against: tonight's run gets a verified copy.
        dest = f"{run}/export/{fmt}"
        if copy_tree(source, fmt, store, dest) is None:
            store.write_manifest(dest, [k for k in store.list(dest + "/") if not k.endswith("/manifest.json")])
        exports[fmt] = dest
    first = next((f for f in formats if f in present), present[0])
    lineage = json.loads(source.get_bytes(f"{first}/draftline.json")) if source.exists(f"{first}/draftline.json") \
        else {}
    return ProductionDrafter(uri=uri, exports=exports, lineage=lineage,
                             fingerprints={fmt: _fingerprint(source, fmt, keys) for fmt in present})


def load_results(store, run: str, engines: list[str], target: str, prompt_set: str, k: int,
                 drafter: str = "", drafter_lineage: dict[str, Any] | None = None,
                 missing_reason: str | None = None) -> list[EvalResult]:
    """Each engine's EvalResult of an evaluation run: the report's results.json (with parity) first, else the
    engine's own result.json; an engine with neither is a failed result (it crashed before writing one)."""
    found: dict[str, EvalResult] = {}
    report_key = f"{run}/eval/report/results.json"
    if store.exists(report_key):
        for item in json.loads(store.get_bytes(report_key)):
            r = EvalResult.model_validate(item)
            found.setdefault(r.engine, r)
    out = []
    for engine in engines:
        if engine not in found and store.exists(f"{run}/eval/{engine}/result.json"):
            found[engine] = EvalResult.model_validate_json(store.get_bytes(f"{run}/eval/{engine}/result.json"))
        out.append(found.get(engine) or EvalResult(
            run=run, engine=engine, engine_version=None, status="failed",
            reason=(f"no result at {store.uri(f'{run}/eval/{engine}/result.json')}: the evaluation stopped before "
                    f"writing one ({missing_reason or 'see its flow run log'})"),
            hardware="unknown", target=target, target_path="", drafter=drafter, drafter_path="",
            drafter_lineage=drafter_lineage or {}, prompt_set=prompt_set, num_speculative_tokens=k))
    return out


# ---------------------------------------------------------------------------------------------- report


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
