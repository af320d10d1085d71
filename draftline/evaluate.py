"""Serves the target with and without the drafter in one engine, measures both, and compares acceptance with the reference."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel

from draftline.aux_ids import AuxLayerIdsError, config_aux_layer_ids, same_layers
from draftline.config import EngineConfig, EvalConfig
from draftline.engines.base import Acceptance, EngineAdapter
from draftline.engines.client import (
    Prompt, RunMetrics, load_prompts, requests_for, round_robin, run_load, summarize_repeats,
)
from draftline.engines.launch import launch
from draftline.engines.vllm import AUX_LAYERS_FROM_MODEL_DEFAULTS
from draftline.engines.preflight import (
    EngineUnavailable, check_drafter, drafter_format, engine_convention, preflight, trained_layer_ids,
)
from draftline.errors import ConfigError, EngineError
from draftline.layout import eval_prefix, eval_result_key

SCHEMA = "draftline-eval/1"
# The verdict when the engine's own log names other aux layers than the drafter was trained on: it stands whatever
# the parity says, because on small targets neighbouring layers cost only a few percent of acceptance.
AUX_IDS_FAULT = "integration: aux-layer ids"
# Below this many accepted draft tokens per step the reference drafter is too weak for a ratio to mean anything.
MIN_REFERENCE_ACCEPTED = 0.02
# Bounds of the parity threshold set from a target's measured power. A gap of 10% or less is never called a fault:
# engines decode in bf16 and batch differently from the reference, and with the trained layers parity measured
# 0.92 (SGLang, 32 prompts) to 1.02 on an H200. Below 0.5 a threshold would excuse an engine that loses half of
# what the drafter earns.
PARITY_THRESHOLD_CEILING = 0.9
PARITY_THRESHOLD_FLOOR = 0.5
# When nothing was measured, or when wrong layers cost too little to see: parity still catches the faults that cost
# far more (a missing d2t, EAGLE instead of EAGLE3, a broken capture).
DEFAULT_PARITY_THRESHOLD = 0.8


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


# ---------------------------------------------------------------------------------------------- facts


def describe_hardware() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return f"{n}x {torch.cuda.get_device_name(0)}"
    except Exception:
        pass
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {model} ({os.cpu_count()} cores)"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------- acceptance


def combine_acceptance(parts: list[Acceptance]) -> Acceptance | None:
    """Acceptance over several runs, weighting each by its number of drafts."""
    parts = [a for a in parts if a is not None and a.num_drafts]
    if not parts:
        return None
    drafts = sum(a.num_drafts for a in parts)
    accepted = sum(a.num_accepted_tokens or 0 for a in parts)
    per_pos = None
    if all(a.per_position is not None for a in parts):
        k = len(parts[0].per_position)
        per_pos = [sum(a.per_position[i] * a.num_drafts for a in parts) / drafts for i in range(k)]
    draft_tokens = [a.num_draft_tokens for a in parts]
    return Acceptance(
        source=parts[0].source, mean_acceptance_length=1.0 + accepted / drafts, per_position=per_pos,
        num_drafts=drafts, num_accepted_tokens=accepted,
        num_draft_tokens=sum(draft_tokens) if all(d is not None for d in draft_tokens) else None,
    )


def _reference_figures(reference: Any) -> tuple[float, list[float] | None]:
    if hasattr(reference, "summary"):
        reference = reference.summary()
    if not isinstance(reference, dict) or reference.get("mean_acceptance_length") is None:
        raise ConfigError("the reference acceptance must be a mapping with mean_acceptance_length (and optionally "
                          "per_position_acceptance); pass draftline.reference's summary()")
    per_pos = reference.get("per_position_acceptance", reference.get("per_position"))
    return float(reference["mean_acceptance_length"]), (list(per_pos) if per_pos is not None else None)


def likely_causes(result: EvalResult, engine_cfg: EngineConfig | None = None) -> list[str]:
    """Integration faults that explain an engine accepting less than the reference, most specific first."""
    causes: list[str] = []
    drafter_dir = Path(result.drafter_path)
    config, lineage = ({}, {})
    if (drafter_dir / "config.json").is_file():
        config, lineage = drafter_format(drafter_dir)
    # The engine's own word beats any inference: the layers it says it fed the drafter, against the training's.
    logged = logged_aux_layers(result, lineage)
    if logged and logged[1]:
        causes.append(logged[0])
    if config and not config.get("speculators_config") and not config_aux_layer_ids(config):
        causes.append("the drafter config has no eagle_aux_hidden_state_layer_ids, so the engine guessed its "
                      "default layers")
    convention = lineage.get("convention")
    expected = engine_convention(result.engine, Path(result.target_path))
    if convention and convention != expected:
        causes.append(f"aux-layer ids are in the {convention!r} convention but {result.engine} reads "
                      f"{expected!r} ones: the drafter sees hidden states one layer off")
    vocab, draft_vocab = config.get("vocab_size"), config.get("draft_vocab_size")
    if vocab and draft_vocab and draft_vocab < vocab:
        from draftline.engines.preflight import _has_tensor

        if not _has_tensor(drafter_dir, "d2t"):
            causes.append("the export has no d2t map although the draft vocabulary is smaller than the target's")
    args = " ".join(engine_cfg.extra_args) if engine_cfg else ""
    if '"eagle"' in args or "--speculative-algorithm EAGLE " in args + " ":
        causes.append("extra_args select method EAGLE, not EAGLE3, for an EAGLE-3 drafter (accepts ~nothing)")
    p = result.parity
    if p and p.engine_per_position and p.reference_per_position and p.reference_per_position[0] > 0:
        if p.engine_per_position[0] < 0.5 * p.reference_per_position[0]:
            causes.append(
                f"position-0 acceptance {p.engine_per_position[0]:.2f} vs reference "
                f"{p.reference_per_position[0]:.2f}: the first draft token is already wrong, the signature of "
                "aux-layer ids in the wrong convention (vLLM: input of layer k; SGLang: output of layer k)"
            )
    causes += [
        "aux-layer ids off by one between conventions (vLLM 'input of layer k' vs SGLang 'output of layer k')",
        "a missing or zero d2t draft-to-target vocabulary map",
        "method EAGLE instead of EAGLE3 (or the engine ignoring the drafter's aux-state inputs)",
        "aux hidden-state capture broken for this target architecture in this engine version (e.g. MLA targets)",
        "the engine serving the target differently from the reference (dtype, chat template, truncation)",
    ]
    seen, out = set(), []
    for c in causes:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def logged_aux_layers(result: EvalResult, lineage: dict | None = None) -> tuple[str, bool] | None:
    """A sentence on the aux layers the EAGLE-3 server's log says it used, against the ones the drafter was trained
    on in that engine's convention (lineage: the drafter's, read here when not given), and whether they differ;
    None when the log named none."""
    facts = result.server_log_facts.get("eagle3", {})
    used = facts.get("aux_hidden_state_layers")
    if not used:
        return None
    if lineage is None:  # the row's own copy first: the report may be written where the drafter's files are not
        drafter_dir = Path(result.drafter_path)
        lineage = result.drafter_lineage or (
            drafter_format(drafter_dir)[1] if (drafter_dir / "config.json").is_file() else {})
    # The training record first: an edited lineage must not vouch for the layers it names.
    trained, _ = trained_layer_ids(result.engine, lineage, result.trained_aux_layer_ids, Path(result.target_path))
    said = (f"{result.engine}'s log says it fed the drafter the hidden states of layers {tuple(used)} (from the "
            f"{facts.get('aux_hidden_state_layers_from', 'its settings')})")
    if not trained:
        return said + "; the drafter's lineage does not say which layers it was trained on", False
    # The drafter config named its layers, yet the engine fell back to the target's defaults: it never read them.
    fell_back = facts.get("aux_hidden_state_layers_from") == AUX_LAYERS_FROM_MODEL_DEFAULTS
    not_read = (f"{result.engine} did not read the layer ids in the drafter's config (vLLM 0.25's GPU model runner "
                "reads them only at the config's top level, where draftline's vLLM export now writes them too)")
    if same_layers(used, trained):
        said += f", the layers the drafter was trained on in {result.engine}'s convention"
        if fell_back:
            said += (f", but only because those are also the target's defaults: {not_read}; harmless here, but a "
                     "drafter trained on other layers needs them at the top level")
        return said, False
    said += f", but the drafter was trained on layers {tuple(trained)} in {result.engine}'s convention"
    if fell_back:
        said += f": {not_read}; export the drafter again"
    return said, True


def parity_power(reference: Any, points: list[ConcurrencyPoint], threshold: float | str = "auto") -> ParityPower:
    """How well parity can see wrong aux-layer ids here, and the threshold that follows from it ("auto"), or the
    configured one (a number). The reference summary brings the shifted-layer runs and the run in another
    precision; the engine's points bring its own spread across concurrencies."""
    if hasattr(reference, "summary"):
        reference = reference.summary()
    ref_acc = float(reference["mean_acceptance_length"]) - 1.0
    shifts = list(reference.get("aux_shift_acceptance") or [])
    kept = max((r["kept_share"] for r in shifts if r.get("kept_share") is not None), default=None)
    sources: dict[str, float] = {}
    other = reference.get("other_precision_acceptance") or {}
    if other.get("kept_share") is not None:
        sources[f"reference decoder in {other['dtype']}"] = abs(1.0 - float(other["kept_share"]))
    engine_acc = [p.acceptance.mean_acceptance_length - 1.0 for p in points
                  if p.acceptance and p.acceptance.mean_acceptance_length is not None]
    if len(engine_acc) > 1 and ref_acc > 0:
        sources["engine across its concurrency points"] = (max(engine_acc) - min(engine_acc)) / ref_acc
    # The same requests again at one point: how far the engine's acceptance moves from run to run by itself.
    repeat_gaps = [max(a) - min(a) for p in points
                   if len(a := [r.mean_acceptance_length for r in p.acceptance_runs
                                if r.mean_acceptance_length is not None]) > 1]
    if repeat_gaps and ref_acc > 0:
        sources["engine across repeats of the same requests"] = max(repeat_gaps) / ref_acc
    noise = max(sources.values()) if sources else None
    upper = min(1.0 - noise, PARITY_THRESHOLD_CEILING) if noise is not None else PARITY_THRESHOLD_CEILING
    detectable = None if kept is None else kept < upper
    if isinstance(threshold, (int, float)):
        value, source = float(threshold), "config"
    elif kept is None and noise is None:
        value, source = DEFAULT_PARITY_THRESHOLD, "default"
    else:
        value = (upper + kept) / 2 if detectable else min(upper, DEFAULT_PARITY_THRESHOLD)
        value, source = max(PARITY_THRESHOLD_FLOOR, min(value, PARITY_THRESHOLD_CEILING)), "measured"
    hardest = next((r for r in shifts if r.get("kept_share") == kept), None)
    noise_said = "" if noise is None else f"; without a fault parity moves by up to {noise:.0%}"
    if kept is None:
        sentence = (f"the cost of wrong aux-layer ids was not measured (eval.reference.aux_shifts is empty or no shift "
                    f"fits the target){noise_said}; parity threshold {value:.2f} ({source})")
    elif detectable:
        sentence = (f"fed layers {tuple(hardest['aux_layer_ids'])}, one convention off, the drafter keeps {kept:.0%} "
                    f"of its accepted draft tokens{noise_said}: a parity below {value:.2f} ({source} threshold) "
                    "reveals such a mismatch")
    else:
        sentence = (f"fed layers {tuple(hardest['aux_layer_ids'])}, one convention off, the drafter still keeps "
                    f"{kept:.0%} of its accepted draft tokens{noise_said}: on this target a parity gap cannot reveal "
                    f"wrong aux-layer ids (threshold {value:.2f}, {source}); the engine's log and preflight can")
    return ParityPower(kept_share=kept, shifts=shifts, noise=noise, noise_sources=sources, detectable=detectable,
                       threshold=value, threshold_source=source, sentence=sentence)


