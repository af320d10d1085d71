"""Sizing an EAGLE-3 head for a target: its Eagle3Config from the target's config.json (Llama-like or DeepSeek MLA) and the drafter: section."""
from __future__ import annotations

from draftline.aux_ids import default_aux_layer_ids
from draftline.drafter.model import MLA_SIZES, Eagle3Config, Eagle3Drafter
from draftline.errors import ConfigError


def _get(config, *names, default=None):
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def target_rope_theta(target_config) -> float:
    params = _get(target_config, "rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(_get(target_config, "rope_theta", default=10000.0))


def config_for_target(target_config, drafter_cfg=None, aux_layer_ids: list[int] | None = None,
                      heads_from: str | None = None) -> Eagle3Config:
    """Eagle3Config from a target config (Llama-like or DeepSeek-V3 MLA/MoE: only the sizes matter); `heads_from`
    names where drafter_cfg's heads came from when not the drafter: section (a warm start), for its refusals."""
    if not isinstance(target_config, dict) and hasattr(target_config, "get_text_config"):
        target_config = target_config.get_text_config()
    elif isinstance(target_config, dict) and isinstance(target_config.get("text_config"), dict):
        target_config = target_config["text_config"]
    hidden = _get(target_config, "hidden_size")
    vocab = _get(target_config, "vocab_size")
    layers = _get(target_config, "num_hidden_layers")
    if not (hidden and vocab and layers):
        raise ConfigError("target config lacks hidden_size, vocab_size or num_hidden_layers; pass the target's config.json")
    own = getattr(drafter_cfg, "num_attention_heads", None)
    named = heads_from or ("drafter.num_attention_heads" if own else "the target's num_attention_heads")
    heads = own or _get(target_config, "num_attention_heads")
    kv_heads = getattr(drafter_cfg, "num_key_value_heads", None) or _get(target_config, "num_key_value_heads", default=heads)
    if not all(isinstance(n, int) and n > 0 for n in (heads, kv_heads)):
        raise ConfigError(f"{named} {heads!r} (key/value heads {kv_heads!r}) is not a positive whole number; set "
                          "drafter.num_attention_heads")
    if kv_heads > heads or heads % kv_heads:
        kv_heads = heads
    mla_head = getattr(drafter_cfg, "attention", "llama") == "mla"
    # Heads that do not divide the hidden size take the target's own head_dim where it names one (targets whose heads
    # times head_dim is not their hidden size); an MLA head's sizes are the target's latent ones whatever the heads.
    head_dim = hidden // heads if not hidden % heads or mla_head else _get(target_config, "head_dim")
    if not head_dim:
        fix = ("start from a drafter made for this target, or train from scratch" if heads_from else
               f"set drafter.num_attention_heads to a divisor of {hidden}")
        raise ConfigError(f"{named} {heads} does not divide the target's hidden_size {hidden} and the target names no "
                          f"head_dim; {fix}")
    intermediate = getattr(drafter_cfg, "intermediate_size", None) or _get(target_config, "intermediate_size", default=4 * hidden)
    draft_vocab = getattr(drafter_cfg, "draft_vocab_size", None) or vocab
    ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(layers)
    mla = {}
    if mla_head:
        mla = {"attention": "mla", **{n: _get(target_config, n) for n in MLA_SIZES}}
        if mla["q_lora_rank"] is None:  # targets without a low-rank q (DeepSeek-V2-Lite): the latent's rank
            mla["q_lora_rank"] = mla["kv_lora_rank"]
        missing = [n for n in MLA_SIZES if mla[n] is None]
        if missing:
            raise ConfigError(f"drafter.attention is mla but the target config has no {', '.join(missing)}; MLA heads "
                              "take their sizes from an MLA target (DeepSeek-V3, Kimi-K2.5): use attention: llama")
        head_dim, kv_heads = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"], heads
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        draft_vocab_size=min(draft_vocab, vocab),  # a draft vocabulary cannot exceed the target's
        target_hidden_size=hidden,
        aux_layer_ids=ids,
        target_num_layers=layers,
        rms_norm_eps=float(_get(target_config, "rms_norm_eps", default=1e-6)),
        rope_theta=target_rope_theta(target_config),
        max_position_embeddings=int(_get(target_config, "max_position_embeddings", default=4096)),
        **mla,
    )


def drafter_for_target(target_config, drafter_cfg=None, aux_layer_ids: list[int] | None = None) -> Eagle3Drafter:
    """A fresh head sized for the target (a transformers config or its config.json dict); ids in vLLM's convention."""
    return Eagle3Drafter(config_for_target(target_config, drafter_cfg, aux_layer_ids))
