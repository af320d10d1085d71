"""Acceptance counters of a decoding run, their offline estimate from training accuracies, and a run's output record.

Definitions follow vLLM's counters, so engine figures and the reference decoder's compare directly:
  * a "draft" is one target verification step that checked k draft tokens;
  * mean acceptance length = 1 + accepted draft tokens / drafts (tokens produced per verification step);
  * per-position acceptance i = drafts whose i-th draft token was accepted / drafts.
No torch here: the report, the evaluation and the regression read these figures without loading a decoder.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from draftline.errors import ConfigError


@dataclass
class AcceptanceStats:
    """Acceptance counters of a speculative run, in vLLM's definitions."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # Entry a = drafts that accepted exactly a draft tokens (acceptance length a + 1), a = 0..k.
    accepted_histogram: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.k
        self.accepted_histogram = self.accepted_histogram or [0] * (self.k + 1)

    def record(self, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += self.k
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        self.accepted_histogram[accepted] += 1

    def add(self, part: "AcceptanceStats") -> None:
        """Add another run's counters (same k) to these: the counters of both runs together."""
        self.num_drafts += part.num_drafts
        self.num_draft_tokens += part.num_draft_tokens
        self.num_accepted_tokens += part.num_accepted_tokens
        self.accepted_per_position = [a + b for a, b in zip(self.accepted_per_position, part.accepted_per_position)]
        self.accepted_histogram = [a + b for a, b in zip(self.accepted_histogram, part.accepted_histogram)]

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else float("nan") for a in self.accepted_per_position]

    @property
    def conditional_acceptance(self) -> list[float | None]:
        """P(draft i accepted | draft i-1 accepted): what training's per-step top-1 accuracy estimates (None: no case)."""
        out, prev = [], self.num_drafts
        for a in self.accepted_per_position:
            out.append(a / prev if prev else None)
            prev = a
        return out

    def summary(self) -> dict:
        return {
            **asdict(self),
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "conditional_acceptance": self.conditional_acceptance,
        }


def expected_acceptance(step_accuracies: Sequence[float], k: int | None = None) -> dict:
    """Offline estimate from training validation, in the same definitions as a decoding run.

    step_accuracies[j] is the drafter's top-1 accuracy at training-time-test step j, measured with the true
    previous tokens as inputs, i.e. the chance that draft j is right given drafts 0..j-1 were. Under chain
    drafting with greedy verification, draft j is accepted iff all of 0..j are right, so
        per-position acceptance j = prod_{i<=j} acc_i,   mean acceptance length = 1 + sum_j prod_{i<=j} acc_i.
    With k larger than the measured steps, the last accuracy is repeated (a stated assumption).
    """
    accs = [float(a) for a in step_accuracies]
    if not accs or any(not 0.0 <= a <= 1.0 for a in accs):
        raise ConfigError(f"step accuracies {accs} must be a non-empty list of numbers between 0 and 1")
    k = len(accs) if k is None else int(k)
    if k < 1:
        raise ConfigError(f"k={k} must be at least 1 (the number of draft tokens per step)")
    accs = (accs + [accs[-1]] * k)[:k]
    per_position, running = [], 1.0
    for a in accs:
        running *= a
        per_position.append(running)
    return {"k": k, "mean_acceptance_length": 1.0 + sum(per_position), "per_position_acceptance": per_position}


@dataclass
class Generation:
    """Output of one decoding run over a batch of prompts."""

    tokens: list[list[int]]  # generated ids per prompt (cut at EOS inclusive, at most max_new_tokens)
    seconds: float
    target_forwards: int  # prefill included
    stats: AcceptanceStats | None = None  # None for plain decoding
    target_seconds: float = 0.0  # time inside target forwards, only when profiled
    drafter_seconds: float = 0.0  # time inside drafter forwards, only when profiled
    drafter_forwards: int = 0
    mode: str = "eager"  # "eager" | "static-eager" | "cuda-graphs" | "cuda-graphs-partial" (draftline.decode_static)
    setup_seconds: float = 0.0  # fast path: buffer allocation and graph capture, not part of `seconds`
    # Greedy fast path with sync_every > 1: target forwards that ran after every row had finished (inside the last
    # sync window, before the host looked) and whose output was discarded. They cost time (counted in `seconds`)
    # but are not in target_forwards / drafter_forwards, which count what sync_every=1 would run, so those stay
    # comparable across sync_every.
    discarded_target_forwards: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")

