"""Every stage, shard and nightly step as one call on a PipelineConfig: what the CLI runs and every Prefect task wraps."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from draftline.aux_ids import VLLM, AuxLayerIds
from draftline.chat_template import ChatTemplate
from draftline.config import EngineConfig, PipelineConfig
from draftline.errors import ConfigError
from draftline.layout import (eval_result_key, export_prefix, hidden_manifest_key, reference_result_key,
                              regression_prefix, trace_stats_key, trained_drafter_prefix, training_record_key)
from draftline.run_summary import print_summary, summary_rows
from draftline.store import Store, open_store

if TYPE_CHECKING:  # the regression package imports the evaluation's engines: only when a nightly needs it
    from draftline.eval_result import EvalResult
    from draftline.regression import ProductionDrafter, Verdict


def traces(config: PipelineConfig, store: Store) -> dict:
    from draftline import traces as trace_lib

    return trace_lib.generate_traces(config.traces, config.target.path, store, config.run, dtype=config.target.dtype,
                                     device=config.traces.device)


def extract(config: PipelineConfig, store: Store) -> dict:
    from draftline import extract as extract_lib

    return extract_lib.extract_hidden_states(config.extract, config.target.path, store, config.run,
                                             dtype=config.target.dtype)


# The same two stages a shard at a time, as the flows run them where no engine server answers every shard: the
# stage's own call above when one does (a start costs minutes).

def traces_in_one_server(config: PipelineConfig) -> bool:
    """Whether the traces come from a vLLM server draftline starts, which answers every shard."""
    return config.traces.backend == "vllm" and not config.traces.endpoint


def trace_shard_count(config: PipelineConfig) -> int:
    from draftline import traces as trace_lib

    return trace_lib.num_trace_shards(config.traces, trace_lib.load_prompts(config.traces))


def trace_shard(config: PipelineConfig, store: Store, shard_index: int) -> dict:
    """One shard of traces; a shard already published intact is skipped."""
    from draftline import traces as trace_lib

    return trace_lib.generate_trace_shard(config.traces, config.target.path, trace_lib.load_prompts(config.traces),
                                          store, config.run, shard_index, dtype=config.target.dtype,
                                          device=config.traces.device)


def finish_traces(config: PipelineConfig, store: Store) -> dict:
    """Stats and the stage manifest once every trace shard is published; returns the stats."""
    from draftline import traces as trace_lib

    return trace_lib.finalize_traces(config.traces, trace_lib.load_prompts(config.traces), store, config.run,
                                     config.target.path)


def extraction_in_one_server(config: PipelineConfig) -> bool:
    """Whether the hidden states come from a vLLM server, which reads every shard."""
    return config.extract.backend == "vllm"


def hidden_shard_count(config: PipelineConfig, store: Store) -> int:
    from draftline import hidden_shards

    return hidden_shards.num_hidden_shards(config.extract, store, config.run)


def extract_shard(config: PipelineConfig, store: Store, shard_index: int) -> dict:
    """Hidden states of one shard of traces; a shard already published intact is skipped."""
    from draftline import extract as extract_lib

    return extract_lib.extract_shard(config.extract, config.target.path, store, config.run, shard_index,
                                     dtype=config.target.dtype)


def finish_extraction(config: PipelineConfig, store: Store, num_shards: int) -> str:
    """The stage manifest once every hidden-state shard exists; returns its URI."""
    from draftline import hidden_shards

    hidden_shards.finalize_hidden_states(store, config.run, num_shards)
    return hidden_manifest_uri(config, store)


def train(config: PipelineConfig, store: Store, on_line: Callable[[str], None] | None = None) -> dict:
    """Train the drafter in this process, or with train.processes > 1 as torchrun ranks whose output lines go to
    `on_line`; either way a rerun resumes from the last checkpoint in the store. With train.source engine a capturing
    vLLM server runs beside the trainer and feeds it (draftline.online)."""
    if config.train.source == "engine":
        from draftline.online.run import train_online

        return train_online(config, store, on_line)
    if config.train.processes > 1:
        from draftline.drafter.torchrun import train_with_torchrun

        return train_with_torchrun(config, store, on_line)
    from draftline.drafter import train as train_lib

    return train_lib.train_drafter(store, config.run, config.target.path, config.drafter, config.train,
                                   replay_answer_tokens=config.eval.max_new_tokens)


# Online training as the flows run it: the engine side and the trainer as two tasks of one flow.

def online_prepare(config: PipelineConfig) -> None:
    """Clear the hand-off folder of an earlier attempt before either side of online training starts."""
    from draftline.online.run import prepare

    prepare(config)


def online_engine(config: PipelineConfig, store: Store, say: Callable[[str], None] | None = None) -> dict:
    """The engine side of online training until the trainer is done; "trainer" in the result is its final state."""
    from draftline.online.run import run_engine

    return run_engine(config, store, say)


def online_trainer(config: PipelineConfig, store: Store, on_line: Callable[[str], None] | None = None) -> dict:
    """The trainer side of online training, fed by online_engine running at the same time."""
    from draftline.online.run import run_trainer

    return run_trainer(config, store, on_line)


def online_trainer_ended(config: PipelineConfig, completed: bool) -> None:
    """Tell the engine side of online training that the trainer has ended (completed or not), whatever it said."""
    from draftline.online.run import trainer_ended

    trainer_ended(config, completed)


def online_clean_up(config: PipelineConfig) -> None:
    """Remove online training's hand-off folder once both sides are done."""
    from draftline.online.run import clean_up

    clean_up(config)


