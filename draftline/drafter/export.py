"""Write a trained drafter once per engine format (vllm, sglang, speculators), each with aux ids in that engine's convention."""
from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftline import layout
from draftline.aux_ids import AuxLayerIds, reader_convention
from draftline.config import DEFAULT_K
from draftline.drafter.eagle_format import (LINEAGE_FILE, WEIGHTS_FILE, eagle_config_json, export_tensors,
                                            load_eagle_dir, save_eagle_dir)
from draftline.drafter.model import Eagle3Drafter
from draftline.errors import ConfigError
from draftline.target import num_layers, read_target_config, target_fingerprint

FORMATS = ("vllm", "sglang", "speculators")


def check_target(model: Eagle3Drafter, target_dir) -> dict:
    """Refuse a target the drafter cannot serve: layer count vs aux ids, hidden size, vocabulary."""
    cfg = read_target_config(target_dir)
    text = cfg.get("text_config", cfg)
    layers = num_layers(cfg)
    AuxLayerIds.of(model.config.aux_layer_ids).check_fits(layers)
    for ours, theirs, what in ((model.config.target_hidden_size, text.get("hidden_size"), "hidden_size"),
                               (model.config.vocab_size, text.get("vocab_size"), "vocab_size")):
        if theirs is not None and ours != theirs:
            raise ConfigError(
                f"the drafter was trained for a target with {what}={ours} but {target_dir} has {what}={theirs}; "
                "export it for the target it was trained on"
            )
    return {"path": str(target_dir), "num_layers": layers, "hidden_size": text.get("hidden_size"),
            "vocab_size": text.get("vocab_size"), "architectures": cfg.get("architectures"),
            "fingerprint": target_fingerprint(target_dir)}


