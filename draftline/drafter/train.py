"""Train an EAGLE-3 drafter with training-time test on hidden-state shards: resumable, warm-startable, DDP via torchrun."""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from draftline.config import DrafterConfig, TrainConfig
from draftline.drafter.data import (BatchStream, Cursor, collate, hidden_shard_entries, hidden_shard_keys, pack_rows,
                                    rank_rows, read_shard_metadata, read_shard_tensors, shard_sequences, split_shards)
from draftline.drafter.replay import replayed_acceptance
from draftline.drafter.model import (LINEAGE_FILE, MLA_ARCHITECTURE, Eagle3Config, Eagle3Drafter, config_aux_layer_ids,
                                     config_for_target, target_rope_theta)
from draftline.drafter.ttt import TTTModel, acceptance_length, loss_plan  # noqa: F401  (acceptance_length is re-exported)
from draftline.drafter.vocab import VocabReport, build_vocab, counts_from_hidden_shards
from draftline.errors import ConfigError
from draftline.progress import progress_step
from draftline.target import resolve_device

log = logging.getLogger("draftline.drafter.train")
# Validation sequences the final decode-schedule replay covers: enough for a stable mean, seconds on a CPU.
REPLAY_SEQUENCES = 128

STAGE = "train"


# ---- target weights ----------------------------------------------------------------------------------------
def load_target_head(target_dir) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(config dict, embed_tokens [V, H], lm_head [V, H]) read from the target's safetensors without loading the model."""
    from draftline.target import read_target_config, read_target_tensor, target_weight_map

    root = Path(target_dir)
    cfg = read_target_config(root)
    text_cfg = cfg.get("text_config", cfg)
    weight_map = target_weight_map(root)

    def tensor(suffix: str) -> torch.Tensor | None:
        names = sorted((k for k in weight_map if k.endswith(suffix) and "mtp" not in k), key=len)
        return read_target_tensor(root, names[0], weight_map) if names else None

    embed = tensor("embed_tokens.weight")
    head = tensor("lm_head.weight")
    if head is None and text_cfg.get("tie_word_embeddings", cfg.get("tie_word_embeddings")):
        head = embed
    if embed is None or head is None:
        raise ConfigError(f"target {root}: could not find embed_tokens.weight and lm_head.weight in its safetensors files")
    return text_cfg, embed, head


# ---- distributed helpers -----------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device_kind: str) -> Dist:
    """Join the torchrun process group when WORLD_SIZE > 1 (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def all_sum(x: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


def barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


# ---- schedule, checkpoints ---------------------------------------------------------------------------------------
def lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


# Not part of what is trained: cadence, and where (processes split each global batch, they do not change it).
_CADENCE_FIELDS = {"val_every", "checkpoint_every", "log_every", "num_threads", "device", "keep_checkpoints",
                   "processes"}


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


# ---- the run --------------------------------------------------------------------------------------------------
def train_device(kind: str) -> torch.device:
    """This process's device: under torchrun, the GPU of its local rank."""
    if resolve_device(kind, "train.device") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def prepare_vocab(store, prefix: str, train_keys: list[str], vocab_size: int, draft_vocab_size: int, d: Dist,
                  expected: dict | None = None):
    """d2t/t2d from the training shards, computed once (rank 0) and kept at `<prefix>/vocab.pt` for resumes and ranks."""
    key = f"{prefix}/vocab.pt"
    if d.main and not store.exists(key):
        counts = counts_from_hidden_shards(store, train_keys, vocab_size, expected)
        d2t, t2d, report = build_vocab(counts, draft_vocab_size)
        buf = io.BytesIO()
        torch.save({"d2t": d2t, "t2d": t2d, "report": report.to_dict()}, buf)
        store.put_bytes(key, buf.getvalue())
    barrier(d)
    saved = torch.load(io.BytesIO(store.get_bytes(key)), weights_only=True)
    report = VocabReport(**saved["report"])
    if report.draft_vocab_size != draft_vocab_size:
        raise ConfigError(
            f"{store.uri(key)} holds a draft vocabulary of {report.draft_vocab_size} ids but drafter.draft_vocab_size="
            f"{draft_vocab_size}; use a new run name or delete that file"
        )
    return saved["d2t"], saved["t2d"], report


