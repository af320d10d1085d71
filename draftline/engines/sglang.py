"""The SGLang adapter: its server command line, a /generate streaming client, and acceptance from meta_info.

SGLang runs on GPU workers only (it cannot run on the CPU machines this project is developed on), so its
parsing is tested against the response shapes read from SGLang 0.5.14's source, never against a running SGLang.

Acceptance: per finished request of a speculating server, SGLang 0.5.14 puts in meta_info `spec_verify_ct`
(target verification steps), `spec_num_correct_drafts` (accepted draft tokens, bonus token not counted),
`spec_num_proposed_drafts` and `spec_correct_drafts_histogram` (entry i = verification steps that accepted exactly
i draft tokens). Mean acceptance length = 1 + Σ spec_num_correct_drafts / Σ spec_verify_ct (vLLM's definition);
with chain drafting (top-k 1) the i-th draft token was accepted in every step that accepted at least i, so the
histogram gives per-position acceptance. Older SGLang without those fields: Σ completion_tokens / Σ spec_verify_ct,
the figure SGLang itself reports as `spec_accept_length`, which also counts the prefill token. `/server_info`
(`/get_server_info` before 0.5.14 deprecated it) → internal_states[0].avg_spec_accept_length is kept as a
cross-check; it accumulates over the server's life, health checks and warm-up included.
"""
from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from draftline.chat_template import ChatTemplate
from draftline.config import EngineConfig
from draftline.engines.base import (
    Acceptance, EngineAdapter, WarningPattern, http_answer, metrics_lines, relayed_warnings, stream_events,
)
from draftline.engines.client import Prompt, RequestResult, Requester, _sse_events
from draftline.engines.launch import ServerSpec, checkpoint_size
from draftline.engines.registry import engine_version
from draftline.errors import EngineError
from draftline.schedule import Schedule, sglang_adaptive_config


def installed_version() -> str | None:
    return engine_version("sglang")


def command(cfg: EngineConfig, target_dir: Path, drafter_dir: Path | None, served_name: str, port: int,
            python: str | None = None, adaptive_config: Path | None = None) -> list[str]:
    """`python -m sglang.launch_server ...`; EAGLE3 (not EAGLE: with an EAGLE-3 drafter that silently gives 1.0).
    python: the engine environment's interpreter (cfg.python, else this one); adaptive_config: a schedule by load
    (draftline.schedule.sglang_adaptive_config) that SGLang's adaptive speculation follows, from
    cfg.num_speculative_tokens steps (its largest k)."""
    argv = [
        python or cfg.python or sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(target_dir), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--context-length", str(cfg.max_model_len), "--tp-size", str(cfg.tensor_parallel_size),
        "--dtype", cfg.dtype, "--random-seed", "0", "--enable-metrics",
    ]
    if drafter_dir is not None:
        k = cfg.num_speculative_tokens
        # Chain drafting (top-k 1) with k steps verifies k draft tokens plus the bonus one, like vLLM's eagle3.
        argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter_dir),
                 "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(k + 1)]
        if adaptive_config is not None:
            argv += ["--speculative-adaptive", "--speculative-adaptive-config", str(adaptive_config)]
    return argv + cfg.server_args(speculative=drafter_dir is not None)


def chat_text(tokenizer, messages: list[dict], template: ChatTemplate | None = None) -> str:
    """The prompt SGLang's chat endpoint would build: the chat template (the target's, or `template` with its
    kwargs) with the generation prompt."""
    return (template or ChatTemplate()).render(tokenizer, messages, add_generation_prompt=True)


def parse_generate_event(event: dict) -> tuple[str, dict]:
    """(cumulative text, meta_info) of one /generate stream event or non-streaming response."""
    if not isinstance(event, dict) or "meta_info" not in event:
        raise EngineError(f"SGLang /generate answered without meta_info: {json.dumps(event)[:300]}", transient=False)
    return event.get("text", ""), event["meta_info"]


def _correct_drafts(meta: dict) -> int | None:
    value = meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts"))  # the second: older alias
    return None if value is None else int(value)


def _histogram(meta: dict) -> list[int] | None:
    value = meta.get("spec_correct_drafts_histogram", meta.get("spec_accept_histogram"))  # the second: older alias
    return [int(x) for x in value] if value else None


