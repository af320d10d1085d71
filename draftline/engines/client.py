"""Sends the prompt set to a served engine at a fixed concurrency over streaming HTTP and measures what users feel.

Per request: latency, time to first token (TTFT), time per output token after the first (TPOT), output tokens
(from the server's own usage count, not from chunk counting: speculative engines stream several tokens per
chunk). Per run: output tokens per second over the wall time of the whole run. Over repeats of the same run
(`summarize_repeats`): the median run figures, and the request percentiles over every measured request.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
from pydantic import BaseModel

from draftline.errors import EngineError

# Seconds an idle kept-alive connection is reused for: below the engines' own 5 s (uvicorn's keep-alive, vLLM's
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so a request never goes out on a connection the server is closing at that moment.
KEEPALIVE_EXPIRY_S = 2.0


@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt: chat messages (sent to /v1/chat/completions) or a raw prompt (to /v1/completions)."""

    id: str
    messages: list[dict] | None = None
    prompt: str | None = None


def load_prompts(path: str | Path, max_prompts: int | None = None) -> list[Prompt]:
    """The evaluation prompts (eval.prompts: a file, a saved dataset or s3://, read by draftline.conversations), each
    answered at its last turn; the first bad record raises BadRecord naming its file, line and field."""
    from draftline.conversations import read_prompt_set
    from draftline.images import engine_messages, image_parts, prompts_base

    records = read_prompt_set(path, "eval.prompts", limit=max_prompts)
    # Image parts reach the chat API as trace generation sends them (data URLs, or http(s) URLs as they are).
    return [Prompt(id=r["id"], prompt=r.get("prompt"),
                   messages=engine_messages(r, records.origin(r["id"]), prompts_base(str(path)))
                   if image_parts(r.get("messages") or []) else r.get("messages"))
            for r in records]


class RequestResult(BaseModel):
    prompt_id: str
    output_tokens: int
    latency_s: float
    ttft_s: float | None
    text: str
    meta: dict[str, Any] = {}  # engine-specific per-request fields (e.g. SGLang's meta_info)
    # What a server with a reasoning parser returned apart from `text` (vLLM's `reasoning`, older servers'
    # `reasoning_content`); None when it returned none: the thinking, if any, is then inline in `text`.
    reasoning: str | None = None


class RunMetrics(BaseModel):
    """One load run: the same prompts at one concurrency against one server."""

    concurrency: int
    requests: int
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    requests_per_s: float
    latency_mean_s: float
    latency_p50_s: float
    latency_p90_s: float
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    tpot_mean_s: float | None
    ttft_p90_s: float | None = None  # absent from results written before it was measured


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(results: list[RequestResult], concurrency: int, duration_s: float) -> RunMetrics:
    tokens = sum(r.output_tokens for r in results)
    lat = [r.latency_s for r in results]
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1)
            for r in results if r.ttft_s is not None and r.output_tokens > 1]
    return RunMetrics(
        concurrency=concurrency, requests=len(results), output_tokens=tokens, duration_s=duration_s,
        output_tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        requests_per_s=len(results) / duration_s if duration_s > 0 else 0.0,
        latency_mean_s=statistics.fmean(lat), latency_p50_s=_percentile(lat, 0.5), latency_p90_s=_percentile(lat, 0.9),
        ttft_mean_s=statistics.fmean(ttft) if ttft else None, ttft_p50_s=_percentile(ttft, 0.5) if ttft else None,
        ttft_p90_s=_percentile(ttft, 0.9) if ttft else None, tpot_mean_s=statistics.fmean(tpot) if tpot else None,
    )


def summarize_repeats(runs: list[tuple[RunMetrics, list[RequestResult]]]) -> RunMetrics:
    """Several measured runs of the same requests at one concurrency as one RunMetrics: the run figures (requests,
    output tokens, duration, tokens and requests per second) are the median over the runs, the request figures
    (latency, TTFT and TPOT) are taken over every request of every run."""
    if not runs:
        raise ValueError("no runs to summarize")
    if len(runs) == 1:
        return runs[0][0]
    metrics = [m for m, _ in runs]
    pooled = summarize([r for _, results in runs for r in results], metrics[0].concurrency, 1.0)

    def median(field: str) -> float:
        return statistics.median(getattr(m, field) for m in metrics)

    return pooled.model_copy(update={
        "requests": round(median("requests")), "output_tokens": round(median("output_tokens")),
        "duration_s": median("duration_s"), "output_tokens_per_s": median("output_tokens_per_s"),
        "requests_per_s": median("requests_per_s"),
    })


