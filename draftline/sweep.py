"""Serves an engine once per k of its sweep and once with the schedule derived from them, and records both.

The evaluation's own two servers (k=0, the target alone, and k=num_speculative_tokens) are the default sweep; a
config's sweep_k adds one server per further k, each reused across the concurrency points. The schedule
(draftline.schedule) is then served on a server of its own and measured at every point, unless it is one setting
everywhere (the sweep's server of that k already served exactly it) or the engine version cannot switch k by load.
A schedule its own server serves slower than no speculation somewhere is replaced by the sweep's best single setting.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

from draftline.config import EngineConfig
from draftline.errors import EngineError
from draftline.schedule import (
    ENGINE_NAMES, Rejected, Schedule, SweepPoint, Verification, best_uniform, compare, derive_schedule, falls_below,
    serve_args, serve_commands, unsupported_note, verification_from_sweep,
)


class Runs(Protocol):
    """What draftline.evaluate.measure returns for one server (its ServerRuns)."""

    runs: list[tuple[Any, Any, list]]
    repeats: list[list[tuple[Any, list]]]
    log_facts: dict[str, Any]


# (drafter directory or None, engine config, schedule or None, server label) -> that server's runs.
Serve = Callable[[Path | None, EngineConfig, Schedule | None, str], Runs]

SCHEDULE_SERVER = "schedule"


def label_of(k: int, cfg: EngineConfig) -> str:
    """A server's name in logs and results: "baseline" (k=0), "eagle3" (the configured k), "eagle3-k5"."""
    return "baseline" if k == 0 else "eagle3" if k == cfg.num_speculative_tokens else f"eagle3-k{k}"


def points_of(k: int, runs: Runs) -> list[SweepPoint]:
    """One server's figures as sweep points: tokens per second per repeat, acceptance and draft tokens per step."""
    out = []
    for (metrics, acceptance, _), repeats in zip(runs.runs, runs.repeats or [[] for _ in runs.runs]):
        drafted = None
        if acceptance is not None and acceptance.num_drafts and acceptance.num_draft_tokens is not None:
            drafted = acceptance.num_draft_tokens / acceptance.num_drafts
        out.append(SweepPoint(
            k=k, concurrency=metrics.concurrency, tokens_per_s=metrics.output_tokens_per_s,
            runs=[m.output_tokens_per_s for m, _ in repeats],
            acceptance_length=acceptance.mean_acceptance_length if acceptance is not None else None,
            draft_tokens_per_draft=drafted))
    return out


def serve_further_ks(serve: Serve, cfg: EngineConfig, drafter_dir: Path) -> dict[int, Runs]:
    """The servers of the sweep beyond the evaluation's own two, one per k, in increasing k."""
    return {k: serve(drafter_dir, cfg.model_copy(update={"num_speculative_tokens": k}), None, label_of(k, cfg))
            for k in cfg.ks if k not in (0, cfg.num_speculative_tokens)}


def schedule_of(servers: dict[int, Runs], cfg: EngineConfig, serve: Serve, target_dir: Path, drafter_dir: Path,
                engine_version: str | None, serves_schedule: bool | None
                ) -> tuple[list[SweepPoint], Schedule, Runs | None]:
    """(the sweep, the schedule derived from it and verified, the schedule server's runs when one was started).

    A schedule server that fails to start leaves the schedule verified on the sweep's servers, with the engine's
    own sentence: the evaluation's fixed-k figures stand whatever happens to it."""
    points = [p for k, runs in sorted(servers.items()) for p in points_of(k, runs)]
    schedule = derive_schedule(points, cfg.engine)
    schedule.supported = serves_schedule
    schedule.commands = commands_of(schedule, cfg, target_dir, drafter_dir)
    name = ENGINE_NAMES.get(cfg.engine, cfg.engine)
    runs = None
    if schedule.uniform:
        k = schedule.max_k
        why = (f"the schedule is one setting at every load, {'no speculation' if k == 0 else f'k={k}'}, which the "
               f"sweep's own server of k={k} served")
        schedule.verification = verification_from_sweep(schedule, points, why)
    elif serves_schedule is False:
        schedule.support_note = unsupported_note(cfg.engine, engine_version, cfg.num_speculative_tokens)
        schedule.verification = verification_from_sweep(
            schedule, points, f"{name} {engine_version} cannot switch k by load, so each load's figure is the "
            "sweep's server of its k")
    else:
        try:
            runs = serve(drafter_dir, cfg.model_copy(update={"num_speculative_tokens": schedule.max_k}), schedule,
                         SCHEDULE_SERVER)
        except EngineError as exc:
            said = str(exc).split("\n")[0]
            schedule.support_note = (f"The server with the schedule did not start ({said}); each load's figure is "
                                     "the sweep's server of its k.")
            schedule.verification = verification_from_sweep(schedule, points, schedule.support_note)
        else:
            measured = [p.model_copy(update={"k": schedule.k_at(p.concurrency)}) for p in points_of(0, runs)]
            schedule.verification = Verification(source="server", points=measured)
    schedule.comparisons = compare(schedule, points)
    if any(falls_below(c, 0.0) for c in schedule.comparisons):
        schedule = replaced(schedule, points, cfg, target_dir, drafter_dir)
    return points, schedule, runs


def replaced(schedule: Schedule, points: list[SweepPoint], cfg: EngineConfig, target_dir: Path, drafter_dir: Path
             ) -> Schedule:
    """The best single setting of the sweep in place of a schedule its own server served slower than no speculation
    somewhere (in vLLM a k=0 range still runs the drafter each step, to keep its cache in step)."""
    best = best_uniform(points, cfg.engine)
    slower = [c for c in schedule.comparisons if falls_below(c, 0.0)]
    k = best.max_k
    setting = "no speculation" if k == 0 else f"k={k}"
    why = ("the derived schedule (" + schedule.describe() + ") served " + ", ".join(
        f"{c.speedup:.2f}x at concurrency {c.concurrency}" for c in slower) + " of no speculation's tokens per second "
        f"on its own server, so the best single setting of the sweep replaces it: {setting} at every load, which the "
        f"sweep's own server of k={k} served")
    best.supported, best.support_note = schedule.supported, schedule.support_note
    best.verification = verification_from_sweep(best, points, why)
    best.comparisons = compare(best, points)
    best.rejected = Rejected(ranges=schedule.ranges, description=schedule.describe(),
                             verification=schedule.verification, comparisons=schedule.comparisons)
    best.commands = commands_of(best, cfg, target_dir, drafter_dir)
    return best


def commands_of(schedule: Schedule, cfg: EngineConfig, target_dir: Path, drafter_dir: Path) -> list[tuple[str, str]]:
    """The lines to serve the schedule with the settings this evaluation measured."""
    args = serve_args(cfg.engine, cfg.tensor_parallel_size, cfg.max_model_len, cfg.dtype,
                      cfg.server_args(speculative=True))
    return serve_commands(schedule, str(Path(target_dir).resolve()), str(Path(drafter_dir).resolve()), args)
