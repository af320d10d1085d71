"""Artifact store throughput, local folder vs SeaweedFS S3 on this machine: upload, download, verify, cached get_dir.

    .venv/bin/python benchmarks/store_throughput.py [--mb 256] [--out benchmarks/results/store_throughput.json]

Prints one table and writes the same numbers as JSON. Both sides include sha256 hashing (the store always hashes
what it writes and verifies what it reads), so the figures are what a pipeline stage sees, not raw disk speed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra.local.seaweedfs import LocalS3  # noqa: E402
from draftline.store import open_store  # noqa: E402


def _write_random(path: Path, size: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 8 << 20)
            f.write(rng.integers(0, 256, size=n, dtype=np.uint8).tobytes())
            left -= n


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(store, work: Path, big: Path, size: int) -> dict[str, float]:
    mb = size / 1e6
    entry_holder = {}
    up = _timed(lambda: entry_holder.setdefault("e", store.put_file("bench/big.bin", big)))
    down = _timed(lambda: store.get_file("bench/big.bin", work / "down.bin", expect=entry_holder["e"]))
    verify = _timed(lambda: store.verify("bench/big.bin", entry_holder["e"]))
    folder = work / "dir"
    folder.mkdir(exist_ok=True)
    for i in range(20):  # a drafter export is a few small files and one large one
        (folder / f"f{i:02d}.json").write_bytes(os.urandom(4096))
    os.link(big, folder / "model.safetensors")  # the large file, without a second copy on disk
    publish = _timed(lambda: store.put_dir("bench/export", folder))
    first = _timed(lambda: store.get_dir("bench/export"))
    cached = _timed(lambda: store.get_dir("bench/export"))
    store.delete_tree("bench")
    return {
        "upload_MBps": round(mb / up, 1),
        "download_verified_MBps": round(mb / down, 1),
        "verify_MBps": round(mb / verify, 1),
        "put_dir_s": round(publish, 2),
        "get_dir_first_s": round(first, 2),
        "get_dir_cached_s": round(cached, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="size of the large object in MiB")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "store_throughput.json"))
    args = parser.parse_args()
    size = args.mb << 20
    rows = {}
    with tempfile.TemporaryDirectory(prefix="draftline-bench-") as tmp:
        tmp = Path(tmp)
        big = tmp / "big.bin"
        _write_random(big, size)
        (tmp / "local").mkdir()
        rows["local folder"] = measure(open_store(str(tmp / "runs")), tmp / "local", big, size)
        with LocalS3(tmp / "seaweedfs", keep_data=False) as s3:
            uri = s3.create_bucket("bench")
            os.environ.update(s3.env())
            os.environ["DRAFTLINE_CACHE_DIR"] = str(tmp / "cache")
            (tmp / "s3").mkdir()
            rows["SeaweedFS S3 (localhost)"] = measure(open_store(uri), tmp / "s3", big, size)
    cols = list(next(iter(rows.values())))
    print(f"store throughput, {args.mb} MiB object, {platform.machine()} {os.cpu_count()} cores")
    print(f"{'store':<26}" + "".join(f"{c:>24}" for c in cols))
    for name, row in rows.items():
        print(f"{name:<26}" + "".join(f"{row[c]:>24}" for c in cols))
    result = {"object_MiB": args.mb, "cpu_count": os.cpu_count(), "machine": platform.machine(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
