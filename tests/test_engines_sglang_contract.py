"""SGLang adapter against SGLang's DOCUMENTED response shapes. No SGLang ran for any test in this file: SGLang
cannot run on these CPU machines, so every shape below is transcribed from SGLang's docs and tests (native API
page: /generate, /get_server_info; its EAGLE tests: accept length = completion_tokens / spec_verify_ct)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from draftline.config import EngineConfig
from draftline.engines.client import Prompt
from draftline.engines.preflight import EngineUnavailable, check_installed
from draftline.engines.sglang import (
    GenerateRequester, acceptance_from_meta, command, parse_generate_event, server_avg_accept_length,
)
from draftline.errors import EngineError

# Documented shape, not captured from a running SGLang: a finished /generate answer of a server started with
# --speculative-algorithm (spec_verify_ct is only present then).
GENERATE_SPEC = {
    "text": " Paris. It is the capital of France.",
    "output_ids": [12366, 13, 1102, 374, 279, 6864, 315, 9822, 13],
    "meta_info": {"id": "a1b2", "finish_reason": {"type": "length", "length": 32}, "prompt_tokens": 7,
                  "completion_tokens": 32, "cached_tokens": 0, "e2e_latency": 0.41, "spec_verify_ct": 12},
}
# Documented shape, not captured from a running SGLang: the same request on a server without speculation.
GENERATE_PLAIN = {
    "text": " Paris.", "output_ids": [12366, 13],
    "meta_info": {"id": "c3d4", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 7,
                  "completion_tokens": 2, "cached_tokens": 0, "e2e_latency": 0.05},
}
# Documented shape, not captured from a running SGLang: /get_server_info (server args flattened at top level).
SERVER_INFO = {"model_path": "/models/target", "speculative_algorithm": "EAGLE3",
               "internal_states": [{"avg_spec_accept_length": 2.61, "last_gen_throughput": 708.9}],
               "version": "0.5.14"}


def test_sglang_contract_not_run_against_sglang_acceptance_is_completion_tokens_over_verify_steps():
    second = json.loads(json.dumps(GENERATE_SPEC))
    second["meta_info"].update(completion_tokens=10, spec_verify_ct=8)
    acc = acceptance_from_meta([GENERATE_SPEC["meta_info"], second["meta_info"]], SERVER_INFO)
    assert acc.mean_acceptance_length == pytest.approx((32 + 10) / (12 + 8))
    assert acc.num_drafts == 20
    assert acc.per_position is None  # SGLang reports no per-position counters
    assert acc.engine_reported == {"get_server_info.avg_spec_accept_length": 2.61}
    assert "SGLang" in acc.source


def test_sglang_contract_not_run_against_sglang_no_speculation_means_no_acceptance():
    assert acceptance_from_meta([GENERATE_PLAIN["meta_info"]]) is None
    assert server_avg_accept_length({"internal_states": [{"last_gen_throughput": 1.0}]}) is None
    assert server_avg_accept_length(SERVER_INFO) == 2.61


def test_sglang_contract_not_run_against_sglang_answer_without_meta_info_is_an_error():
    text, meta = parse_generate_event(GENERATE_SPEC)
    assert text.startswith(" Paris") and meta["spec_verify_ct"] == 12
    with pytest.raises(EngineError, match="without meta_info"):
        parse_generate_event({"error": {"message": "bad request"}})


def _flags(args: list[str]) -> dict[str, str | None]:
    out, i = {}, 0
    while i < len(args):
        has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        out[args[i]] = args[i + 1] if has_value else None
        i += 2 if has_value else 1
    return out


def test_sglang_contract_not_run_against_sglang_command_line_uses_eagle3_chain_drafting(tmp_path):
    cfg = EngineConfig(engine="sglang", num_speculative_tokens=4, tensor_parallel_size=2, max_model_len=4096,
                       extra_args=["--mem-fraction-static", "0.8"])
    argv = command(cfg, tmp_path / "t", tmp_path / "d", "target", 30000, python="python")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    flags = _flags(argv[3:])
    assert "--enable-metrics" in flags
    assert flags["--speculative-algorithm"] == "EAGLE3"  # EAGLE with an EAGLE-3 drafter silently accepts nothing
    assert flags["--speculative-draft-model-path"] == str(tmp_path / "d")
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"],
            flags["--speculative-num-draft-tokens"]) == ("4", "1", "5")
    assert flags["--tp-size"] == "2" and flags["--context-length"] == "4096" and flags["--port"] == "30000"
    assert argv[-2:] == ["--mem-fraction-static", "0.8"]
    baseline = command(cfg, tmp_path / "t", None, "target", 30000)
    assert not any(a.startswith("--speculative") for a in baseline)


def _documented_stream(final_meta: dict, pieces: list[str]) -> bytes:
    """SGLang's /generate stream as documented: `data: {json}` events with cumulative text, then `data: [DONE]`."""
    events, text = [], ""
    for i, piece in enumerate(pieces, 1):
        text += piece
        meta = {**final_meta, "completion_tokens": i, "finish_reason": None}
        meta.pop("spec_verify_ct", None)  # only present once the request has finished
        events.append({"text": text, "meta_info": meta})
    events[-1]["meta_info"] = final_meta
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_sglang_contract_not_run_against_sglang_streaming_client_reads_tokens_and_verify_count():
    final = {**GENERATE_SPEC["meta_info"], "completion_tokens": 3, "spec_verify_ct": 2}
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"], seen["body"] = request.url.path, json.loads(request.content)
        return httpx.Response(200, content=_documented_stream(final, [" Par", "is", "."]),
                              headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await GenerateRequester(16, 0.0)(client, "http://sglang", Prompt(id="r1", prompt="Capital?"))

    result = asyncio.run(go())
    assert seen["path"] == "/generate" and seen["body"]["stream"] is True
    assert seen["body"]["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.0}
    assert result.text == " Paris." and result.output_tokens == 3 and result.ttft_s is not None
    assert acceptance_from_meta([result.meta]).mean_acceptance_length == pytest.approx(1.5)


def test_sglang_contract_not_run_against_sglang_chat_prompts_use_the_targets_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from tests.fixtures.tiny_targets import build_tokenizer

    build_tokenizer(tmp_path, 300)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    sent = {}

    def handler(request):
        sent.update(json.loads(request.content))
        return httpx.Response(200, content=_documented_stream({**GENERATE_PLAIN["meta_info"]}, ["x"]))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            msgs = [{"role": "user", "content": "hello there"}]
            return await GenerateRequester(4, 0.0, tok)(client, "http://sglang", Prompt(id="c", messages=msgs))

    asyncio.run(go())
    expected = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False,
                                       add_generation_prompt=True)
    assert sent["text"] == expected and "hello there" in expected


def test_sglang_missing_here_is_reported_as_skipped_not_as_a_failure():
    try:
        import sglang  # noqa: F401
    except ImportError:
        with pytest.raises(EngineUnavailable, match="skipped: needs a GPU worker with sglang"):
            check_installed("sglang")
    else:
        assert check_installed("sglang")
