"""The nightly's stored figures: what it watches of one engine's evaluation, and the append-only history of them."""
from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from draftline.config import validated_at
from draftline.errors import ConfigError
from draftline.eval_result import EvalResult
from draftline.schedule import Comparison

SCHEMA = "draftline-regression/1"
CauseKind = Literal["aux-layer-ids", "integration", "drafter-or-target", "engine-performance", "engine-failure", "unexplained",
                    "estimate-gap", "schedule-below-baseline"]
CAUSE_TITLES: dict[str, str] = {
    "aux-layer-ids": "integration: aux-layer ids",
    "integration": "parity drop: integration (engine or export)",
    "drafter-or-target": "reference drop: the drafter or the target changed",
    "engine-performance": "throughput-only drop: engine performance",
    "engine-failure": "the engine failed to serve",
    "unexplained": "acceptance drop that draftline cannot attribute",
    "estimate-gap": "acceptance fell away from the training estimate",
    "schedule-below-baseline": "the schedule by load is slower than no speculation",
}
Status = Literal["baseline", "pass", "regressed", "skipped", "failed"]


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
    # The schedule by load the evaluation derived ((first batch size, last, k) ranges), how it reads, and its
    # verification against no speculation at each concurrency; None and [] in records older than it.
    schedule: list[tuple[int, int, int]] | None = None
    schedule_description: str | None = None
    schedule_comparisons: list[Comparison] = []
    # A derived schedule its own server served slower than no speculation, which the one above replaced.
    schedule_rejected: str | None = None
    schedule_rejected_comparisons: list[Comparison] = []


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
    if not accuracy or (k is not None and not validated_at(k, len(accuracy))):  # one accuracy per TTT step
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
        schedule=list(result.schedule.ranges) if result.schedule else None,
        schedule_description=result.schedule.describe() if result.schedule else None,
        schedule_comparisons=list(result.schedule.comparisons) if result.schedule else [],
        schedule_rejected=result.schedule.rejected.description if result.schedule and result.schedule.rejected else None,
        schedule_rejected_comparisons=(list(result.schedule.rejected.comparisons)
                                       if result.schedule and result.schedule.rejected else []),
    )


# ---------------------------------------------------------------------------------------------- findings and causes
# Judgement makes these, but every HistoryRecord stores them: they live here so that judgement imports
# history and never the reverse.


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


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


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
