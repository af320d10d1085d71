"""The reference stage: a drafter's ground-truth acceptance on a prompt set, with its speedup over plain decoding.

Runs draftline.speculative's decoder and plain decoding on the same prompts in one process, as the engines see
them (chat template, EOS ids), and optionally the same decode with the drafter fed neighbouring layers or in
another precision: what wrong aux-layer ids would cost on this target, and how far numerics alone move acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from draftline.acceptance import AcceptanceStats
from draftline.aux_ids import AuxLayerIds, outside
from draftline.chat_template import ChatTemplate
from draftline.config import DEFAULT_K
from draftline.errors import ConfigError
from draftline.speculative import SpeculativeDecoder, plain_decode
from draftline.target import decoder_layers, resolve_device

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# The precision a reference run is repeated in to see how far numerics alone move acceptance (engines serve bf16).
_OTHER_PRECISION = {"float32": "bfloat16", "bfloat16": "float32", "float16": "float32"}


@dataclass
class ReferenceResult:
    """Ground-truth acceptance of a drafter on a prompt set, with speedup over plain decoding in the same run."""

    target: str
    drafter: str
    k: int
    temperature: float
    draft_sampling: str
    dtype: str
    device: str
    batch_size: int
    num_prompts: int
    max_new_tokens: int
    stats: AcceptanceStats
    spec_tokens: int
    spec_seconds: float
    plain_tokens: int
    plain_seconds: float
    greedy_outputs_match: bool | None  # temperature 0: speculative output == plain greedy output, every prompt
    target_forwards_spec: int
    target_forwards_plain: int
    mode: str = "eager"  # the speculative run's implementation (Generation.mode)
    plain_mode: str = "eager"
    aux_shifts: list[dict] = field(default_factory=list)  # the same drafter fed neighbouring layers (variant_runs)
    other_precision: dict | None = None  # the same decode in another precision: how far numerics alone move it
    chat_template: dict | None = None  # the template and kwargs the chat prompts were rendered with

    @property
    def spec_tokens_per_s(self) -> float:
        return self.spec_tokens / self.spec_seconds if self.spec_seconds > 0 else float("nan")

    @property
    def plain_tokens_per_s(self) -> float:
        return self.plain_tokens / self.plain_seconds if self.plain_seconds > 0 else float("nan")

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.plain_tokens_per_s

    def summary(self) -> dict:
        """JSON-ready figures; acceptance keys use the same names as the engine results."""
        s = self.stats
        return {
            "engine": "reference decoder (torch, chain drafting)",
            "target": self.target, "drafter": self.drafter, "k": self.k, "temperature": self.temperature,
            "draft_sampling": self.draft_sampling,
            "dtype": self.dtype, "device": self.device, "batch_size": self.batch_size,
            "num_prompts": self.num_prompts, "max_new_tokens": self.max_new_tokens,
            "chat_template": self.chat_template,
            "mean_acceptance_length": s.mean_acceptance_length,
            "per_position_acceptance": s.per_position_acceptance,
            "conditional_acceptance": s.conditional_acceptance,
            "accepted_histogram": s.accepted_histogram,
            "num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens, "accepted_per_position": s.accepted_per_position,
            "spec_tokens": self.spec_tokens, "spec_seconds": self.spec_seconds,
            "spec_tokens_per_s": self.spec_tokens_per_s,
            "plain_tokens": self.plain_tokens, "plain_seconds": self.plain_seconds,
            "plain_tokens_per_s": self.plain_tokens_per_s, "speedup": self.speedup,
            "greedy_outputs_match": self.greedy_outputs_match,
            "target_forwards_spec": self.target_forwards_spec, "target_forwards_plain": self.target_forwards_plain,
            "mode": self.mode, "plain_mode": self.plain_mode,
            "aux_shift_acceptance": self.aux_shifts,
            "other_precision_acceptance": self.other_precision,
        }


def variant_runs(decoder: "SpeculativeDecoder", batches: Sequence[Sequence[Sequence[int]]], max_new_tokens: int,
                 reference: AcceptanceStats, seed: int, shifts: Sequence[int] = (),
                 other: tuple[str, Callable[[], tuple]] | None = None,
                 before_batch: Callable[[int, int], None] | None = None) -> tuple[list[dict], dict | None]:
    """The reference decode again with one thing changed, on the same batches: the drafter fed the layers `shift`
    away from its trained ones (every id moved alike, as a convention mix-up moves them), or target and drafter in
    another precision (other: its dtype name and a loader of (target, drafter) in it). Each row gives its acceptance
    and `kept_share`, the share of accepted draft tokens per step it keeps: what wrong ids would cost on this target,
    and how far numerics alone move acceptance."""
    trained = AuxLayerIds.of(decoder.aux_layer_ids)
    base = reference.mean_acceptance_length - 1.0
    num_layers = len(decoder_layers(decoder.model))

    def decode(model, drafter, ids) -> dict:
        variant = SpeculativeDecoder(model, drafter, decoder.k, temperature=decoder.temperature,
                                     eos_token_ids=decoder.eos_token_ids, pad_token_id=decoder.pad_token_id,
                                     seed=decoder.seed, draft_sampling=decoder.draft_sampling, fast=decoder.fast,
                                     sync_every=decoder.sync_every, aux_layer_ids=ids)
        stats, start = AcceptanceStats(k=decoder.k), 0
        for batch in batches:
            if before_batch is not None:
                before_batch(start, len(batch))
            stats.add(variant.generate(batch, max_new_tokens, seed=seed + start).stats)
            start += len(batch)
        length = stats.mean_acceptance_length
        return {"mean_acceptance_length": length, "kept_share": (length - 1.0) / base if base > 0 else None}

    shifted = []
    for shift in shifts:
        ids = trained.shifted(shift)
        row: dict = {"shift": shift, "aux_layer_ids": ids}
        if outside(ids, num_layers):
            shifted.append({**row, "skipped": f"layers {ids} are outside the target's 0..{num_layers - 1}"})
            continue
        shifted.append({**row, **decode(decoder.model, decoder.drafter, ids)})
    other_row = None
    if other is not None:
        # Loaded afresh: casting the caller's target there and back would not give its weights back bit for bit.
        model, drafter = other[1]()
        other_row = {"dtype": other[0], **decode(model, drafter, trained.as_list())}
        del model, drafter
    return shifted, other_row


def eos_token_ids(target_dir: str | Path, tokenizer) -> list[int]:
    """EOS ids from generation_config.json and the tokenizer: the engines stop at any of them."""
    import json

    ids: set[int] = set()
    gen = Path(target_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def load_drafter(drafter_dir: str | Path, target_model, dtype: torch.dtype, device: str):
    """An Eagle3Drafter from a drafter directory, checked against the target, on device in dtype."""
    from draftline.drafter.eagle_format import load_eagle_dir

    drafter = load_eagle_dir(
        drafter_dir, embed_tokens=target_model.get_input_embeddings().weight.detach().float().cpu(),
        target_num_layers=len(decoder_layers(target_model)))
    return drafter.to(device=device, dtype=dtype).eval()


def reference_acceptance(target_dir, drafter_dir, prompts, k: int = DEFAULT_K, max_new_tokens: int = 128,
                         device: str = "auto", dtype: str = "float32", *, temperature: float = 0.0,
                         max_prompts: int | None = None, use_chat_template: bool = True, batch_size: int = 1,
                         seed: int = 0, draft_sampling: str = "greedy", target=None, fast: bool | None = None,
                         sync_every: int | None = None, aux_shifts: Sequence[int] = (),
                         other_precision: bool = False, template: ChatTemplate | None = None) -> dict:
    """Acceptance of `drafter_dir` on `prompts` (a prompts .jsonl path or contract-B dicts), as JSON-ready figures.

    Prompts are encoded as the engines see them (chat template with generation prompt for messages). Plain
    decoding of the same prompts runs in the same process for the speedup. See run_reference for the result object.
    fast: decode with the static-cache path (CUDA graphs on CUDA), None = on for CUDA; the summary's "mode" says which ran.
    sync_every: greedy fast-path steps per host sync, as in SpeculativeDecoder (None = 8 on CUDA, 1 elsewhere).
    """
    return run_reference(target_dir, drafter_dir, prompts, k, max_new_tokens, device, dtype, temperature=temperature,
                         max_prompts=max_prompts, use_chat_template=use_chat_template, batch_size=batch_size,
                         seed=seed, draft_sampling=draft_sampling, target=target, fast=fast,
                         sync_every=sync_every, aux_shifts=aux_shifts,
                         other_precision=other_precision, template=template).summary()


def run_reference(target_dir, drafter_dir, prompts, k: int = DEFAULT_K, max_new_tokens: int = 128, device: str = "auto",
                  dtype: str = "float32", *, temperature: float = 0.0, max_prompts: int | None = None,
                  use_chat_template: bool = True, batch_size: int = 1, seed: int = 0, draft_sampling: str = "greedy",
                  target=None, fast: bool | None = None, sync_every: int | None = None,
                  aux_shifts: Sequence[int] = (), other_precision: bool = False,
                  template: ChatTemplate | None = None) -> ReferenceResult:
    """Like reference_acceptance, returning the ReferenceResult; `target` = an already loaded (model, tokenizer).
    aux_shifts: also decode with the drafter fed layers moved by each shift; other_precision: also decode in
    bfloat16 (float32 when dtype is bfloat16); both on the same prompts (variant_runs). template: the chat template
    and kwargs (traces.chat_template and chat_template_kwargs; None: the tokenizer's own)."""
    from draftline.target import load_target
    from draftline.traces import encode_prompt, read_prompts

    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be at least 1")
    device = resolve_device(device)
    rows = read_prompts(prompts) if isinstance(prompts, (str, Path)) else list(prompts)
    if not rows:
        raise ConfigError("the prompt set is empty; pass a prompts .jsonl file with at least one prompt")
    rows = rows[:max_prompts] if max_prompts else rows
    model, tokenizer = target if target is not None else load_target(target_dir, dtype, device)
    drafter = load_drafter(drafter_dir, model, _DTYPES[dtype], device)
    template = template or ChatTemplate()
    encoded, feed = _encoded(rows, prompts, target_dir, model, tokenizer, use_chat_template, template)
    try:
        batches = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]

        def images_of(first: int, count: int) -> None:  # the images of the rows about to be decoded, if any
            if feed is not None:
                feed.rows = feed.all_rows[first:first + count]

        eos = eos_token_ids(target_dir, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        decoder = SpeculativeDecoder(model, drafter, k, temperature=temperature, eos_token_ids=eos, pad_token_id=pad,
                                     seed=seed, draft_sampling=draft_sampling, fast=fast, sync_every=sync_every)

        # Warm-up outside the timed region: first calls pay for allocator growth and kernel selection (and the fast
        # path's capture, which a batch that needs more capacity pays again, outside `seconds` too).
        images_of(0, 1)
        decoder.generate(encoded[:1], min(4, max_new_tokens))
        plain_decode(model, encoded[:1], min(4, max_new_tokens), eos_token_ids=eos, pad_token_id=pad, fast=fast,
                     sync_every=sync_every)

        stats = AcceptanceStats(k=k)
        spec_tokens = plain_tokens = spec_fw = plain_fw = 0
        spec_s = plain_s = 0.0
        match = True
        modes = {"spec": set(), "plain": set()}
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start:start + batch_size]
            images_of(start, len(batch))
            plain = plain_decode(model, batch, max_new_tokens, temperature=temperature, eos_token_ids=eos,
                                 pad_token_id=pad, seed=seed + start, fast=fast, sync_every=sync_every)
            spec = decoder.generate(batch, max_new_tokens, seed=seed + start)
            stats.add(spec.stats)
            spec_tokens, spec_s = spec_tokens + spec.num_tokens, spec_s + spec.seconds
            spec_fw = spec_fw + spec.target_forwards
            plain_tokens, plain_s = plain_tokens + plain.num_tokens, plain_s + plain.seconds
            plain_fw = plain_fw + plain.target_forwards
            match = match and spec.tokens == plain.tokens
            modes["spec"].add(spec.mode)
            modes["plain"].add(plain.mode)

        def load_other():
            other_model, _ = load_target(target_dir, _OTHER_PRECISION[dtype], device)
            if feed is not None:
                feed.attach(other_model)
            return other_model, load_drafter(drafter_dir, other_model, _DTYPES[_OTHER_PRECISION[dtype]], device)

        shifted, other = variant_runs(decoder, batches, max_new_tokens, stats, seed, aux_shifts,
                                      (_OTHER_PRECISION[dtype], load_other) if other_precision else None,
                                      before_batch=images_of)
        return ReferenceResult(
            target=str(target_dir), drafter=str(drafter_dir), k=k, temperature=temperature, draft_sampling=draft_sampling,
            dtype=dtype, device=device,
            batch_size=batch_size, num_prompts=len(encoded), max_new_tokens=max_new_tokens, stats=stats,
            spec_tokens=spec_tokens, spec_seconds=spec_s, plain_tokens=plain_tokens, plain_seconds=plain_s,
            greedy_outputs_match=match if temperature == 0.0 else None,
            target_forwards_spec=spec_fw, target_forwards_plain=plain_fw,
            mode="+".join(sorted(modes["spec"])), plain_mode="+".join(sorted(modes["plain"])),
            aux_shifts=shifted, other_precision=other,
            chat_template=template.describe(tokenizer) if use_chat_template else None)
    finally:
        if feed is not None:  # the target may be the caller's, used again without images
            feed.detach()


