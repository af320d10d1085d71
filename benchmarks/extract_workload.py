"""What both extraction benchmarks (transformers, vLLM) measure with: random token sequences as the traces, and the
disk's fsync'd write bandwidth that bounds how fast shards can be written."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from draftline.store import BackgroundFlush


def disk_bandwidth(folder: Path, total: int, chunk: int = 64 << 20, early_flush: bool = False) -> float:
    """Bytes/s of a sequential write with fsync, like the store's atomic publish; early_flush: a background flush
    after each chunk, as the store starts one every EARLY_WRITEBACK_BYTES (64 MiB), so the disk writes early."""
    data = os.urandom(chunk)
    path = folder / "disk-probe.bin"
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        flush = BackgroundFlush(f.fileno())
        for _ in range(max(1, total // chunk)):
            f.write(data)
            if early_flush:
                flush.start()
        flush.wait()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t
    size = path.stat().st_size
    path.unlink()
    return size / elapsed


def random_sequences(n: int, length: int, vocab: int, seed: int = 0, jitter: bool = False):
    """n lists of `length` random token ids (jitter: each up to a quarter shorter), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    lengths = [length - (int(torch.randint(0, length // 4, (1,), generator=g)) if jitter else 0) for _ in range(n)]
    return [torch.randint(10, vocab, (m,), generator=g).tolist() for m in lengths]
