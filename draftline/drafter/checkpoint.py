"""Training checkpoints in the store: what a resume must agree with, writing and rotating them, loading the newest, and the RNG state they carry."""
from __future__ import annotations

import hashlib
import io
import json
import random

import torch

from draftline.config import DrafterConfig, TrainConfig
from draftline.errors import ConfigError

# Not part of what is trained: cadence, and where (processes split each global batch, they do not change it), and
# how an engine hands its states over (the source itself is part of the data's identity).
_CADENCE_FIELDS = {"val_every", "checkpoint_every", "log_every", "num_threads", "device", "keep_checkpoints",
                   "processes", "online", "source"}


def run_fingerprint(drafter_cfg: DrafterConfig, cfg: TrainConfig, aux_ids, data_keys) -> str:
    """What a checkpoint must agree with to be resumed (not logging or checkpoint cadence)."""
    spec = {"drafter": drafter_cfg.model_dump(), "aux": aux_ids, "data": data_keys,
            "train": {k: v for k, v in cfg.model_dump().items() if k not in _CADENCE_FIELDS}}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _ckpt_dir(prefix: str) -> str:
    return f"{prefix}/checkpoints"


def latest_checkpoint(store, prefix: str) -> dict | None:
    key = f"{_ckpt_dir(prefix)}/latest.json"
    return json.loads(store.get_bytes(key)) if store.exists(key) else None


def save_checkpoint(store, prefix: str, state: dict, keep: int) -> str:
    """Write state (which holds its step and fingerprint) as the newest checkpoint, point latest.json at it and delete
    the older ones beyond `keep`; returns its key."""
    buf = io.BytesIO()
    torch.save(state, buf)
    key = f"{_ckpt_dir(prefix)}/step-{state['step']:08d}.pt"
    store.put_bytes(key, buf.getvalue())
    store.put_bytes(f"{_ckpt_dir(prefix)}/latest.json",
                    json.dumps({"key": key, "step": state["step"], "fingerprint": state["fingerprint"]}).encode())
    old = sorted(k for k in store.list(f"{_ckpt_dir(prefix)}/") if k.endswith(".pt") and k != key)
    for stale in old[: max(0, len(old) - (keep - 1))]:
        store.delete(stale)
    return key


def load_latest_checkpoint(store, prefix: str, fingerprint: str) -> tuple[str, dict] | None:
    """(key, state) of the newest checkpoint under prefix, None when there is none; refused when a run with another
    fingerprint wrote it."""
    latest = latest_checkpoint(store, prefix)
    if latest is None:
        return None
    if latest["fingerprint"] != fingerprint:
        raise ConfigError(
            f"{store.uri(latest['key'])} was written by a run with another config or data; "
            f"use a new run name, or delete {store.uri(_ckpt_dir(prefix))} to start over"
        )
    return latest["key"], torch.load(io.BytesIO(store.get_bytes(latest["key"])), map_location="cpu",
                                     weights_only=False)


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
