"""Prompts and conversations → the target's own answers ("traces"): turn by turn, loss masks, filters, resumable shards."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from draftline import turns as turn_lib
from draftline.chat_template import ChatTemplate
from draftline.config import TracesConfig
from draftline.conversations import BadRecord, Origin, PromptSet, read_prompt_set
from draftline.errors import ConfigError, EngineError
from draftline.images import (engine_messages, image_parts, mask_media, media_token_ids, part_source, prompts_base,
                              target_takes_images)
from draftline.layout import TRACES_STAGE, this_start, trace_stats_key, traces_logs_prefix, traces_prefix
from draftline.served_context import engine_context
from draftline.shards import finished_shard, publish_shard, shard_records, spec_hash, write_stage_manifest

log = logging.getLogger(__name__)

STAGE = TRACES_STAGE
SUFFIX = ".jsonl"
LENGTH_BINS = [0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
LISTED_SKIPS = 1000  # stats.json lists this many skipped records; it counts them all
REQUEST_ATTEMPTS = 3  # sends of one trace request whose connection dropped before its answer
REQUEST_RETRY_PAUSE_S = 1.0


# ---------------------------------------------------------------- prompts

def read_prompts(path: str | Path) -> PromptSet:
    """Every record of a prompt set (draftline.conversations), answered at its last turn: {"id", "prompt"} or
    {"id", "messages"} each; a bad record raises BadRecord naming its file, line and field."""
    return read_prompt_set(path, "traces.prompts")


def load_prompts(cfg: TracesConfig) -> PromptSet:
    """The records this stage answers: read as traces.turns, responses and on_bad_record say, duplicates dropped
    (same content, first kept), capped at max_prompts."""
    prompts = read_prompt_set(cfg.prompts, "traces.prompts", turns=cfg.turns, responses=cfg.responses,
                              on_bad_record=cfg.on_bad_record)
    kept = list(prompts)
    if cfg.drop_duplicates:
        seen, kept = set(), []
        for p in prompts:
            k = json.dumps(p.get("messages", p.get("prompt")), sort_keys=True)
            if k not in seen:
                seen.add(k)
                kept.append(p)
    kept = kept[: cfg.max_prompts] if cfg.max_prompts else kept
    return PromptSet(kept, prompts.source, prompts.origins, prompts.skipped, prompts.read)


def num_trace_shards(cfg: TracesConfig, prompts: list[dict]) -> int:
    return max(1, -(-len(prompts) // cfg.traces_per_shard))


def shard_prompts(cfg: TracesConfig, prompts: list[dict], shard_index: int) -> list[dict]:
    n = num_trace_shards(cfg, prompts)
    if not 0 <= shard_index < n:
        raise ConfigError(f"trace shard {shard_index} does not exist; there are {n} shards (0..{n - 1})")
    return prompts[shard_index * cfg.traces_per_shard:(shard_index + 1) * cfg.traces_per_shard]


def encode_prompt(tokenizer, prompt: dict, use_chat_template: bool, template: ChatTemplate | None = None,
                  image_refusal: str | None = turn_lib.TEXT_ONLY, origin: Origin | None = None) -> list[int]:
    """Token ids the target sees before its answer to the last turn: the chat template (the tokenizer's, or
    `template`) with a generation prompt, or the raw text; an image gives one placeholder (image_refusal: None)."""
    d = turn_lib.plan(prompt, origin or Origin(f"prompt {prompt['id']!r}"), "last", "regenerate", use_chat_template,
                      image_refusal)
    return turn_lib.turn_prompt(d, 0, tokenizer, template or ChatTemplate(), use_chat_template)[1]


def _request_seed(seed: int, prompt_id: str, turn: int = 0) -> int:
    # Per-prompt (and per-turn) seeds make sampled traces independent of batching, sharding and resumption.
    key = prompt_id if turn == 0 else f"{prompt_id}#{turn}"
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:4], "little") & 0x7FFFFFFF


# ---------------------------------------------------------------- backends

@functools.lru_cache(maxsize=1)
def _cached_target(path: str, dtype: str, device: str):
    from draftline.target import load_target

    return load_target(path, dtype, device)


@functools.lru_cache(maxsize=2)
def _cached_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"target {path} has no usable tokenizer ({str(exc).splitlines()[0]}); add tokenizer.json "
                          "there") from None


def _eos_ids(target_dir: str, tokenizer) -> list[int]:
    ids = set()
    gen = Path(target_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def _generate_transformers(cfg: TracesConfig, target_dir: str, prompt_ids: list[list[int]], seeds: list[int],
                           budgets: list[int], dtype: str, device: str) -> list[list[int]]:
    import torch

    model, tok = _cached_target(target_dir, dtype, device)
    eos = _eos_ids(target_dir, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    out: list[list[int] | None] = [None] * len(prompt_ids)
    sample = cfg.temperature > 0
    # Similar lengths together: less padding. Sampling goes one prompt at a time under its own seed, because
    # generate() has one random stream per batch and the traces must not depend on how prompts were batched.
    order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
    step = 1 if sample else cfg.batch_size
    for start in range(0, len(order), step):
        idx = order[start:start + step]
        width = max(len(prompt_ids[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):  # left padding: every row's answer starts at column `width`
            ids[row, width - len(prompt_ids[i]):] = torch.tensor(prompt_ids[i])
            mask[row, width - len(prompt_ids[i]):] = 1
        torch.manual_seed(seeds[idx[0]])
        gen = model.generate(
            input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
            max_new_tokens=max(budgets[i] for i in idx), do_sample=sample,
            temperature=cfg.temperature if sample else None, top_p=cfg.top_p if sample else None, top_k=None,
            pad_token_id=pad, eos_token_id=eos,
        )
        for row, i in enumerate(idx):
            out[i] = turn_lib.cut_at_stop(gen[row, width:].tolist(), eos)[: budgets[i]]
    return out  # type: ignore[return-value]


class _Answerer:
    """Answers token-id prompts with traces' backend. A vLLM server draftline starts (traces.vllm) starts with the
    first prompts, so work without any (the dataset's answers, prompts all too long) starts none, and it answers
    every round of turns until the block ends."""

    def __init__(self, cfg: TracesConfig, target_dir: str, dtype: str, device: str, store=None, run: str | None = None):
        self.cfg, self.target_dir, self.dtype, self.device = cfg, target_dir, dtype, device
        # Where the server's log goes when it stops: <run>/traces/logs/<UTC start time>/.
        self.store, self.log_prefix = store, this_start(traces_logs_prefix(run)) if run else None
        self.endpoint = cfg.endpoint
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "_Answerer":
        return self

    def __exit__(self, *exc) -> None:
        # The exception goes on to the server, which names its own exit when it died mid-stage.
        self._stack.__exit__(*exc)

    def __call__(self, prompt_ids: list[list[int]], seeds: list[int], budgets: list[int]) -> list[list[int]]:
        if not prompt_ids:
            return []
        if self.cfg.backend == "transformers":
            return _generate_transformers(self.cfg, self.target_dir, prompt_ids, seeds, budgets, self.dtype,
                                          self.device)
        if self.endpoint is None:
            self.endpoint = self._start_server()
        return _generate_vllm_at(self.endpoint, self.cfg, prompt_ids, seeds, budgets)

    def chat(self, messages: list[list[dict]], seeds: list[int], budgets: list[int]
             ) -> list[tuple[list[int], list[int]]]:
        """Chat prompts with images through vLLM's chat API: each prompt's token ids as vLLM expanded them, and the
        answer's."""
        if self.endpoint is None:
            self.endpoint = self._start_server()
        return _chat_vllm_at(self.endpoint, self.cfg, messages, seeds, budgets)

    def _start_server(self) -> str:
        """A supervised vLLM server with traces.vllm's settings (tensor parallelism, quantization, ...)."""
        from draftline.engines.launch import launch
        from draftline.engines.vllm import generation_server_spec
        from draftline.extract_vllm import check_devices

        settings = self.cfg.vllm.resolved(self.dtype)
        check_devices(settings, "traces.vllm")
        limit = _length_limit(self.cfg, self.target_dir)
        spec = generation_server_spec(settings, Path(self.target_dir), settings.max_model_len or limit)
        logs = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="draftline-traces-"))
        return self._stack.enter_context(launch(spec, settings, logs, store=self.store,
                                                log_key_prefix=self.log_prefix)).base_url + "/v1"