def stage_gpus(config: PipelineConfig, stage: str) -> int:
    """GPUs the worker of a stage needs, as the config asks: a vLLM server's tensor x pipeline x data parallel sizes
    for traces and extraction through vLLM, one per training process, one where the target loads on one device
    (the transformers paths, the reference decoder)."""
    from draftline.engines.parallel import devices_needed

    if stage == "traces":
        served = config.traces.backend == "vllm" and not config.traces.endpoint
        return devices_needed(config.traces.vllm) if served else 1
    if stage == "extract":
        return devices_needed(config.extract.vllm) if config.extract.backend == "vllm" else 1
    if stage == "train":
        if config.train.source == "engine":  # the capturing engine runs beside the trainer on the same worker
            online = config.train.online
            if online.engine_devices is not None or online.trainer_devices is not None:
                from draftline.online.placement import place

                placed = place(config, 1 + max((online.engine_devices or []) + (online.trainer_devices or [])))
                return len(set(placed.engine) | set(placed.trainer))
            return max(devices_needed(config.extract.vllm), config.train.processes)
        return config.train.processes
    if stage == "reference":
        return 1
    raise ValueError(f"unknown stage {stage!r}; use traces, extract, train or reference")


def engine_gpus(engine: EngineConfig) -> int:
    """GPUs one engine's evaluation needs: its servers' tensor x pipeline x data parallel sizes."""
    from draftline.engines.parallel import devices_needed

    return devices_needed(engine)


def stored_trace_stats(config: PipelineConfig, store: Store) -> dict:
    """What the trace stage returned, from the store: its stats.json (written last, after every shard)."""
    return json.loads(store.get_bytes(trace_stats_key(config.run)))


def hidden_manifest_uri(config: PipelineConfig, store: Store) -> str:
    """The extraction stage's manifest, which exists only once every shard does."""
    key = hidden_manifest_key(config.run)
    if not store.exists(key):
        raise ConfigError(f"{store.uri(key)} does not exist; run the extraction stage for run {config.run!r} first")
    return store.uri(key)


def stored_training(config: PipelineConfig, store: Store) -> dict:
    """What the train-drafter flow returned, from the store: the training summary and the exports."""
    return {"training": json.loads(store.get_bytes(training_record_key(config.run))),
            "exports": stored_exports(config, store)}


def export(config: PipelineConfig, store: Store) -> dict[str, str]:
    """Write every configured engine format; returns {format: store prefix of that export directory}."""
    from draftline.drafter import export as export_lib

    return export_lib.export_from_store(store, config.run, config.target.path, config.export.formats,
                                        num_speculative_tokens=config.eval.export_k)