def _encoded(rows, prompts, target_dir, model, tokenizer, use_chat_template: bool, template: ChatTemplate):
    """The rows' prompt ids, and a MediaFeed attached to the target when some rows have images (None otherwise): each
    image's placeholder expanded to its features' count, the features placed as the target embeds the prompt."""
    from draftline.conversations import Origin
    from draftline.images import image_parts, media_placeholder_id, prompts_base, target_takes_images
    from draftline.traces import encode_prompt
    from draftline.turns import TEXT_ONLY

    takes_images = target_takes_images(target_dir)
    origin_of = getattr(rows, "origin", lambda rid: Origin(f"prompt {rid!r}"))
    base = prompts_base(str(prompts)) if isinstance(prompts, (str, Path)) else None
    encoded, features = [], []
    for row in rows:
        with_images = takes_images and bool(image_parts(row.get("messages") or []))
        ids = encode_prompt(tokenizer, row, use_chat_template, template, None if with_images else TEXT_ONLY,
                            origin_of(row["id"]))
        feats: list = []
        if with_images:
            from draftline.media_reference import prompt_media

            ids, feats = prompt_media(target_dir, row, ids, origin_of(row["id"]), base)
        encoded.append(ids)
        features.append(feats)
    if not any(features):
        return encoded, None
    from draftline.media_reference import MediaFeed

    feed = MediaFeed(model, media_placeholder_id(target_dir))
    feed.all_rows = features
    feed.attach()
    return encoded, feed