def compute_parity(engine: Acceptance, reference: Any, threshold: float) -> Parity:
    """Parity = engine accepted tokens per step / reference accepted tokens per step; below threshold: suspected."""
    ref_len, ref_pp = _reference_figures(reference)
    eng_len = float(engine.mean_acceptance_length)
    ref_acc, eng_acc = ref_len - 1.0, eng_len - 1.0
    length_ratio = eng_len / ref_len
    if ref_acc < MIN_REFERENCE_ACCEPTED:
        return Parity(
            engine_mean_acceptance_length=eng_len, reference_mean_acceptance_length=ref_len, value=None,
            length_ratio=length_ratio, threshold=threshold, integration_suspected=False,
            verdict=(f"parity not measurable: the reference decoder accepts {ref_acc:.3f} draft tokens per step, "
                     "so the drafter itself is too weak to judge the engine integration"),
            engine_per_position=engine.per_position, reference_per_position=ref_pp,
        )
    value = eng_acc / ref_acc
    suspected = value < threshold
    verdict = (f"integration suspected: the engine accepts {eng_acc:.3f} draft tokens per step, the reference "
               f"{ref_acc:.3f} (parity {value:.2f} < {threshold:.2f})" if suspected else
               f"parity {value:.2f} >= {threshold:.2f}: the engine accepts what the reference accepts")
    return Parity(
        engine_mean_acceptance_length=eng_len, reference_mean_acceptance_length=ref_len, value=value,
        length_ratio=length_ratio, threshold=threshold, integration_suspected=suspected, verdict=verdict,
        engine_per_position=engine.per_position, reference_per_position=ref_pp,
    )


