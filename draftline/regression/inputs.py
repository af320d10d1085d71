"""What the nightly judges: the production drafter's exports under one URI, and each engine's evaluation result."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from draftline.errors import ConfigError
from draftline.eval_result import EvalResult
from draftline.layout import eval_result_key, export_prefix, report_results_key


class ProductionDrafter(BaseModel):
    """The drafter the nightly evaluates: one export per engine format, found under one store URI."""

    uri: str
    exports: dict[str, str]  # format -> prefix of that export in the pipeline's store (what the evaluation reads)
    fingerprints: dict[str, str]  # format -> sha256 over the export's weights and config, to tell a changed drafter
    lineage: dict[str, Any] = {}  # draftline.json of the first export


def _prefix_within(store, uri: str) -> str | None:
    """`uri` as a prefix of `store` when it lies inside it, else None."""
    root = store.uri("")
    if uri.startswith("s3://") or root.startswith("s3://"):
        root, uri = root.rstrip("/"), uri.rstrip("/")
        if uri == root:
            return ""
        return uri[len(root) + 1:] if uri.startswith(root + "/") else None
    try:
        rel = Path(uri).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return None
    return "" if rel == "." else rel


def _fingerprint(source, fmt: str, keys: list[str]) -> str:
    """Digest of an export's files except its lineage note and its serve/ folder (re-exporting the same weights keeps
    the digest, and so does a new schedule measured for them)."""
    import hashlib

    manifest = source.read_manifest(fmt)
    entries = {e.key: e.sha256 for e in manifest} if manifest else {}
    digest = hashlib.sha256()
    for key in sorted(k for k in keys if k.startswith(fmt + "/")):
        name = key[len(fmt) + 1:]
        if name in ("manifest.json", "draftline.json") or name.startswith("serve/"):
            continue
        digest.update(f"{name}:{entries.get(key) or source.hash_object(key).sha256}\n".encode())
    return digest.hexdigest()


def engine_exports(uri: str, formats: list[str], keys: list[str] | None = None) -> list[str]:
    """The engine formats exported under `uri` (`<format>/config.json`); refused when none is, or when one of
    `formats` (the engines to evaluate) is missing. `keys`: the listing of `uri`, when already read."""
    from draftline.store import open_store

    keys = open_store(uri).list("") if keys is None else keys
    present = sorted({k.split("/", 1)[0] for k in keys if k.count("/") == 1 and k.endswith("/config.json")})
    if not present:
        raise ConfigError(f"drafter {uri} holds no engine export (a folder such as vllm/ with config.json); pass the "
                          "exports folder that the export stage wrote, e.g. ./runs/demo/export")
    missing = [f for f in formats if f not in present]
    if missing:
        raise ConfigError(f"drafter {uri} has no {', '.join(missing)} export but eval.engines lists "
                          f"{', '.join(missing)}; export that format (export.formats) or remove the engine")
    return present


def production_drafter(uri: str, formats: list[str], store, run: str) -> ProductionDrafter:
    """Find the exports under `uri` (`<format>/config.json`) and fingerprint them; exports outside the pipeline's
    `store` are copied to `<run>/export/` there, so the evaluation reads them like its own and the night keeps them."""
    from draftline.store import copy_tree, open_store

    source = open_store(uri)
    keys = source.list("")
    present = engine_exports(uri, formats, keys)
    inside = _prefix_within(store, uri)
    exports = {}
    for fmt in present:
        if inside is not None and source.read_manifest(fmt) is not None:
            exports[fmt] = f"{inside}/{fmt}" if inside else fmt
            continue
        # Elsewhere, or without the manifest the evaluation verifies against: tonight's run gets a verified copy.
        dest = export_prefix(run, fmt)
        if copy_tree(source, fmt, store, dest) is None:
            store.write_manifest(dest, [k for k in store.list(dest + "/") if not k.endswith("/manifest.json")])
        exports[fmt] = dest
    first = next((f for f in formats if f in present), present[0])
    lineage = json.loads(source.get_bytes(f"{first}/draftline.json")) if source.exists(f"{first}/draftline.json") \
        else {}
    return ProductionDrafter(uri=uri, exports=exports, lineage=lineage,
                             fingerprints={fmt: _fingerprint(source, fmt, keys) for fmt in present})


def load_results(store, run: str, engines: list[str], target: str, prompt_set: str, k: int,
                 drafter: str = "", drafter_lineage: dict[str, Any] | None = None,
                 missing_reason: str | None = None) -> list[EvalResult]:
    """Each engine's EvalResult of an evaluation run: the report's results.json (with parity) first, else the
    engine's own result.json; an engine with neither is a failed result (it crashed before writing one)."""
    found: dict[str, EvalResult] = {}
    report_key = report_results_key(run)
    if store.exists(report_key):
        for item in json.loads(store.get_bytes(report_key)):
            r = EvalResult.model_validate(item)
            found.setdefault(r.engine, r)
    out = []
    for engine in engines:
        if engine not in found and store.exists(eval_result_key(run, engine)):
            found[engine] = EvalResult.model_validate_json(store.get_bytes(eval_result_key(run, engine)))
        out.append(found.get(engine) or EvalResult(
            run=run, engine=engine, engine_version=None, status="failed",
            reason=(f"no result at {store.uri(eval_result_key(run, engine))}: the evaluation stopped before "
                    f"writing one ({missing_reason or 'see its flow run log'})"),
            hardware="unknown", target=target, target_path="", drafter=drafter, drafter_path="",
            drafter_lineage=drafter_lineage or {}, prompt_set=prompt_set, num_speculative_tokens=k))
    return out