def _drafter_dir(store: Store, exports: dict[str, str], fmt: str) -> Path:
    if fmt not in exports:
        raise ConfigError(f"no {fmt!r} export of the drafter; add {fmt!r} to export.formats")
    return store.get_dir(exports[fmt])


def _engine_format(engine: str) -> str:
    return {"vllm": "vllm", "sglang": "sglang"}[engine]


def evaluate_engine(config: PipelineConfig, engine: EngineConfig, exports: dict[str, str], store: Store,
                    baselines: dict | None = None) -> str:
    """One engine's baseline and EAGLE-3 runs on the eval prompts; returns the store key of its EvalResult.
    `baselines`: shared by the evaluations of several drafters (draftline.evaluate.evaluate_engine)."""
    from draftline import evaluate as eval_lib

    fmt = _engine_format(engine.engine)
    drafter_dir = _drafter_dir(store, exports, fmt) if fmt in exports else Path(exports.get("vllm", "."))
    # The schedule goes into the export's serve/ folder at the report, not here: an evaluation worker's identity
    # writes only evaluations (infra/s3_policy.py).
    eval_lib.evaluate_engine(engine, config.target.path, drafter_dir, config.eval.prompts, config.eval, store,
                             config.run, trained_aux_layer_ids=trained_aux_layer_ids(config, store, exports),
                             template=ChatTemplate.of(config.traces), baselines=baselines)
    return engine_result_key(config, engine)


def publish_own_schedule(config: PipelineConfig, store: Store, result: EvalResult) -> list[str]:
    """The serve/ folder of an engine's schedule, in this run's own export of that engine's format when the run has
    one (a production drafter evaluated by the nightly is never written to); returns the keys written."""
    export = export_prefix(config.run, _engine_format(result.engine))
    if result.status != "ok" or result.schedule is None or store.read_manifest(export) is None:
        return []
    return publish_serve_folder(store, export, result.schedule, Path(result.drafter_path))


def publish_serve_folder(store: Store, export: str, schedule, drafter_dir: Path) -> list[str]:
    """The schedule and what to pass the engine, in the export's serve/ folder and manifest (this run's own export
    only: a production drafter evaluated by the nightly is never written to); returns the keys written."""
    from draftline.schedule import SERVE_FOLDER, serve_files

    entries = [store.put_bytes(f"{export}/{SERVE_FOLDER}/{name}", text.encode())
               for name, text in serve_files(schedule, str(Path(drafter_dir).resolve())).items()]
    store.update_manifest(export, entries)
    return [e.key for e in entries]


def misread_exports(config: PipelineConfig, exports: dict[str, str], store: Store) -> dict[str, ConfigError]:
    """{engine: refusal} for each engine whose export it would misread (aux-layer ids against the training record,
    conventions, d2t), checked from the files alone before the evaluation spends anything; each such engine's failed
    row is in the store. A target that is not on this machine (its engines run on other workers) is left to the
    engines' own preflight."""
    from draftline import evaluate as eval_lib

    if not Path(config.target.path).is_dir():
        return {}
    trained = trained_aux_layer_ids(config, store, exports)
    refused = {}
    for engine in config.eval.engines:
        fmt = _engine_format(engine.engine)
        if fmt not in exports:
            continue
        refusal = eval_lib.refuse_misread_export(engine, config.target.path, _drafter_dir(store, exports, fmt),
                                                 config.eval.prompts, config.eval, store, config.run, trained)
        if refusal is not None:
            refused[engine.engine] = refusal
    return refused


def servable_here(engine: EngineConfig) -> bool:
    """Whether this environment can serve the engine at all (installed here, or an environment of its own named)."""
    from draftline.engines.preflight import engine_version, runs_elsewhere

    return runs_elsewhere(engine) or engine_version(engine.engine) is not None