def with_parity(result: EvalResult, reference: Any, threshold: float | str = "auto",
                engine_cfg: EngineConfig | None = None) -> EvalResult:
    """The result with parity against the reference filled in (unchanged when the engine did not run); threshold
    "auto" is set from this target's measured power (parity_power)."""
    if result.status != "ok" or result.acceptance is None or result.acceptance.mean_acceptance_length is None:
        return result
    power = parity_power(reference, result.points, threshold)
    parity = compute_parity(result.acceptance, reference, power.threshold).model_copy(update={"power": power})
    logged = logged_aux_layers(result)
    if logged and logged[1]:
        seen = "" if parity.value is None else (
            f" (parity {parity.value:.2f}: " + ("low as well)" if parity.value < parity.threshold else
                                                "acceptance alone would not show it)"))
        parity = parity.model_copy(update={"integration_suspected": True, "integration_fault": AUX_IDS_FAULT,
                                           "verdict": f"{AUX_IDS_FAULT}: {logged[0]}{seen}"})
    updated = result.model_copy(update={"parity": parity})
    if updated.parity.integration_suspected:
        updated.parity.likely_causes = likely_causes(updated, engine_cfg)
    return updated


# ---------------------------------------------------------------------------------------------- running


def adapter_for(engine: str) -> EngineAdapter:
    if engine == "vllm":
        from draftline.engines.vllm import VllmAdapter

        return VllmAdapter()
    if engine == "sglang":
        from draftline.engines.sglang import SglangAdapter

        return SglangAdapter()
    raise ConfigError(f"engine {engine!r} is not supported; use 'vllm' or 'sglang'")


