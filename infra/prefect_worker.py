"""Start a Prefect worker only once the team's Prefect server has accepted this machine's auth string.

    PREFECT_API_URL=http://HOST:4200/api PREFECT_API_AUTH_STRING=user:password \\
        python infra/prefect_worker.py --pool gpu-vllm --type process [other `prefect worker start` options]

The server (PREFECT_SERVER_API_AUTH_STRING) answers every API request without the right string with 401. Prefect's
own worker then stops with a traceback, and a restart policy starts it again; this checks first and says in one
sentence what to fix (exit status 2), or replaces itself with `prefect worker start` and the options given.
Standard library only, so that it also runs in Prefect's stock image (the Kubernetes workers mount it).
"""
from __future__ import annotations

import base64
import os
import sys
import time
import urllib.error
import urllib.request

AUTH_VARIABLE = "PREFECT_API_AUTH_STRING"
# Exit statuses: the setting is wrong (a restart cannot help), the server did not answer in time.
BAD_SETTING, NO_SERVER = 2, 1


class Refused(Exception):
    """The check failed; the message is the one sentence to print, `code` the exit status."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _get(url: str, auth: str | None, timeout: float) -> int:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def check_server(environ: dict[str, str] | os._Environ = os.environ, wait_s: float = 180.0,
                 probe_timeout_s: float = 5.0) -> str | None:
    """Raise Refused unless the server at PREFECT_API_URL accepts PREFECT_API_AUTH_STRING; waits up to wait_s for a
    server that is still starting. Returns a warning when the server also answers without any auth string."""
    api = (environ.get("PREFECT_API_URL") or "").rstrip("/")
    if not api:
        raise Refused("PREFECT_API_URL is not set; set it to the team server's API URL, e.g. http://HOST:4200/api",
                      BAD_SETTING)
    auth = environ.get(AUTH_VARIABLE) or ""
    if not auth.strip():
        raise Refused(f"{AUTH_VARIABLE} is not set; a draftline worker sends the Prefect server's auth string "
                      f"(user:password, the server's PREFECT_SERVER_API_AUTH_STRING) from that variable", BAD_SETTING)
    url = f"{api}/admin/version"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            status = _get(url, auth, probe_timeout_s)
        except (OSError, ValueError) as exc:  # connection refused, DNS, timeout, a malformed URL
            status, last = None, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        if status == 401:
            raise Refused(f"the Prefect server at {api} refused the auth string (401 Unauthorized); check "
                          f"{AUTH_VARIABLE}: it must equal the server's PREFECT_SERVER_API_AUTH_STRING", BAD_SETTING)
        if status is not None and 200 <= status < 300:
            break
        if status == 404:
            raise Refused(f"{url} does not exist (404); check PREFECT_API_URL: it ends in /api", BAD_SETTING)
        if status is not None:
            last = f"HTTP {status}"
        if time.monotonic() > deadline:
            raise Refused(f"the Prefect server at {api} did not answer within {wait_s:.0f} s ({last}); check "
                          "PREFECT_API_URL and that the server runs", NO_SERVER)
        time.sleep(2.0)
    try:
        open_to_all = _get(url, None, probe_timeout_s) != 401
    except (OSError, ValueError):
        open_to_all = False
    if open_to_all:
        return (f"the Prefect server at {api} answers without an auth string, so anyone who reaches it can start "
                "runs; start it with PREFECT_SERVER_API_AUTH_STRING set")
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    wait_s = float(os.environ.get("DRAFTLINE_WORKER_WAIT_S", "180"))
    try:
        warning = check_server(wait_s=wait_s)
    except Refused as refused:
        print(f"draftline worker: {refused}", file=sys.stderr, flush=True)
        return refused.code
    if warning:
        print(f"draftline worker: warning: {warning}", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "prefect", "worker", "start", *argv])
    return 0  # not reached: execv replaced this process


if __name__ == "__main__":
    sys.exit(main())
