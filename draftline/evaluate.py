"""Serves the target with and without the drafter in one engine, measures both, and compares acceptance with the reference."""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from draftline.aux_ids import AuxLayerIdsError
from draftline.chat_template import ChatTemplate
from draftline.config import EngineConfig, EvalConfig
from draftline.engines.base import Acceptance, EngineAdapter
from draftline.engines.client import (
    Prompt, RunMetrics, load_prompts, requests_for, round_robin, run_load, summarize_repeats,
)
from draftline.conversations import source_name, source_sha256
from draftline.engines.launch import launch
from draftline.engines.preflight import EngineUnavailable, check_drafter, preflight
from draftline.images import image_parts
from draftline.errors import ConfigError, EngineError
from draftline.eval_result import ConcurrencyPoint, EngineWarning, EvalResult, timestamp
from draftline.layout import eval_logs_prefix, eval_prefix, eval_result_key, this_start
from draftline.parity import AUX_IDS_FAULT, with_parity
from draftline.schedule import Schedule
from draftline.sweep import label_of, schedule_of, serve_further_ks


# ---------------------------------------------------------------------------------------------- facts


def describe_hardware() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return f"{n}x {torch.cuda.get_device_name(0)}"
    except Exception:
        pass
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {model} ({os.cpu_count()} cores)"


# ---------------------------------------------------------------------------------------------- acceptance


def combine_acceptance(parts: list[Acceptance]) -> Acceptance | None:
    """Acceptance over several runs, weighting each by its number of drafts."""
    parts = [a for a in parts if a is not None and a.num_drafts]
    if not parts:
        return None
    drafts = sum(a.num_drafts for a in parts)
    accepted = sum(a.num_accepted_tokens or 0 for a in parts)
    per_pos = None
    if all(a.per_position is not None for a in parts):
        k = len(parts[0].per_position)
        per_pos = [sum(a.per_position[i] * a.num_drafts for a in parts) / drafts for i in range(k)]
    draft_tokens = [a.num_draft_tokens for a in parts]
    return Acceptance(
        source=parts[0].source, mean_acceptance_length=1.0 + accepted / drafts, per_position=per_pos,
        num_drafts=drafts, num_accepted_tokens=accepted,
        num_draft_tokens=sum(draft_tokens) if all(d is not None for d in draft_tokens) else None,
    )



# ---------------------------------------------------------------------------------------------- running


def adapter_for(engine: str) -> EngineAdapter:
    if engine == "vllm":
        from draftline.engines.vllm import VllmAdapter

        return VllmAdapter()
    if engine == "sglang":
        from draftline.engines.sglang import SglangAdapter

        return SglangAdapter()
    raise ConfigError(f"engine {engine!r} is not supported; use 'vllm' or 'sglang'")


def _identical_share(base: list, spec: list) -> float:
    first = {}
    for r in base:  # the thinking a reasoning parser split off counts as much as the answer
        first.setdefault(r.prompt_id, (r.reasoning, r.text))
    same = [first.get(r.prompt_id) == (r.reasoning, r.text) for r in spec]
    return sum(same) / len(same) if same else 0.0


def _served_name(target_dir: Path) -> str:
    return Path(target_dir).resolve().name or "target"


class ServerRuns(NamedTuple):
    """One server's load runs, one (metrics, acceptance, request results) per concurrency, what its log said, and
    per concurrency each measured repeat's (metrics, request results) and acceptance. The metrics of `runs` are the
    repeats' medians (client.summarize_repeats), its request results those of every repeat, its acceptance over them
    all."""

    runs: list[tuple[RunMetrics, Acceptance | None, list]]
    log_facts: dict[str, Any]
    repeats: list[list[tuple[RunMetrics, list]]] = []
    repeat_acceptance: list[list[Acceptance | None]] = []


