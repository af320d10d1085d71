"""Starts an engine server as a supervised process group and returns it only once it has answered a real request.

The model load is the flaky step (long loads, servers that exit half-way, servers that say "ready" and then
never answer), so every launch is: free port -> guarded process group -> health polling with a deadline that
grows with the checkpoint size -> a watchdog on log progress -> a first real request -> retries with
exponential backoff and jitter. Logs go to a local file and, when a store is given, to the store.
"""
from __future__ import annotations

import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from draftline.config import ServerSettings
from draftline.errors import EngineError

LOG_TAIL_LINES = 40
# Run by path: the guard needs only the standard library, so it works even where draftline is not installed.
GUARD = Path(__file__).with_name("guard.py")
POLL_S = 0.5

logger = logging.getLogger(__name__)
EXIT_SETTLE_S = 5.0  # how long a server whose requests broke off is given to exit before it counts as running
LOADING_REPORT_S = 30.0  # how often a load in progress is reported


@dataclass
class ServerSpec:
    """What to start and how to know it works; the engine adapters build one of these."""

    name: str  # e.g. "vllm-eagle3": used for log names and error messages
    command: Callable[[int], list[str]]  # port -> argv
    first_request: Callable[[str, float], None]  # (base_url, timeout_s) -> None, raises on a bad answer
    health_path: str = "/health"
    env: dict[str, str] = field(default_factory=dict)
    checkpoint_bytes: int = 0  # size of what the server loads; stretches the readiness deadline
    max_port: int = 65535  # an engine that derives more ports from its own (SGLang: port + 10000) needs room above


