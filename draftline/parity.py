"""An engine's acceptance against the reference decoder's: parity, its power on this target, a gap's likely causes."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from draftline.aux_ids import config_aux_layer_ids, same_layers
from draftline.config import EngineConfig
from draftline.engines.base import Acceptance
from draftline.engines.preflight import drafter_format, engine_convention, trained_layer_ids
from draftline.engines.vllm import AUX_LAYERS_FROM_MODEL_DEFAULTS
from draftline.errors import ConfigError
from draftline.eval_result import ConcurrencyPoint, EvalResult, Parity, ParityPower

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
# What parity compares an engine with unless the figures say otherwise (a run without the reference decoder).
REFERENCE_BASIS = "reference decoder"
# When nothing was measured, or when wrong layers cost too little to see: parity still catches the faults that cost
# far more (a missing d2t, EAGLE instead of EAGLE3, a broken capture).
DEFAULT_PARITY_THRESHOLD = 0.8


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
    basis = (reference.get("basis") if isinstance(reference, dict) else None) or REFERENCE_BASIS
    ref_name = "the reference" if basis == REFERENCE_BASIS else f"the {basis}"
    eng_len = float(engine.mean_acceptance_length)
    ref_acc, eng_acc = ref_len - 1.0, eng_len - 1.0
    length_ratio = eng_len / ref_len
    if ref_acc < MIN_REFERENCE_ACCEPTED:
        return Parity(
            engine_mean_acceptance_length=eng_len, reference_mean_acceptance_length=ref_len, value=None,
            length_ratio=length_ratio, threshold=threshold, integration_suspected=False,
            verdict=(f"parity not measurable: {ref_name} accepts {ref_acc:.3f} draft tokens per step, "
                     "so the drafter itself is too weak to judge the engine integration"),
            engine_per_position=engine.per_position, reference_per_position=ref_pp, basis=basis,
        )
    value = eng_acc / ref_acc
    suspected = value < threshold
    verdict = (f"integration suspected: the engine accepts {eng_acc:.3f} draft tokens per step, {ref_name} "
               f"{ref_acc:.3f} (parity {value:.2f} < {threshold:.2f})" if suspected else
               f"parity {value:.2f} >= {threshold:.2f}: the engine accepts what {ref_name} accepts")
    return Parity(
        engine_mean_acceptance_length=eng_len, reference_mean_acceptance_length=ref_len, value=value,
        length_ratio=length_ratio, threshold=threshold, integration_suspected=suspected, verdict=verdict,
        engine_per_position=engine.per_position, reference_per_position=ref_pp, basis=basis,
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
