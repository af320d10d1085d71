"""Load a target model, read its config, and capture its aux and final hidden states with hooks."""
from __future__ import annotations

import hashlib
import json
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from draftline.aux_ids import AuxLayerIds
from draftline.errors import ConfigError

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Above this many bytes of weights the fingerprint hashes safetensors headers instead of every byte.
_FULL_HASH_LIMIT = 2 * 1024**3


def resolve_device(device: str, field: str = "device") -> str:
    """'auto' is 'cuda' when a GPU is visible, else 'cpu'; 'cuda' without one is one sentence naming the field."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{field}={device!r} but no CUDA device is visible; use 'auto' or 'cpu'")
    return device


def read_target_config(path: str | Path) -> dict:
    """Parse `<path>/config.json`, or raise one sentence saying what is missing and how to fix it."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"target {root}: no such directory; point target.path at a transformers checkpoint directory")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(
            f"target {root} has no config.json; point target.path at a transformers checkpoint directory "
            "(config.json, weights, tokenizer)"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"target {cfg_file} is not valid JSON (line {exc.lineno}); repair or re-export the checkpoint") from None
    if not isinstance(cfg, dict) or not cfg.get("model_type"):
        raise ConfigError(f"target {cfg_file} has no model_type; re-export the checkpoint with transformers' save_pretrained")
    return cfg


def num_layers(target: torch.nn.Module | dict | str | Path) -> int:
    """Decoder layer count of a loaded model, a config dict, or a checkpoint directory."""
    if isinstance(target, torch.nn.Module):
        return len(decoder_layers(target))
    cfg = target if isinstance(target, dict) else read_target_config(target)
    cfg = cfg.get("text_config", cfg)
    if "num_hidden_layers" not in cfg:
        raise ConfigError("target config.json has no num_hidden_layers; only decoder-only LMs are supported")
    return int(cfg["num_hidden_layers"])


def _weight_files(root: Path) -> list[Path]:
    files = sorted(root.glob("*.safetensors"))
    return files or sorted(root.glob("pytorch_model*.bin"))


def load_target(path: str | Path, dtype: str | torch.dtype = "bfloat16", device: str | torch.device = "cpu"):
    """Load (model, tokenizer) from a transformers checkpoint directory, in eval mode on `device`."""
    from transformers import AutoConfig, AutoTokenizer

    root = Path(path)
    read_target_config(root)
    if not _weight_files(root):
        raise ConfigError(f"target {root} has no weights (*.safetensors); save the model there with save_pretrained")
    torch_dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    try:
        config = AutoConfig.from_pretrained(root)
    except (ValueError, KeyError) as exc:
        raise ConfigError(
            f"target {root}/config.json is not usable by transformers ({str(exc).splitlines()[0]}); "
            "use a supported architecture such as LlamaForCausalLM or DeepseekV3ForCausalLM"
        ) from None
    try:
        model = _auto_class(config).from_pretrained(root, dtype=torch_dtype)
    except ValueError as exc:
        raise ConfigError(
            f"target {root}: architecture {getattr(config, 'architectures', None)} cannot be loaded as a causal LM "
            f"({str(exc).splitlines()[0]}); use a decoder-only architecture such as LlamaForCausalLM"
        ) from None
    model.to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(root)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"target {root} has no usable tokenizer ({str(exc).splitlines()[0]}); add tokenizer.json there") from None
    decoder_layers(model)  # fail now, not mid-extraction, on an unusual module layout
    return model, tokenizer