def free_port(max_port: int = 65535) -> int:
    """A local port nothing listens on, at most max_port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if port <= max_port:
        return port
    # The kernel's ephemeral range (often 32768-60999) can lie above max_port: try ports below it instead.
    for _ in range(500):
        port = random.randint(min(20000, max_port), max_port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise EngineError(f"no free local port at or below {max_port}", transient=True)


def checkpoint_size(*paths: str | os.PathLike | None) -> int:
    """Bytes of model weights under the given directories (what a load has to read)."""
    total = 0
    for p in paths:
        if p is None:
            continue
        root = Path(p)
        if root.is_file():
            total += root.stat().st_size
            continue
        for f in root.rglob("*"):
            if f.is_file() and f.suffix in {".safetensors", ".bin", ".pt", ".gguf"}:
                total += f.stat().st_size
    return total


def ready_timeout(cfg: ServerSettings, checkpoint_bytes: int) -> float:
    return cfg.ready_timeout_s + cfg.ready_timeout_s_per_gb * checkpoint_bytes / 1e9


# An exception line as Python prints it, alone or after a log prefix: "(EngineCore pid=12) ValueError: ..." or
# vLLM's worker lines "(Worker pid=7) ERROR 12-02 03:26:37 [multiproc_executor.py:953] AttributeError: ...".
_EXCEPTION_LINE = re.compile(r"(?:^|[)\]]\s)((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)): (.+)$")
_ARGPARSE_LINE = re.compile(r"^[\w.-]+: error: (.+)$")
# A bare exception line (an `assert` without a message): the traceback's last frame says what failed.
_BARE_EXCEPTION_LINE = re.compile(r"(?:^|[)\]]\s)((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception))$")
_FRAME_LINE = re.compile(r'File "(?:[^"]*?/)?((?:vllm|sglang|draftline|torch|transformers)/[^"]+|[^"/]+)", '
                         r'line (\d+), in (\w+)')
# Wrappers that only point at the real error printed before them.
_WRAPPERS = ("See root cause above", "Engine core initialization failed", "Worker failed with error",
             "died unexpectedly", "exited with")
# Exception types that say a load will fail the same way every time: bad input or an unsupported combination.
_DETERMINISTIC = ("ValueError", "ValidationError", "NotImplementedError", "TypeError", "KeyError", "AttributeError",
                  "AssertionError", "ImportError", "ModuleNotFoundError", "FileNotFoundError", "OSError", "ConfigError")
# ... except these messages, which come from the machine's state at that moment and clear on a later start: memory
# still held by a server that just stopped, a port taken between choosing it and binding it.
_PASSING = ("Free memory on device", "out of memory", "Address already in use", "Errno 98", "Connection refused")


def root_cause(log_text: str) -> tuple[str, bool] | None:
    """The engine's own sentence on why it failed (the last exception line of its log that is not a wrapper around an
    earlier one) and whether that kind of error repeats on every attempt; None when the log names no exception."""
    found, detail = None, ""
    lines = log_text.replace("\r", "\n").splitlines()
    for n, line in enumerate(lines):
        m = _EXCEPTION_LINE.search(line.strip())
        bare = None if m else _BARE_EXCEPTION_LINE.search(line.strip())
        if bare:
            found, detail = bare, _failed_frame(lines[max(0, n - 4):n])
            continue
        if m and not any(w in m.group(2) for w in _WRAPPERS):
            found, detail = m, ""
            # pydantic's "1 validation error for X" gives the reason on the next, indented line
            if re.match(r"\d+ validation errors? for ", m.group(2)) and n + 1 < len(lines):
                nxt = re.sub(r"^\([^)]*pid=\d+\)\s*", "", lines[n + 1].strip())
                detail = " " + nxt.split(" [type=", 1)[0]
    if found is None:
        # An engine refusing its command line prints argparse's "prog: error: ..." and exits 2: the same every time.
        refused = next((m for m in map(_ARGPARSE_LINE.match, reversed(lines)) if m), None)
        return (f"the engine refused its command line: {refused.group(1)}", True) if refused else None
    kind = found.group(1).rsplit(".", 1)[-1]
    message = f"{kind}: {found.group(2).strip()}{detail}" if found.re is _EXCEPTION_LINE else f"{kind}{detail}"
    return message, kind in _DETERMINISTIC and not any(p in message for p in _PASSING)


def _failed_frame(before: list[str]) -> str:
    """' at vllm/x.py:109 in make_dummy: assert 0 < n' from the traceback lines just above a bare exception line."""
    for i in range(len(before) - 1, -1, -1):
        frame = _FRAME_LINE.search(before[i])
        if frame:
            code = next((_strip_prefix(c) for c in before[i + 1:] if _strip_prefix(c) and
                         set(_strip_prefix(c)) - set("^~ ")), "")
            return f" at {frame.group(1)}:{frame.group(2)} in {frame.group(3)}" + (f": {code}" if code else "")
    return " (no message)"


def _strip_prefix(line: str) -> str:
    """A log line without vLLM's process and logger prefixes."""
    return re.sub(r"^\([^)]*pid=\d+\)\s*(?:[A-Z]+ [\d-]+ [\d:]+ \[[^\]]+\])?", "", line).strip()


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.replace("\r", "\n").splitlines()[-lines:])


