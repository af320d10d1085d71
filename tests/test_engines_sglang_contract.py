"""SGLang adapter against SGLang's response shapes. No SGLang ran for any test in this file: SGLang cannot run on
these CPU machines, so every shape below is written from the field names in sglang 0.5.14's source (its wheel,
as read for this file): meta_info in srt/managers/tokenizer_manager.py (_handle_batch_output, and
_calculate_spec_decoding_metrics for the spec_* fields, set only once a request has finished), /server_info in
srt/entrypoints/http_server.py (/get_server_info is its deprecated alias), avg_spec_accept_length in
srt/managers/scheduler.py (get_internal_state). Older SGLang lacked spec_num_correct_drafts and the histogram."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from draftline.config import EngineConfig
from draftline.engines.client import Prompt
from draftline.engines.preflight import EngineUnavailable, check_installed
from draftline.engines.sglang import (
    GenerateRequester, acceptance_from_meta, command, parse_generate_event, server_avg_accept_length, server_info,
)
from draftline.errors import EngineError

# Shape from sglang 0.5.14's source, not captured from a running SGLang: a finished /generate answer of a server
# started with --speculative-algorithm EAGLE3 --speculative-num-draft-tokens 4 (3 drafts a step). 12 verification
# steps: 2 accepted 0 drafts, 3 accepted 1, 3 accepted 2, 4 accepted 3 → 21 correct drafts of 36 proposed.
GENERATE_SPEC = {
    "text": " Paris. It is the capital of France.",
    "output_ids": [12366, 13, 1102, 374, 279, 6864, 315, 9822, 13],
    "meta_info": {"id": "a1b2", "finish_reason": {"type": "length", "length": 34}, "prompt_tokens": 7,
                  "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
                  "completion_tokens": 34, "cached_tokens": 0, "e2e_latency": 0.41,
                  "spec_accept_rate": 21 / 36, "spec_accept_length": 34 / 12, "spec_num_correct_drafts": 21,
                  "spec_num_proposed_drafts": 36, "spec_verify_ct": 12, "spec_accepted_drafts": 21,
                  "spec_proposed_drafts": 36, "spec_correct_drafts_histogram": [2, 3, 3, 4],
                  "spec_accept_histogram": [2, 3, 3, 4]},
}
# The same request on a server without speculation (no spec_* fields at all).
GENERATE_PLAIN = {
    "text": " Paris.", "output_ids": [12366, 13],
    "meta_info": {"id": "c3d4", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 7,
                  "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
                  "completion_tokens": 2, "cached_tokens": 0, "e2e_latency": 0.05},
}
# Older SGLang (before spec_num_correct_drafts and the histogram): spec_verify_ct only.
OLD_SPEC_META = {"id": "e5f6", "finish_reason": {"type": "length", "length": 32}, "prompt_tokens": 7,
                 "completion_tokens": 32, "cached_tokens": 0, "e2e_latency": 0.41, "spec_verify_ct": 12}
# /server_info: the server args flattened at top level, scheduler info, internal_states (one per DP rank), version.
SERVER_INFO = {"model_path": "/models/target", "speculative_algorithm": "EAGLE3",
               "internal_states": [{"avg_spec_accept_length": 2.61, "last_gen_throughput": 708.9}],
               "version": "0.5.14"}


def test_sglang_contract_not_run_against_sglang_acceptance_is_one_plus_correct_drafts_over_verify_steps():
    second = json.loads(json.dumps(GENERATE_SPEC))
    second["meta_info"].update(completion_tokens=10, spec_verify_ct=8, spec_num_correct_drafts=1,
                               spec_num_proposed_drafts=24, spec_correct_drafts_histogram=[7, 1])
    acc = acceptance_from_meta([GENERATE_SPEC["meta_info"], second["meta_info"]], SERVER_INFO, k=3)
    assert acc.mean_acceptance_length == pytest.approx(1 + (21 + 1) / (12 + 8))  # vLLM's definition
    assert acc.num_drafts == 20 and acc.num_accepted_tokens == 22 and acc.num_draft_tokens == 60
    # histogram summed over requests: [9, 4, 3, 4] over 20 steps; draft i accepted in steps accepting >= i
    assert acc.per_position == pytest.approx([11 / 20, 7 / 20, 4 / 20])
    assert acc.engine_reported == {"meta_info.completion_tokens/spec_verify_ct": pytest.approx(44 / 20),
                                   "server_info.avg_spec_accept_length": 2.61}
    assert "spec_num_correct_drafts" in acc.source


def test_sglang_contract_not_run_against_sglang_histogram_agrees_with_correct_drafts():
    meta = GENERATE_SPEC["meta_info"]
    hist = meta["spec_correct_drafts_histogram"]
    assert sum(hist) == meta["spec_verify_ct"]
    assert sum(i * n for i, n in enumerate(hist)) == meta["spec_num_correct_drafts"]
    acc = acceptance_from_meta([meta])  # without k, the histogram's width decides
    assert len(acc.per_position) == 3
    assert 1 + sum(acc.per_position) == pytest.approx(acc.mean_acceptance_length)


def test_sglang_contract_not_run_against_sglang_older_fields_fall_back_to_completion_tokens():
    acc = acceptance_from_meta([OLD_SPEC_META], SERVER_INFO)
    assert acc.mean_acceptance_length == pytest.approx(32 / 12)
    assert acc.per_position is None and acc.num_draft_tokens is None
    assert "completion_tokens / spec_verify_ct" in acc.source
    aliased = {k: v for k, v in GENERATE_SPEC["meta_info"].items()
               if k not in ("spec_num_correct_drafts", "spec_correct_drafts_histogram")}
    current = acceptance_from_meta([GENERATE_SPEC["meta_info"]])
    assert acceptance_from_meta([aliased]).per_position == current.per_position
    assert acceptance_from_meta([aliased]).mean_acceptance_length == current.mean_acceptance_length


def test_sglang_contract_not_run_against_sglang_server_info_path_then_deprecated_alias(monkeypatch):
    asked, known = [], {"/server_info", "/get_server_info"}

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path not in known:
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json=SERVER_INFO)

    client = httpx.Client(transport=httpx.MockTransport(handler))
    monkeypatch.setattr(httpx, "get", lambda url, **kw: client.get(url, timeout=kw.get("timeout")))
    assert server_info("http://sglang") == SERVER_INFO and asked == ["/server_info"]
    known.discard("/server_info")  # an SGLang older than /server_info
    asked.clear()
    assert server_info("http://sglang") == SERVER_INFO and asked == ["/server_info", "/get_server_info"]


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


def test_sglang_contract_not_run_against_sglang_speculative_only_arguments_reach_the_eagle3_server_only(tmp_path):
    """--disable-overlap-schedule speeds SGLang's EAGLE-3 and slows its baseline: it must be settable for one only."""
    cfg = EngineConfig(engine="sglang", extra_args=["--mem-fraction-static", "0.8"],
                       speculative_extra_args=["--disable-overlap-schedule"])
    eagle = command(cfg, tmp_path / "t", tmp_path / "d", "target", 30000)
    baseline = command(cfg, tmp_path / "t", None, "target", 30000)
    assert eagle[-3:] == ["--mem-fraction-static", "0.8", "--disable-overlap-schedule"]
    assert baseline[-2:] == ["--mem-fraction-static", "0.8"] and "--disable-overlap-schedule" not in baseline


