"""What a capture request and draftline's vLLM connector agree on (the request's parameters, where the states land),
importable without vLLM: the process that sends the requests need not have it."""
from __future__ import annotations

import os
import re

KEY_PARAM = "draftline_key"
STORAGE_PARAM = "draftline_storage"
PATH_PARAM = "draftline_path"
_SAFE_KEY = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def spool_path(spool_dir: str, key: str) -> str:
    """Where the connector writes (and the client reads) the states of the request tagged `key`."""
    if not _SAFE_KEY.match(key):
        raise ValueError(f"{KEY_PARAM}={key!r} must be 1-200 letters, digits, '.', '_' or '-'")
    return os.path.join(spool_dir, f"{key}.safetensors")


def error_path(path: str) -> str:
    """Written instead of `path` when the connector could not write it; holds the reason."""
    return path + ".error"
