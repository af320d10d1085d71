"""Reads every EAGLE-3 drafter layout teams hold into one in-memory drafter with explicit aux-layer ids and their source.

The layouts: draftline's own (training output and exports, with draftline.json); the EAGLE and SpecForge Hugging Face
layout (LlamaForCausalLMEagle3, `midlayer.*` or `layers.0.*` weights, d2t/t2d, ids in eagle_config, at the top level
or absent, as the public Kimi-K2/K2.5 drafters ship); the same head with DeepSeek's latent attention
(Eagle3DeepseekV2ForCausalLM); and vLLM's speculators format. The aux-layer ids come, in this order, from the caller
(`aux_layer_ids` with `convention`: the command line's --aux-layer-ids and --convention), from the drafter's own
files (its convention stated there or inferred, and the record says which), or not at all: a drafter that names
none is refused, never served with an engine's default layers.
"""
from __future__ import annotations

import json
import tempfile
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

import torch

from draftline.aux_ids import (CONVENTIONS, SGLANG, SGLANG_DEEPSEEK, VLLM, AuxLayerIds, config_aux_layer_ids,
                               from_convention, outside, reader_convention, same_layers)
from draftline.drafter.eagle_format import (ARCHITECTURE, LINEAGE_FILE, MLA_ARCHITECTURE, complete_tensors,
                                            config_from_eagle_json, head_key)
from draftline.drafter.model import Eagle3Drafter
from draftline.errors import ConfigError

DRAFTLINE = "draftline"  # draftline's training output or export: an EAGLE config with draftline.json beside it
EAGLE = "eagle"  # the EAGLE and SpecForge Hugging Face layout
EAGLE_MLA = "eagle-mla"  # the same head with DeepSeek's latent attention
SPECULATORS = "speculators"  # vLLM's speculators format
LAYOUTS = (DRAFTLINE, EAGLE, EAGLE_MLA, SPECULATORS)
# vLLM registers the Llama-layer head under both names.
LLAMA_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")
USER_CONVENTIONS = (VLLM, SGLANG)
IDS_FLAGS = "--aux-layer-ids and --convention vllm|sglang"
_REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


@dataclass
class ReadDrafter:
    """A drafter read from any layout: the head (aux ids in vLLM's convention in its config), and what was read.

    The head's embeddings are the source's, else the caller's `embed_tokens`, else zeros: `has_embeddings` says
    whether the source shipped its own (a writer then writes them; the engines and the reference decoder otherwise
    take the target's)."""

    model: Eagle3Drafter
    path: Path
    layout: str
    layout_said: str  # e.g. "the EAGLE/SpecForge layout (LlamaForCausalLMEagle3, layers.0.* weights)"
    aux_ids: AuxLayerIds
    ids_source: str  # one sentence: where the ids came from and in which convention, stated or inferred
    ids_named: bool  # whether the drafter's own files name ids at all
    has_embeddings: bool
    dtype: torch.dtype
    lineage: dict = field(default_factory=dict)  # draftline.json, when the source has one

    def describe(self) -> str:
        """One line for logs and reports."""
        return f"{self.path}: {self.layout_said}; {self.ids_source}"


