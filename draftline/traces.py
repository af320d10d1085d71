"""Prompts → the target's own responses ("traces"): chat templates, sampling, loss masks, filters, resumable shards."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from draftline.config import TracesConfig
from draftline.errors import ConfigError, EngineError
from draftline.layout import TRACES_STAGE, trace_stats_key, traces_prefix
from draftline.shards import finished_shard, publish_shard, shard_records, spec_hash, write_stage_manifest

log = logging.getLogger(__name__)

STAGE = TRACES_STAGE
SUFFIX = ".jsonl"
LENGTH_BINS = [0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]


# ---------------------------------------------------------------- prompts

def read_prompts(path: str | Path) -> list[dict]:
    """Read a prompts jsonl: each line {"id", "prompt": str} or {"id", "messages": [{"role", "content"}]}."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such prompts file; set traces.prompts to a .jsonl file of prompts")
    prompts = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                prompts.append(_parse_prompt(line, p, n))
    if not prompts:
        raise ConfigError(f"{p}: holds no prompts; add lines like {{\"id\": \"p1\", \"prompt\": \"Hello\"}}")
    return prompts


def _parse_prompt(line: str, path: Path, n: int) -> dict:
    where = f"{path}, line {n}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); fix that line") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object with \"id\" and \"prompt\" or \"messages\"; fix that line")
    pid = obj.get("id")
    if not isinstance(pid, str) or not pid:
        raise ConfigError(f"{where}: \"id\" must be a non-empty string; add one")
    if "messages" in obj:
        msgs = obj["messages"]
        ok = isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        )
        if not ok:
            raise ConfigError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}; fix that line")
        if msgs[-1]["role"] == "assistant":
            raise ConfigError(f"{where}: the last message is the assistant's; end with the user turn the target should answer")
        return {"id": pid, "messages": msgs}
    if isinstance(obj.get("prompt"), str):
        return {"id": pid, "prompt": obj["prompt"]}
    raise ConfigError(f"{where}: needs \"prompt\" (a string) or \"messages\" (a list); add one of them")


def load_prompts(cfg: TracesConfig) -> list[dict]:
    """The prompts this stage answers: read, duplicates dropped (same text, first kept), capped at max_prompts."""
    prompts = read_prompts(cfg.prompts)
    seen_ids: set[str] = set()
    for p in prompts:
        if p["id"] in seen_ids:
            raise ConfigError(f"{cfg.prompts}: id {p['id']!r} appears twice; prompt ids must be unique")
        seen_ids.add(p["id"])
    if cfg.drop_duplicates:
        seen, unique = set(), []
        for p in prompts:
            k = json.dumps(p.get("messages", p.get("prompt")), sort_keys=True)
            if k not in seen:
                seen.add(k)
                unique.append(p)
        prompts = unique
    return prompts[: cfg.max_prompts] if cfg.max_prompts else prompts


def num_trace_shards(cfg: TracesConfig, prompts: list[dict]) -> int:
    return max(1, -(-len(prompts) // cfg.traces_per_shard))


def shard_prompts(cfg: TracesConfig, prompts: list[dict], shard_index: int) -> list[dict]:
    n = num_trace_shards(cfg, prompts)
    if not 0 <= shard_index < n:
        raise ConfigError(f"trace shard {shard_index} does not exist; there are {n} shards (0..{n - 1})")
    return prompts[shard_index * cfg.traces_per_shard:(shard_index + 1) * cfg.traces_per_shard]


def encode_prompt(tokenizer, prompt: dict, use_chat_template: bool) -> list[int]:
    """Token ids the target sees before its answer: the chat template with a generation prompt, or the raw text."""
    if "messages" in prompt and use_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "the target's tokenizer has no chat template; add one to tokenizer_config.json "
                "or set traces.use_chat_template: false"
            )
        text = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False)
        # The template already writes BOS where the model wants it.
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = prompt.get("prompt") if "prompt" in prompt else "\n\n".join(m["content"] for m in prompt["messages"])
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _request_seed(seed: int, prompt_id: str) -> int:
    # Per-prompt seeds make sampled traces independent of batching, sharding and resumption.
    return int.from_bytes(hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[:4], "little") & 0x7FFFFFFF


# ---------------------------------------------------------------- backends

@functools.lru_cache(maxsize=1)
def _cached_target(path: str, dtype: str, device: str):
    from draftline.target import load_target

    return load_target(path, dtype, device)


