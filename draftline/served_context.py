"""The longest context vLLM and SGLang serve a checkpoint at, read from its config.json as each engine reads it."""
from __future__ import annotations

import functools
import math
import os

# The variables with which vLLM and SGLang serve a context longer than the checkpoint's own.
LONGER_CONTEXT_ENV = {"vllm": "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "sglang": "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"}
# Their flags that change the target's config.json as the server loads it.
_CONFIG_OVERRIDES = ("--hf-overrides", "--json-model-override-args")

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
    None where neither the config nor its model type's defaults name one (both engines then take any length)."""
    wrapped = isinstance(target.get("text_config"), dict)
    text = target["text_config"] if wrapped else target
    model_type = str(text.get("model_type") or target.get("model_type") or "")
    # Both engines read transformers' config object, where a key config.json leaves out has its class's default.
    text = {**_context_defaults(model_type, wrapped and not text.get("model_type")), **text}
    if engine == "vllm":
        found = {k: _number(text.get(k)) for k in _VLLM_CONTEXT_KEYS if _number(text.get(k))}
        if not found:
            return None
        key = "model_max_length" if "model_max_length" in found else min(found, key=found.get)
        gemma3 = "gemma3" in model_type

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


def context_lifted(settings, engine: str = "vllm", here: bool = True) -> bool:
    """Whether this server is told to serve past the checkpoint's context: the engine's override variable in its env
    (or in this process's, which a server started here inherits), or a flag that loads another config.json."""
    env = LONGER_CONTEXT_ENV[engine]
    worker = os.environ.get(env, "") if here else ""
    if str(settings.env.get(env, worker)).strip().lower() in ("1", "true", "yes", "y", "on"):  # read as booleans
        return True
    return any(a.split("=", 1)[0] in _CONFIG_OVERRIDES for a in settings.extra_args)


@functools.lru_cache(maxsize=None)
def _context_defaults(model_type: str, text_of_wrapper: bool) -> dict:
    """The context and RoPE keys transformers' config class for `model_type` sets by default (of its text config when
    config.json's text_config names no type); none for a type transformers does not know (remote code)."""
    try:
        from transformers import CONFIG_MAPPING

        config = CONFIG_MAPPING[model_type]()
        config = config.get_text_config() if text_of_wrapper else config
        values = config.to_dict()
    except Exception:  # an unknown type, or a class that needs arguments: only config.json speaks then
        return {}
    keys = set(_VLLM_CONTEXT_KEYS) | set(_SGLANG_CONTEXT_KEYS) | {"rope_scaling", "rope_parameters"}
    return {k: values[k] for k in keys if values.get(k) is not None}