# ---- whether to run it at all ----------------------------------------------------------------------------------------
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def float32_bytes(target_dir) -> int | None:
    """About how many bytes the target takes in float32, the reference decoder's precision: its checkpoint's size
    (the index's total_size, else the weight files') scaled from the dtype its config names; None when unknown."""
    import json

    root = Path(target_dir)
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    index = root / "model.safetensors.index.json"
    size = None
    if index.is_file():
        size = (json.loads(index.read_text()).get("metadata") or {}).get("total_size")
    if size is None:
        files = list(root.glob("*.safetensors")) or list(root.glob("*.bin"))
        size = sum(f.stat().st_size for f in files) or None
    if size is None:
        return None
    text = cfg.get("text_config", cfg)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or text.get("torch_dtype") or "bfloat16")
    return int(size) * 4 // _DTYPE_BYTES.get(dtype.removeprefix("torch."), 2)


def device_memory(device: str) -> int | None:
    """Bytes the reference decoder can use on `device`: a GPU's total memory, the host's available memory."""
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        return torch.cuda.get_device_properties(index).total_memory
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def skip_reason(target_dir, enabled: bool | str, device: str = "auto") -> str | None:
    """Why the reference decoder does not run (eval.reference.enabled: false, or auto and a target too large for
    the device), in one sentence; None when it runs."""
    if enabled is False:
        return "the reference decoder did not run (eval.reference.enabled is false)"
    if enabled is True:
        return None
    need = float32_bytes(target_dir)
    device = resolve_device(device, "eval.reference.device")
    have = device_memory(device)
    if need is None or have is None or need <= have:
        return None
    where = f"the {torch.cuda.get_device_name(0)}" if device.startswith("cuda") else "this machine's available memory"
    return (f"the reference decoder was skipped: the target needs about {need / 1e9:,.0f} GB in float32, more than "
            f"the {have / 1e9:,.0f} GB of {where} (eval.reference.enabled is auto; set it to true to try anyway)")