def group_alive(pgid: int) -> bool:
    """True while any process of the group exists (zombies excluded, since they hold no resources)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class EngineServer:
    """A running, answering engine server; stop() (or leaving the `with` block) kills its whole process group."""

    def __init__(self, spec: ServerSpec, port: int, proc: subprocess.Popen, pipe_w: int, log_path: Path,
                 store=None, log_key: str | None = None):
        self.spec = spec
        self.port = port
        self.proc = proc
        self.pgid = proc.pid  # the guard leads its own session and process group
        self._pipe_w = pipe_w
        self.log_path = log_path
        self._store = store
        self._log_key = log_key
        self.stopped = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        if self.stopped:
            return
        self.stopped = True
        _kill_group(self.proc, self.pgid, grace_s)
        try:
            os.close(self._pipe_w)
        except OSError:
            pass
        _upload_log(self._store, self._log_key, self.log_path)

    def __enter__(self) -> "EngineServer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        failure = self.failure_while_serving(exc) if exc is not None else None
        self.stop()
        if failure is not None:
            raise failure from exc

    def failure_while_serving(self, exc: BaseException) -> EngineError | None:
        """What a request that failed while this server was serving comes down to: the server's exit and its log's
        root cause, or, for a raw connection error from a server still running, that error named; None where the
        error already says it all (bad input, a refusal with the engine's own message, an interrupt)."""
        if not isinstance(exc, (httpx.HTTPError, EngineError)) or (isinstance(exc, EngineError) and not exc.transient):
            return None
        deadline = time.monotonic() + EXIT_SETTLE_S  # a dying server drops its connections just before it exits
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        code = self.proc.poll()
        said = str(exc).split("\n", 1)[0]
        if code is None:
            if isinstance(exc, EngineError):
                return None
            return EngineError(f"{self.spec.name} stopped answering while still running ({type(exc).__name__}: "
                               f"{said})", log_tail(self.log_path), transient=True)
        cause = root_cause(self.log_path.read_text(errors="replace")) if self.log_path.exists() else None
        return EngineError(f"{self.spec.name} exited with status {code} while serving"
                           + (f": {cause[0]}" if cause else _exit_signal(code))
                           + f" (the request saw {type(exc).__name__}: {said})",
                           log_tail(self.log_path), transient=not (cause and cause[1]))

    def __del__(self):  # last resort: never leave a server behind when a caller forgets stop()
        if not getattr(self, "stopped", True):
            try:
                self.stop(grace_s=2.0)
            except Exception:
                pass


def _exit_signal(code: int) -> str:
    """' (killed by SIGKILL ...)' for the guard's 128 + signal exit statuses, else ''."""
    if not 128 < code < 128 + 65:
        return ""
    try:
        name = signal.Signals(code - 128).name
    except ValueError:
        name = f"signal {code - 128}"
    why = ", which the kernel's out-of-memory killer sends" if code - 128 == signal.SIGKILL else ""
    return f" (killed by {name}{why})"


def _kill_group(proc: subprocess.Popen, pgid: int, grace_s: float) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and group_alive(pgid):
        proc.poll()
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _upload_log(store, key: str | None, path: Path) -> None:
    if store is None or key is None or not path.exists():
        return
    try:
        store.put_file(key, path)
    except Exception as exc:  # a log upload must never hide the engine's own outcome
        print(f"draftline: could not upload engine log {path} to {key}: {exc}", file=sys.stderr)


def _start_once(spec: ServerSpec, cfg: ServerSettings, log_path: Path, store, log_key: str | None) -> EngineServer:
    port = free_port(spec.max_port)
    argv = spec.command(port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **cfg.env, **spec.env, "PYTHONUNBUFFERED": "1"}
    pipe_r, pipe_w = os.pipe()  # both ends close-on-exec; only the guard receives the read end
    with open(log_path, "wb") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        if spec.env:  # what draftline set for this server beyond the worker's environment
            log.write(("# env: " + " ".join(f"{k}={v}" for k, v in spec.env.items()) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, str(GUARD), str(pipe_r), "--", *argv],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, pass_fds=(pipe_r,),
        )
    os.close(pipe_r)
    server = EngineServer(spec, port, proc, pipe_w, log_path, store, log_key)
    started = time.monotonic()
    logger.info("%s: loading on port %d (%.2f GB of weights; its log: %s)", spec.name, port, spec.checkpoint_bytes / 1e9,
             log_path)
    try:
        _wait_ready(server, cfg)
        logger.info("%s: healthy after %.0f s; sending a first request", spec.name, time.monotonic() - started)
        spec.first_request(server.base_url, cfg.first_request_timeout_s)
        logger.info("%s: ready after %.0f s", spec.name, time.monotonic() - started)
    except EngineError:
        server.stop(grace_s=5.0)
        raise
    except Exception as exc:
        tail = log_tail(log_path)  # before stopping: shutdown chatter would bury the cause
        server.stop(grace_s=5.0)
        raise EngineError(
            f"{spec.name} reported healthy on port {port} but its first request failed within "
            f"{cfg.first_request_timeout_s:.0f} s ({type(exc).__name__}: {exc}); the server is stuck or broken",
            tail,
        ) from exc
    return server


def _wait_ready(server: EngineServer, cfg: ServerSettings) -> None:
    spec = server.spec
    limit = ready_timeout(cfg, spec.checkpoint_bytes)
    start = time.monotonic()
    last_size, last_progress, last_report = -1, start, start
    url = server.base_url + spec.health_path
    with httpx.Client(timeout=5.0) as client:
        while True:
            now = time.monotonic()
            code = server.proc.poll()
            if code is not None:
                cause = root_cause(server.log_path.read_text(errors="replace")) if server.log_path.exists() else None
                raise EngineError(f"{spec.name} exited with status {code} while loading"
                                  + (f": {cause[0]}" if cause else ""), log_tail(server.log_path),
                                  transient=not (cause and cause[1]))
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            size = server.log_path.stat().st_size if server.log_path.exists() else 0
            if size != last_size:
                last_size, last_progress = size, now
            if now - last_report >= LOADING_REPORT_S:
                last_report = now
                last_line = log_tail(server.log_path, 1).strip()[:160]
                logger.info("%s: still loading after %.0f s; its log's last line: %s", spec.name, now - start, last_line)
            elif now - last_progress > cfg.no_progress_timeout_s:
                raise EngineError(
                    f"{spec.name} printed nothing for {cfg.no_progress_timeout_s:.0f} s while loading and was killed "
                    "(raise no_progress_timeout_s in this server's section, traces.vllm, extract.vllm or its "
                    "eval.engines entry, if this load is legitimately silent)",
                    log_tail(server.log_path),
                )
            if now - start > limit:
                raise EngineError(
                    f"{spec.name} was not ready after {limit:.0f} s (ready_timeout_s + ready_timeout_s_per_gb x "
                    f"{spec.checkpoint_bytes / 1e9:.2f} GB) and was killed",
                    log_tail(server.log_path),
                )
            time.sleep(POLL_S)


def backoff_delay(attempt: int, base_s: float, rng: random.Random) -> float:
    """Exponential backoff with full jitter on top: base x 2^attempt x U(1, 2)."""
    return base_s * (2 ** attempt) * (1.0 + rng.random())


def launch(spec: ServerSpec, cfg: ServerSettings, log_dir: str | os.PathLike, store=None,
           log_key_prefix: str | None = None, rng: random.Random | None = None,
           sleep: Callable[[float], None] = time.sleep) -> EngineServer:
    """Start the server, retrying failed loads; raise EngineError (with the last log tail) when all attempts fail."""
    rng = rng or random.Random()
    attempts = cfg.retries + 1
    errors: list[str] = []
    for attempt in range(attempts):
        log_path = Path(log_dir) / f"{spec.name}-attempt{attempt + 1}.log"
        log_key = f"{log_key_prefix}/{log_path.name}" if log_key_prefix else None
        try:
            return _start_once(spec, cfg, log_path, store, log_key)
        except EngineError as exc:
            _upload_log(store, log_key, log_path)
            errors.append(str(exc).split("\n", 1)[0])
            why = "" if exc.transient else " (not retried: the engine refused its input, which a new load would not change)"
            if exc.transient and len(errors) > 1 and errors[-1] == errors[-2]:
                exc.transient = False  # the same failure twice: a third load would only fail the same way again
                why = " (not retried further: the same failure twice)"
            if not exc.transient or attempt == attempts - 1:
                summary = "; ".join(f"attempt {i + 1}: {e}" for i, e in enumerate(errors))
                raise EngineError(f"{spec.name} failed to start after {attempt + 1} attempt(s){why}: {summary}",
                                  exc.log_tail, transient=exc.transient) from exc
            delay = backoff_delay(attempt, cfg.retry_backoff_s, rng)
            print(f"draftline: {spec.name} attempt {attempt + 1} failed ({errors[-1]}); retrying in {delay:.1f} s",
                  file=sys.stderr)
            sleep(delay)
    raise AssertionError("unreachable")
