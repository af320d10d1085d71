"""Does the memory the bytes come from, or writing over existing files, change the shard writers' speed?

8 shards of 1.07 GB through LocalStore.put_chunks, 6 threads, two repeats per source (the second writes over the
first's files). Needs a CUDA device (pinned memory). Run from the repository root: python3 benchmarks/probes/write_source.py
Figures (2026-12-01): benchmarks/log/2026-12-01-h200-extraction.md."""
import sys, time, shutil, tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import torch
sys.path.insert(0, ".")
from draftline.store import LocalStore

SHARD = 65536 * 16384
BLOCK = SHARD // 4
def run(label, sources, root):
    store = LocalStore(str(root))
    def one(i):
        store.put_chunks(f"s/shard-{i}.bin", [b.numpy() for b in sources[i]])
    for rep in range(2):
        t = time.perf_counter()
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(one, range(8)))
        dt = time.perf_counter() - t
        print(f"{label:40s} repeat {rep}: {8 * SHARD / dt / 1e9:.2f} GB/s", flush=True)
    shutil.rmtree(root)

with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    t = time.perf_counter()
    one = torch.randint(0, 256, (SHARD,), dtype=torch.uint8).pin_memory()
    run("one pinned buffer for every shard", [[one[j*BLOCK:(j+1)*BLOCK] for j in range(4)] for _ in range(8)], tmp / "a")
    distinct = [[torch.randint(0, 256, (BLOCK,), dtype=torch.uint8).pin_memory() for _ in range(4)] for _ in range(8)]
    print(f"pinned 8.6 GB in {time.perf_counter() - t:.1f} s", flush=True)
    run("32 distinct pinned buffers", distinct, tmp / "b")
    for shard in distinct:  # GPU writes into them first, as the extractor's copies do
        for b in shard:
            b.copy_(torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
    run("32 distinct pinned, filled by the GPU", distinct, tmp / "c")
    del distinct
    pageable = [[torch.randint(0, 256, (BLOCK,), dtype=torch.uint8) for _ in range(4)] for _ in range(8)]
    run("32 distinct pageable buffers", pageable, tmp / "d")