def _identical_share(base: list, spec: list) -> float:
    first = {}
    for r in base:
        first.setdefault(r.prompt_id, r.text)
    same = [first.get(r.prompt_id) == r.text for r in spec]
    return sum(same) / len(same) if same else 0.0


def _served_name(target_dir: Path) -> str:
    return Path(target_dir).resolve().name or "target"


class ServerRuns(NamedTuple):
    """One server's load runs, one (metrics, acceptance, request results) per concurrency, what its log said, and
    per concurrency each measured repeat's (metrics, request results) and acceptance. The metrics of `runs` are the
    repeats' medians (client.summarize_repeats), its request results those of every repeat, its acceptance over them
    all."""

    runs: list[tuple[RunMetrics, Acceptance | None, list]]
    log_facts: dict[str, Any]
    repeats: list[list[tuple[RunMetrics, list]]] = []
    repeat_acceptance: list[list[Acceptance | None]] = []


def measure(adapter: EngineAdapter, cfg: EngineConfig, target_dir: Path, drafter_dir: Path | None,
            prompts: list[Prompt], eval_cfg: EvalConfig, log_dir: Path, store, prefix: str | None) -> ServerRuns:
    """Start one server (baseline or EAGLE-3), run every configured concurrency against it (one warm-up wave, then
    `cfg.repeats` measured runs of the same requests), keep the engine's raw answers
    (`prefix`/responses/<server>.json), stop it, and read its log."""
    served = _served_name(target_dir)
    spec = adapter.server_spec(cfg, target_dir, drafter_dir, served)
    requester = adapter.requester(served, target_dir, eval_cfg.max_new_tokens, eval_cfg.temperature)
    out, repeats, repeat_acceptance = [], [], []
    log_prefix = f"{prefix}/logs" if prefix else None
    with launch(spec, cfg, log_dir, store=store, log_key_prefix=log_prefix) as server:
        for c in cfg.concurrency:
            # One unmeasured wave at this concurrency first: an engine meets a new batch size with one-off work
            # (kernel selection, graph capture, allocator growth), and a point of a few seconds would count it.
            run_load(server.base_url, round_robin(prompts, c), c, requester)
            before = adapter.acceptance_before(server.base_url)
            requests = requests_for(prompts, c, cfg.requests_per_point)
            runs, accepted = [], []
            for _ in range(cfg.repeats):
                start = adapter.acceptance_before(server.base_url)
                runs.append(run_load(server.base_url, requests, c, requester))
                accepted.append(adapter.acceptance_after(server.base_url, start, runs[-1][1],
                                                         cfg.num_speculative_tokens))
            results = [r for _, rs in runs for r in rs]
            acceptance = adapter.acceptance_after(server.base_url, before, results, cfg.num_speculative_tokens)
            out.append((summarize_repeats(runs), acceptance, results))
            repeats.append(runs)
            repeat_acceptance.append(accepted)
        if prefix:
            _put_json(store, f"{prefix}/responses/{spec.name}.json", adapter.snapshot(server.base_url, served))
    log_text = server.log_path.read_text(errors="replace") if server.log_path.is_file() else ""
    return ServerRuns(out, adapter.log_facts(log_text), repeats, repeat_acceptance)


