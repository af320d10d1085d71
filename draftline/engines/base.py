"""What every engine adapter provides (server spec, load client, acceptance readout) and the acceptance result type."""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel

from draftline.chat_template import ChatTemplate
from draftline.config import EngineConfig
from draftline.engines.client import Prompt, RequestResult, Requester
from draftline.engines.launch import ServerSpec
from draftline.schedule import Schedule


class Acceptance(BaseModel):
    """Speculative acceptance over one run, in vLLM's definitions (the reference decoder uses the same ones).

    mean_acceptance_length = 1 + accepted draft tokens / drafts (tokens produced per target verification step);
    per_position[i] = drafts whose i-th draft token was accepted / drafts (None where the engine does not say).
    """

    source: str  # where the numbers came from, e.g. "vLLM /metrics deltas" or "SGLang /generate meta_info"
    mean_acceptance_length: float | None
    per_position: list[float] | None = None
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    engine_reported: dict[str, Any] = {}  # the engine's own summary figures, kept as a cross-check


class EngineAdapter(ABC):
    """One engine (vLLM, SGLang): how to start it, how to load it, how to read its acceptance."""

    name: str

    @abstractmethod
    def version(self) -> str | None:
        """The installed engine version, or None when the engine is not installed here."""

    @abstractmethod
    def server_spec(self, cfg: EngineConfig, target_dir: Path, drafter_dir: Path | None, served_name: str,
                    template: ChatTemplate | None = None, schedule: Schedule | None = None) -> ServerSpec:
        """The supervised server: baseline when drafter_dir is None, else EAGLE-3 with that drafter, drafting
        cfg.num_speculative_tokens per step, or by load as `schedule` says (draftline.schedule); `template`: the chat
        template the prompts are rendered with (None: the target tokenizer's own, no kwargs)."""

    @abstractmethod
    def requester(self, served_name: str, target_dir: Path, max_new_tokens: int, temperature: float,
                  template: ChatTemplate | None = None) -> Requester:
        """The coroutine that streams one prompt and returns its RequestResult."""

    @abstractmethod
    def rendering(self, template: ChatTemplate) -> str:
        """Who renders the chat prompts with the template and kwargs, and how they get there: for the report."""

    def acceptance_before(self, base_url: str) -> Any:
        """A snapshot taken before a load run (counters), or None when acceptance comes per request."""
        return None

    @abstractmethod
    def acceptance_after(self, base_url: str, before: Any, results: list[RequestResult], k: int
                         ) -> Acceptance | None:
        """Acceptance of the run between `before` and now; None when the server did no speculation."""

    def snapshot(self, base_url: str, served_name: str) -> dict[str, Any]:
        """The engine's own raw answers (a few KB), taken after the load runs and kept beside the result: the
        evidence behind its acceptance figures, and real response shapes to test the adapter against."""
        return {}

    def log_facts(self, log_text: str) -> dict[str, Any]:
        """What the server's own log says about how it ran (which passes were CUDA graphs, say), read after it
        stopped, for the report's explanations; empty when the log holds nothing draftline reads."""
        return {}


class WarningPattern(NamedTuple):
    """A warning an engine logs that changes what its figures mean: the regular expression that finds the start
    of the message, and how many of its sentences say what it means (the rest is usually a remedy or a link)."""

    pattern: str
    sentences: int = 1


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")


def relayed_warnings(log_text: str, patterns: list[WarningPattern]) -> list[str]:
    """The messages of the log lines that match `patterns`, each cut after its first `sentences` sentences, once
    each in the order first logged (an engine's API server, engine core and workers often log the same one)."""
    found: dict[str, None] = {}
    compiled = [(re.compile(p.pattern), p.sentences) for p in patterns]
    for line in _ANSI.sub("", log_text).splitlines():
        for regex, sentences in compiled:
            m = regex.search(line)
            if m:
                message = line[m.start():].strip()
                ends = list(_SENTENCE_END.finditer(message))
                if len(ends) >= sentences:
                    message = message[:ends[sentences - 1].start()]
                found.setdefault(message.rstrip(), None)
                break
    return list(found)


def http_answer(method: str, url: str, **kwargs) -> Any:
    """One raw answer for a snapshot: parsed JSON, else text; an error becomes {"error": ...} (a snapshot is
    evidence, never a reason to fail an evaluation)."""
    import httpx

    try:
        r = httpx.request(method, url, timeout=kwargs.pop("timeout", 60), **kwargs)
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        body = r.json()
    except ValueError:
        body = r.text
    return body if r.status_code == 200 else {"error": f"HTTP {r.status_code}", "body": body}


def metrics_lines(base_url: str, needle: str) -> list[str] | dict:
    """The Prometheus lines of /metrics that contain `needle` (its speculation counters), for a snapshot."""
    text = http_answer("GET", base_url + "/metrics")
    return [line for line in text.splitlines() if needle in line] if isinstance(text, str) else text


def stream_events(url: str, body: dict, timeout: float = 60) -> list | dict:
    """Every `data:` event of one streamed request, decoded, for a snapshot; [DONE] kept as the string."""
    import httpx

    events: list = []
    try:
        with httpx.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}", "body": r.read().decode("utf-8", "replace")[:2000]}
            for line in r.iter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    events.append(data if data == "[DONE]" else json.loads(data))
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "events": events}
    return events


__all__ = ["Acceptance", "EngineAdapter", "Prompt", "RequestResult", "Requester", "ServerSpec", "http_answer",
           "metrics_lines", "stream_events"]
