"""The longest context vLLM and SGLang serve a checkpoint at, read from its config.json as each engine reads it."""
from __future__ import annotations

import functools
import json
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
    text, model_type = _text_config_as_read(target)
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


def _text_config_as_read(target: dict) -> tuple[dict, str]:
    """The text config's keys and model type as both engines read them: from transformers' config object, where a key
    config.json leaves out has its class's default and an alias (gpt2's max_position_embeddings) reads as the key it
    stands for. Where config.json states max_position_embeddings it speaks for itself: building the object imports
    transformers, which takes seconds."""
    wrapped = isinstance(target.get("text_config"), dict)
    text = target["text_config"] if wrapped else target
    model_type = str(text.get("model_type") or target.get("model_type") or "")
    if _number(text.get("max_position_embeddings")):
        return text, model_type
    loaded = _loaded_text_config(json.dumps(target, sort_keys=True, default=str))
    if not loaded and wrapped:  # a wrapper transformers does not know (remote code) around a text model it does
        loaded = _loaded_text_config(json.dumps(text, sort_keys=True, default=str))
    return {**text, **loaded}, str(loaded.get("model_type") or model_type)


@functools.lru_cache(maxsize=16)
def _loaded_text_config(config_json: str) -> dict:
    """The context, RoPE and type keys of the text config transformers builds from this config.json; none for a type
    it does not know or a config it rejects."""
    try:
        from transformers import CONFIG_MAPPING

        raw = json.loads(config_json)
        config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw).get_text_config()
    except Exception:  # config.json alone speaks then
        return {}
    keys = (*_VLLM_CONTEXT_KEYS, *_SGLANG_CONTEXT_KEYS, "rope_scaling", "rope_parameters", "model_type")
    return {k: getattr(config, k) for k in keys if getattr(config, k, None) is not None}
