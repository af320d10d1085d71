"""Runs one engine command in its own process group and kills that whole group when the supervisor dies.

Started by launch.py as `python guard.py FD -- CMD...` in a new session. FD is the read end
of a pipe whose write end only the supervisor holds: the kernel closes it when the supervisor exits for any
reason (SIGKILL included), the read returns EOF, and the guard tears the group down. PR_SET_PDEATHSIG is not
used because it fires when the *thread* that spawned the child exits, which kills healthy servers started
from worker threads (Prefect runs sync tasks in threads).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

GRACE_S = 10.0


def _teardown(child: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM the whole group (engines spawn workers), wait for the main child, then SIGKILL what is left."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the guard must outlive its own group-wide SIGTERM
    try:
        os.killpg(0, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    # Give stragglers (engine worker processes) the rest of a short grace before the group-wide SIGKILL.
    time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    sys.stdout.flush()
    os.killpg(0, signal.SIGKILL)  # ends the guard too


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python guard.py FD -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    pipe_fd = int(argv[0])
    child = subprocess.Popen(argv[2:])  # inherits our process group, stdout and stderr (the log file)
    stop = threading.Event()

    def watch_supervisor() -> None:
        try:
            while os.read(pipe_fd, 1):
                pass
        except OSError:
            pass
        stop.set()

    threading.Thread(target=watch_supervisor, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.is_set():
        code = child.poll()
        if code is not None:
            # The server exited on its own: take its workers with it, then report its exit status.
            try:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                os.killpg(0, signal.SIGTERM)
            except ProcessLookupError:
                pass
            return code if code >= 0 else 128 - code
        stop.wait(0.2)
    _teardown(child)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