def trained_aux_layer_ids(config: PipelineConfig, store: Store, exports: dict[str, str] | None = None
                          ) -> list[int] | None:
    """The aux layers the training fed the drafter (vLLM convention), from its metrics.json: the one record every
    export and engine log is checked against. The run's own training first; a run that trained nothing (the
    nightly evaluating a production drafter) reads the record its exports' lineage points at."""
    key = training_record_key(config.run)
    if store.exists(key):
        source, raw = store.uri(key), store.get_bytes(key)
    else:
        found = _lineage_training_record(store, exports or {})
        if found is None:
            return None
        source, raw = found
    record = json.loads(raw)
    ids = AuxLayerIds.stored(record.get("aux_layer_ids") or None, record.get("convention", VLLM), source,
                             "rerun the training stage")
    return ids.as_list() if ids else None


def lineage_training_record(store: Store, exports: dict[str, str]) -> dict | None:
    """The training record (metrics.json) the exports' lineage names, parsed; None when none can be read."""
    found = _lineage_training_record(store, exports)
    return json.loads(found[1]) if found else None


def _lineage_training_record(store: Store, exports: dict[str, str]) -> tuple[str, bytes] | None:
    """(uri, bytes) of the training record named by an export's lineage (`training_metrics`), when it can be read."""
    for prefix in exports.values():
        lineage_key = f"{prefix}/draftline.json"
        try:
            if not store.exists(lineage_key):
                continue
        except ConfigError:  # an export outside this store (a path, not a key): its lineage is not read here
            continue
        found = _record_at(json.loads(store.get_bytes(lineage_key)).get("training_metrics"))
        if found:
            return found
    return None


def engine_result_key(config: PipelineConfig, engine: EngineConfig) -> str:
    """Where an engine's EvalResult lives; a failed evaluation writes its row there too, before it raises."""
    return eval_result_key(config.run, engine.engine)


def reference(config: PipelineConfig, exports: dict[str, str], store: Store) -> str:
    """The reference decoder's acceptance on the same eval prompts and k; returns the store key of its JSON, which
    holds {"status": "skipped", "reason": ...} when eval.reference.enabled turns it off for this target."""
    from draftline.reference import reference_acceptance, skip_reason

    skipped = skip_reason(config.target.path, config.eval.reference.enabled, config.eval.reference.device)
    if skipped:
        logging.getLogger(__name__).info(skipped)
        store.put_bytes(reference_key(config), (json.dumps({"status": "skipped", "reason": skipped}) + "\n").encode())
        return reference_key(config)

    # The trained checkpoint, not an export: an export bug must show as a parity gap, not cancel out in both.
    trained = trained_drafter_prefix(config.run)
    if store.read_manifest(trained) is not None:
        drafter_dir = store.get_dir(trained)
    else:
        drafter_dir = _drafter_dir(store, exports, "sglang" if "sglang" in exports else next(iter(exports)))
    summary = reference_acceptance(
        config.target.path, drafter_dir, config.eval.prompts, k=config.eval.reference_k,
        max_new_tokens=config.eval.max_new_tokens, max_prompts=config.eval.reference.max_prompts or config.eval.max_prompts,
        use_chat_template=config.eval.use_chat_template, device=config.eval.reference.device,
        temperature=config.eval.temperature, batch_size=config.eval.reference.batch_size,
        aux_shifts=config.eval.reference.aux_shifts, other_precision=config.eval.reference.other_precision,
        template=ChatTemplate.of(config.traces),
    )
    key = reference_key(config)
    store.put_bytes(key, (json.dumps(summary, indent=2) + "\n").encode())
    return key


def reference_key(config: PipelineConfig) -> str:
    """Where the reference decoder's result lives."""
    return reference_result_key(config.run)


