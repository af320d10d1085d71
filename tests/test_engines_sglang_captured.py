"""SGLang adapter against answers captured from a real SGLang 0.5.14 on an H200 (tests/fixtures/sglang-0.5.14,
README there). No SGLang runs in these tests: they replay what one said, so they check the adapter's reading of
real answers, not SGLang's behaviour today."""
from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import httpx
import pytest

from draftline.config import EngineConfig
from draftline.engines.client import Prompt
from draftline.engines.launch import free_port
from draftline.engines.sglang import (
    GenerateRequester, SglangAdapter, acceptance_from_meta, parse_generate_event, server_avg_accept_length,
)

CAPTURED = Path(__file__).parent / "fixtures" / "sglang-0.5.14"


def _load(name: str):
    return json.loads((CAPTURED / name).read_text())


def test_captured_from_sglang_0_5_14_no_sglang_runs_here_eagle3_answer_gives_acceptance():
    # "Hello" → 8 tokens in 7 verification steps, none of which accepted a draft: the histogram has one entry.
    meta = _load("generate-eagle3.json")["meta_info"]
    acc = acceptance_from_meta([meta], _load("server-info-eagle3.json"), k=3)
    assert acc.mean_acceptance_length == pytest.approx(1 + meta["spec_num_correct_drafts"] / meta["spec_verify_ct"])
    assert acc.num_drafts == meta["spec_verify_ct"] == 7
    assert acc.num_draft_tokens == meta["spec_num_proposed_drafts"] == 3 * 7
    assert acc.per_position == [0.0, 0.0, 0.0]
    assert acc.engine_reported["meta_info.completion_tokens/spec_verify_ct"] == pytest.approx(meta["spec_accept_length"])
    assert acc.engine_reported["server_info.avg_spec_accept_length"] == pytest.approx(2.2032783462100647)


def test_captured_from_sglang_0_5_14_no_sglang_runs_here_server_info_holds_the_servers_own_accept_length():
    info = _load("server-info-eagle3.json")
    assert info["version"] == "0.5.14" and info["speculative_algorithm"] == "EAGLE3"
    assert server_avg_accept_length(info) == pytest.approx(2.2032783462100647)


def test_captured_from_sglang_0_5_14_no_sglang_runs_here_baseline_answers_carry_no_acceptance():
    assert acceptance_from_meta([_load("generate-baseline.json")["meta_info"]]) is None
    events = [e for e in _load("generate-stream-baseline.json") if e != "[DONE]"]
    assert acceptance_from_meta([parse_generate_event(events[-1])[1]]) is None


def test_captured_from_sglang_0_5_14_no_sglang_runs_here_stream_is_cumulative_and_ends_with_the_full_answer():
    events = _load("generate-stream-eagle3.json")
    assert events[-1] == "[DONE]"
    parsed = [parse_generate_event(e) for e in events[:-1]]
    texts = [text for text, _ in parsed]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative text, not increments
    assert texts[-1] == _load("generate-eagle3.json")["text"]
    assert parsed[-1][1]["spec_verify_ct"] == 7 and "spec_verify_ct" not in parsed[0][1]  # spec_* at the end only


def test_captured_from_sglang_0_5_14_no_sglang_runs_here_streaming_client_replays_the_real_stream():
    events = _load("generate-stream-eagle3.json")
    body = "".join(f"data: {e if e == '[DONE]' else json.dumps(e)}\n\n" for e in events).encode()

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await GenerateRequester(8, 0.0)(client, "http://sglang", Prompt(id="r1", prompt="Hello"))

    result = asyncio.run(go())
    assert result.text == " World! World!" and result.output_tokens == 8 and result.ttft_s is not None
    assert acceptance_from_meta([result.meta], k=3).num_drafts == 7


def test_sglang_servers_get_a_port_with_room_for_their_grpc_port_no_sglang_runs_here(tmp_path):
    # SGLang 0.5.14 exits at once when port + 10000 passes 65535 ("SGLANG_GRPC_PORT (70501) must be between 1 and
    # 65535"), which happened on an H200 when the kernel handed out port 60501.
    (tmp_path / "config.json").write_text("{}")
    spec = SglangAdapter().server_spec(EngineConfig(engine="sglang"), tmp_path, None, "target")
    assert spec.max_port + 10000 <= 65535
    ports = [free_port(spec.max_port) for _ in range(50)]
    assert all(1024 <= p <= spec.max_port for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))  # what it hands out is free


def test_a_port_cap_below_the_kernels_ephemeral_range_is_still_served():
    ports = {free_port(30000) for _ in range(20)}
    assert all(20000 <= p <= 30000 for p in ports)


def test_captured_from_sglang_0_5_14_no_sglang_runs_here_log_shows_eagle3_prefills_without_cuda_graphs():
    """Excerpts of the two servers' logs from an H200 run with the 6.88B target: the baseline's prefills ran as
    piecewise CUDA graphs, EAGLE-3's eagerly, and SGLang said why when it started."""
    adapter = SglangAdapter()
    base = adapter.log_facts((CAPTURED / "server-log-baseline.txt").read_text())
    spec = adapter.log_facts((CAPTURED / "server-log-eagle3.txt").read_text())
    assert base == {"prefill_batches": 8, "prefill_batches_with_cuda_graph": 8}
    assert spec["prefill_batches"] == 8 and spec["prefill_batches_with_cuda_graph"] == 0
    assert spec["prefill_cuda_graph_off_log_line"].startswith("Disable prefill CUDA graph for EAGLE target on tc_piecewise")
    # With the breakable prefill backend on the EAGLE-3 server, SGLang kept the target's prefill graph.
    breakable = adapter.log_facts((CAPTURED / "server-log-eagle3-breakable.txt").read_text())
    assert breakable == {"prefill_batches": 8, "prefill_batches_with_cuda_graph": 8}
    # Decode batches carry "cuda graph: True" too; they are not prefills.
    assert adapter.log_facts("Decode batch, #running-req: 1, cuda graph: True, gen throughput (token/s): 9") == {}


def test_captured_from_sglang_0_5_14_no_sglang_runs_here_its_prefill_graph_warning_is_relayed():
    """SGLang's line on turning the EAGLE-3 target's prefill graph off, from the captured H200 log, is one of the
    engine's warnings the report relays; the baseline's log has none."""
    adapter = SglangAdapter()
    spec = adapter.log_facts((CAPTURED / "server-log-eagle3.txt").read_text())
    assert spec["warnings"] == ["Disable prefill CUDA graph for EAGLE target on tc_piecewise to avoid FP4/MoE "
                                "decode-replay corruption (#28386)."]
    assert "warnings" not in adapter.log_facts((CAPTURED / "server-log-baseline.txt").read_text())