def _served_model(client, base: str, endpoint: str) -> str:
    """The model name a running vLLM server serves (its /v1/models), or one sentence on why it is not such a server."""
    import httpx

    try:
        return client.get(f"{base}/models").json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise EngineError(f"{endpoint} does not answer /v1/models like a vLLM server ({exc})") from None


def _post(client, url: str, body: dict, endpoint: str):
    """POST one trace request, sent again when its connection dropped (a server may close a kept-alive connection
    just as the client reuses it; the request is seeded, so answering it twice gives the same trace); a server that
    keeps dropping or refusing it becomes one sentence naming the server."""
    import httpx

    for attempt in range(REQUEST_ATTEMPTS):
        try:
            return client.post(url, json=body)
        except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError, httpx.WriteError) as exc:
            if attempt + 1 == REQUEST_ATTEMPTS:
                raise _stopped_answering(endpoint, exc) from exc
            log.warning("traces: %s dropped a request (%s: %s); sending it again", endpoint, type(exc).__name__, exc)
            time.sleep(REQUEST_RETRY_PAUSE_S)
        except httpx.HTTPError as exc:
            raise _stopped_answering(endpoint, exc) from exc


def _stopped_answering(endpoint: str, exc: Exception) -> EngineError:
    return EngineError(f"{endpoint} stopped answering trace requests ({type(exc).__name__}: {exc}); the shards "
                       "already published are kept and a rerun resumes after them", transient=True)


