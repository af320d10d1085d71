"""Turn trained demo weights into self-contained checkpoint dirs under assets/ (config, bf16 safetensors, tokenizer, lineage, sha256 sums)."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftline.demo.models import TARGET_NAMES, build_config, moe_layer_ids

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_sha256sums(target_dir: Path) -> None:
    files = sorted(p for p in target_dir.iterdir() if p.is_file() and p.name != "SHA256SUMS")
    (target_dir / "SHA256SUMS").write_text("".join(f"{sha256_file(p)}  {p.name}\n" for p in files))


def sha256_mismatches(target_dir: Path) -> list[str]:
    """The files of a target folder that are missing or differ from its SHA256SUMS (all of them: no SHA256SUMS)."""
    sums = target_dir / "SHA256SUMS"
    if not sums.exists():
        return ["SHA256SUMS"]
    bad = []
    for line in sums.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        path = target_dir / name
        if not path.exists() or sha256_file(path) != digest:
            bad.append(name)
    return bad


def asset_main(name: str, out: Path, build, ensure, rebuild_help: str, argv: list[str] | None, doc: str) -> int:
    """The command line of a derived demo target: assemble what is missing (default), --rebuild or --check."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help=rebuild_help)
    parser.add_argument("--check", action="store_true", help="only verify the files against SHA256SUMS")
    args = parser.parse_args(argv)
    if args.rebuild:
        print(f"wrote {build()}")
        return 0
    if args.check:
        bad = sha256_mismatches(out)
        print(f"{name}: ok" if not bad else f"{name}: {', '.join(bad)} missing or changed")
        return 1 if bad else 0
    ensure()
    print(f"{name}: ready at {out}")
    return 0


def package_target(name: str, weights: Path, metrics: dict, data_meta: dict, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Load the trained state dict into transformers' class, save it in the on-disk format engines read, and fix what vLLM needs."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = build_config(name, data_meta["special_ids"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(load_file(str(weights)), strict=True)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir)
    # vLLM's noaux_tc router reads a float32 e_score_correction_bias per MoE layer (real DeepSeek-V3 ships them so).
    layers = moe_layer_ids(config.to_dict())
    if layers:
        path = out_dir / "model.safetensors"
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        tensors = load_file(str(path))
        for i in layers:
            key = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            tensors[key] = tensors.get(key, torch.zeros(config.n_routed_experts)).float()
        save_file(tensors, str(path), metadata=meta)
    ids = data_meta["special_ids"]
    GenerationConfig(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                     pad_token_id=ids["pad_token_id"], do_sample=False).save_pretrained(out_dir)
    for f in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / f, out_dir / f)
    lineage = {
        "name": name,
        "built_by": "python -m draftline.demo.build (draftline/demo/)",
        "corpus": {"what": "Python standard library source", "python": data_meta["python"],
                   "fingerprint": data_meta["corpus_fingerprint"], "modules": data_meta["modules"],
                   "tokens": data_meta["tokens"]},
        "training": metrics,
    }
    (out_dir / "training.json").write_text(json.dumps(lineage, indent=1) + "\n")
    write_sha256sums(out_dir)
    return out_dir


def package_all(work: Path, trained: Path, assets: Path) -> None:
    data_meta = json.loads((work / "data.json").read_text())
    for name in TARGET_NAMES:
        metrics = json.loads((trained / f"{name}.metrics.json").read_text())
        out = package_target(name, trained / f"{name}.safetensors", metrics, data_meta, work / "tokenizer", assets / name)
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"{out}: {size/1e6:.1f} MB, held-out ppl {metrics['heldout_ppl']} (untrained {metrics['untrained_heldout_ppl']})")