def report(config: PipelineConfig, store: Store, result_keys: list[str], reference_key: str | None
           ) -> dict[str, Any]:
    """Fill in parity for every engine result, rewrite them, and render the report; returns rows for a table."""
    from draftline import report as report_lib
    from draftline.eval_result import EvalResult
    from draftline.parity import with_parity

    # None when every engine was refused before serving: nothing was left for the reference decoder to compare.
    reference_summary = json.loads(store.get_bytes(reference_key)) if reference_key else None
    engines = {e.engine: e for e in config.eval.engines}
    results = [EvalResult.model_validate_json(store.get_bytes(key)) for key in result_keys
               if store.exists(key)]  # an evaluation that failed before it could write its row has none
    basis, basis_said = parity_basis(config, store, reference_summary, results)
    for i, (key, result) in enumerate(zip([k for k in result_keys if store.exists(k)], results)):
        if result.status == "ok" and result.acceptance is not None and basis is not None:
            results[i] = with_parity(result, basis, config.eval.parity_threshold, engines.get(result.engine))
            store.put_bytes(key, (results[i].model_dump_json(indent=2) + "\n").encode())
    for result in results:
        publish_own_schedule(config, store, result)
    keys = report_lib.write_report(results, store, config.run, basis_said)
    rows = summary_rows(results, reference_summary, basis_said)
    from draftline.schedule_report import summary_lines

    return {"rows": rows, "markdown": store.get_bytes(keys["report.md"]).decode(), "report_key": keys["report.md"],
            "keys": keys, "result_keys": result_keys, "reference_key": reference_key,
            "schedules": summary_lines(results)}


def parity_basis(config: PipelineConfig, store: Store, reference_summary: dict | None, results: list
                 ) -> tuple[dict | None, str | None]:
    """(the figures parity compares the engines with, a sentence naming them when they are not the reference
    decoder's): the reference decoder's summary; where it was skipped, the training's offline estimate at the
    reference's k from the run's training record or the one the drafter's lineage names; else (None, why)."""
    if reference_summary is None or reference_summary.get("status") != "skipped":
        return reference_summary, None
    from draftline.regression import offline_estimate

    record = _training_record_of(config, store, results)
    estimate, kind = offline_estimate(record[1] if record else None, config.eval.reference_k)
    if estimate is None:
        return None, (f"{reference_summary['reason']}; the drafter has no training estimate at k="
                      f"{config.eval.reference_k} either, so parity is not measured")
    what = "replayed estimate" if kind == "replayed" else "per-step estimate"
    return ({"mean_acceptance_length": estimate, "basis": f"training's {what}"},
            f"{reference_summary['reason']}; parity compares the engines with the training's {what} of acceptance "
            f"length at k={config.eval.reference_k}, {estimate:.3f} (from {record[0]}), instead")


def _training_record_of(config: PipelineConfig, store: Store, results: list) -> tuple[str, bytes] | None:
    """(uri, bytes) of the run's training record, else of the one an evaluated drafter's lineage names."""
    key = training_record_key(config.run)
    if store.exists(key):
        return store.uri(key), store.get_bytes(key)
    for result in results:
        found = _record_at((result.drafter_lineage or {}).get("training_metrics"))
        if found:
            return found
    return None


def _record_at(uri: str | None) -> tuple[str, bytes] | None:
    """(uri, bytes) of a training record named by its URI, when this worker can read it."""
    if not uri:
        return None
    folder, _, name = uri.rstrip("/").rpartition("/")
    try:
        source = open_store(folder)
        return (uri, source.get_bytes(name)) if source.exists(name) else None
    except (ConfigError, OSError):  # moved, or a store this worker has no credentials for
        return None


def production_drafter(config: PipelineConfig, store: Store, drafter_uri: str) -> ProductionDrafter:
    """The nightly's drafter: its exports under `drafter_uri` (copied into this run when they live in another store),
    their fingerprints and lineage; refused when an engine's export is missing."""
    from draftline import regression

    return regression.production_drafter(drafter_uri, [e.engine for e in config.eval.engines], store, config.run)