# The head's layer shape a warm start takes from its source (a public drafter's heads, MLP width and RoPE), unless
# the drafter: section sets it; hidden size and vocabulary come from the target and must match the source's.
WARM_START_SHAPE = ("intermediate_size", "num_attention_heads", "num_key_value_heads")


def warm_start_config(source: str, target_cfg: dict, drafter_cfg: DrafterConfig, aux_ids: list[int]) -> Eagle3Config:
    """This run's head for a warm start: the target's sizes and this run's aux ids, the source's layer shape."""
    from dataclasses import replace

    cfg_path = Path(source) / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"train.warm_start={source} has no config.json; point it at a drafter directory in the "
                          "SGLang/EAGLE format")
    theirs = json.loads(cfg_path.read_text())
    theirs_mla = MLA_ARCHITECTURE in (theirs.get("architectures") or [])
    if theirs_mla != (drafter_cfg.attention == "mla"):
        kind = "an MLA head" if theirs_mla else "a Llama-layer head"
        raise ConfigError(f"train.warm_start={source} is {kind} but drafter.attention is {drafter_cfg.attention}; set "
                          f"drafter.attention to {'mla' if theirs_mla else 'llama'} or train from scratch")
    text = target_cfg.get("text_config", target_cfg)
    for name, target_value in (("hidden_size", text.get("hidden_size")), ("vocab_size", text.get("vocab_size"))):
        if theirs.get(name) is not None and theirs[name] != target_value:
            raise ConfigError(f"warm start {source} has {name}={theirs[name]} but this drafter needs {target_value} "
                              "(the target's); start from a drafter made for the same target, or train from scratch")
    for name in WARM_START_SHAPE:
        ours = getattr(drafter_cfg, name)
        if ours is not None and theirs.get(name) is not None and ours != theirs[name]:
            raise ConfigError(f"drafter.{name}={ours} but the warm start {source} has {theirs[name]}; remove "
                              f"drafter.{name} to take the warm start's, or train from scratch")
    shaped = drafter_cfg.model_copy(update={n: getattr(drafter_cfg, n) or theirs.get(n) for n in WARM_START_SHAPE})
    cfg = config_for_target(target_cfg, shaped, aux_ids)
    return replace(cfg, head_dim=int(theirs.get("head_dim") or cfg.head_dim),
                   rms_norm_eps=float(theirs.get("rms_norm_eps", cfg.rms_norm_eps)),
                   rope_theta=target_rope_theta({"rope_theta": cfg.rope_theta, **theirs}),  # the target's if unnamed
                   max_position_embeddings=int(theirs.get("max_position_embeddings", cfg.max_position_embeddings)))


