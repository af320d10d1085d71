"""Train an EAGLE-3 drafter with training-time test on hidden-state shards: resumable, warm-startable, DDP via torchrun."""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import math
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from draftline.aux_ids import VLLM, sglang_convention
from draftline.config import DrafterConfig, TrainConfig
from draftline.drafter.checkpoint import (load_latest_checkpoint, rng_state, run_fingerprint, save_checkpoint,
                                          set_rng_state)
from draftline.drafter.data import BatchStream, Cursor, collate, pack_rows, part_sequences, rank_rows
from draftline.drafter.training_data import TrainingData, shard_training_data
from draftline.drafter.eagle_format import LINEAGE_FILE, save_eagle_dir
from draftline.drafter.model import Eagle3Drafter
from draftline.drafter.replay import replayed_acceptance, replayed_summary
from draftline.drafter.target_sizing import drafter_for_target
from draftline.drafter.ttt import TTTModel, acceptance_length, loss_plan
from draftline.drafter.vocab import VocabReport, build_vocab
from draftline.drafter.warm_start import warm_start, warm_start_config
from draftline.errors import ConfigError
from draftline.layout import train_prefix, trained_drafter_in, training_record_in
from draftline.progress import progress_step
from draftline.target import resolve_device

log = logging.getLogger("draftline.drafter.train")
# Validation sequences the final decode-schedule replay covers: enough for a stable mean, seconds on a CPU.
REPLAY_SEQUENCES = 128


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


def _no_buffer_sync() -> dict:
    """DDP's flag that skips syncing buffers each forward (they are the same on every rank): torch 2.13 renamed it
    and warns at the old name."""
    import inspect

    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def exit_rank(code: int) -> None:
    """End a torchrun rank: leave the process group, flush, and exit without the interpreter's teardown.

    DDP's reducer keeps the process group alive past destroy_process_group, so gloo's worker threads outlive the
    interpreter; one still releasing a finished collective's tensors while the interpreter tears down aborts the
    process (SIGABRT, "terminate called without an active exception") after every result was written. Outside
    torchrun this returns without exiting."""
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- schedule ---------------------------------------------------------------------------------------------------
def lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


# ---- the run --------------------------------------------------------------------------------------------------
def train_device(kind: str, devices: list[int] | None = None) -> torch.device:
    """This process's device: under torchrun, the GPU of its local rank (torchrun's ranks see only `devices`); alone,
    the first of `devices` (online training's trainer_devices), else GPU 0."""
    if resolve_device(kind, "train.device") == "cuda":
        if devices and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return torch.device("cuda", devices[0])
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def prepare_vocab(store, prefix: str, token_counts, vocab_size: int, draft_vocab_size: int, d: Dist):
    """d2t/t2d from the training tokens' counts (token_counts(vocab_size)), computed once (rank 0) and kept at
    `<prefix>/vocab.pt` for resumes and ranks."""
    key = f"{prefix}/vocab.pt"
    if d.main and not store.exists(key):
        counts = token_counts(vocab_size)
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