def engine_warnings(server_log_facts: dict[str, dict[str, Any]]) -> list[EngineWarning]:
    """The warnings of every server's log (log_facts' "warnings"), once each, with the servers that logged them."""
    found: dict[str, list[str]] = {}
    for server, facts in server_log_facts.items():
        for text in facts.get("warnings") or []:
            found.setdefault(text, []).append(server)
    return [EngineWarning(text=text, servers=servers) for text, servers in found.items()]


def _put_json(store, key: str, data: dict) -> None:
    if store is not None:
        store.put_bytes(key, (json.dumps(data, indent=2) + "\n").encode())


def _new_result(cfg: EngineConfig, adapter: EngineAdapter, target_dir: Path, drafter_dir: Path, prompts_path: Path,
                num_prompts: int, eval_cfg: EvalConfig, run: str, trained_aux_layer_ids: list[int] | None) -> EvalResult:
    """An engine's result row before anything is measured: what is evaluated, where and with which settings."""
    lineage = {}
    if (drafter_dir / "draftline.json").is_file():
        lineage = json.loads((drafter_dir / "draftline.json").read_text())
    return EvalResult(
        run=run, engine=cfg.engine, engine_version=adapter.version(), status="ok", hardware=describe_hardware(),
        target=_served_name(target_dir), target_path=str(target_dir), drafter=drafter_dir.resolve().name,
        drafter_path=str(drafter_dir), drafter_lineage=lineage, prompt_set=prompts_path.name,
        prompt_set_sha256=_sha256(prompts_path), num_prompts=num_prompts,
        sampling={"temperature": eval_cfg.temperature, "max_new_tokens": eval_cfg.max_new_tokens},
        num_speculative_tokens=cfg.num_speculative_tokens, server_args=list(cfg.extra_args),
        speculative_server_args=list(cfg.speculative_extra_args), started_at=_now(),
        trained_aux_layer_ids=trained_aux_layer_ids,
    )


def _refused(result: EvalResult, exc: ConfigError) -> EvalResult:
    """The failed row of an evaluation refused before any server started."""
    fault = AUX_IDS_FAULT if isinstance(exc, AuxLayerIdsError) else None
    return result.model_copy(update={"status": "failed", "reason": str(exc).split("\n")[0], "fault": fault,
                                     "finished_at": _now()})