async def _sse_events(response: httpx.Response):
    """Yield decoded JSON objects of a server-sent-events stream, stopping at `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)


@dataclass
class OpenAIRequester:
    """Streams one prompt through the OpenAI-compatible API (vLLM and SGLang both serve it)."""

    model: str
    max_tokens: int
    temperature: float
    extra_body: dict = field(default_factory=dict)
    chat_body: dict = field(default_factory=dict)  # chat requests only: the template's kwargs (chat_template_kwargs)

    async def __call__(self, client: httpx.AsyncClient, base_url: str, prompt: Prompt) -> RequestResult:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}, **self.extra_body}
        if prompt.messages is not None:
            url, body["messages"] = base_url + "/v1/chat/completions", prompt.messages
            body.update(self.chat_body)
        else:
            url, body["prompt"] = base_url + "/v1/completions", prompt.prompt
        start = time.perf_counter()
        ttft, parts, thought, usage_tokens = None, [], [], None
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")[:500]
                raise EngineError(f"{url} answered HTTP {response.status_code}: {text}", transient=False)
            async for event in _sse_events(response):
                for choice in event.get("choices") or []:
                    if prompt.messages is not None:
                        piece, reasoning = chat_delta(choice.get("delta") or {})
                    else:
                        piece, reasoning = choice.get("text"), None
                    # The first token is the first the server streams, thinking included: a reasoning parser moves
                    # the thinking out of `content`, not out of the time to first token.
                    if (piece or reasoning) and ttft is None:
                        ttft = time.perf_counter() - start
                    if reasoning:
                        thought.append(reasoning)
                    if piece:
                        parts.append(piece)
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
        latency = time.perf_counter() - start
        if usage_tokens is None:
            raise EngineError(f"{url} streamed no usage block; the server ignored stream_options.include_usage",
                              transient=False)
        return RequestResult(prompt_id=prompt.id, output_tokens=usage_tokens, latency_s=latency, ttft_s=ttft,
                             text="".join(parts), reasoning="".join(thought) if thought else None)


def chat_delta(delta: dict) -> tuple[str | None, str | None]:
    """(content, reasoning) of one streamed chat delta: a server started with a reasoning parser streams the thinking
    as `reasoning` (vLLM) or `reasoning_content` (older vLLM, SGLang) and the answer after it as `content`."""
    return delta.get("content"), delta.get("reasoning") or delta.get("reasoning_content")


Requester = Callable[[httpx.AsyncClient, str, Prompt], Any]


async def _run(base_url: str, prompts: list[Prompt], concurrency: int, requester: Requester,
               timeout_s: float) -> tuple[list[RequestResult], float]:
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        async def one(prompt: Prompt) -> RequestResult:
            async with semaphore:
                return await requester(client, base_url, prompt)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return list(results), time.perf_counter() - start


def round_robin(prompts: list[Prompt], n: int) -> list[Prompt]:
    """n requests taking the prompts in turn, from the first again when they run out."""
    return [prompts[i % len(prompts)] for i in range(n)]


def requests_for(prompts: list[Prompt], concurrency: int, at_least: int | None = None) -> list[Prompt]:
    """Every prompt once, repeated round-robin when there are fewer prompts than twice the concurrency (so that a
    high-concurrency run is not measured on a half-empty batch) or than `at_least`."""
    return round_robin(prompts, max(len(prompts), 2 * concurrency, at_least or 0))


def run_load(base_url: str, prompts: list[Prompt], concurrency: int, requester: Requester,
             timeout_s: float = 600.0) -> tuple[RunMetrics, list[RequestResult]]:
    """Send the prompts with at most `concurrency` in flight; return the run's metrics and each request's result."""
    try:
        results, duration = asyncio.run(_run(base_url, prompts, concurrency, requester, timeout_s))
    except httpx.HTTPError as exc:
        raise EngineError(f"load run against {base_url} at concurrency {concurrency} failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    return summarize(results, concurrency, duration), results