def _ask_all(endpoint: str, cfg: TracesConfig, path: str, bodies: list[dict], answered: str, read) -> list:
    """POST each body, with the served model's name, to a running vLLM server's /v1/`path`, cfg.batch_size at a time,
    and read each answer's JSON with `read`; a refusal is one sentence beginning with `answered`."""
    import httpx

    from draftline.engines.client import KEEPALIVE_EXPIRY_S

    base = endpoint.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    with httpx.Client(timeout=600.0, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)) as client:
        model = _served_model(client, base, endpoint)

        def one(body: dict):
            resp = _post(client, f"{base}/{path}", {"model": model, **body}, endpoint)
            if resp.status_code != 200:
                raise EngineError(f"{answered} HTTP {resp.status_code}: {resp.text[:300]}")
            return read(resp.json())

        with ThreadPoolExecutor(max_workers=cfg.batch_size) as pool:
            return list(pool.map(one, bodies))


def _generate_vllm_at(endpoint: str, cfg: TracesConfig, prompt_ids: list[list[int]], seeds: list[int],
                      budgets: list[int]) -> list[list[int]]:
    """Ask a running vLLM OpenAI server (/v1/completions with token-id prompts) and read back the token ids."""

    def token_ids(data: dict) -> list[int]:
        choice = data["choices"][0]
        if choice.get("token_ids") is None:
            raise EngineError(f"{endpoint} returned no token_ids; it must be vLLM >= 0.10.2")
        return list(choice["token_ids"])

    bodies = [{"prompt": ids, "max_tokens": budget, "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": seed,
               "return_token_ids": True, "skip_special_tokens": False}
              for ids, seed, budget in zip(prompt_ids, seeds, budgets)]
    return _ask_all(endpoint, cfg, "completions", bodies, f"{endpoint} answered", token_ids)