def refuse_misread_export(cfg: EngineConfig, target_dir: str | Path, drafter_dir: str | Path,
                          prompts_path: str | Path, eval_cfg: EvalConfig, store, run: str,
                          trained_aux_layer_ids: list[int] | None = None) -> ConfigError | None:
    """The export check of preflight alone (files only: no engine is asked, no server starts): None when the engine
    would read the export as it was trained; else the refusal, with the engine's failed row written to the store as
    evaluate_engine writes it. Lets an evaluation fail before its reference decoder runs."""
    target_dir, drafter_dir, prompts_path = Path(target_dir), Path(drafter_dir), Path(prompts_path)
    try:
        check_drafter(cfg.engine, drafter_dir, target_dir, trained_aux_layer_ids)
    except ConfigError as exc:
        result = _new_result(cfg, adapter_for(cfg.engine), target_dir, drafter_dir, prompts_path,
                             len(load_prompts(prompts_path, eval_cfg.max_prompts)), eval_cfg, run,
                             trained_aux_layer_ids)
        _put_json(store, eval_result_key(run, cfg.engine), _refused(result, exc).model_dump(mode="json"))
        return exc
    return None


def evaluate_engine(cfg: EngineConfig, target_dir: str | Path, drafter_dir: str | Path, prompts_path: str | Path,
                    eval_cfg: EvalConfig, store, run: str, reference: Any = None,
                    log_dir: str | Path | None = None, trained_aux_layer_ids: list[int] | None = None) -> EvalResult:
    """Baseline and EAGLE-3 runs of one engine on the same prompts at each concurrency; result JSON in the store.

    An engine not installed here gives a "skipped" result; a server that cannot be started after its retries
    gives a "failed" result in the store and raises EngineError. With `reference` (draftline.reference's
    acceptance summary on the same prompts and k), parity is filled in; compute the reference on the trained
    checkpoint itself, not on this engine's export, or an export bug (wrong aux-layer ids) hides in both.
    `trained_aux_layer_ids` (vLLM convention, from the training record) is what the export and the engine's log are
    checked against; without it, the export's own lineage.
    """
    target_dir, drafter_dir, prompts_path = Path(target_dir), Path(drafter_dir), Path(prompts_path)
    adapter = adapter_for(cfg.engine)
    prompts = load_prompts(prompts_path, eval_cfg.max_prompts)
    prefix, result_key = eval_prefix(run, cfg.engine), eval_result_key(run, cfg.engine)
    result = _new_result(cfg, adapter, target_dir, drafter_dir, prompts_path, len(prompts), eval_cfg, run,
                         trained_aux_layer_ids)
    try:
        facts = preflight(cfg, target_dir, drafter_dir, trained_aux_layer_ids)
    except EngineUnavailable as exc:
        result = result.model_copy(update={"status": "skipped", "reason": str(exc).split("\n")[0],
                                           "finished_at": _now()})
        _put_json(store, result_key, result.model_dump(mode="json"))
        return result
    except ConfigError as exc:  # the row is written first, so the report and the nightly show why
        _put_json(store, result_key, _refused(result, exc).model_dump(mode="json"))
        raise
    result.engine_version = facts["engine_version"]
    result.target_architecture = facts["architecture"]
    if facts["gpu"]:
        result.hardware = facts["gpu"]
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"draftline-{cfg.engine}-logs-"))
    try:
        base = measure(adapter, cfg, target_dir, None, prompts, eval_cfg, logs, store, prefix)
        spec = measure(adapter, cfg, target_dir, drafter_dir, prompts, eval_cfg, logs, store, prefix)
    except EngineError as exc:
        failed = result.model_copy(update={"status": "failed", "reason": str(exc).split("\n")[0],
                                           "finished_at": _now()})
        _put_json(store, result_key, failed.model_dump(mode="json"))
        raise
    points = []
    for (_, _, b_results), (_, acc, s_results), b_repeats, s_repeats, s_accepted in zip(
            base.runs, spec.runs, base.repeats, spec.repeats, spec.repeat_acceptance):
        points.append(ConcurrencyPoint.of_repeats(
            b_repeats, s_repeats, acc,
            _identical_share(b_results, s_results) if eval_cfg.temperature == 0 else None, s_accepted))
    result.points = points
    result.acceptance = combine_acceptance([p.acceptance for p in points])
    result.server_log_facts = {mode: facts for mode, facts in (("baseline", base.log_facts), ("eagle3", spec.log_facts))
                               if facts}
    result.engine_warnings = engine_warnings(result.server_log_facts)
    result.finished_at = _now()
    if reference is not None:
        result = with_parity(result, reference, eval_cfg.parity_threshold, cfg)
    _put_json(store, result_key, result.model_dump(mode="json"))
    return result