def warm_start(model: Eagle3Drafter, source: str, embed: torch.Tensor, remap: bool, target_cfg: dict) -> dict:
    """Copy weights from an existing SGLang/EAGLE drafter dir; its vocabulary replaces ours unless `remap`. A drafter
    without draftline.json has its ids read as SGLang reads them for this target; one that names no ids (many public
    drafters) starts this run's layers, and the record says so."""
    from draftline.target import sglang_convention

    old = Eagle3Drafter.from_pretrained(source, convention=sglang_convention(target_cfg), embed_tokens=embed,
                                        assume_aux_layer_ids=model.config.aux_layer_ids)
    ours, theirs = model.config, old.config
    named = config_aux_layer_ids(json.loads((Path(source) / "config.json").read_text())) is not None
    for name in ("hidden_size", "target_hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size"):
        if getattr(ours, name) != getattr(theirs, name):
            raise ConfigError(
                f"warm start {source} has {name}={getattr(theirs, name)} but this drafter needs {getattr(ours, name)}; "
                "start from a drafter made for the same target, or train from scratch"
            )
    if named and sorted(theirs.aux_layer_ids) != sorted(ours.aux_layer_ids):
        raise ConfigError(
            f"warm start {source} reads aux layers {theirs.aux_layer_ids} (vLLM convention) but the hidden states were "
            f"extracted at {ours.aux_layer_ids}; extract with extract.aux_layer_ids={theirs.aux_layer_ids}"
        )
    state = {k: v for k, v in old.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")}
    model.load_state_dict(state, strict=False)
    if theirs.draft_vocab_size != ours.draft_vocab_size and not remap:
        raise ConfigError(
            f"warm start {source} has draft_vocab_size={theirs.draft_vocab_size} but drafter.draft_vocab_size="
            f"{ours.draft_vocab_size}; set them equal, or set train.warm_start_remap_vocab=true to map lm_head rows by token"
        )
    record = {"source": str(source),
              "aux_layer_ids": (f"as trained here, {ours.aux_layer_ids}" if named else
                                f"not named by the source; its weights start this run's layers {ours.aux_layer_ids}")}
    with torch.no_grad():
        if not remap:
            model.set_vocab(old.d2t, old.t2d)
            model.lm_head.weight.copy_(old.lm_head.weight)
            return {**record, "vocab": "kept from the warm start", "rows_copied": theirs.draft_vocab_size}
        # Remap: rows of tokens both vocabularies share are copied; the others keep their fresh initialisation.
        old_row = torch.full((ours.vocab_size,), -1, dtype=torch.long)
        old_row[old.draft_token_ids] = torch.arange(theirs.draft_vocab_size)
        src = old_row[model.draft_token_ids.cpu()]
        hit = src >= 0
        model.lm_head.weight[hit] = old.lm_head.weight[src[hit]].to(model.lm_head.weight.dtype)
    return {**record, "vocab": "remapped to this run's", "rows_copied": int(hit.sum())}


def train_drafter(store, run: str, target_dir, drafter_cfg: DrafterConfig | None = None,
                  cfg: TrainConfig | None = None, out_prefix: str | None = None) -> dict:
    """Train on `<run>/hidden/` shards; checkpoints, metrics and the final drafter go to `<run>/train/`.

    Resumes from the last checkpoint there when one exists. Returns the metrics summary (also at metrics.json).
    """
    drafter_cfg = drafter_cfg or DrafterConfig()
    cfg = cfg or TrainConfig()
    prefix = out_prefix or f"{run}/{STAGE}"
    device = train_device(cfg.device)
    d = init_distributed(device.type)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    keys = hidden_shard_keys(store, run)
    entries = hidden_shard_entries(store, run, keys)  # every shard is checked against these before it is used
    train_keys, val_keys = split_shards(keys, cfg.val_fraction)
    meta = read_shard_metadata(store, keys[0])
    if meta.get("convention", "vllm") != "vllm":
        raise ConfigError(f"{store.uri(keys[0])} says convention={meta.get('convention')!r}; shards must store vLLM ids")
    aux_ids = json.loads(meta["aux_layer_ids"])

    target_cfg, embed, head = load_target_head(target_dir)
    torch.manual_seed(cfg.seed)
    model = (Eagle3Drafter(warm_start_config(cfg.warm_start, target_cfg, drafter_cfg, aux_ids)) if cfg.warm_start
             else Eagle3Drafter.from_target_config(target_cfg, drafter_cfg, aux_ids))
    model.load_target_weights(embed)
    d2t, t2d, vocab_report = prepare_vocab(store, prefix, train_keys, model.config.vocab_size,
                                           model.config.draft_vocab_size, d, entries)
    model.set_vocab(d2t, t2d)
    warm = warm_start(model, cfg.warm_start, embed, cfg.warm_start_remap_vocab, target_cfg) if cfg.warm_start else None
    if d.main:
        log.info(vocab_report.message)
    model.to(device)

    attention = cfg.attention if cfg.attention != "auto" else ("flex" if device.type == "cuda" else "eager")
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ttt = TTTModel(model, head.to(device), cfg.ttt_steps, cfg.logits_chunk_tokens, attention, compute_dtype)
    # Compiled flex attention recompiles for every new sequence length (and gives up after a few): one length for
    # all batches. Padding attends to itself only, so it costs no attention between padding blocks.
    fixed_length = cfg.max_seq_len if attention == "flex" else None
    net = ttt
    if d.world > 1:
        net = nn.parallel.DistributedDataParallel(
            ttt, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                                  **({"fused": True} if device.type == "cuda" else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))

    # The shards' contents, not only their names: re-extracted shards (another storage, another target) start over.
    fingerprint = run_fingerprint(drafter_cfg, cfg, aux_ids, [[k, entries[k].sha256 if k in entries else None]
                                                              for k in keys])
    step, cursor, history, resumed_from = 0, Cursor(), {"train": [], "val": []}, None
    latest = latest_checkpoint(store, prefix)
    if latest is not None:
        if latest["fingerprint"] != fingerprint:
            raise ConfigError(
                f"{store.uri(latest['key'])} was written by a run with another config or data; "
                f"use a new run name, or delete {store.uri(_ckpt_dir(prefix))} to start over"
            )
        state = torch.load(io.BytesIO(store.get_bytes(latest["key"])), map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], device)
        step, cursor, history = state["step"], Cursor(**state["cursor"]), state["history"]
        resumed_from = step
        if d.main:
            log.info("resumed from %s at step %d", store.uri(latest["key"]), step)

    stream = BatchStream(store, train_keys, cfg.tokens_per_batch, cfg.max_seq_len, cfg.seed, cursor=cursor,
                         expected=entries)
    aux_width, hidden = 3 * model.config.target_hidden_size, model.config.target_hidden_size
    weights = torch.tensor([cfg.step_weight_decay ** j for j in range(cfg.ttt_steps)], device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    t0, tokens_seen = time.perf_counter(), 0

    def to_device(batch: dict) -> dict:
        """The collated batch and its loss plan (made here, on the host) on the device. From pinned memory on a GPU:
        a copy from pageable memory waits for the device to finish all queued work first."""
        batch = dict(batch, plan=loss_plan(batch["loss_mask"], batch["doc_ids"], cfg.ttt_steps))
        if device.type == "cuda":
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    def validate() -> dict:
        ttt.eval()
        sums = torch.zeros(4, cfg.ttt_steps, device=device)
        vstream = BatchStream(store, val_keys, cfg.tokens_per_batch, cfg.max_seq_len, cfg.seed, shuffle=False, epochs=1,
                              expected=entries)
        try:
            with torch.no_grad(), autocast:
                while (vb := vstream.next_batch()) is not None:
                    rows = rank_rows(pack_rows(vb, cfg.max_seq_len), d.rank, d.world)
                    loss_sum, count, hit, total = ttt(**to_device(collate(rows, aux_width, hidden, fixed_length)))
                    sums += torch.stack([loss_sum.float(), count, hit, total])
        finally:
            vstream.close()
        sums = all_sum(sums, d)
        ttt.train()
        per_step_loss = (sums[0] / sums[1].clamp(min=1)).tolist()
        acc = (sums[2] / sums[3].clamp(min=1)).tolist()
        return {"step": step, "loss": float((weights * sums[0] / sums[1].clamp(min=1)).sum()),
                "per_step_loss": per_step_loss, "accuracy": acc, "acceptance_length": acceptance_length(acc),
                "tokens": int(sums[3][0])}

    def replay_validation() -> dict:
        """The decode-schedule estimate (draftline.drafter.replay) over the first REPLAY_SEQUENCES validation
        sequences: what the reference decoder will measure, where the per-step accuracies overstate it."""
        sequences: list = []
        for key in val_keys:
            sequences += shard_sequences(read_shard_tensors(store, key, expect=entries.get(key)), cfg.max_seq_len)
            if len(sequences) >= REPLAY_SEQUENCES:
                break
        # Eager attention: one sequence per forward, each of its own length, which compiled attention would recompile for.
        replay = TTTModel(ttt.drafter, ttt.target_lm_head, cfg.ttt_steps, cfg.logits_chunk_tokens, "eager",
                          compute_dtype).eval()
        try:
            with autocast:
                return replayed_acceptance(replay, sequences[:REPLAY_SEQUENCES], device)
        finally:
            ttt.train()

    def checkpoint() -> None:
        if d.main:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "rng": rng_state(device), "step": step,
                        "cursor": stream.cursor.to_dict(), "history": history, "fingerprint": fingerprint}, buf)
            key = f"{_ckpt_dir(prefix)}/step-{step:08d}.pt"
            store.put_bytes(key, buf.getvalue())
            store.put_bytes(f"{_ckpt_dir(prefix)}/latest.json",
                            json.dumps({"key": key, "step": step, "fingerprint": fingerprint}).encode())
            old = sorted(k for k in store.list(f"{_ckpt_dir(prefix)}/") if k.endswith(".pt") and k != key)
            for stale in old[: max(0, len(old) - (cfg.keep_checkpoints - 1))]:
                store.delete(stale)
            log.info("checkpoint %s", store.uri(key))
        barrier(d)

    pending: list[dict] = []  # the last step's figures, still on the device

    def record_pending() -> None:
        """The last step's figures into the history and the log. Read one step late, after the next step is
        queued: reading them at once would make the host wait for the device at every step, and the device
        would then idle while the host prepares and issues the next one."""
        while pending:
            p = pending.pop()
            entry = {"step": p["step"], "loss": float(p["loss"]), "lr": p["lr"], "grad_norm": float(p["grad_norm"]),
                     "accuracy": (p["stats"][1] / p["stats"][2].clamp(min=1)).tolist()}
            history["train"].append(entry)
            if d.main and (entry["step"] % cfg.log_every == 0 or entry["step"] == cfg.max_steps):
                elapsed = max(1e-9, time.perf_counter() - t0)  # the step is done: its figures are read
                # ETA from this process's own pace (steps since start or resume), validation pauses included.
                eta = (cfg.max_steps - entry["step"]) * elapsed / max(1, entry["step"] - (resumed_from or 0))
                log.info("step %d/%d loss %.4f acc0 %.3f lr %.2e %.0f tok/s, ETA %s", entry["step"], cfg.max_steps,
                         entry["loss"], entry["accuracy"][0], entry["lr"], p["tokens_seen"] / elapsed,
                         _duration(eta), extra=progress_step("training", entry["step"], cfg.max_steps))

    ttt.train()
    try:
        while step < cfg.max_steps:
            batch = stream.next_batch()
            rows = pack_rows(batch, cfg.max_seq_len)
            local = to_device(collate(rank_rows(rows, d.rank, d.world), aux_width, hidden, fixed_length))
            with autocast:
                loss_sum, count, hit, total = net(**local)
            stats = all_sum(torch.stack([count, hit.detach(), total]), d)
            # Each step's loss is its mean over the GLOBAL batch; DDP averages gradients, hence the * world.
            loss = (weights * loss_sum / stats[0].clamp(min=1)).sum() * d.world
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            record_pending()  # the step before this one, now that this one is queued
            step += 1
            tokens_seen += sum(len(s) for s in batch)
            pending.append({"step": step, "loss": all_sum(loss.detach() / d.world, d), "lr": scheduler.get_last_lr()[0],
                            "grad_norm": grad_norm, "stats": stats, "tokens_seen": tokens_seen})
            validating = bool(val_keys) and (step % cfg.val_every == 0 or step == cfg.max_steps)
            if validating or step % cfg.checkpoint_every == 0 or step == cfg.max_steps:
                record_pending()  # the log in step order, and a checkpoint holds the history up to its step
            if validating:
                v = validate()
                if d.main and step == cfg.max_steps:
                    v["replayed"] = replay_validation()
                history["val"].append(v)
                if d.main:
                    log.info("validation at step %d: loss %.4f accuracy %s acceptance length %.3f%s", step, v["loss"],
                             [round(a, 3) for a in v["accuracy"]], v["acceptance_length"],
                             f", replayed as decoding drafts {v['replayed']['acceptance_length']:.3f}"
                             if v.get("replayed", {}).get("acceptance_length") else "")
            if step % cfg.checkpoint_every == 0 or step == cfg.max_steps:
                checkpoint()
    finally:
        stream.close()

    summary = {"run": run, "steps": step, "final_train": history["train"][-1] if history["train"] else None,
               "final_val": history["val"][-1] if history["val"] else None, "vocab": vocab_report.to_dict(),
               "aux_layer_ids": aux_ids, "convention": "vllm", "warm_start": warm, "world_size": d.world, "resumed_from": resumed_from,
               "fingerprint": fingerprint, "train_shards": train_keys, "val_shards": val_keys,
               "history": history, "drafter": store.uri(f"{prefix}/drafter"), "weights_digest": weights_digest(model)}
    if d.main:
        publish_drafter(store, prefix, model, summary, target_dir, run)
        store.put_bytes(f"{prefix}/metrics.json", json.dumps(summary, indent=1).encode())
    barrier(d)
    return summary