def _chat_vllm_at(endpoint: str, cfg: TracesConfig, messages: list[list[dict]], seeds: list[int], budgets: list[int]
                  ) -> list[tuple[list[int], list[int]]]:
    """Ask a running vLLM server's chat API (the target's own template; images as data or http(s) URLs) and read back
    the prompt's token ids, media tokens expanded, and the answer's."""

    def token_ids(data: dict) -> tuple[list[int], list[int]]:
        if data.get("prompt_token_ids") is None or data["choices"][0].get("token_ids") is None:
            raise EngineError(f"{endpoint} returned no token ids for a chat prompt; it must be vLLM >= 0.11")
        return list(data["prompt_token_ids"]), list(data["choices"][0]["token_ids"])

    kwargs = {"chat_template_kwargs": cfg.chat_template_kwargs} if cfg.chat_template_kwargs else {}
    bodies = [{"messages": chat, "max_tokens": budget, "temperature": cfg.temperature, "top_p": cfg.top_p,
               "seed": seed, "return_token_ids": True, "skip_special_tokens": False, **kwargs}
              for chat, seed, budget in zip(messages, seeds, budgets)]
    return _ask_all(endpoint, cfg, "chat/completions", bodies,
                    f"{endpoint} answered a chat prompt with images with", token_ids)


def image_refusal(cfg: TracesConfig, target_dir: str | Path) -> str | None:
    """Why this stage cannot use a record's images (None: it sends them to vLLM's chat API)."""
    if not target_takes_images(target_dir):
        return (f"the target {target_dir} is text-only (its config.json has no vision_config); remove the image or "
                "use a multimodal target")
    if cfg.backend != "vllm":
        return "images reach a multimodal target through vLLM's chat API; set traces.backend: vllm"
    if cfg.chat_template:
        return ("vLLM renders prompts with images with the target's own template, not traces.chat_template; remove "
                "traces.chat_template")
    return None


# ---------------------------------------------------------------- shards

def _shard_spec(cfg: TracesConfig, target_dir: str, prompts: list[dict], dtype: str) -> str:
    from draftline.target import target_fingerprint

    # How and where the work runs, not what it produces: changing them keeps finished shards.
    knobs = cfg.model_dump(exclude={"prompts", "max_prompts", "traces_per_shard", "batch_size", "endpoint", "device",
                                    "vllm", "on_bad_record"})
    # Settings at their defaults stay out, so that shards published before the settings existed are still found.
    for name, default in (("turns", "last"), ("responses", "regenerate"), ("chat_template", None),
                          ("chat_template_kwargs", {}), ("reasoning_markers", ("<think>", "</think>"))):
        if knobs[name] == default:
            del knobs[name]
    if cfg.chat_template:
        knobs["chat_template"] = ChatTemplate.of(cfg).describe()
    return spec_hash({"cfg": knobs, "target": target_fingerprint(target_dir), "dtype": dtype, "prompts": prompts})


def _device(cfg: TracesConfig, device: str) -> str:
    """Where the transformers backend generates ('auto': a GPU when one is visible); vLLM picks its own."""
    if cfg.backend != "transformers":
        return device
    from draftline.target import resolve_device

    return resolve_device(device, "traces.device")


def generate_trace_shard(cfg: TracesConfig, target_dir: str | Path, prompts: list[dict], store, run: str,
                         shard_index: int, dtype: str = "bfloat16", device: str = "cpu") -> dict:
    """Answer shard `shard_index` of `prompts` (from load_prompts) and publish it; skip if already published intact.

    Returns the shard's stats (count, dropped by reason, token totals, length histogram, computed: bool).
    device: as for generate_traces.
    """
    device = _device(cfg, device)
    target_dir = str(target_dir)
    mine = shard_prompts(cfg, prompts, shard_index)
    spec = _shard_spec(cfg, target_dir, mine, dtype)
    done = finished_shard(store, run, STAGE, shard_index, spec)
    if done is not None:
        return {**done.metadata, "computed": False}
    started = time.monotonic()
    with _Answerer(cfg, target_dir, dtype, device, store, run) as answerer:
        answered = _answer(cfg, target_dir, prompts, mine, answerer)
    return _publish_trace_shard(cfg, target_dir, mine, store, run, shard_index, spec, answered, started)