def judge_regression(config: PipelineConfig, store: Store, production: ProductionDrafter, history_prefix: str,
                     evaluation_error: str | None = None) -> tuple[Verdict, list[EvalResult]]:
    """(Verdict, EvalResults): the evaluation of run `config.run` against each engine's history series;
    `evaluation_error` explains the engines that left no result."""
    from draftline import regression

    lineage = regression.lineage_name(production.lineage, production.uri.rstrip("/").rsplit("/", 1)[-1])
    results = regression.load_results(
        store, config.run, [e.engine for e in config.eval.engines], config.target.display_name,
        config.eval.prompts.rsplit("/", 1)[-1], config.eval.reference_k,
        drafter=production.uri, drafter_lineage=production.lineage, missing_reason=evaluation_error)
    # The production drafter's own training record (through its lineage), not this run's: it holds the offline
    # estimate the measured acceptance is compared with.
    verdict = regression.judge_all(results, regression.History(store, history_prefix), config.regression,
                                   fingerprints=production.fingerprints, lineage=lineage, drafter=production.uri,
                                   target=config.target.display_name, target_fingerprint=_target_fingerprint(config),
                                   training_record=lineage_training_record(store, production.exports))
    return verdict, results


def _target_fingerprint(config: PipelineConfig) -> str | None:
    """Tells a changed target from a changed drafter; only for a target in a local folder."""
    from draftline.target import target_fingerprint

    return target_fingerprint(config.target.path) if Path(config.target.path, "config.json").is_file() else None


def compare_with_history(config: PipelineConfig, store: Store, verdict: Verdict, history_prefix: str
                         ) -> dict[str, Any]:
    """comparison.md/.json and history.png in the run's regression folder; returns their store keys by name, and the
    table rows and the page (its plot left in the store) for the flow to publish."""
    from draftline import regression

    keys = regression.write_comparison(verdict, regression.History(store, history_prefix), config.regression, store,
                                       regression_prefix(config.run))
    return {"keys": keys, "rows": regression.comparison_rows(verdict, config.regression),
            "markdown": regression.comparison_markdown(verdict, config.regression, plot_name=None)}


def record_history(config: PipelineConfig, store: Store, verdict: Verdict, results: list[EvalResult],
                   history_prefix: str, accept_new_baseline: bool, nightly_run: str | None) -> list[str]:
    """Append tonight's records to the history, whatever the verdict; returns their store keys."""
    from draftline import regression

    return regression.record(verdict, results, regression.History(store, history_prefix),
                             accept=accept_new_baseline, nightly_run=nightly_run, drafter_uri=verdict.drafter)


def run_stage(name: str, config: PipelineConfig) -> Any:
    """`draftline <stage> CONFIG`: run one stage (or the whole pipeline through Prefect) and print its result."""
    import subprocess
    import sys

    if name == "run":
        # The pipeline is a Prefect flow; the library never imports Prefect, so it runs as its own process.
        data = json.dumps(config.model_dump(mode="json"))
        return subprocess.run([sys.executable, "-m", "flows.pipeline", "--config-json", data])
    store = open_store(config.store.root)
    if name == "traces":
        out = traces(config, store)
    elif name == "extract":
        out = extract(config, store)
    elif name == "train":
        out = train(config, store)
    elif name == "export":
        out = export(config, store)
    elif name in ("eval", "report"):
        exports = stored_exports(config, store)
        if name == "eval":
            keys = [evaluate_engine(config, e, exports, store) for e in config.eval.engines]
            ref = reference(config, exports, store)
        else:
            keys = [eval_result_key(config.run, e.engine) for e in config.eval.engines]
            ref = reference_key(config)
        out = report(config, store, [k for k in keys if store.exists(k)], ref)
        print_summary(config, out)
        return out
    else:
        raise ConfigError(f"unknown stage {name!r}; use traces, extract, train, export, eval, report or run")
    print(json.dumps(out, indent=2, default=str))
    return out


def stored_exports(config: PipelineConfig, store: Store) -> dict[str, str]:
    """The exports a previous `export` stage wrote, found by their manifests."""
    found = {}
    for fmt in config.export.formats:
        prefix = export_prefix(config.run, fmt)
        if store.read_manifest(prefix) is not None:
            found[fmt] = prefix
    if not found:
        raise ConfigError(f"run {config.run!r} has no drafter exports in {store.uri(config.run)}; "
                          "run `draftline export` first")
    return found