def _auto_class(config):
    """AutoModelForCausalLM, or for a multimodal wrapper around a text model (Kimi-K2.5: `text_config`, the language
    model under `model.language_model`) the image-text-to-text class, whose forward on text alone is the text model's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    wrapper = (config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
               and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and hasattr(config, "text_config"))
    return AutoModelForImageTextToText if wrapper else AutoModelForCausalLM


def decoder_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embeddings, layers, final norm) without the lm_head; a wrapper's language model."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return inner
    language = getattr(inner, "language_model", None)
    if language is not None and hasattr(language, "layers"):
        return language
    if hasattr(model, "layers"):
        return model
    raise ConfigError(
        f"{type(model).__name__} has no `model.layers` decoder stack; only Llama-like decoder-only targets are supported"
    )


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return decoder_model(model).layers


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    norm = getattr(decoder_model(model), "norm", None)
    if norm is None:
        raise ConfigError(f"{type(model).__name__} has no final `norm` module; cannot capture the last hidden state")
    return norm


@contextmanager
def capture_hidden_states(
    model: torch.nn.Module,
    aux_layer_ids: list[int],
    sink: Callable[[str, torch.Tensor], None],
) -> Iterator[None]:
    """While active, every forward calls sink("aux0".."aux2", input of layer k) and sink("last", output of the final norm).

    Pre-hooks on exactly the aux layers (vLLM ids, "input of layer k") and one hook on the final norm:
    nothing else is kept, unlike output_hidden_states=True which holds every layer.
    """
    layers = decoder_layers(model)
    ids = AuxLayerIds.for_target(aux_layer_ids, len(layers)).ids
    handles = []

    def pre_hook(name):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            sink(name, hidden)

        return hook

    for slot, layer_id in enumerate(ids):
        handles.append(layers[layer_id].register_forward_pre_hook(pre_hook(f"aux{slot}"), with_kwargs=True))
    handles.append(final_norm(model).register_forward_hook(lambda m, a, out: sink("last", out)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def target_weight_map(path: str | Path) -> dict[str, str]:
    """Tensor name -> safetensors file name of a checkpoint (its index when it has one), read without loading weights."""
    from safetensors import safe_open

    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    weight_map = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            weight_map.update({k: f.name for k in fh.keys()})
    if not weight_map:
        raise ConfigError(f"target {root} has no *.safetensors weights; save it with save_pretrained(safe_serialization=True)")
    return weight_map


def read_target_tensor(path: str | Path, name: str, weight_map: dict[str, str] | None = None) -> torch.Tensor:
    """One tensor of a checkpoint, read from its safetensors file alone."""
    from safetensors import safe_open

    weight_map = weight_map if weight_map is not None else target_weight_map(path)
    with safe_open(str(Path(path) / weight_map[name]), "pt") as fh:
        return fh.get_tensor(name)


# Text models whose final norm is RMSNorm with a plain weight (HF: weight * (x / rms(x)) cast back to x's dtype).
_RMS_NORM_TYPES = {"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                   "kimi_k2"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama and DeepSeek compute their final norm: in float32, scaled by the weight in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


def final_norm_params(path: str | Path) -> tuple[torch.Tensor, float]:
    """The target's final norm weight and eps, from its checkpoint (see final_norm_of)."""
    cfg = read_target_config(path)
    text = cfg.get("text_config", cfg)
    kind = text.get("model_type")
    if kind not in _RMS_NORM_TYPES:
        raise ConfigError(f"target {path}: model_type {kind!r} has a final norm draftline cannot apply by itself "
                          f"(it knows {sorted(_RMS_NORM_TYPES)}); use extract.backend: transformers")
    weight_map = target_weight_map(path)
    names = sorted((k for k in weight_map if k.endswith("model.norm.weight") and "layers." not in k and "mtp" not in k),
                   key=len)
    if not names:
        raise ConfigError(f"target {path}: no final norm weight (*model.norm.weight) in its safetensors files")
    return read_target_tensor(path, names[0], weight_map), float(text.get("rms_norm_eps", 1e-6))


def final_norm_of(path: str | Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's final norm as a function, from its checkpoint: what turns the last layer's output into what
    the lm_head reads. The one definition used where an engine hands over the output before the norm."""
    weight, eps = final_norm_params(path)
    return lambda x: rms_norm(x, weight, eps)


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def target_fingerprint(path: str | Path) -> str:
    """A stable id for (config, weights): sha256 of config.json's content and of the weights.

    Small checkpoints hash every weight byte; huge ones hash the safetensors headers (names, shapes, dtypes,
    offsets) and file sizes, so fingerprinting a 1 TB target does not take an hour.
    """
    root = Path(path)
    cfg = read_target_config(root)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    files = _weight_files(root)
    total = sum(f.stat().st_size for f in files)
    full = total <= _FULL_HASH_LIMIT
    for f in files:
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        if full:
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
        elif f.suffix == ".safetensors":
            h.update(_safetensors_header(f))
    return ("sha256:" if full else "sha256-headers:") + h.hexdigest()