def train_drafter(store, run: str, target_dir, drafter_cfg: DrafterConfig | None = None,
                  cfg: TrainConfig | None = None, out_prefix: str | None = None,
                  replay_answer_tokens: int | None = None, data: TrainingData | None = None) -> dict:
    """Train on `<run>/hidden/` shards (or on `data`, e.g. an engine's states: draftline.online); checkpoints, metrics
    and the final drafter go to `<run>/train/`.

    replay_answer_tokens: the replayed estimate reads each validation answer's first that many tokens, the length the
    evaluation decodes (eval.max_new_tokens): later positions of long answers are easier to draft (on the demo the
    whole answers read 4.5% above their first 64 tokens), so whole answers overstate a shorter decode.

    Resumes from the last checkpoint there when one exists. Returns the metrics summary (also at metrics.json).
    """
    drafter_cfg = drafter_cfg or DrafterConfig()
    cfg = cfg or TrainConfig()
    prefix = out_prefix or train_prefix(run)
    device = train_device(cfg.device, cfg.online.trainer_devices if cfg.source == "engine" else None)
    d = init_distributed(device.type)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    data = data or shard_training_data(store, run, cfg.val_fraction, cfg.tokens_per_batch, cfg.max_seq_len, cfg.seed)
    val_parts, entries, aux_ids = data.val_parts, data.expected, data.aux_ids
    if d.main and val_parts:
        share = data.record.get("held_out_share")
        log.info("validation holds out the last %d sequences (%s of the tokens): %s", data.record["val_sequences"],
                 "?" if share is None else f"{share:.1%}", ", ".join(str(p) for p in val_parts))

    target_cfg, embed, head = load_target_head(target_dir)
    torch.manual_seed(cfg.seed)
    model = (Eagle3Drafter(warm_start_config(cfg.warm_start, target_cfg, drafter_cfg, aux_ids)) if cfg.warm_start
             else drafter_for_target(target_cfg, drafter_cfg, aux_ids))
    model.load_target_weights(embed)
    d2t, t2d, vocab_report = prepare_vocab(store, prefix, data.token_counts, model.config.vocab_size,
                                           model.config.draft_vocab_size, d)
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
            ttt, device_ids=[device.index] if device.type == "cuda" else None, **_no_buffer_sync())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                                  **({"fused": True} if device.type == "cuda" else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))

    fingerprint = run_fingerprint(drafter_cfg, cfg, aux_ids, data.identity)
    step, cursor, history, resumed_from = 0, Cursor(), {"train": [], "val": []}, None
    resumed = load_latest_checkpoint(store, prefix, fingerprint)
    if resumed is not None:
        latest_key, state = resumed
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], device)
        step, cursor, history = state["step"], Cursor(**state["cursor"]), state["history"]
        resumed_from = step
        if d.main:
            log.info("resumed from %s at step %d", store.uri(latest_key), step)

    stream = data.open_stream(cursor, d.rank, d.world, lambda: barrier(d), steps=cfg.max_steps - step)
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
        vstream = BatchStream(store, val_parts, cfg.tokens_per_batch, cfg.max_seq_len, cfg.seed, shuffle=False, epochs=1,
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
        for part in val_parts:
            sequences += part_sequences(store, part, cfg.max_seq_len, entries)
            if len(sequences) >= REPLAY_SEQUENCES:
                break
        # Eager attention: one sequence per forward, each of its own length, which compiled attention would recompile for.
        replay = TTTModel(ttt.drafter, ttt.target_lm_head, cfg.ttt_steps, cfg.logits_chunk_tokens, "eager",
                          compute_dtype).eval()
        try:
            with autocast:
                return {**replayed_acceptance(replay, sequences[:REPLAY_SEQUENCES], device, replay_answer_tokens),
                        "answer_tokens": replay_answer_tokens}
        finally:
            ttt.train()

    def checkpoint() -> None:
        if d.main:
            key = save_checkpoint(store, prefix, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": rng_state(device), "step": step, "cursor": stream.cursor.to_dict(), "history": history,
                "fingerprint": fingerprint}, cfg.keep_checkpoints)
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
            validating = bool(val_parts) and (step % cfg.val_every == 0 or step == cfg.max_steps)
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
                             replayed_summary(v.get("replayed") or {}))
            if step % cfg.checkpoint_every == 0 or step == cfg.max_steps:
                checkpoint()
    finally:
        stream.close()

    summary = {"run": run, "steps": step, "final_train": history["train"][-1] if history["train"] else None,
               "final_val": history["val"][-1] if history["val"] else None, "vocab": vocab_report.to_dict(),
               "aux_layer_ids": aux_ids, "convention": VLLM, "warm_start": warm, "world_size": d.world, "resumed_from": resumed_from,
               "tokens_trained": tokens_seen,  # by this process, since it started or resumed
               "fingerprint": fingerprint, "source": cfg.source, **data.record,
               "history": history, "drafter": store.uri(trained_drafter_in(prefix)), "weights_digest": weights_digest(model)}
    if d.main:
        publish_drafter(store, prefix, model, summary, target_dir, run)
        store.put_bytes(training_record_in(prefix), json.dumps(summary, indent=1).encode())
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
    from draftline.target import read_target_config, target_fingerprint

    with tempfile.TemporaryDirectory(prefix="draftline-drafter-") as tmp:
        convention = sglang_convention(read_target_config(target_dir))
        save_eagle_dir(model, tmp, convention=convention)
        lineage = {"convention": convention, "format": "sglang", "target": str(target_dir),
                   "target_fingerprint": target_fingerprint(target_dir), "run": run,
                   "training": {k: summary[k] for k in ("steps", "fingerprint", "world_size", "warm_start")},
                   "data": {"train_shards": summary["train_shards"], "val_shards": summary["val_shards"]},
                   "aux_layer_ids_vllm": model.config.aux_layer_ids,
                   "target_num_layers": model.config.target_num_layers, "code_version": code_version()}
        Path(tmp, LINEAGE_FILE).write_text(json.dumps(lineage, indent=2) + "\n")
        store.put_dir(trained_drafter_in(prefix), tmp)


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
    from draftline.config_loading import load_config
    from draftline.store import open_store

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("config", help="pipeline YAML (run, store, target, drafter, train)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    cfg = load_config(args.config)
    store = open_store(cfg.store.root)
    data = None
    if cfg.train.source == "engine":  # the engine side runs in the process that started torchrun
        from draftline.online.source import online_training_data

        data = online_training_data(cfg, store)
    try:
        summary = train_drafter(store, cfg.run, cfg.target.path, cfg.drafter, cfg.train,
                                replay_answer_tokens=cfg.eval.max_new_tokens, data=data)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: summary[k] for k in ("steps", "final_val", "drafter")}))
    exit_rank(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