@functools.lru_cache(maxsize=2)
def _cached_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _eos_ids(target_dir: str, tokenizer) -> list[int]:
    ids = set()
    gen = Path(target_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def _cut_at_eos(tokens: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]  # the EOS is part of the answer: the drafter must learn to predict it
    return tokens


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
            out[i] = _cut_at_eos(gen[row, width:].tolist(), eos)[: budgets[i]]
    return out  # type: ignore[return-value]


def _generate_vllm_server(cfg: TracesConfig, target_dir: str, prompt_ids: list[list[int]], seeds: list[int],
                          budgets: list[int], dtype: str) -> list[list[int]]:
    """Start a supervised vLLM server with traces.vllm's settings (tensor parallelism, quantization, ...), answer
    every prompt through it, stop it."""
    from draftline.engines.launch import launch
    from draftline.engines.vllm import generation_server_spec
    from draftline.extract_vllm import check_devices

    settings = cfg.vllm.resolved(dtype)
    check_devices(settings, "traces.vllm")
    limit = _length_limit(cfg, target_dir)
    spec = generation_server_spec(settings, Path(target_dir), settings.max_model_len or limit)
    with tempfile.TemporaryDirectory(prefix="draftline-traces-") as logs:
        with launch(spec, settings, logs) as server:
            return _generate_vllm_at(server.base_url + "/v1", cfg, prompt_ids, seeds, budgets)


def _generate_vllm_at(endpoint: str, cfg: TracesConfig, prompt_ids: list[list[int]], seeds: list[int],
                      budgets: list[int]) -> list[list[int]]:
    """Ask a running vLLM OpenAI server (/v1/completions with token-id prompts) and read back the token ids."""
    import httpx

    base = endpoint.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    with httpx.Client(timeout=600.0) as client:
        try:
            model = client.get(f"{base}/models").json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise EngineError(f"{endpoint} does not answer /v1/models like a vLLM server ({exc})") from None

        def one(i: int) -> list[int]:
            body = {"model": model, "prompt": prompt_ids[i], "max_tokens": budgets[i], "temperature": cfg.temperature,
                    "top_p": cfg.top_p, "seed": seeds[i], "return_token_ids": True, "skip_special_tokens": False}
            resp = client.post(f"{base}/completions", json=body)
            if resp.status_code != 200:
                raise EngineError(f"{endpoint} answered HTTP {resp.status_code}: {resp.text[:300]}")
            choice = resp.json()["choices"][0]
            if choice.get("token_ids") is None:
                raise EngineError(f"{endpoint} returned no token_ids; it must be vLLM >= 0.10.2")
            return list(choice["token_ids"])

        with ThreadPoolExecutor(max_workers=cfg.batch_size) as pool:
            return list(pool.map(one, range(len(prompt_ids))))


# ---------------------------------------------------------------- shards

def _shard_spec(cfg: TracesConfig, target_dir: str, prompts: list[dict], dtype: str) -> str:
    from draftline.target import target_fingerprint

    # How and where the work runs, not what it produces: changing them keeps finished shards.
    knobs = cfg.model_dump(exclude={"prompts", "max_prompts", "traces_per_shard", "batch_size", "endpoint", "device",
                                    "vllm"})
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
    return _publish_trace_shard(cfg, target_dir, mine, store, run, shard_index, spec,
                                _generate(cfg, target_dir, mine, dtype, device), started)


def _length_limit(cfg: TracesConfig, target_dir: str) -> int:
    """Longest trace: max_total_tokens, or less when the target's context is shorter (vLLM refuses a longer one)."""
    from draftline.target import read_target_config

    tc = read_target_config(target_dir)
    tc = tc.get("text_config", tc)
    return min(cfg.max_total_tokens, int(tc.get("max_position_embeddings") or cfg.max_total_tokens))


def _generate(cfg, target_dir, mine, dtype, device) -> tuple[list, list]:
    """Encode and answer `mine`; returns (prompt_ids per prompt or None if too long, response ids)."""
    tok = _cached_tokenizer(target_dir) if cfg.backend == "vllm" else _cached_target(target_dir, dtype, device)[1]
    encoded = [encode_prompt(tok, p, cfg.use_chat_template) for p in mine]
    limit = _length_limit(cfg, target_dir)
    keep = [i for i, ids in enumerate(encoded) if len(ids) < limit]
    ids = [encoded[i] for i in keep]
    seeds = [_request_seed(cfg.seed, mine[i]["id"]) for i in keep]
    budgets = [min(cfg.max_new_tokens, limit - len(x)) for x in ids]
    if not ids:
        responses = []
    elif cfg.backend == "transformers":
        responses = _generate_transformers(cfg, target_dir, ids, seeds, budgets, dtype, device)
    elif cfg.endpoint:
        responses = _generate_vllm_at(cfg.endpoint, cfg, ids, seeds, budgets)
    else:
        responses = _generate_vllm_server(cfg, target_dir, ids, seeds, budgets, dtype)
    eos = _eos_ids(target_dir, tok)
    full: list = [None] * len(mine)
    resp: list = [None] * len(mine)
    for j, i in enumerate(keep):
        full[i], resp[i] = encoded[i], _cut_at_eos(list(responses[j]), eos)
    return (full, resp), tok


def _publish_trace_shard(cfg, target_dir, mine, store, run, shard_index, spec, generated,
                         started: float | None = None) -> dict:
    """Publish one shard's traces; with `started` (when its generation began) the log line gives tokens/s."""
    (prompt_ids, responses), tok = generated
    lines, seen = [], set()
    dropped = {"prompt_too_long": 0, "response_too_short": 0, "duplicate": 0}
    prompt_tokens = response_tokens = 0
    hist = [0] * (len(LENGTH_BINS) - 1)
    for p, pids, rids in zip(mine, prompt_ids, responses):
        if pids is None:
            dropped["prompt_too_long"] += 1
            continue
        if len(rids) < cfg.min_response_tokens:
            dropped["response_too_short"] += 1
            continue
        input_ids = pids + rids
        if cfg.drop_duplicates:
            k = hashlib.sha256(json.dumps(input_ids).encode()).digest()
            if k in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(k)
        trace = {"id": f"{p['id']}:0", "prompt_id": p["id"], "input_ids": input_ids,
                 "loss_mask": [0] * len(pids) + [1] * len(rids),
                 "text": tok.decode(rids, skip_special_tokens=True)}
        lines.append(json.dumps(trace, ensure_ascii=False))
        prompt_tokens += len(pids)
        response_tokens += len(rids)
        hist[_bin(len(input_ids))] += 1
    stats = {"count": len(lines), "prompts": len(mine), "dropped": dropped, "prompt_tokens": prompt_tokens,
             "response_tokens": response_tokens, "total_tokens": prompt_tokens + response_tokens,
             "length_histogram": hist}
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


def finalize_traces(cfg: TracesConfig, prompts: list[dict], store, run: str) -> dict:
    """After every shard: write `<run>/traces/stats.json` and the stage manifest; returns the stats."""
    n = num_trace_shards(cfg, prompts)
    records = shard_records(store, run, STAGE, n)
    ms = [r.metadata for r in records]
    dropped = {k: sum(m["dropped"][k] for m in ms) for k in ms[0]["dropped"]}
    stats = {
        "count": sum(m["count"] for m in ms), "prompts": sum(m["prompts"] for m in ms), "shards": n,
        "dropped": dropped,
        "prompt_tokens": sum(m["prompt_tokens"] for m in ms), "response_tokens": sum(m["response_tokens"] for m in ms),
        "total_tokens": sum(m["total_tokens"] for m in ms),
        "length_histogram": {"bin_edges": LENGTH_BINS,
                             "counts": [sum(c) for c in zip(*(m["length_histogram"] for m in ms))]},
        "backend": cfg.backend, "temperature": cfg.temperature, "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
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
              "duplicate": "duplicates (traces.drop_duplicates)"}
    return "; ".join(f"{n} {remedy.get(k, k)}" for k, n in dropped.items() if n)


def generate_traces(cfg: TracesConfig, target_dir: str | Path, store, run: str, dtype: str = "bfloat16",
                    device: str = "cpu") -> dict:
    """The whole stage: every unfinished shard (one vLLM start for all of them), then stats and manifest.

    device: where the transformers backend generates ('auto': a GPU when one is visible); vLLM picks its own."""
    device = _device(cfg, device)
    prompts = load_prompts(cfg)
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
        (pids, resp), tok = _generate(cfg, target_dir, everything, dtype, device)
        at = 0
        for i, mine, spec in pending:
            part = ((pids[at:at + len(mine)], resp[at:at + len(mine)]), tok)
            _publish_trace_shard(cfg, target_dir, mine, store, run, i, spec, part)
            at += len(mine)
        log.info("traces: %d prompts answered in %.0f s, the server's start included", len(everything),
                 time.monotonic() - started)
    else:
        for i, mine, spec in pending:
            began = time.monotonic()
            _publish_trace_shard(cfg, target_dir, mine, store, run, i, spec,
                                 _generate(cfg, target_dir, mine, dtype, device), began)
    stats = finalize_traces(cfg, prompts, store, run)
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