def read_drafter(path, target_dir=None, *, aux_layer_ids=None, convention: str | None = None,
                 embed_tokens: torch.Tensor | None = None, assume_aux_layer_ids=None,
                 target_config: dict | None = None) -> ReadDrafter:
    """Read the drafter folder `path` in whatever layout it has. With `target_dir`, it is checked against the target
    (hidden size, vocabulary, ids in range; SGLang's convention for this target family) in one sentence naming the
    file and the fix. `aux_layer_ids` (with `convention`, "vllm" or "sglang") override the drafter's own;
    `convention` alone says how to read the drafter's own ids; `assume_aux_layer_ids` (vLLM convention) stand in
    for a drafter that names none (a warm start takes the run's). `target_config` (the target's config.json, for a
    caller that checks the fit itself) tells SGLang's convention for the target's family where `target_dir` is not
    given."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"drafter {directory}: no such folder; pass the folder that holds the drafter's config.json "
                          "and weights")
    cfg_path = directory / "config.json"
    raw = _read_json(cfg_path, "pass the folder that holds the drafter's config.json and weights")
    lineage = _read_json(directory / LINEAGE_FILE, "delete it or export the drafter again") \
        if (directory / LINEAGE_FILE).is_file() else {}
    files = weight_files(directory)
    layout, view = eagle_view(raw, cfg_path, lineage)
    target_cfg = _target_config(target_dir) if target_dir is not None else (target_config or {})
    resolved = resolve_aux_ids(raw, layout, lineage, cfg_path, target_cfg, aux_layer_ids, convention,
                               assume_aux_layer_ids)
    ids = resolved.ids
    tensors, sources = load_weights(files)
    naming = "layers.0" if any(n.startswith(("layers.0.", "model.layers.0.")) for _, n in sources.values()) \
        else "midlayer"
    # Fields some layouts leave out, from the weights that fix them.
    if not view.get("target_hidden_size") and "fc.weight" in tensors:
        view["target_hidden_size"] = tensors["fc.weight"].shape[1] // 3
    if not view.get("draft_vocab_size") and "lm_head.weight" in tensors:
        view["draft_vocab_size"] = tensors["lm_head.weight"].shape[0]
    missing = [f for f in _REQUIRED_FIELDS if view.get(f) is None]
    if missing:
        raise ConfigError(f"{cfg_path}: no {', '.join(missing)}; the drafter's config.json is incomplete, so download "
                          "it again with the weights")
    try:
        cfg = config_from_eagle_json(_without_ids(view), cfg_path, VLLM, None, ids.as_list())
    except ConfigError as exc:
        raise ConfigError(str(exc) if str(exc).startswith(str(cfg_path)) else f"{cfg_path}: {exc}") from None
    if target_dir is not None:
        check_fits_target(cfg, ids, resolved.claim, cfg_path, target_dir, target_cfg)
    model = Eagle3Drafter(cfg)
    _check_shapes(tensors, sources, model, directory, cfg_path)
    has_embeddings = "embed_tokens.weight" in tensors
    source_dtype = _dominant_dtype(tensors)
    if not has_embeddings and embed_tokens is None:
        embed_tokens = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    tensors = complete_tensors(tensors, model, directory, embed_tokens)
    if target_dir is not None:
        _check_d2t(tensors["d2t"], directory / sources.get("d2t", (files[0].name,))[0], target_dir, target_cfg)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
    arch = (raw.get("architectures") or ["Eagle3Speculator"])[0]
    said = {DRAFTLINE: f"draftline's own layout ({arch}, with {LINEAGE_FILE})",
            EAGLE: f"the EAGLE/SpecForge layout ({arch}, {naming}.* weights)",
            EAGLE_MLA: f"the EAGLE-3 layout with DeepSeek's latent attention ({arch}, {naming}.* weights)",
            SPECULATORS: "the speculators format (speculators_model_type eagle3)"}[layout]
    return ReadDrafter(model=model, path=directory, layout=layout, layout_said=said, aux_ids=ids,
                       ids_source=resolved.said, ids_named=resolved.named, has_embeddings=has_embeddings,
                       dtype=source_dtype, lineage=lineage)


def drafter_shape(path) -> dict:
    """The head's config fields as the EAGLE layout names them, whatever the folder's layout (what a warm start takes
    its layer shape from); the ids are left out."""
    directory = Path(path)
    cfg_path = directory / "config.json"
    raw = _read_json(cfg_path, "point it at a drafter folder")
    lineage = _read_json(directory / LINEAGE_FILE, "delete it") if (directory / LINEAGE_FILE).is_file() else {}
    return _without_ids(eagle_view(raw, cfg_path, lineage)[1])


# ---- layouts ----------------------------------------------------------------------------------------------------
def eagle_view(raw: dict, cfg_path: Path, lineage: dict) -> tuple[str, dict]:
    """(layout, the config's fields as the EAGLE layout names them), or one sentence when it is no EAGLE-3 head."""
    if raw.get("speculators_model_type") or raw.get("speculators_config"):
        kind = raw.get("speculators_model_type") or (raw.get("speculators_config") or {}).get("algorithm")
        if kind != "eagle3":
            raise ConfigError(f"{cfg_path}: a speculators {kind!r} drafter, not EAGLE-3; pass a speculators drafter "
                              "with speculators_model_type eagle3, or an EAGLE-3 drafter in another layout")
        if raw.get("norm_before_residual"):
            raise ConfigError(f"{cfg_path}: norm_before_residual is true, a variant whose residual is the normalised "
                              "hidden state, which the EAGLE-3 head draftline evaluates does not have; use a drafter "
                              "trained with norm_before_residual false")
        layer = dict(raw.get("transformer_layer_config") or {})
        view = {**layer, "architectures": [ARCHITECTURE],
                **{k: raw[k] for k in ("draft_vocab_size", "target_hidden_size") if raw.get(k) is not None}}
        return SPECULATORS, view
    archs = list(raw.get("architectures") or [])
    if MLA_ARCHITECTURE in archs:
        layout = EAGLE_MLA
    elif any(a in LLAMA_ARCHITECTURES for a in archs):
        layout = EAGLE
        archs = [ARCHITECTURE if a in LLAMA_ARCHITECTURES else a for a in archs]
    else:
        raise ConfigError(f"{cfg_path}: architectures {archs} is not an EAGLE-3 drafter; pass a folder whose "
                          f"config.json names {ARCHITECTURE} or {MLA_ARCHITECTURE}, or a speculators eagle3 drafter "
                          "(EAGLE-1/2 heads, MTP layers and whole models are not EAGLE-3 drafters)")
    return (DRAFTLINE if lineage else layout), {**raw, "architectures": archs}


def _without_ids(view: dict) -> dict:
    out = {k: v for k, v in view.items() if k not in ("eagle_aux_hidden_state_layer_ids", "speculators_config")}
    if isinstance(out.get("eagle_config"), dict):
        out["eagle_config"] = {k: v for k, v in out["eagle_config"].items()
                               if k != "eagle_aux_hidden_state_layer_ids"}
    return out


# ---- aux-layer ids ------------------------------------------------------------------------------------------------
def user_convention(convention: str, target_cfg: dict) -> str:
    """The convention a user means by "vllm" or "sglang": SGLang's reads ids for DeepSeek-family targets its own
    way (aux_ids.SGLANG_DEEPSEEK)."""
    if convention not in USER_CONVENTIONS + (SGLANG_DEEPSEEK,):
        raise ConfigError(f"--convention {convention!r} is unknown; use vllm (id k = the input of layer k) or sglang "
                          "(id k = the output of layer k)")
    return reader_convention(SGLANG, target_cfg) if convention == SGLANG else convention


class ResolvedIds(NamedTuple):
    ids: AuxLayerIds
    said: str  # where they came from and in which convention, stated or inferred
    named: bool  # whether the drafter's own files name ids
    claim: str  # the ids as found and where, e.g. "aux-layer ids [1, 3, 4] from config.json"


def resolve_aux_ids(raw: dict, layout: str, lineage: dict, cfg_path: Path, target_cfg: dict, aux_layer_ids,
                    convention: str | None, assume) -> ResolvedIds:
    """The ids in the readers' order: the caller's, the drafter's own files, `assume`; else one sentence."""
    named = config_aux_layer_ids(raw)
    if aux_layer_ids is not None:
        if convention is None:
            raise ConfigError("--aux-layer-ids needs --convention vllm|sglang: the same numbers name layers one apart "
                              "in the two engines' conventions")
        given = [int(i) for i in aux_layer_ids]
        ids = _checked_ids(given, user_convention(convention, target_cfg), "--aux-layer-ids")
        said = f"aux-layer ids {given} as given (--aux-layer-ids, {convention} convention), layers {ids.as_list()} " \
               "in vLLM's convention"
        if named:
            own_conv, _ = infer_convention(raw, layout, lineage, cfg_path, target_cfg)
            own = from_convention(named, own_conv)
            said += ("; its config.json names the same layers" if same_layers(own, ids.as_list()) else
                     f"; they replace the {list(named)} its config.json names")
        return ResolvedIds(ids, said, bool(named), f"aux-layer ids {given} from --aux-layer-ids")
    if named:
        if convention is not None:
            conv = user_convention(convention, target_cfg)
            how = f"read in the {convention} convention as given (--convention)"
        else:
            conv, how = infer_convention(raw, layout, lineage, cfg_path, target_cfg)
        ids = _checked_ids(named, conv, str(cfg_path))
        claim = f"aux-layer ids {list(named)} from {cfg_path.name}"
        return ResolvedIds(ids, f"{claim}, {how}: layers {ids.as_list()} in vLLM's convention", True, claim)
    if lineage.get("aux_layer_ids_vllm"):
        ids = _checked_ids(lineage["aux_layer_ids_vllm"], VLLM, str(cfg_path.parent / LINEAGE_FILE))
        claim = f"aux-layer ids {ids.as_list()} from {LINEAGE_FILE}"
        return ResolvedIds(ids, f"{claim}, in vLLM's convention as it states", True, claim)
    if assume is not None:
        ids = AuxLayerIds.of(assume)
        return ResolvedIds(ids, f"no aux-layer ids in {cfg_path.name}; assumed {ids.as_list()} (vLLM convention)",
                           False, f"the assumed aux-layer ids {ids.as_list()}")
    raise ConfigError(f"{cfg_path} names no aux-layer ids (eagle_aux_hidden_state_layer_ids), and an engine would "
                      "silently feed the drafter its own default layers; pass the layers it was trained on with "
                      f"{IDS_FLAGS}, e.g. --aux-layer-ids 2,4,5 --convention vllm")


def infer_convention(raw: dict, layout: str, lineage: dict, cfg_path: Path, target_cfg: dict) -> tuple[str, str]:
    """(the convention the drafter's own ids are written in, how that is known: stated or inferred)."""
    if lineage.get("convention") in CONVENTIONS:
        return lineage["convention"], f"in the {lineage['convention']} convention its {LINEAGE_FILE} states"
    if layout == SPECULATORS:
        return VLLM, "in vLLM's convention, which the speculators format states"
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top and nested and list(top) != list(nested):
        raise ConfigError(f"{cfg_path}: eagle_aux_hidden_state_layer_ids {list(top)} at the top level and "
                          f"{list(nested)} in eagle_config differ, and nothing says which convention each is in; "
                          f"pass the layers the drafter was trained on with {IDS_FLAGS}")
    if top:
        return VLLM, ("in vLLM's convention (inferred: ids at the config's top level are where vLLM reads them; pass "
                      "--convention sglang if they were written for SGLang)")
    conv = reader_convention(SGLANG, target_cfg)
    family = " for DeepSeek-family targets" if conv == SGLANG_DEEPSEEK else ""
    return conv, (f"in SGLang's convention{family} (inferred: ids only in eagle_config are where SGLang reads them, "
                  "as EAGLE and SpecForge write them; pass --convention vllm if they were written for vLLM)")


def _checked_ids(ids, convention: str, where: str) -> AuxLayerIds:
    try:
        return AuxLayerIds.read(ids, convention)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


# ---- the target ----------------------------------------------------------------------------------------------------
def _target_config(target_dir) -> dict:
    from draftline.target import read_target_config

    return read_target_config(target_dir)


def check_fits_target(cfg, ids: AuxLayerIds, ids_claim: str, cfg_path: Path, target_dir, target_cfg: dict) -> None:
    """Hidden sizes, vocabulary and aux layers against the target, each failure one sentence naming the file."""
    from draftline.target import num_layers

    text = target_cfg.get("text_config", target_cfg)
    other = "evaluate the drafter with the target it was trained for, or train one for this target"
    width = text.get("hidden_size")
    if width is not None and cfg.target_hidden_size != width:
        raise ConfigError(f"{cfg_path}: target_hidden_size {cfg.target_hidden_size} (the width of the hidden states "
                          f"its fc reads) but the target {target_dir} has hidden_size {width}; {other}")
    if width is not None and cfg.hidden_size != width:
        raise ConfigError(f"{cfg_path}: hidden_size {cfg.hidden_size} but the target {target_dir} has {width}, and "
                          f"the drafter's embeddings must be the target's; {other}")
    vocab = text.get("vocab_size")
    if vocab is not None and cfg.vocab_size != vocab:
        raise ConfigError(f"{cfg_path}: vocab_size {cfg.vocab_size} but the target {target_dir} has {vocab}, so its "
                          f"token ids would name other tokens; use a drafter made for this target's tokenizer")
    layers = num_layers(target_cfg)
    bad = outside(ids.as_list(), layers)
    if bad:
        raise ConfigError(f"{cfg_path.parent}: {ids_claim} name layers {ids.as_list()} (vLLM convention) but the "
                          f"target {target_dir} has {layers} layers, so {bad} are out of range; pass the layers the "
                          f"drafter was trained on with {IDS_FLAGS}, or use a drafter made for this target")


def _check_d2t(d2t: torch.Tensor, path: Path, target_dir, target_cfg: dict) -> None:
    vocab = target_cfg.get("text_config", target_cfg).get("vocab_size")
    if vocab is None or not len(d2t):
        return
    mapped = torch.arange(len(d2t)) + d2t.long()
    if int(mapped.min()) < 0 or int(mapped.max()) >= vocab:
        raise ConfigError(f"{path}: d2t maps draft tokens to target ids {int(mapped.min())}..{int(mapped.max())}, "
                          f"outside the vocabulary of {vocab} of the target {target_dir}; use a drafter made for this "
                          "target's tokenizer")


# ---- files --------------------------------------------------------------------------------------------------------
@contextmanager
def local_copy(location: str) -> Iterator[Path]:
    """The drafter folder at `location` on this machine: a local path as it is, an s3:// folder copied into a
    temporary one for the block."""
    if not str(location).startswith("s3://"):
        yield Path(location)
        return
    from draftline.store import open_store

    store = open_store(str(location))
    keys = [k for k in store.list("") if not k.endswith("manifest.json")]
    if not keys:
        raise ConfigError(f"drafter {location}: nothing stored there; pass the S3 folder that holds the drafter's "
                          "config.json and weights")
    with tempfile.TemporaryDirectory(prefix="draftline-drafter-") as tmp:
        for key in keys:
            dest = Path(tmp, key)
            dest.parent.mkdir(parents=True, exist_ok=True)
            store.get_file(key, dest)
        yield Path(tmp)


def _read_json(path: Path, fix: str) -> dict:
    if not path.is_file():
        raise ConfigError(f"drafter {path.parent}: no {path.name}; {fix}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON (line {exc.lineno}); download or export it again") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object; download or export it again")
    return data


def weight_files(directory: Path) -> list[Path]:
    """The folder's weight files: *.safetensors, else PyTorch's pytorch_model*.bin; one sentence when none."""
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("pytorch_model*.bin"))
    if not files:
        raise ConfigError(f"drafter {directory}: no weights beside config.json (model.safetensors or "
                          "pytorch_model.bin); copy the drafter's weight files into the folder")
    return files


def load_weights(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, str]]]:
    """Every tensor under the head's own key (eagle_format.head_key), and each key's (file name, original name)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    sources: dict[str, tuple[str, str]] = {}
    for f in files:
        part = load_file(str(f)) if f.suffix == ".safetensors" else torch.load(str(f), map_location="cpu",
                                                                                 weights_only=True)
        for name, tensor in part.items():
            tensors[head_key(name)] = tensor
            sources[head_key(name)] = (f.name, name)
    return tensors, sources


def _check_shapes(tensors: dict, sources: dict, model: Eagle3Drafter, directory: Path, cfg_path: Path) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for key, tensor in tensors.items():
        if key in expected and tuple(tensor.shape) != expected[key]:
            file, name = sources[key]
            raise ConfigError(f"{directory / file}: {name} has shape {list(tensor.shape)} but {cfg_path.name} "
                              f"describes {list(expected[key])}; the weights and config.json come from different "
                              "drafters, so download both again")


def _dominant_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    counts = Counter(t.dtype for k, t in tensors.items() if t.is_floating_point())
    return counts.most_common(1)[0][0] if counts else torch.bfloat16