def _documented_stream(final_meta: dict, pieces: list[str]) -> bytes:
    """SGLang's /generate stream: `data: {json}` events with cumulative text (incremental_streaming_output is off by
    default), then `data: [DONE]`."""
    events, text = [], ""
    for i, piece in enumerate(pieces, 1):
        text += piece
        meta = {**final_meta, "completion_tokens": i, "finish_reason": None}
        for key in [k for k in meta if k.startswith("spec_")]:
            meta.pop(key)  # the spec_* fields come only once the request has finished
        events.append({"text": text, "meta_info": meta})
    events[-1]["meta_info"] = final_meta
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_sglang_contract_not_run_against_sglang_streaming_client_reads_tokens_and_verify_count():
    final = {**OLD_SPEC_META, "completion_tokens": 3, "spec_verify_ct": 2}
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


def test_sglang_contract_not_run_against_sglang_warnings_that_bear_on_the_figures_are_relayed():
    """Not run against SGLang: these log lines are written from the warnings in SGLang's server_args.py (the texts of
    its logger.warning calls, in its log format "[time] WARNING file:line: message"), which no SGLang here ever
    logged. The overlap scheduler and CUDA graphs it turns off change what its speedup means."""
    from draftline.engines.sglang import SglangAdapter

    log = "\n".join([
        "[2026-02-10 22:23:57] INFO server_args.py:1806: Attention backend not specified. Use flashinfer backend by "
        "default.",
        "[2026-02-10 22:23:57] WARNING server_args.py:2314: Overlap scheduler is disabled when spec v2 is off or using "
        "unsupported speculative algorithm. You can set env SGLANG_ENABLE_SPEC_V2=True to enable the experimental "
        "overlap scheduler. ",
        "[2026-02-10 22:23:57] WARNING server_args.py:2330: Mixed chunked prefill is disabled because of using eagle "
        "speculative decoding.",
        "[2026-02-10 22:23:57] WARNING server_args.py:1850: Cuda graph is disabled because of using torch native "
        "attention backend",
        "[2026-02-10 22:23:58] WARNING server_args.py:2314: Overlap scheduler is disabled when spec v2 is off or using "
        "unsupported speculative algorithm. You can set env SGLANG_ENABLE_SPEC_V2=True to enable the experimental "
        "overlap scheduler. ",
    ])
    assert SglangAdapter().log_facts(log) == {"warnings": [
        "Overlap scheduler is disabled when spec v2 is off or using unsupported speculative algorithm.",
        "Mixed chunked prefill is disabled because of using eagle speculative decoding.",
        "Cuda graph is disabled because of using torch native attention backend",
    ]}
