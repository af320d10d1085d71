"""What every engine adapter provides (server spec, load client, acceptance readout) and the acceptance result type."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from draftline.config import EngineConfig
from draftline.engines.client import Prompt, RequestResult, Requester
from draftline.engines.launch import ServerSpec


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
    def server_spec(self, cfg: EngineConfig, target_dir: Path, drafter_dir: Path | None, served_name: str
                    ) -> ServerSpec:
        """The supervised server: baseline when drafter_dir is None, else EAGLE-3 with that drafter."""

    @abstractmethod
    def requester(self, served_name: str, target_dir: Path, max_new_tokens: int, temperature: float) -> Requester:
        """The coroutine that streams one prompt and returns its RequestResult."""

    def acceptance_before(self, base_url: str) -> Any:
        """A snapshot taken before a load run (counters), or None when acceptance comes per request."""
        return None

    @abstractmethod
    def acceptance_after(self, base_url: str, before: Any, results: list[RequestResult], k: int
                         ) -> Acceptance | None:
        """Acceptance of the run between `before` and now; None when the server did no speculation."""


__all__ = ["Acceptance", "EngineAdapter", "Prompt", "RequestResult", "Requester", "ServerSpec"]