def measure(adapter: EngineAdapter, cfg: EngineConfig, target_dir: Path, drafter_dir: Path | None,
            prompts: list[Prompt], eval_cfg: EvalConfig, log_dir: Path, store, prefix: str | None,
            template: ChatTemplate | None = None, schedule: Schedule | None = None,
            label: str | None = None, logs_prefix: str | None = None) -> ServerRuns:
    """Start one server (baseline, EAGLE-3, or EAGLE-3 by load as `schedule` says), run every configured concurrency
    against it (one warm-up wave, then `cfg.repeats` measured runs of the same requests), keep the engine's raw
    answers (`prefix`/responses/<server>.json), stop it, and read its log. `template`: the chat template and kwargs
    the chat prompts are rendered with (traces.chat_template and chat_template_kwargs); `label` names the server
    ("eagle3-k5"); `logs_prefix`: the store folder its log is kept in (None: the local `log_dir` only)."""
    served = _served_name(target_dir)
    spec = adapter.server_spec(cfg, target_dir, drafter_dir, served, template=template, schedule=schedule)
    if label:
        spec = dataclasses.replace(spec, name=f"{adapter.name}-{label}")
    requester = adapter.requester(served, target_dir, eval_cfg.max_new_tokens, eval_cfg.temperature, template)
    out, repeats, repeat_acceptance = [], [], []
    with launch(spec, cfg, log_dir, store=store, log_key_prefix=logs_prefix) as server:
        for c in cfg.concurrency:
            # One unmeasured wave at this concurrency first: an engine meets a new batch size with one-off work
            # (kernel selection, graph capture, allocator growth), and a point of a few seconds would count it.
            run_load(server.base_url, round_robin(prompts, c), c, requester)
            before = adapter.acceptance_before(server.base_url)
            requests = requests_for(prompts, c, cfg.requests_per_point)
            runs, accepted = [], []
            for _ in range(cfg.repeats):
                start = adapter.acceptance_before(server.base_url)
                runs.append(run_load(server.base_url, requests, c, requester))
                accepted.append(adapter.acceptance_after(server.base_url, start, runs[-1][1],
                                                         cfg.num_speculative_tokens))
            results = [r for _, rs in runs for r in rs]
            acceptance = adapter.acceptance_after(server.base_url, before, results, cfg.num_speculative_tokens)
            out.append((summarize_repeats(runs), acceptance, results))
            repeats.append(runs)
            repeat_acceptance.append(accepted)
        if prefix:
            _put_json(store, f"{prefix}/responses/{spec.name}.json", adapter.snapshot(server.base_url, served))
    log_text = server.log_path.read_text(errors="replace") if server.log_path.is_file() else ""
    return ServerRuns(out, adapter.log_facts(log_text), repeats, repeat_acceptance)


def engine_warnings(server_log_facts: dict[str, dict[str, Any]]) -> list[EngineWarning]:
    """The warnings of every server's log (log_facts' "warnings"), once each, with the servers that logged them."""
    found: dict[str, list[str]] = {}
    for server, facts in server_log_facts.items():
        for text in facts.get("warnings") or []:
            found.setdefault(text, []).append(server)
    return [EngineWarning(text=text, servers=servers) for text, servers in found.items()]


def _put_json(store, key: str, data: dict) -> None:
    if store is not None:
        store.put_bytes(key, (json.dumps(data, indent=2) + "\n").encode())


def _new_result(cfg: EngineConfig, adapter: EngineAdapter, target_dir: Path, drafter_dir: Path, prompts_path: str,
                num_prompts: int, eval_cfg: EvalConfig, run: str, trained_aux_layer_ids: list[int] | None,
                template: ChatTemplate | None = None) -> EvalResult:
    """An engine's result row before anything is measured: what is evaluated, where and with which settings."""
    lineage = {}
    if (drafter_dir / "draftline.json").is_file():
        lineage = json.loads((drafter_dir / "draftline.json").read_text())
    return EvalResult(
        run=run, engine=cfg.engine, engine_version=adapter.version(), status="ok", hardware=describe_hardware(),
        target=_served_name(target_dir), target_path=str(target_dir),
        drafter=lineage.get("evaluated_as") or drafter_dir.resolve().name,  # a given drafter's name, not its format's
        drafter_path=str(drafter_dir), drafter_lineage=lineage, prompt_set=source_name(prompts_path),
        prompt_set_sha256=source_sha256(prompts_path), num_prompts=num_prompts,
        chat_template={"rendered_by": adapter.rendering(template or ChatTemplate()),
                       **(template or ChatTemplate()).describe(target_dir=target_dir)},
        sampling={"temperature": eval_cfg.temperature, "max_new_tokens": eval_cfg.max_new_tokens},
        num_speculative_tokens=cfg.num_speculative_tokens, server_args=list(cfg.extra_args),
        speculative_server_args=list(cfg.speculative_extra_args), started_at=timestamp(),
        trained_aux_layer_ids=trained_aux_layer_ids,
    )


def _refused(result: EvalResult, exc: ConfigError) -> EvalResult:
    """The failed row of an evaluation refused before any server started."""
    fault = AUX_IDS_FAULT if isinstance(exc, AuxLayerIdsError) else None
    return result.model_copy(update={"status": "failed", "reason": str(exc).split("\n")[0], "fault": fault,
                                     "finished_at": timestamp()})


def refuse_misread_export(cfg: EngineConfig, target_dir: str | Path, drafter_dir: str | Path,
                          prompts_path: str | Path, eval_cfg: EvalConfig, store, run: str,
                          trained_aux_layer_ids: list[int] | None = None) -> ConfigError | None:
    """The export check of preflight alone (files only: no engine is asked, no server starts): None when the engine
    would read the export as it was trained; else the refusal, with the engine's failed row written to the store as
    evaluate_engine writes it. Lets an evaluation fail before its reference decoder runs."""
    target_dir, drafter_dir, prompts_path = Path(target_dir), Path(drafter_dir), str(prompts_path)
    try:
        check_drafter(cfg.engine, drafter_dir, target_dir, trained_aux_layer_ids)
    except ConfigError as exc:
        result = _new_result(cfg, adapter_for(cfg.engine), target_dir, drafter_dir, prompts_path,
                             len(load_prompts(prompts_path, eval_cfg.max_prompts)), eval_cfg, run,
                             trained_aux_layer_ids)
        _put_json(store, eval_result_key(run, cfg.engine), _refused(result, exc).model_dump(mode="json"))
        return exc
    return None


