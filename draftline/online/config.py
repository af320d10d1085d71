"""The config section of online training (train.online): the hand-off between the capturing engine and the trainer,
its buffer, and where each side runs."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from draftline.config_base import Strict


class OnlineConfig(Strict):
    """Online training (train.source: engine): the capturing vLLM server (extract.vllm) hands each request's hidden
    states to the trainer through a local folder instead of writing shards."""

    buffer_tokens: int = Field(65536, ge=16, description="Tokens of captured states waiting for the trainer, at most "
                               "(requests in flight and files not yet trained on): a full buffer holds the engine's "
                               "next requests back until training catches up.")
    hand_off: Literal["local", "store"] = Field(
        "local", description="How the engine's states reach the trainer: local, through one folder both sides see "
        "(one machine, or a shared filesystem); store, through the run's store under <run>/online/, so that the "
        "engine and the trainer may run on two machines (each keeps its own folder, a relay thread on each side "
        "mirrors it; every request's states cross the store once and are deleted once trained).")
    spool_dir: str | None = Field(None, description="The local folder of the hand-off (the engine writes a file per "
                                  "request, the trainer reads and deletes it); null: /dev/shm when it is writable, "
                                  "else the temp dir. With hand_off store, each side's own folder under it.")
    epoch_cache_tokens: int = Field(262144, ge=0, description="Tokens of states the trainer keeps in host memory "
                                    "for the epochs after the first (the first it reads, 4 x hidden size x 2 bytes "
                                    "each); the engine captures the rest again every epoch; 0: every epoch is "
                                    "captured again. Several training processes keep none.")
    wait_s: float = Field(1800.0, gt=0, description="Seconds the trainer waits for the engine's next states (its "
                          "start and the validation capture included) before it fails naming the engine side.")
    engine_memory_fraction: float | None = Field(
        None, gt=0.0, lt=1.0, description="With the engine and the trainer on one GPU: the engine's share of its "
        "memory (vLLM --gpu-memory-utilization), the trainer takes the rest; preflight checks that both fit; null: "
        "extract.vllm's own flags decide.")
    engine_devices: list[int] | None = Field(None, description="GPU indices the engine runs on (its "
                                             "CUDA_VISIBLE_DEVICES); null: every GPU the worker sees.")
    trainer_devices: list[int] | None = Field(None, description="GPU indices the trainer runs on (its "
                                              "CUDA_VISIBLE_DEVICES), one process each up to train.processes; null: "
                                              "every GPU the worker sees.")
