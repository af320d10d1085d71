"""Fsync'd write bandwidth of 2 GB split over F files and S threads (os.pwrite, 8 MiB pieces): does one file take
parallel writers, or only several files? python3 benchmarks/probes/parallel_writes.py [FOLDER]
On the H200 machine (2026-12-01): one file 1.4-1.8 GB/s whatever the threads; 4 files 2.1-2.2; 8 files 2.4."""
import os, time, threading, sys
N = 2 << 30; CH = 8 << 20
buf = bytearray(os.urandom(CH))
folder = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
def run(files, streams):
    paths = [f"{folder}/pw-{i}.bin" for i in range(files)]
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for p in paths]
    per_file = N // files
    per_stream = N // streams
    spf = streams // files
    def one(s):
        fd = fds[s // spf]
        base = (s % spf) * per_stream
        for off in range(0, per_stream, CH):
            os.pwrite(fd, buf, base + off)
    t = time.perf_counter()
    ts = [threading.Thread(target=one, args=(s,)) for s in range(streams)]
    [x.start() for x in ts]; [x.join() for x in ts]
    w = time.perf_counter() - t
    for fd in fds: os.fsync(fd); os.close(fd)
    dt = time.perf_counter() - t
    for p in paths: os.unlink(p)
    return round(N / w / 1e9, 2), round(N / dt / 1e9, 2)
for files, streams in [(1,1),(1,4),(4,4),(1,8),(2,8),(8,8),(1,1),(1,4),(4,4),(1,8)]:
    print(files, "files", streams, "streams: written, fsynced GB/s", run(files, streams), flush=True)