def evaluate_engine(cfg: EngineConfig, target_dir: str | Path, drafter_dir: str | Path, prompts_path: str | Path,
                    eval_cfg: EvalConfig, store, run: str, reference: Any = None,
                    log_dir: str | Path | None = None, trained_aux_layer_ids: list[int] | None = None,
                    template: ChatTemplate | None = None,
                    baselines: dict[str, ServerRuns] | None = None) -> EvalResult:
    """Baseline and EAGLE-3 runs of one engine on the same prompts at each concurrency, any further k of its sweep,
    and the schedule by load derived from them (draftline.sweep); result JSON in the store.

    An engine not installed here gives a "skipped" result; a server that cannot be started after its retries
    gives a "failed" result in the store and raises EngineError. With `reference` (draftline.reference's
    acceptance summary on the same prompts and k), parity is filled in; compute the reference on the trained
    checkpoint itself, not on this engine's export, or an export bug (wrong aux-layer ids) hides in both.
    `trained_aux_layer_ids` (vLLM convention, from the training record) is what the export and the engine's log are
    checked against; without it, the export's own lineage. `template`: the chat template and kwargs of the chat
    prompts (traces.chat_template and chat_template_kwargs, so that the engines render what the traces did).
    `baselines` (engine -> its baseline server's runs) lets the evaluations of several drafters on the same prompts
    and settings share one baseline server: the first measures it, the others reuse it.
    """
    target_dir, drafter_dir, prompts_path = Path(target_dir), Path(drafter_dir), str(prompts_path)
    adapter = adapter_for(cfg.engine)
    prompts = load_prompts(prompts_path, eval_cfg.max_prompts)
    prefix, result_key = eval_prefix(run, cfg.engine), eval_result_key(run, cfg.engine)
    result = _new_result(cfg, adapter, target_dir, drafter_dir, prompts_path, len(prompts), eval_cfg, run,
                         trained_aux_layer_ids, template)
    result.num_prompts_with_images = sum(1 for p in prompts if image_parts(p.messages or []))
    try:
        facts = preflight(cfg, target_dir, drafter_dir, trained_aux_layer_ids)
    except EngineUnavailable as exc:
        result = result.model_copy(update={"status": "skipped", "reason": str(exc).split("\n")[0],
                                           "finished_at": timestamp()})
        _put_json(store, result_key, result.model_dump(mode="json"))
        return result
    except ConfigError as exc:  # the row is written first, so the report and the nightly show why
        _put_json(store, result_key, _refused(result, exc).model_dump(mode="json"))
        raise
    result.engine_version = facts["engine_version"]
    result.target_architecture = facts["architecture"]
    if facts["gpu"]:
        result.hardware = facts["gpu"]
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"draftline-{cfg.engine}-logs-"))
    logs_prefix = this_start(eval_logs_prefix(run, cfg.engine))  # a retried evaluation keeps the logs it retries

    def serve(drafter: Path | None, engine_cfg: EngineConfig, schedule: Schedule | None, label: str) -> ServerRuns:
        return measure(adapter, engine_cfg, target_dir, drafter, prompts, eval_cfg, logs, store, prefix, template,
                       schedule, label, logs_prefix)

    try:  # the sweep: the target alone, the configured k, then any further k; then the schedule derived from them
        base = (baselines or {}).get(cfg.engine)
        if base is None:
            base = serve(None, cfg, None, label_of(0, cfg))
            if baselines is not None:
                baselines[cfg.engine] = base
        spec = serve(drafter_dir, cfg, None, label_of(cfg.num_speculative_tokens, cfg))
        servers = {0: base, cfg.num_speculative_tokens: spec, **serve_further_ks(serve, cfg, drafter_dir)}
        result.sweep, result.schedule, scheduled = schedule_of(servers, cfg, serve, target_dir, drafter_dir,
                                                               result.engine_version, facts.get("serves_schedule"))
    except EngineError as exc:
        failed = result.model_copy(update={"status": "failed", "reason": str(exc).split("\n")[0],
                                           "finished_at": timestamp()})
        _put_json(store, result_key, failed.model_dump(mode="json"))
        raise
    points = []
    for (_, _, b_results), (_, acc, s_results), b_repeats, s_repeats, s_accepted in zip(
            base.runs, spec.runs, base.repeats, spec.repeats, spec.repeat_acceptance):
        points.append(ConcurrencyPoint.of_repeats(
            b_repeats, s_repeats, acc,
            _identical_share(b_results, s_results) if eval_cfg.temperature == 0 else None, s_accepted))
    result.points = points
    result.acceptance = combine_acceptance([p.acceptance for p in points])
    named = {label_of(k, cfg): runs for k, runs in servers.items()} | ({"schedule": scheduled} if scheduled else {})
    result.server_log_facts = {label: runs.log_facts for label, runs in named.items() if runs.log_facts}
    result.engine_warnings = engine_warnings(result.server_log_facts)
    result.finished_at = timestamp()
    if reference is not None:
        result = with_parity(result, reference, eval_cfg.parity_threshold, cfg)
    _put_json(store, result_key, result.model_dump(mode="json"))
    return result
