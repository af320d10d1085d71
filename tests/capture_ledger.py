"""draftline's capture connector with a ledger: every rank that registers and every file any rank writes is recorded,
so a test can count each request's writes and see which rank made them.

Load it in vLLM with kv_connector LedgerConnector from this module and DRAFTLINE_CAPTURE_LEDGER naming the ledger file
in the server's environment. Each line is JSON: {"event": "register" | "write", "rank", "pid", "path"}. Lines are
appended with O_APPEND in one write each, so processes and threads never interleave them.
"""
from __future__ import annotations

import json
import os

from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from draftline.engines import vllm_capture
from draftline.engines.vllm_capture import DraftlineHiddenStatesConnector

LEDGER_ENV = "DRAFTLINE_CAPTURE_LEDGER"


def _record(event: str, path: str = "") -> None:
    line = json.dumps({"event": event, "rank": get_tensor_model_parallel_rank(), "pid": os.getpid(), "path": path})
    fd = os.open(os.environ[LEDGER_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


_write = vllm_capture._write


def _ledger_write(path, tensors, storage, copied) -> None:
    _record("write", path)
    _write(path, tensors, storage, copied)


# Every write of the connector's module goes through the ledger, whichever rank or thread makes it.
vllm_capture._write = _ledger_write


class LedgerConnector(DraftlineHiddenStatesConnector):
    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        _record("register")


def read_ledger(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
