"""The longest context vLLM and SGLang serve a checkpoint at, read from its config.json as each engine reads it."""
from __future__ import annotations

import math

# Where each engine reads a checkpoint's context: vLLM takes the smallest of these (model_max_length overriding
# them), SGLang the first present.
_VLLM_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                      "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
_SGLANG_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                        "max_position_embeddings")
# RoPE types whose max_position_embeddings vLLM takes as already scaled.
_VLLM_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def _number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return float(value) if ok else None


def _ropes(text: dict) -> list[dict]:
    """The RoPE parameter sets of a config (transformers may key them by layer type)."""
    ropes = [r for r in (text.get("rope_scaling"), text.get("rope_parameters")) if isinstance(r, dict)]
    return ropes + [v for r in ropes for v in r.values() if isinstance(v, dict)]


def engine_context(target: dict, engine: str) -> tuple[int, str] | None:
    """The longest context `engine` serves the target at without its override variable, and the keys it comes from;
    None where the config names none (both engines then take any length)."""
    text = target.get("text_config") if isinstance(target.get("text_config"), dict) else target
    if engine == "vllm":
        found = {k: _number(text.get(k)) for k in _VLLM_CONTEXT_KEYS if _number(text.get(k))}
        if not found:
            return None
        key = "model_max_length" if "model_max_length" in found else min(found, key=found.get)
        gemma3 = "gemma3" in str(text.get("model_type"))

        def scales(kind, rope: dict) -> bool:
            return not gemma3 and kind not in _VLLM_PRESCALED_ROPE
    else:
        key = next((k for k in _SGLANG_CONTEXT_KEYS if _number(text.get(k))), None)
        if key is None:
            return None

        def scales(kind, rope: dict) -> bool:
            return kind != "llama3" and "original_max_position_embeddings" not in rope
    factor = 1.0
    for rope in _ropes(text):
        if scales(rope.get("rope_type", rope.get("type")), rope) and _number(rope.get("factor")):
            factor = _number(rope["factor"])
    limit = _number(text.get(key)) * factor
    return int(limit), key + (f" x RoPE factor {factor:g}" if factor != 1 else "")
