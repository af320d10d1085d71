"""Drafter training on several processes: `torchrun --nproc-per-node N -m draftline.drafter.train` run as a supervised
process group, its output handed over line by line, its failure saying whether a retry (which resumes from the last
checkpoint) can help."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Callable

import torch
import yaml

from draftline.config import PipelineConfig, TrainConfig
from draftline.engines.launch import GUARD, root_cause
from draftline.errors import ConfigError, TrainingError
from draftline.layout import training_record_key
from draftline.store import Store
from draftline.target import resolve_device

# Lines kept to find the root cause and to show with a failure; a rank's traceback ends well within them.
KEPT_LINES = 400
TAIL_LINES = 40


def torchrun_command(config_path: str | os.PathLike, processes: int) -> list[str]:
    """torchrun on this machine only (--standalone picks a free rendezvous port), one rank per process."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            "-m", "draftline.drafter.train", str(config_path)]


def check_devices(cfg: TrainConfig, visible: int | None = None) -> None:
    """On GPUs each rank takes one: refuse more processes than this worker sees, before any process starts."""
    if resolve_device(cfg.device, "train.device") != "cuda":
        return  # CPU ranks (gloo) share the cores
    visible = torch.cuda.device_count() if visible is None else visible
    if cfg.processes > visible:
        raise ConfigError(f"train.processes={cfg.processes} but this worker sees {visible} GPU(s); lower "
                          f"train.processes to {visible} or run training on a worker with {cfg.processes} GPUs")


def _trainer_gpus(config: PipelineConfig) -> dict[str, str]:
    """Online training with GPUs of the trainer's own: the ranks see only those."""
    devices = config.train.online.trainer_devices
    if config.train.source != "engine" or devices is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in devices)}


def train_with_torchrun(config: PipelineConfig, store: Store, on_line: Callable[[str], None] | None = None) -> dict:
    """Train with config.train.processes ranks and return the run's summary (its `<run>/train/metrics.json`).

    Every output line of torchrun and its ranks goes to `on_line` (default: this process's stderr) as it comes. The
    process group runs under draftline's guard, so it dies with this process, however this process ends. A rerun
    resumes from the last checkpoint in the store, as a single-process run does.
    """
    check_devices(config.train)
    on_line = on_line or _to_stderr
    processes = config.train.processes
    with tempfile.TemporaryDirectory(prefix="draftline-torchrun-") as tmp:
        # The ranks read the same config the caller holds; relative paths in it resolve from the same folder.
        config_path = Path(tmp) / "config.yaml"
        config_path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        argv = torchrun_command(config_path, processes)
        on_line(f"$ {' '.join(argv)}")
        pipe_r, pipe_w = os.pipe()  # the guard kills the group when this end closes, e.g. when this process dies
        proc = subprocess.Popen([sys.executable, str(GUARD), str(pipe_r), "--", *argv],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, **_trainer_gpus(config), "PYTHONUNBUFFERED": "1"},
                                start_new_session=True,
                                pass_fds=(pipe_r,), text=True, errors="replace", bufsize=1)
        os.close(pipe_r)
        kept: deque[str] = deque(maxlen=KEPT_LINES)
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                kept.append(line)
                on_line(line)
            code = proc.wait()
        finally:
            os.close(pipe_w)  # on an exception here (a cancelled task), the guard stops the ranks
            if proc.poll() is None:
                proc.wait(timeout=60)
            proc.stdout.close()
    if code != 0:
        raise training_failure(processes, code, list(kept))
    return json.loads(store.get_bytes(training_record_key(config.run)))


# torch prefixes the lines of a rank's uncaught exception with "[rankN]: ".
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank(\d+)\]:\s?")
# torchrun's summary of the first rank that failed: its rank, then its exit code (negative: the signal that ended it).
_FIRST_FAILURE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)",
                            re.S)


def training_failure(processes: int, code: int, lines: list[str]) -> TrainingError:
    """The error for a failed torchrun, from the first rank that failed (the others fail because it did): killed by a
    signal, or its own exception; retried unless that exception says the input is bad."""
    first = _FIRST_FAILURE.search("\n".join(lines))
    if first and int(first.group(2)) < 0:
        why, transient = f"rank {first.group(1)} was killed by {_signal_name(-int(first.group(2)))}", True
    else:
        failed_rank = first.group(1) if first else None
        own = [_RANK_PREFIX.sub("", line) for line in lines
               if (m := _RANK_PREFIX.match(line)) and m.group(1) == failed_rank]
        cause = root_cause("\n".join(own)) or root_cause("\n".join(_RANK_PREFIX.sub("", line) for line in lines))
        if cause is not None:
            why, transient = cause[0], not cause[1]
        else:
            # No exception printed: the process ended some other way (the OOM killer, preemption); a retry resumes.
            why, transient = "a training process exited without an error message", True
    retry = "a retry resumes from the last checkpoint" if transient else "not retried: the same input fails again"
    return TrainingError(f"training with torchrun ({processes} processes) exited with status {code}: {why} ({retry})",
                         "\n".join(lines[-TAIL_LINES:]), transient=transient)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