def _length_limit(cfg: TracesConfig, target_dir: str) -> int:
    """Longest trace: max_total_tokens, or one below the context vLLM serves the target at where that is shorter:
    extraction through vLLM sends a whole trace and asks one token more, which the context must hold."""
    from draftline.target import read_target_config

    context = engine_context(read_target_config(target_dir), "vllm")
    return min(cfg.max_total_tokens, context[0] - 1) if context else cfg.max_total_tokens


def _answer(cfg: TracesConfig, target_dir: str, prompts: list[dict], mine: list[dict], answerer: _Answerer
            ) -> tuple[list[turn_lib.Dialogue], object]:
    """Every record of `mine` as a Dialogue with its answers (the target's, turn by turn, or the dataset's), and the
    tokenizer. Every first prompt is rendered before anything is generated: a bad record or template stops the
    stage before a server starts (with on_bad_record: skip, the record is dropped and kept as the reason)."""
    tok = _cached_tokenizer(target_dir)
    template, skip = ChatTemplate.of(cfg), cfg.on_bad_record == "skip"
    if cfg.use_chat_template and any("messages" in p for p in mine):
        template.check(tok)
    origin = getattr(prompts, "origin", lambda pid: Origin(f"{cfg.prompts}, id {pid!r}"))
    dialogues, refusal = [], image_refusal(cfg, target_dir)
    base = prompts_base(cfg.prompts)
    for p in mine:
        try:
            d = turn_lib.plan(p, origin(p["id"]), cfg.turns, cfg.responses, cfg.use_chat_template, refusal)
            if d.media:  # every image read and checked here, before any server starts
                d.engine_messages = engine_messages(p, d.origin, base)
            dialogues.append(d)
        except BadRecord as bad:
            if not skip:
                raise
            dialogues.append(turn_lib.Dialogue(p, origin(p["id"]), [], dropped="bad_record", problem=bad))
    eos, limit = _eos_ids(target_dir, tok), _length_limit(cfg, target_dir)
    if cfg.responses == "dataset":
        for d in dialogues:
            if d.dropped is None:
                try:
                    turn_lib.dataset_answers(d, tok, template, eos, limit, tuple(cfg.reasoning_markers))
                except BadRecord as bad:
                    if not skip:
                        raise
                    d.dropped, d.problem = "bad_record", bad
    else:
        turn_lib.regenerate(dialogues, tok, template, cfg.use_chat_template, eos, limit, cfg.max_new_tokens,
                            lambda pid, turn: _request_seed(cfg.seed, pid, turn), answerer, skip, answerer.chat)
    return dialogues, tok


def _publish_trace_shard(cfg, target_dir, mine, store, run, shard_index, spec, answered,
                         started: float | None = None) -> dict:
    """Publish one shard's traces; with `started` (when its generation began) the log line gives tokens/s."""
    dialogues, tok = answered
    limit, media_ids = _length_limit(cfg, target_dir), media_token_ids(target_dir)
    lines, seen, skipped = [], set(), []
    dropped = {"prompt_too_long": 0, "response_too_short": 0, "duplicate": 0, "bad_record": 0}
    prompt_tokens = response_tokens = answers = image_count = 0
    hist = [0] * (len(LENGTH_BINS) - 1)
    for d in dialogues:
        if d.dropped:
            dropped[d.dropped] += 1
            if d.problem is not None:
                skipped.append(d.problem.as_dict())
            continue
        for n, (input_ids, loss_mask, said) in enumerate(turn_lib.assemble(d, tok, limit)):
            loss_mask = mask_media(input_ids, loss_mask, media_ids)
            if sum(loss_mask) < cfg.min_response_tokens:
                dropped["response_too_short"] += 1
                continue
            images = [part_source(p) for _, _, p in image_parts(turn_lib.history(d, n))] if d.media else None
            if cfg.drop_duplicates:  # the same ids with other images are another trace
                k = hashlib.sha256(json.dumps([input_ids, images] if images else input_ids).encode()).digest()
                if k in seen:
                    dropped["duplicate"] += 1
                    continue
                seen.add(k)
            text = "\n\n".join(tok.decode(a.ids, skip_special_tokens=True) for a in said)
            trace = {"id": f"{d.record['id']}:{n}", "prompt_id": d.record["id"], "input_ids": input_ids,
                     "loss_mask": loss_mask, "text": text}
            if images:  # what extraction sends with the ids so that the engine computes the same media states
                trace["images"] = images
                image_count += len(images)
            lines.append(json.dumps(trace, ensure_ascii=False))
            response_tokens += sum(loss_mask)
            prompt_tokens += len(loss_mask) - sum(loss_mask)
            answers += len(said)
            hist[_bin(len(input_ids))] += 1
    stats = {"count": len(lines), "prompts": len(mine), "answers": answers, "images": image_count, "dropped": dropped,
             "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
             "total_tokens": prompt_tokens + response_tokens, "length_histogram": hist, "skipped": skipped}
    data = ("\n".join(lines) + ("\n" if lines else "")).encode("utf-8")
    meta = {**stats, "sequences": len(lines), "tokens": prompt_tokens + response_tokens}
    publish_shard(store, run, STAGE, shard_index, SUFFIX, spec, meta, data=data)
    rate = ""
    if started is not None:
        rate = f", {response_tokens / max(1e-9, time.monotonic() - started):.0f} generated tokens/s"
    log.info("traces: shard %d published: %d traces, %d response tokens%s", shard_index, len(lines), response_tokens,
             rate)
    return {**meta, "computed": True}