def acceptance_from_meta(metas: list[dict], server_info: dict | None = None, k: int | None = None
                         ) -> Acceptance | None:
    """Acceptance over the requests that speculated (meta_info with spec_verify_ct > 0); None when none did.

    k (draft tokens per step) sizes per_position; without it the longest histogram decides."""
    spec = [m for m in metas if (m.get("spec_verify_ct") or 0) > 0]
    if not spec:
        return None
    tokens = sum(int(m.get("completion_tokens") or 0) for m in spec)
    verify = sum(int(m["spec_verify_ct"]) for m in spec)
    reported: dict[str, Any] = {"meta_info.completion_tokens/spec_verify_ct": tokens / verify}
    avg = server_avg_accept_length(server_info) if server_info else None
    if avg is not None:
        reported["server_info.avg_spec_accept_length"] = avg
    correct = [_correct_drafts(m) for m in spec]
    if all(c is not None for c in correct):
        accepted = sum(correct)
        source = "SGLang /generate meta_info (1 + spec_num_correct_drafts / spec_verify_ct)"
    else:  # SGLang before spec_num_correct_drafts: its own accept length, prefill token included
        accepted = tokens - verify
        source = "SGLang /generate meta_info (completion_tokens / spec_verify_ct)"
    proposed = [m.get("spec_num_proposed_drafts") for m in spec]
    per_position = None
    hists = [_histogram(m) for m in spec]
    if all(h is not None for h in hists):
        width = max(len(h) for h in hists)
        total = [sum(h[i] for h in hists if i < len(h)) for i in range(width)]
        steps = sum(total)
        positions = k if k is not None else width - 1
        if steps > 0:
            per_position = [sum(total[i + 1:]) / steps for i in range(positions)]
    return Acceptance(
        source=source, mean_acceptance_length=1.0 + accepted / verify, per_position=per_position,
        num_drafts=verify, num_draft_tokens=sum(int(p) for p in proposed) if None not in proposed else None,
        num_accepted_tokens=accepted, engine_reported=reported,
    )


def server_avg_accept_length(server_info: dict) -> float | None:
    states = server_info.get("internal_states") or []
    if states and isinstance(states[0], dict) and states[0].get("avg_spec_accept_length") is not None:
        return float(states[0]["avg_spec_accept_length"])
    return None


