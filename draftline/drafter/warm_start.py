"""Warm starts: a drafter config shaped like an existing head (any layout draftline reads), and that head's weights and vocabulary copied into the new one."""
from __future__ import annotations

from pathlib import Path

import torch

from draftline.aux_ids import same_layers
from draftline.config import DrafterConfig
from draftline.drafter.eagle_format import MLA_ARCHITECTURE
from draftline.drafter.readers import drafter_shape, read_drafter
from draftline.drafter.model import Eagle3Config, Eagle3Drafter
from draftline.drafter.target_sizing import config_for_target, target_rope_theta
from draftline.errors import ConfigError


# The head's layer shape a warm start takes from its source (a public drafter's heads, MLP width and RoPE), unless
# the drafter: section sets it; hidden size and vocabulary come from the target and must match the source's.
WARM_START_SHAPE = ("intermediate_size", "num_attention_heads", "num_key_value_heads")


def warm_start_config(source: str, target_cfg: dict, drafter_cfg: DrafterConfig, aux_ids: list[int]) -> Eagle3Config:
    """This run's head for a warm start: the target's sizes and this run's aux ids, the source's layer shape."""
    from dataclasses import replace

    cfg_path = Path(source) / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"train.warm_start={source} has no config.json; point it at a drafter directory (the "
                          "EAGLE/SpecForge layout, the speculators format or a draftline export)")
    theirs = drafter_shape(source)
    theirs_mla = MLA_ARCHITECTURE in (theirs.get("architectures") or [])
    if theirs_mla != (drafter_cfg.attention == "mla"):
        kind = "an MLA head" if theirs_mla else "a Llama-layer head"
        raise ConfigError(f"train.warm_start={source} is {kind} but drafter.attention is {drafter_cfg.attention}; set "
                          f"drafter.attention to {'mla' if theirs_mla else 'llama'} or train from scratch")
    text = target_cfg.get("text_config", target_cfg)
    for name, target_value in (("hidden_size", text.get("hidden_size")), ("vocab_size", text.get("vocab_size"))):
        if theirs.get(name) is not None and theirs[name] != target_value:
            raise ConfigError(f"warm start {source} has {name}={theirs[name]} but this drafter needs {target_value} "
                              "(the target's); start from a drafter made for the same target, or train from scratch")
    for name in WARM_START_SHAPE:
        if theirs.get(name) is not None and not (isinstance(theirs[name], int) and theirs[name] > 0):
            raise ConfigError(f"train.warm_start={source}: its config.json's {name} {theirs[name]!r} is not a positive "
                              "whole number; correct that file or train from scratch")
        ours = getattr(drafter_cfg, name)
        if ours is not None and theirs.get(name) is not None and ours != theirs[name]:
            raise ConfigError(f"drafter.{name}={ours} but the warm start {source} has {theirs[name]}; remove "
                              f"drafter.{name} to take the warm start's, or train from scratch")
    shaped = drafter_cfg.model_copy(update={n: getattr(drafter_cfg, n) or theirs.get(n) for n in WARM_START_SHAPE})
    heads_from = None if drafter_cfg.num_attention_heads or theirs.get("num_attention_heads") is None else \
        f"the warm start {source}'s num_attention_heads"
    cfg = config_for_target(target_cfg, shaped, aux_ids, heads_from)
    # A size the source's config.json leaves out or sets to null is the target's.
    return replace(cfg, head_dim=int(theirs.get("head_dim") or cfg.head_dim),
                   rms_norm_eps=float(theirs.get("rms_norm_eps") or cfg.rms_norm_eps),
                   rope_theta=target_rope_theta({"rope_theta": cfg.rope_theta,
                                                 **{k: v for k, v in theirs.items() if v is not None}}),
                   max_position_embeddings=int(theirs.get("max_position_embeddings") or cfg.max_position_embeddings))


def warm_start(model: Eagle3Drafter, source: str, embed: torch.Tensor, remap: bool, target_cfg: dict) -> dict:
    """Copy weights from an existing drafter dir in any layout draftline reads (draftline.drafter.readers); its
    vocabulary replaces ours unless `remap`. Ids a drafter names are read in the convention it states or its layout
    implies for this target; one that names no ids (many public drafters) starts this run's layers, and the record
    says so."""
    read = read_drafter(source, embed_tokens=embed, assume_aux_layer_ids=model.config.aux_layer_ids,
                        target_config=target_cfg)
    old = read.model
    ours, theirs = model.config, old.config
    named = read.ids_named
    for name in ("hidden_size", "target_hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size"):
        if getattr(ours, name) != getattr(theirs, name):
            raise ConfigError(
                f"warm start {source} has {name}={getattr(theirs, name)} but this drafter needs {getattr(ours, name)}; "
                "start from a drafter made for the same target, or train from scratch"
            )
    if named and not same_layers(theirs.aux_layer_ids, ours.aux_layer_ids):
        raise ConfigError(
            f"warm start {source} reads aux layers {theirs.aux_layer_ids} (vLLM convention) but the hidden states were "
            f"extracted at {ours.aux_layer_ids}; extract with extract.aux_layer_ids={theirs.aux_layer_ids}"
        )
    state = {k: v for k, v in old.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")}
    model.load_state_dict(state, strict=False)
    if theirs.draft_vocab_size != ours.draft_vocab_size and not remap:
        raise ConfigError(
            f"warm start {source} has draft_vocab_size={theirs.draft_vocab_size} but drafter.draft_vocab_size="
            f"{ours.draft_vocab_size}; set them equal, or set train.warm_start_remap_vocab=true to map lm_head rows by token"
        )
    record = {"source": str(source),
              "aux_layer_ids": (f"as trained here, {ours.aux_layer_ids}" if named else
                                f"not named by the source; its weights start this run's layers {ours.aux_layer_ids}")}
    with torch.no_grad():
        if not remap:
            model.set_vocab(old.d2t, old.t2d)
            model.lm_head.weight.copy_(old.lm_head.weight)
            return {**record, "vocab": "kept from the warm start", "rows_copied": theirs.draft_vocab_size}
        # Remap: rows of tokens both vocabularies share are copied; the others keep their fresh initialisation.
        old_row = torch.full((ours.vocab_size,), -1, dtype=torch.long)
        old_row[old.draft_token_ids] = torch.arange(theirs.draft_vocab_size)
        src = old_row[model.draft_token_ids.cpu()]
        hit = src >= 0
        model.lm_head.weight[hit] = old.lm_head.weight[src[hit]].to(model.lm_head.weight.dtype)
    return {**record, "vocab": "remapped to this run's", "rows_copied": int(hit.sum())}