def _bin(length: int) -> int:
    for b in range(len(LENGTH_BINS) - 1):
        if length < LENGTH_BINS[b + 1]:
            return b
    return len(LENGTH_BINS) - 2


def finalize_traces(cfg: TracesConfig, prompts: list[dict], store, run: str, target_dir: str | Path | None = None
                    ) -> dict:
    """After every shard: write `<run>/traces/stats.json` and the stage manifest; returns the stats. target_dir:
    where the target's tokenizer files are, for the sha256 of its chat template."""
    n = num_trace_shards(cfg, prompts)
    records = shard_records(store, run, STAGE, n)
    ms = [r.metadata for r in records]
    dropped = {k: sum(m["dropped"].get(k, 0) for m in ms) for k in dict.fromkeys(k for m in ms for k in m["dropped"])}
    # Bad records the reader left out, then those the template refused while the shards were made.
    skipped = [b.as_dict() for b in getattr(prompts, "skipped", [])] + [s for m in ms for s in m.get("skipped", [])]
    stats = {
        "count": sum(m["count"] for m in ms), "prompts": sum(m["prompts"] for m in ms), "shards": n,
        "answers": sum(m.get("answers", m["count"]) for m in ms), "images": sum(m.get("images", 0) for m in ms),
        "dropped": dropped,
        "skipped": {"count": len(skipped), "records": skipped[:LISTED_SKIPS]},
        "prompt_tokens": sum(m["prompt_tokens"] for m in ms), "response_tokens": sum(m["response_tokens"] for m in ms),
        "total_tokens": sum(m["total_tokens"] for m in ms),
        "length_histogram": {"bin_edges": LENGTH_BINS,
                             "counts": [sum(c) for c in zip(*(m["length_histogram"] for m in ms))]},
        "backend": cfg.backend, "temperature": cfg.temperature, "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed, "turns": cfg.turns, "responses": cfg.responses,
        "chat_template": ChatTemplate.of(cfg).describe(target_dir=target_dir) if cfg.use_chat_template else None,
    }
    stats_key = trace_stats_key(run)
    stats_bytes = json.dumps(stats, indent=2).encode()
    store.put_bytes(stats_key, stats_bytes)
    write_stage_manifest(store, run, STAGE, records, [{
        "key": stats_key, "size": len(stats_bytes), "sha256": hashlib.sha256(stats_bytes).hexdigest(), "metadata": {}}])
    if stats["count"] == 0:
        raise ConfigError(f"traces: none of the {stats['prompts']} prompts gave a trace ({_drop_reasons(cfg, dropped)})"
                          "; nothing is left to extract or train on")
    return stats