def _duration(seconds: float) -> str:
    """0:42, 12:05 or 1:02:05."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def weights_digest(model: nn.Module) -> str:
    """sha256 over every trained parameter's bytes: equal digests mean bitwise-equal weights."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def publish_drafter(store, prefix: str, model: Eagle3Drafter, summary: dict, target_dir, run: str) -> None:
    """The trained head in the SGLang/EAGLE layout at `<prefix>/drafter/`, with a lineage file."""
    from draftline.target import read_target_config, sglang_convention, target_fingerprint

    with tempfile.TemporaryDirectory(prefix="draftline-drafter-") as tmp:
        convention = sglang_convention(read_target_config(target_dir))
        model.save_pretrained(tmp, convention=convention)
        lineage = {"convention": convention, "format": "sglang", "target": str(target_dir),
                   "target_fingerprint": target_fingerprint(target_dir), "run": run,
                   "training": {k: summary[k] for k in ("steps", "fingerprint", "world_size", "warm_start")},
                   "data": {"train_shards": summary["train_shards"], "val_shards": summary["val_shards"]},
                   "aux_layer_ids_vllm": model.config.aux_layer_ids,
                   "target_num_layers": model.config.target_num_layers, "code_version": code_version()}
        Path(tmp, LINEAGE_FILE).write_text(json.dumps(lineage, indent=2) + "\n")
        store.put_dir(f"{prefix}/drafter", tmp)


def code_version() -> str:
    """draftline's version plus the git commit when run from a checkout."""
    import subprocess

    import draftline

    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{draftline.__version__}+{sha}" if sha else draftline.__version__


def main(argv: list[str] | None = None) -> int:
    """`python -m draftline.drafter.train CONFIG.yaml` (or under torchrun) trains the drafter of a pipeline config."""
    from draftline.config import load_config
    from draftline.store import open_store

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("config", help="pipeline YAML (run, store, target, drafter, train)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    cfg = load_config(args.config)
    store = open_store(cfg.store.root)
    try:
        summary = train_drafter(store, cfg.run, cfg.target.path, cfg.drafter, cfg.train)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: summary[k] for k in ("steps", "final_val", "drafter")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