def _speculators_config(model: Eagle3Drafter, target_dir, num_speculative_tokens: int,
                        dtype: torch.dtype = torch.bfloat16) -> dict:
    cfg = model.config
    layer = eagle_config_json(model.config, "vllm", dtype)
    for key in ("eagle_config", "eagle_aux_hidden_state_layer_ids"):  # the ids go at speculators' top level
        layer.pop(key)
    for key in ("architectures", "draft_vocab_size", "target_hidden_size"):
        layer.pop(key)
    target_cfg = read_target_config(target_dir)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # speculators defaults to normalising before the residual; our head keeps the raw hidden as residual.
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": str(target_dir), "architectures": target_cfg.get("architectures", [])},
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def write_format(model: Eagle3Drafter, fmt: str, out_dir, target_dir, lineage: dict,
                 num_speculative_tokens: int = DEFAULT_K, include_embeddings: bool = True,
                 dtype: torch.dtype = torch.bfloat16) -> Path:
    """One engine-format directory: config.json, model.safetensors, draftline.json; weights in `dtype`."""
    if fmt not in FORMATS:
        raise ConfigError(f"export format {fmt!r} is unknown; use one of {list(FORMATS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    convention = reader_convention(fmt, read_target_config(target_dir))
    if fmt == "speculators":
        if model.config.attention != "llama":
            raise ConfigError(f"the speculators format describes Llama-layer heads only and this drafter has "
                              f"{model.config.attention} attention; export it as vllm or sglang")
        config = _speculators_config(model, target_dir, num_speculative_tokens, dtype)
        tensors = export_tensors(model, include_embeddings, dtype)
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    else:
        save_eagle_dir(model, out, convention=convention, include_embeddings=include_embeddings, dtype=dtype)
        config = json.loads((out / "config.json").read_text())
    ids = AuxLayerIds.of(model.config.aux_layer_ids)
    record = {**lineage, "format": fmt, "convention": convention, "aux_layer_ids": ids.written(convention),
              "aux_layer_ids_vllm": ids.as_list(),
              "draft_vocab_size": model.config.draft_vocab_size, "target_hidden_size": model.config.target_hidden_size,
              "has_d2t": model.config.draft_vocab_size < model.config.vocab_size,
              "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (out / LINEAGE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return out


def export_drafter(drafter_dir, target_dir, out_root, formats=FORMATS, num_speculative_tokens: int = DEFAULT_K,
                   lineage: dict | None = None) -> dict[str, Path]:
    """Export a trained drafter dir (SGLang/EAGLE layout with draftline.json) into `<out_root>/<format>/` dirs."""
    source = Path(drafter_dir)
    from_lineage = json.loads((source / LINEAGE_FILE).read_text()) if (source / LINEAGE_FILE).is_file() else {}
    model = load_eagle_dir(source, target_num_layers=None)
    target = check_target(model, target_dir)
    model.config.target_num_layers = target["num_layers"]
    base = {"target": target, "training": from_lineage.get("training"), "data": from_lineage.get("data"),
            "run": from_lineage.get("run"), "code_version": _code_version(), "source": str(source),
            **(lineage or {})}
    return {fmt: write_format(model, fmt, Path(out_root) / fmt, target_dir, base, num_speculative_tokens)
            for fmt in formats}


# What a conversion keeps of its source's draftline.json: where the weights came from, not how they were written.
KEPT_LINEAGE = ("training", "data", "run", "training_metrics", "data_manifests")


def convert_drafter(source, fmt: str, out_dir, target_dir=None, aux_layer_ids=None, convention: str | None = None,
                    num_speculative_tokens: int = DEFAULT_K, lineage: dict | None = None) -> Path:
    """`draftline convert`: a drafter in any layout draftline reads (draftline.drafter.readers) written in one
    engine's format by the export's own writer, with the ids explicit in that engine's convention and a
    draftline.json saying where they came from. The target is `target_dir`, else the one the source's draftline.json
    names."""
    from draftline.drafter.readers import read_drafter

    if fmt not in FORMATS:
        raise ConfigError(f"--to {fmt!r} is unknown; use one of {list(FORMATS)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not empty; give the converted drafter a new folder")
    target_dir = target_dir or source_target(source)
    read = read_drafter(source, target_dir, aux_layer_ids=aux_layer_ids, convention=convention)
    record = conversion_lineage(read, str(source), target_dir, lineage)
    return write_format(read.model, fmt, out, target_dir, record, num_speculative_tokens,
                        include_embeddings=read.has_embeddings, dtype=read.dtype)


def conversion_lineage(read, source: str, target_dir, extra: dict | None = None) -> dict:
    """The draftline.json record of a drafter read from `source` (readers.ReadDrafter) and written again: what its
    own draftline.json said of its training, the target, the source and its layout, and where the ids came from.
    Sets the head's target layer count on the way."""
    target = check_target(read.model, target_dir)
    read.model.config.target_num_layers = target["num_layers"]
    return {**{k: read.lineage[k] for k in KEPT_LINEAGE if k in read.lineage}, "target": target, "source": source,
            "source_layout": read.layout, "aux_layer_ids_source": read.ids_source, "code_version": _code_version(),
            **(extra or {})}


def source_target(source) -> str:
    """The target a draftline drafter's draftline.json names, when that folder is on this machine; else one sentence
    asking for --target."""
    lineage_path = Path(source) / LINEAGE_FILE
    named = (json.loads(lineage_path.read_text()).get("target") or {}).get("path") if lineage_path.is_file() else None
    if named and Path(named, "config.json").is_file():
        return named
    raise ConfigError(f"{source}: pass the target's checkpoint folder with --target; the drafter is checked against "
                      "it (hidden size, vocabulary, aux layers) and SGLang's convention depends on its family")


def _manifest_digest(store, prefix: str) -> dict | None:
    key = f"{prefix}/manifest.json"
    if not store.exists(key):
        return None
    return {"uri": store.uri(key), "sha256": hashlib.sha256(store.get_bytes(key)).hexdigest()}


def export_from_store(store, run: str, target_dir, formats=FORMATS, num_speculative_tokens: int = DEFAULT_K,
                      train_prefix: str | None = None) -> dict[str, str]:
    """Export `<run>/train/drafter` to `<run>/export/<format>/` in the store; returns each format's store prefix."""
    train_prefix = train_prefix or layout.train_prefix(run)
    trained = layout.trained_drafter_in(train_prefix)
    if store.read_manifest(trained) is None:
        raise ConfigError(f"{store.uri(trained)} holds no trained drafter; run the training stage first")
    source = store.get_dir(trained)
    lineage = {"data_manifests": {stage: _manifest_digest(store, layout.stage_prefix(run, stage))
                                  for stage in (layout.TRACES_STAGE, layout.HIDDEN_STAGE)},
               "training_metrics": store.uri(layout.training_record_in(train_prefix))}
    out = {}
    with tempfile.TemporaryDirectory(prefix="draftline-export-") as tmp:
        dirs = export_drafter(source, target_dir, tmp, formats, num_speculative_tokens, lineage)
        for fmt, path in dirs.items():
            out[fmt] = layout.export_prefix(run, fmt)
            store.put_dir(out[fmt], path)
    return out


def _code_version() -> str:
    from draftline.drafter.train import code_version

    return code_version()


__all__ = ["FORMATS", "convert_drafter", "export_drafter", "export_from_store", "write_format", "check_target"]

def main(argv: list[str] | None = None) -> int:
    """`python -m draftline.drafter.export CONFIG.yaml`: export the run's trained drafter in every configured format."""
    import argparse

    from draftline.config_loading import load_config
    from draftline.store import open_store

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("config", help="pipeline YAML (run, store, target, export)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    store = open_store(cfg.store.root)
    out = export_from_store(store, cfg.run, cfg.target.path, cfg.export.formats, cfg.eval.export_k)
    print(json.dumps({fmt: store.uri(prefix) for fmt, prefix in out.items()}, indent=2))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())