def _drop_reasons(cfg: TracesConfig, dropped: dict[str, int]) -> str:
    """Each reason a prompt was dropped, with the setting that decides it."""
    remedy = {"prompt_too_long": f"longer than traces.max_total_tokens={cfg.max_total_tokens} or the target's context",
              "response_too_short": f"answered in fewer than traces.min_response_tokens={cfg.min_response_tokens} "
                                    "tokens",
              "duplicate": "duplicates (traces.drop_duplicates)",
              "bad_record": "bad records (traces.on_bad_record: skip; stats.json lists them)"}
    return "; ".join(f"{n} {remedy.get(k, k)}" for k, n in dropped.items() if n)


def generate_traces(cfg: TracesConfig, target_dir: str | Path, store, run: str, dtype: str = "bfloat16",
                    device: str = "cpu") -> dict:
    """The whole stage: every unfinished shard (one vLLM start for all of them), then stats and manifest.

    device: where the transformers backend generates ('auto': a GPU when one is visible); vLLM picks its own."""
    device = _device(cfg, device)
    prompts = load_prompts(cfg)
    if prompts.skipped:
        log.warning("traces: %d of %d records of %s skipped as bad (traces.on_bad_record: skip), the first: %s",
                    len(prompts.skipped), prompts.read, cfg.prompts, prompts.skipped[0])
    target_dir = str(target_dir)
    n = num_trace_shards(cfg, prompts)
    pending = []
    for i in range(n):
        mine = shard_prompts(cfg, prompts, i)
        spec = _shard_spec(cfg, target_dir, mine, dtype)
        if finished_shard(store, run, STAGE, i, spec) is None:
            pending.append((i, mine, spec))
    log.info("traces: %d of %d shards to generate (%d prompts, %s backend)%s", len(pending), n,
             sum(len(mine) for _, mine, _ in pending), cfg.backend,
             f"; {n - len(pending)} already published" if len(pending) < n else "")
    started = time.monotonic()
    if cfg.backend == "vllm" and not cfg.endpoint and len(pending) > 1:
        # Starting vLLM costs a minute: answer all pending shards through one server, then split them back.
        everything = [p for _, mine, _ in pending for p in mine]
        with _Answerer(cfg, target_dir, dtype, device, store, run) as answerer:
            dialogues, tok = _answer(cfg, target_dir, prompts, everything, answerer)
        at = 0
        for i, mine, spec in pending:
            _publish_trace_shard(cfg, target_dir, mine, store, run, i, spec, (dialogues[at:at + len(mine)], tok))
            at += len(mine)
        log.info("traces: %d prompts answered in %.0f s, the server's start included", len(everything),
                 time.monotonic() - started)
    else:
        for i, mine, spec in pending:
            began = time.monotonic()
            with _Answerer(cfg, target_dir, dtype, device, store, run) as answerer:
                answered = _answer(cfg, target_dir, prompts, mine, answerer)
            _publish_trace_shard(cfg, target_dir, mine, store, run, i, spec, answered, began)
    stats = finalize_traces(cfg, prompts, store, run, target_dir)
    return {**stats, "computed_shards": [i for i, _, _ in pending]}


def trace_shard_keys(store, run: str) -> list[str]:
    """Keys of the trace shards the stage's manifest lists, in order (shards of an older, larger run are ignored)."""
    manifest = store.read_manifest(traces_prefix(run))
    if manifest is None:
        raise ConfigError(f"{store.uri(traces_prefix(run))} has no manifest.json; run trace generation for run {run!r} first")
    return [k for k in manifest.keys() if k.rsplit("/", 1)[-1].startswith("shard-") and k.endswith(SUFFIX)]


def read_trace_shard(store, key: str) -> list[dict]:
    return [json.loads(line) for line in store.get_bytes(key).decode("utf-8").splitlines() if line.strip()]


def iter_traces(store, run: str) -> Iterator[dict]:
    for key in trace_shard_keys(store, run):
        yield from read_trace_shard(store, key)
