"""The evaluation's result records as stored in JSON: an engine's EvalResult, its concurrency points and parity."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel

from draftline.engines.base import Acceptance
from draftline.engines.client import RunMetrics, summarize_repeats
from draftline.schedule import Schedule, SweepPoint

SCHEMA = "draftline-eval/1"


def timestamp() -> str:
    """Now in UTC to the second: the format of EvalResult's started_at and finished_at."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class ConcurrencyPoint(BaseModel):
    """Baseline and speculative runs of the same requests at one concurrency, each measured `repeats` times on one
    server after an unmeasured warm-up wave.

    `baseline` and `speculative` are the medians over the repeats (run figures; latency and TTFT over every
    measured request: client.summarize_repeats), `speedup` the ratio of the median tokens per second; each repeat's
    own figures are in `baseline_runs` and `speculative_runs`."""

    concurrency: int
    baseline: RunMetrics
    speculative: RunMetrics
    speedup: float  # speculative / baseline output tokens per second (medians over the repeats)
    acceptance: Acceptance | None
    identical_outputs: float | None = None  # greedy only: share of requests whose text equals the baseline's
    repeats: int = 1
    baseline_runs: list[RunMetrics] = []
    speculative_runs: list[RunMetrics] = []
    # From the slowest EAGLE-3 repeat over the fastest baseline repeat to the fastest over the slowest: the two
    # servers' repeats are not paired, so every pairing is one the measurements allow.
    speedup_min: float | None = None
    speedup_max: float | None = None
    # Each EAGLE-3 repeat's own acceptance (the same requests again): the engine's run-to-run spread.
    acceptance_runs: list[Acceptance] = []

    def throughput_range(self, side: Literal["baseline", "speculative"]) -> tuple[float, float]:
        """Min and max output tokens per second over the repeats (the median twice when only it was kept)."""
        runs = getattr(self, f"{side}_runs") or [getattr(self, side)]
        values = [r.output_tokens_per_s for r in runs]
        return min(values), max(values)

    @classmethod
    def of_repeats(cls, baseline: list[tuple[RunMetrics, list]], speculative: list[tuple[RunMetrics, list]],
                   acceptance: Acceptance | None, identical_outputs: float | None,
                   acceptance_runs: list[Acceptance | None] = ()) -> "ConcurrencyPoint":
        """The point of `repeats` measured runs on each server, (metrics, request results) each."""
        base, spec = summarize_repeats(baseline), summarize_repeats(speculative)

        def ratio(s: float, b: float) -> float:
            return s / b if b else 0.0

        b_tps = [m.output_tokens_per_s for m, _ in baseline]
        s_tps = [m.output_tokens_per_s for m, _ in speculative]
        return cls(concurrency=base.concurrency, baseline=base, speculative=spec,
                   speedup=ratio(spec.output_tokens_per_s, base.output_tokens_per_s), acceptance=acceptance,
                   identical_outputs=identical_outputs, repeats=min(len(baseline), len(speculative)),
                   baseline_runs=[m for m, _ in baseline], speculative_runs=[m for m, _ in speculative],
                   speedup_min=ratio(min(s_tps), max(b_tps)), speedup_max=ratio(max(s_tps), min(b_tps)),
                   acceptance_runs=[a for a in acceptance_runs if a is not None])


class EngineWarning(BaseModel):
    """A warning of the engine's own that bears on its figures (EngineAdapter.log_facts), and which servers
    logged it ("baseline", "eagle3")."""

    text: str
    servers: list[str]


class ParityPower(BaseModel):
    """Whether a parity gap can reveal wrong aux-layer ids on this target: the share of accepted draft tokens the
    drafter keeps when the reference decoder feeds it neighbouring layers, against how far parity moves without
    any fault (the reference decoder in another precision, the engine across its concurrency points)."""

    kept_share: float | None  # the most any measured shift keeps: the mismatch hardest to see
    shifts: list[dict] = []  # the reference decoder's runs with neighbouring layers (aux_shift_acceptance)
    noise: float | None  # how far parity moves without a fault: the largest of noise_sources
    noise_sources: dict[str, float] = {}
    detectable: bool | None  # kept_share below the threshold's upper bound (1 - noise, at most the ceiling)
    threshold: float
    threshold_source: Literal["measured", "config", "default"]
    sentence: str


