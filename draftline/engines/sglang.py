"""The SGLang adapter: its server command line, a /generate streaming client, and acceptance from meta_info.

SGLang runs on GPU workers only (it cannot run on the CPU machines this project is developed on), so its
parsing is tested against SGLang's documented response shapes, never against a running SGLang.

Acceptance: per finished request SGLang reports `completion_tokens` and `spec_verify_ct` (target verification
steps) in meta_info; mean acceptance length = Σ completion_tokens / Σ spec_verify_ct, the way SGLang's own tests
and benchmarks compute it. `/get_server_info` → internal_states[0].avg_spec_accept_length is kept as a
cross-check. SGLang exposes no per-position counters, so per-position acceptance is not reported for it.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from draftline.config import EngineConfig
from draftline.engines.base import Acceptance, EngineAdapter
from draftline.engines.client import Prompt, RequestResult, Requester, _sse_events
from draftline.engines.launch import ServerSpec, checkpoint_size
from draftline.errors import EngineError


def installed_version() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def command(cfg: EngineConfig, target_dir: Path, drafter_dir: Path | None, served_name: str, port: int,
            python: str = sys.executable) -> list[str]:
    """`python -m sglang.launch_server ...`; EAGLE3 (not EAGLE: with an EAGLE-3 drafter that silently gives 1.0)."""
    argv = [
        python, "-m", "sglang.launch_server",
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
    return argv + list(cfg.extra_args)


def chat_text(tokenizer, messages: list[dict]) -> str:
    """The prompt SGLang's chat endpoint would build: the target's chat template with the generation prompt."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def parse_generate_event(event: dict) -> tuple[str, dict]:
    """(cumulative text, meta_info) of one /generate stream event or non-streaming response."""
    if not isinstance(event, dict) or "meta_info" not in event:
        raise EngineError(f"SGLang /generate answered without meta_info: {json.dumps(event)[:300]}", transient=False)
    return event.get("text", ""), event["meta_info"]


def acceptance_from_meta(metas: list[dict], server_info: dict | None = None) -> Acceptance | None:
    """Σ completion_tokens / Σ spec_verify_ct over requests that speculated; None when none did."""
    spec = [m for m in metas if (m.get("spec_verify_ct") or 0) > 0]
    if not spec:
        return None
    tokens = sum(int(m.get("completion_tokens") or 0) for m in spec)
    verify = sum(int(m["spec_verify_ct"]) for m in spec)
    reported: dict[str, Any] = {}
    avg = server_avg_accept_length(server_info) if server_info else None
    if avg is not None:
        reported["get_server_info.avg_spec_accept_length"] = avg
    return Acceptance(
        source="SGLang /generate meta_info (completion_tokens / spec_verify_ct)",
        mean_acceptance_length=tokens / verify, per_position=None, num_drafts=verify,
        num_accepted_tokens=tokens - verify, engine_reported=reported,
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

    async def __call__(self, client: httpx.AsyncClient, base_url: str, prompt: Prompt) -> RequestResult:
        if prompt.messages is not None:
            if self.tokenizer is None:
                raise EngineError("chat prompts need the target tokenizer to build SGLang /generate text",
                                  transient=False)
            text = chat_text(self.tokenizer, prompt.messages)
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

    def server_spec(self, cfg: EngineConfig, target_dir: Path, drafter_dir: Path | None, served_name: str
                    ) -> ServerSpec:
        mode = "eagle3" if drafter_dir is not None else "baseline"
        return ServerSpec(
            name=f"sglang-{mode}",
            command=lambda port: command(cfg, target_dir, drafter_dir, served_name, port),
            first_request=_first_generate, health_path="/health",
            checkpoint_bytes=checkpoint_size(target_dir, drafter_dir),
        )

    def requester(self, served_name: str, target_dir: Path, max_new_tokens: int, temperature: float) -> Requester:
        from transformers import AutoTokenizer

        return GenerateRequester(max_new_tokens, temperature, AutoTokenizer.from_pretrained(str(target_dir)))

    def acceptance_after(self, base_url: str, before: Any, results: list[RequestResult], k: int
                         ) -> Acceptance | None:
        try:
            info = httpx.get(base_url + "/get_server_info", timeout=30).json()
        except (httpx.HTTPError, ValueError):
            info = None
        return acceptance_from_meta([r.meta for r in results], info)
