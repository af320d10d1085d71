"""infra/prefect_worker.py, the workers' start: a missing or refused Prefect auth string is one sentence and exit status 2
at once, never a traceback or a worker that keeps retrying. Against a stand-in that answers as the Prefect server's
auth middleware does (401 without the right `Authorization: Basic` header); tests/test_infra_local.py runs it against
the real server."""
from __future__ import annotations

import base64
import http.server
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "infra/prefect_worker.py"
sys.path.insert(0, str(REPO))
from infra.prefect_worker import Refused, check_server  # noqa: E402


def _server(required: str | None):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server name
            self.server.requests += 1
            given = self.headers.get("Authorization", "")
            ok = required is None or given == "Basic " + base64.b64encode(required.encode()).decode()
            body = b'"3.9.1"' if ok else b'{"exception_message":"Unauthorized"}'
            self.send_response(200 if ok else 401)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.requests = 0
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture
def httpd():
    httpd = _server("draftline:right")
    httpd.api = f"http://127.0.0.1:{httpd.server_address[1]}/api"
    yield httpd
    httpd.shutdown()


def _start(api: str, auth: str | None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PREFECT_API_URL": api, "DRAFTLINE_WORKER_WAIT_S": "600"}
    if auth is not None:
        env["PREFECT_API_AUTH_STRING"] = auth
    return subprocess.run([sys.executable, str(SCRIPT), "--pool", "cpu", "--type", "process"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_wrong_auth_string_is_one_sentence_naming_the_variable_and_the_worker_does_not_start(httpd):
    done = _start(httpd.api, "draftline:wrong")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line == (f"draftline worker: the Prefect server at {httpd.api} refused the auth string (401 Unauthorized); "
                    "check PREFECT_API_AUTH_STRING: it must equal the server's PREFECT_SERVER_API_AUTH_STRING")
    assert "draftline:wrong" not in done.stderr + done.stdout
    # Asked once and gave up: no retrying on a refusal (it waits only for a server that does not answer yet).
    assert httpd.requests == 1


def test_without_an_auth_string_the_worker_is_refused_before_it_asks_the_server(httpd):
    for auth in (None, "", "  "):
        done = _start(httpd.api, auth)
        assert done.returncode == 2
        (line,) = done.stderr.splitlines()
        assert line.startswith("draftline worker: PREFECT_API_AUTH_STRING is not set;")
    assert httpd.requests == 0


def test_the_right_auth_string_passes_and_an_open_server_is_named_as_such(httpd):
    assert check_server({"PREFECT_API_URL": httpd.api, "PREFECT_API_AUTH_STRING": "draftline:right"}, wait_s=5) is None

    open_server = _server(None)
    try:
        api = f"http://127.0.0.1:{open_server.server_address[1]}/api"
        warning = check_server({"PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": "any:thing"}, wait_s=5)
    finally:
        open_server.shutdown()
    assert "answers without an auth string" in warning and "PREFECT_SERVER_API_AUTH_STRING" in warning


def test_a_server_that_does_not_answer_is_waited_for_then_named():
    with pytest.raises(Refused, match=r"did not answer within 1 s .*check PREFECT_API_URL") as refused:
        check_server({"PREFECT_API_URL": "http://127.0.0.1:9/api", "PREFECT_API_AUTH_STRING": "a:b"}, wait_s=1)
    assert refused.value.code == 1