class Parity(BaseModel):
    """Engine acceptance against the reference decoder's on the same prompts, drafter and k.

    `value` compares accepted draft tokens per verification step (acceptance length minus the bonus token):
    every drafter, even a useless one, gets the bonus token, so a ratio of lengths hides a broken integration
    (1.01 vs 1.17 is 0.86 as lengths but 0.06 as accepted tokens). `length_ratio` is kept for reference.
    """

    engine_mean_acceptance_length: float
    reference_mean_acceptance_length: float
    value: float | None
    length_ratio: float
    threshold: float
    integration_suspected: bool
    verdict: str
    # A fault the engine's own log proves (AUX_IDS_FAULT), whatever the parity value; None when there is none.
    integration_fault: str | None = None
    likely_causes: list[str] = []
    engine_per_position: list[float] | None = None
    reference_per_position: list[float] | None = None
    power: ParityPower | None = None
    # What the engine was compared with: the reference decoder, or where it did not run the training's estimate.
    basis: str = "reference decoder"


class EvalResult(BaseModel):
    """One engine's evaluation: every number here belongs to the engine, version, hardware, target, drafter
    and prompt set named at the top."""

    schema_version: str = SCHEMA
    run: str
    engine: str
    engine_version: str | None
    status: Literal["ok", "skipped", "failed"]
    reason: str | None = None
    hardware: str
    target: str
    target_path: str
    target_architecture: str | None = None
    drafter: str
    drafter_path: str
    drafter_lineage: dict[str, Any] = {}
    # The layers the training run fed the drafter (vLLM convention), from its record, when the caller knew it.
    trained_aux_layer_ids: list[int] | None = None
    prompt_set: str
    prompt_set_sha256: str | None = None
    num_prompts: int = 0
    num_prompts_with_images: int = 0  # of them, those with image parts (sent to the engine's chat API)
    # How the chat prompts were rendered: by whom, the template (a file, or the target tokenizer's own), its sha256
    # where known, and the kwargs.
    chat_template: dict[str, Any] | None = None
    sampling: dict[str, Any] = {}
    num_speculative_tokens: int
    server_args: list[str] = []  # the arguments given to both servers beyond draftline's own
    speculative_server_args: list[str] = []  # and to the EAGLE-3 server only
    points: list[ConcurrencyPoint] = []
    acceptance: Acceptance | None = None  # over all concurrency levels
    parity: Parity | None = None
    # A fault found before any server started (AUX_IDS_FAULT when preflight refused the export's aux-layer ids).
    fault: str | None = None
    # Per server ("baseline", "eagle3"): what its own log said about how it ran (EngineAdapter.log_facts).
    server_log_facts: dict[str, dict[str, Any]] = {}
    # The warnings among them that bear on the figures, once each, with the servers that logged them.
    engine_warnings: list[EngineWarning] = []
    # Every k the evaluation served (0: the target alone) at every concurrency (draftline.schedule), and the schedule
    # by load derived from them with its verification; empty and None in results written before the sweep.
    sweep: list[SweepPoint] = []
    schedule: Schedule | None = None
    started_at: str | None = None
    finished_at: str | None = None

    def label(self) -> str:
        version = self.engine_version or "not installed"
        return (f"{self.engine} {version} on {self.hardware}; target {self.target_label()}; {self.drafter_label()}; "
                f"prompts {self.prompt_set}")

    def drafter_label(self, export: bool = True) -> str:
        """The drafter by the training run its lineage names, "drafter of run 'demo' (vllm export)", rather than by
        its export folder; the folder's name when the lineage names no run."""
        trained_in = self.drafter_lineage.get("run")
        if not trained_in:
            return f"drafter {self.drafter}"
        fmt = self.drafter_lineage.get("format") or self.drafter
        return f"drafter of run {trained_in!r}" + (f" ({fmt} export)" if export and fmt else "")

    def target_label(self) -> str:
        """The target's name and, once preflight read it, its architecture: "demo-kimi (KimiK25ForConditionalGeneration)"."""
        return f"{self.target} ({self.target_architecture})" if self.target_architecture else self.target