@dataclass
class GenerateRequester:
    """Streams one prompt through SGLang's native /generate, which reports speculation per request."""

    max_new_tokens: int
    temperature: float
    tokenizer: Any = None  # needed for chat prompts only
    template: ChatTemplate | None = None  # the chat template and kwargs; None: the tokenizer's own

    async def __call__(self, client: httpx.AsyncClient, base_url: str, prompt: Prompt) -> RequestResult:
        if prompt.messages is not None:
            if self.tokenizer is None:
                raise EngineError("chat prompts need the target tokenizer to build SGLang /generate text",
                                  transient=False)
            text = chat_text(self.tokenizer, prompt.messages, self.template)
        else:
            text = prompt.prompt
        body = {"text": text, "stream": True,
                "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature}}
        start = time.perf_counter()
        ttft, out, meta = None, "", {}
        async with client.stream("POST", base_url + "/generate", json=body) as response:
            if response.status_code != 200:
                body_text = (await response.aread()).decode("utf-8", "replace")[:500]
                raise EngineError(f"{base_url}/generate answered HTTP {response.status_code}: {body_text}",
                                  transient=False)
            async for event in _sse_events(response):
                out, meta = parse_generate_event(event)
                if ttft is None and (meta.get("completion_tokens") or 0) > 0:
                    ttft = time.perf_counter() - start
        return RequestResult(prompt_id=prompt.id, output_tokens=int(meta.get("completion_tokens") or 0),
                             latency_s=time.perf_counter() - start, ttft_s=ttft, text=out, meta=meta)


def _first_generate(base_url: str, timeout_s: float) -> None:
    r = httpx.post(base_url + "/generate", timeout=timeout_s,
                   json={"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    r.raise_for_status()
    parse_generate_event(r.json())


class SglangAdapter(EngineAdapter):
    name = "sglang"

    def version(self) -> str | None:
        return installed_version()

    def server_spec(self, cfg: EngineConfig, target_dir: Path, drafter_dir: Path | None, served_name: str,
                    template: ChatTemplate | None = None, schedule: Schedule | None = None) -> ServerSpec:
        mode = "baseline" if drafter_dir is None else "schedule" if schedule is not None else "eagle3"
        adaptive = None
        if schedule is not None and drafter_dir is not None:
            adaptive = Path(tempfile.mkdtemp(prefix="draftline-sglang-adaptive-")) / "sglang-adaptive.json"
            adaptive.write_text(json.dumps(sglang_adaptive_config(schedule), indent=2) + "\n")
        return ServerSpec(
            name=f"sglang-{mode}",
            command=lambda port: command(cfg, target_dir, drafter_dir, served_name, port, adaptive_config=adaptive),
            first_request=_first_generate, health_path="/health",
            checkpoint_bytes=checkpoint_size(target_dir, drafter_dir),
            # SGLang 0.5.14 refuses to start when port + 10000 (its gRPC port) passes 65535, even with gRPC off;
            # seen on an H200 when the kernel handed out port 60501.
            max_port=65535 - 10000,
        )

    def requester(self, served_name: str, target_dir: Path, max_new_tokens: int, temperature: float,
                  template: ChatTemplate | None = None) -> Requester:
        from transformers import AutoTokenizer

        return GenerateRequester(max_new_tokens, temperature, AutoTokenizer.from_pretrained(str(target_dir)),
                                 template)

    def rendering(self, template: ChatTemplate) -> str:
        # /generate takes text: draftline renders the chat prompts, as SGLang's chat endpoint would.
        return "draftline, for SGLang's /generate"

    def acceptance_after(self, base_url: str, before: Any, results: list[RequestResult], k: int
                         ) -> Acceptance | None:
        return acceptance_from_meta([r.meta for r in results], server_info(base_url), k)

    def snapshot(self, base_url: str, served_name: str) -> dict[str, Any]:
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        return {
            "engine_version": installed_version(),
            "GET /server_info": http_answer("GET", base_url + "/server_info"),
            "GET /get_server_info": http_answer("GET", base_url + "/get_server_info"),
            "GET /v1/models": http_answer("GET", base_url + "/v1/models"),
            "POST /generate": http_answer("POST", base_url + "/generate", json=body),
            "POST /generate stream": stream_events(base_url + "/generate", {**body, "stream": True}),
            "GET /metrics (spec lines)": metrics_lines(base_url, "spec"),
        }

    def log_facts(self, log_text: str) -> dict[str, Any]:
        warnings = relayed_warnings(log_text, SGLANG_WARNINGS)
        return {**prefill_graph_facts(log_text), **({"warnings": warnings} if warnings else {})}


# Warnings SGLang logs when it turns off something that sets its speed. All but the prefill-graph one are read from
# SGLang's server_args.py, where it adjusts the launch arguments, and were never seen in a log: SGLang does not run
# on these machines.
SGLANG_WARNINGS = [
    # EAGLE-3 without spec v2: no overlap scheduler ("because of using eagle3 ..." or "when spec v2 is off ...").
    WarningPattern(r"Overlap scheduler is disabled\b"),
    WarningPattern(r"The overlap scheduler and mixed chunked prefill are disabled\b"),
    WarningPattern(r"Mixed chunked prefill is disabled\b"),
    # 0.5.14 on an EAGLE-3 target with its default prefill backend (captured: tests/fixtures/sglang-0.5.14).
    WarningPattern(r"Disable prefill CUDA graph\b"),
    # No CUDA graphs at all (torch native or flex attention backend, tensor dumps, a prefill-only server).
    WarningPattern(r"Cuda graph (?:and server warmup )?(?:is|are) disabled\b"),
    WarningPattern(r"Max running requests is reset to"),
    WarningPattern(r"speculative_num_draft_tokens is adjusted to"),
]


# SGLang 0.5.14 logs every prefill batch as "Prefill batch, #new-seq: ..., cuda graph: True|False, ...".
PREFILL_BATCH_LINE = re.compile(r"Prefill batch\b.*\bcuda graph: (True|False)\b")
PREFILL_GRAPH_OFF = "Disable prefill CUDA graph"


def prefill_graph_facts(log_text: str) -> dict[str, Any]:
    """How many of the server's prefill batches ran as CUDA graphs, from its own log, and SGLang's words when it
    turned the prefill graph off (0.5.14 does so for an EAGLE-3 target on its default tc_piecewise backend)."""
    flags = PREFILL_BATCH_LINE.findall(log_text)
    if not flags:
        return {}
    facts: dict[str, Any] = {"prefill_batches": len(flags), "prefill_batches_with_cuda_graph": flags.count("True")}
    for line in log_text.splitlines():
        if PREFILL_GRAPH_OFF in line:
            facts["prefill_cuda_graph_off_log_line"] = line[line.index(PREFILL_GRAPH_OFF):].strip()
            break
    return facts


def server_info(base_url: str, timeout_s: float = 30) -> dict | None:
    """/server_info (SGLang 0.5.14; /get_server_info there only logs a deprecation and forwards), else the old path."""
    for path in ("/server_info", "/get_server_info"):
        try:
            r = httpx.get(base_url + path, timeout=timeout_s)
            if r.status_code == 404:
                continue
            r.raise_for_status()
            info = r.json()
        except (httpx.HTTPError, ValueError):
            return None
        return info if isinstance(info, dict) else None
    return None
