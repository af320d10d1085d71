"""`draftline eval --drafter`: drafters draftline did not train, evaluated in their own run exactly as a trained one is.

Each drafter is read from its layout (draftline.drafter.readers) and checked against the target before anything
starts, written into the run as each configured engine's export with explicit ids, then checked, decoded by the
reference decoder and served like the pipeline's own exports. Several drafters share the prompts, engines,
concurrencies and one baseline server per engine, and a comparison page puts every later drafter beside the first.
No regression history is read or written.
"""
from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftline import stages
from draftline.config import PipelineConfig
from draftline.errors import ConfigError, EngineError
from draftline.layout import export_prefix
from draftline.store import Store, open_store

# Export formats of the engines (each engine serves its own; the reference decoder reads any of them).
ENGINE_FORMAT = {"vllm": "vllm", "sglang": "sglang"}
COMPARISON = "comparison"  # `<run>/comparison/`: the page that puts the drafters side by side
# Folder names that say which format an export is rather than which drafter: the label takes the parent's too.
_FORMAT_NAMES = {"vllm", "sglang", "speculators", "export", "drafter"}


@dataclass
class GivenDrafter:
    """A drafter of this evaluation: its label, where it came from, its run and its exports there."""

    label: str
    source: str
    config: PipelineConfig  # the evaluation's config with this drafter's run
    exports: dict[str, str]  # format -> store prefix
    read_said: str  # its layout and where its aux-layer ids came from


def drafter_labels(sources: list[str]) -> list[str]:
    """A short unique name per drafter: its folder's name (with its parent's where the name is a format's)."""
    labels = []
    for source in sources:
        parts = [p for p in str(source).rstrip("/").split("/") if p and p != "s3:"]
        name = "-".join(parts[-2:]) if len(parts) > 1 and parts[-1] in _FORMAT_NAMES else (parts or ["drafter"])[-1]
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._") or "drafter"
        if name == COMPARISON:
            name += "-drafter"
        label, n = name, 2
        while label in labels:
            label, n = f"{name}-{n}", n + 1
        labels.append(label)
    return labels


def default_run(sources: list[str]) -> str:
    """The run an evaluation of given drafters writes when --run names none: eval-<label> or compare-<a>-vs-<b>."""
    labels = drafter_labels(sources)
    name = f"eval-{labels[0]}" if len(labels) == 1 else "compare-" + "-vs-".join(labels)
    return name[:128].rstrip("-._")


def stage_drafter(config: PipelineConfig, store: Store, label: str, source: str, aux_layer_ids=None,
                  convention: str | None = None) -> GivenDrafter:
    """Read `source` (a folder or s3:// URI) in any layout, check it against the target, and publish it into
    `config.run` as each engine's export, the ids explicit in that engine's convention (one sentence on failure,
    before any server starts)."""
    from draftline.drafter.export import conversion_lineage, write_format
    from draftline.drafter.readers import local_copy, read_drafter

    formats = sorted({ENGINE_FORMAT[e.engine] for e in config.eval.engines})
    exports = {}
    with local_copy(source) as folder:
        read = read_drafter(folder, config.target.path, aux_layer_ids=aux_layer_ids, convention=convention)
        lineage = conversion_lineage(read, str(source), config.target.path, {"evaluated_as": label})
        with tempfile.TemporaryDirectory(prefix="draftline-given-") as tmp:
            for fmt in formats:
                written = write_format(read.model, fmt, Path(tmp) / fmt, config.target.path, lineage,
                                       config.eval.export_k, include_embeddings=read.has_embeddings, dtype=read.dtype)
                exports[fmt] = export_prefix(config.run, fmt)
                store.put_dir(exports[fmt], written)
    return GivenDrafter(label=label, source=str(source), config=config, exports=exports,
                        read_said=f"{read.layout_said}; {read.ids_source}")


def evaluate_drafters(config: PipelineConfig, sources: list[str], aux_layer_ids=None, convention: str | None = None,
                      store: Store | None = None) -> dict[str, Any]:
    """Evaluate the drafters at `sources` in run `config.run` (one drafter: the run itself; several: `<run>/<label>`
    each, and the comparison at `<run>/comparison/`). Returns {"drafters": [GivenDrafter], "reports": {label:
    stages.report's dict}, "comparison": the verdicts and keys, or None}. An engine that failed fails the call after
    every report is written."""
    if not sources:
        raise ConfigError("pass at least one --drafter: a drafter folder or an s3:// URI")
    store = store or open_store(config.store.root)
    labels = drafter_labels(sources)
    several = len(sources) > 1
    runs = {label: f"{config.run}/{label}" if several else config.run for label in labels}
    # Every drafter is read and checked before anything is measured.
    drafters = [stage_drafter(config.model_copy(update={"run": runs[label]}), store, label, source, aux_layer_ids,
                              convention) for label, source in zip(labels, sources)]
    refused = {d.label: stages.misread_exports(d.config, d.exports, store) for d in drafters}
    references = {}
    for d in drafters:  # before any engine: it times plain against speculative decoding on this machine
        if any(e.engine not in refused[d.label] for e in config.eval.engines):
            references[d.label] = stages.reference(d.config, d.exports, store)
    failures: list[Exception] = [exc for r in refused.values() for exc in r.values()]
    baselines: dict = {}  # one baseline server per engine for every drafter
    for engine in config.eval.engines:
        for d in drafters:
            if engine.engine in refused[d.label]:
                continue
            try:
                stages.evaluate_engine(d.config, engine, d.exports, store, baselines=baselines)
            except EngineError as exc:  # its failed row is in the store; the other drafters still run
                failures.append(exc)
    reports = {}
    for d in drafters:
        keys = [stages.engine_result_key(d.config, e) for e in config.eval.engines]
        reports[d.label] = stages.report(d.config, store, [k for k in keys if store.exists(k)],
                                         references.get(d.label))
    comparison = compare_drafters(config, store, drafters, reports, references) if several else None
    if failures:
        raise failures[0]
    return {"drafters": drafters, "reports": reports, "comparison": comparison}


def compare_drafters(config: PipelineConfig, store: Store, drafters: list[GivenDrafter], reports: dict,
                     references: dict) -> dict[str, Any]:
    """The comparison page of the evaluated drafters, every later one against the first."""
    import json

    from draftline.comparison import Compared, write_comparison
    from draftline.eval_result import EvalResult

    compared = []
    for d in drafters:
        results = [EvalResult.model_validate_json(store.get_bytes(k)) for k in reports[d.label]["result_keys"]
                   if store.exists(k)]
        ref_key = references.get(d.label)
        reference = json.loads(store.get_bytes(ref_key)) if ref_key else None
        compared.append(Compared(label=d.label, source=d.source, read_said=d.read_said, results=results,
                                 reference=reference, report_uri=store.uri(reports[d.label]["report_key"])))
    ev = config.eval
    engines = ", ".join(f"{e.engine} at concurrency {e.concurrency} with k={e.num_speculative_tokens}"
                        for e in ev.engines)
    setting = (f"The same target ({config.target.display_name}), prompts ({Path(ev.prompts).name}"
               f"{f', the first {ev.max_prompts}' if ev.max_prompts else ''}, at most {ev.max_new_tokens} new tokens, "
               f"temperature {ev.temperature}), engines ({engines}) and reference decoder settings for every drafter; "
               "each engine's baseline server was measured once and shared, and each drafter's parity is against "
               "its own reference decoder run.")
    return write_comparison(compared, store, f"{config.run}/{COMPARISON}", setting)
