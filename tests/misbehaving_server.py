"""A tiny HTTP server that misbehaves the way real engine loads do, to test our supervisor (not a stand-in for vLLM).

Modes: ok (loads, serves), exit-then-ok (exits during its first load, serves on the next), crash (exits during
every load), fatal (exits during every load with a Python ValueError, as an engine refusing its input does), hang (prints one line then goes silent without ever becoming healthy), mute (healthy, but never
answers a completion), die-serving (answers its first completion, then prints an engine's error and exits in the
middle of the next), killed-serving (the same, but SIGKILLed as the out-of-memory killer does), drop-posts (serves
/health and /v1/models, and closes every POST's connection without an answer), drop-first-post (the same for its
first POST only, then answers each with token ids).
Every mode starts a grandchild process, so tests can check that the whole process group dies.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", choices=["ok", "exit-then-ok", "crash", "fatal", "hang", "mute", "die-serving",
                                           "killed-serving", "drop-posts",
                                           "drop-first-post"], default="ok")
    ap.add_argument("--marker", help="exit-then-ok: this file's existence means 'the first attempt already ran'")
    ap.add_argument("--pids", help="append this process's and its grandchild's pids here (JSON lines)")
    ap.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM, so only SIGKILL ends it")
    args = ap.parse_args()

    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    if args.pids:
        with open(args.pids, "a") as f:
            f.write(json.dumps({"server": os.getpid(), "worker": worker.pid, "pgid": os.getpgrp()}) + "\n")

    print("loading weights", flush=True)
    if args.mode == "crash" or (args.mode == "exit-then-ok" and not os.path.exists(args.marker)):
        open(args.marker, "w").close()
        print("simulated crash during load", flush=True)
        sys.exit(3)
    if args.mode == "fatal":
        print("(EngineCore pid=7) Traceback (most recent call last):", flush=True)
        print("(EngineCore pid=7) ValueError: head size 72 is not supported by this attention backend", flush=True)
        print("(APIServer pid=6) RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
        sys.exit(1)
    if args.mode == "hang":
        while True:
            time.sleep(3600)

    mode = args.mode
    answered = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                self._json(200, {"data": [{"id": "misbehaving"}]})
            else:
                self._json(200 if self.path == "/health" else 404, {})

        def do_POST(self):
            length = int(self.headers.get("Content-Length", 0))
            self.rfile.read(length)
            if mode == "mute":
                time.sleep(3600)
            if mode == "drop-posts" or (mode == "drop-first-post" and not answered):
                answered.append(0)
                self.close_connection = True
                return
            answered.append(1)
            if mode in ("die-serving", "killed-serving") and len(answered) > 1:
                if mode == "killed-serving":
                    os.kill(os.getpid(), signal.SIGKILL)
                print("(EngineCore pid=7) Traceback (most recent call last):", flush=True)
                print("(EngineCore pid=7) RuntimeError: CPU out of memory while allocating the KV cache", flush=True)
                os._exit(1)  # the connection drops without an answer, as a crashing engine's does
            self._json(200, {"choices": [{"text": "x", "token_ids": [11, 12, 13]}], "usage": {"completion_tokens": 3}})

    print("ready", flush=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
