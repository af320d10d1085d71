"""What every draftline task shares: retry only transient failures, cache on inputs + source, artifacts that link the store."""
from __future__ import annotations

import base64
import functools
import re
import uuid
from dataclasses import dataclass
from typing import Any

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy
from prefect.tasks import exponential_backoff

# transformers resolves its names lazily and that first import is not thread-safe; tasks run in threads, so
# the names the stages use are resolved here, once, on import.
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

from draftline.errors import is_transient
from draftline.store import Store, open_store

RUN_ID_FILE = "run-id"


def store_run_id(store: Store, run: str) -> str:
    """The identity of a run's artifacts: made once per run folder, gone when the folder is deleted."""
    key = f"{run}/{RUN_ID_FILE}"
    if not store.exists(key):
        store.put_bytes(key, uuid.uuid4().hex.encode())
    return store.get_bytes(key).decode().strip()


@dataclass
class StoreRun(CachePolicy):
    """Cache key part naming the store's copy of the run, so deleting a run's artifacts invalidates its cache."""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str | None:
        config = (inputs or {}).get("config")
        if config is None:
            return None
        return store_run_id(store_at(config.store.root), config.run)


# A rerun of the pipeline is served from these results: keyed on the task's inputs (configs, store URI, run,
# shard index), its source and the store's copy of the run, persisted in Prefect's result storage, so finished
# stages are skipped across runs while their artifacts exist.
CACHED = INPUTS + TASK_SOURCE + StoreRun()


def retry_if_transient(task, task_run, state) -> bool:
    """Prefect retry condition: retry engine loads and network hiccups, never bad input or integrity errors."""
    try:
        state.result()
    except Exception as exc:  # the task's own exception, re-raised by Prefect
        return is_transient(exc)
    return False


def transient_retries(retries: int = 2, base_delay_s: float = 10.0) -> dict[str, Any]:
    """Task options for steps that touch the network or load models: exponential backoff with jitter."""
    return {
        "retries": retries,
        "retry_delay_seconds": exponential_backoff(backoff_factor=base_delay_s),
        "retry_jitter_factor": 0.5,
        "retry_condition_fn": retry_if_transient,
    }


@functools.lru_cache(maxsize=8)
def store_at(uri: str) -> Store:
    """One Store per URI and process (boto3 clients are reusable across tasks)."""
    return open_store(uri)


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    raw = "-".join(parts).lower()
    return "".join(c if c.isalnum() else "-" for c in raw).strip("-")[:100]


def publish_table(key: str, rows: list[dict], description: str) -> None:
    create_table_artifact(key=artifact_key(key), table=rows, description=description)


def publish_markdown(key: str, markdown: str, description: str, images_from: tuple[Store, str] | None = None) -> None:
    """A markdown artifact; with images_from=(store, prefix) its relative PNG images are read from that store folder
    and inlined (inline_images), so the UI shows the plots and not broken links."""
    if images_from is not None:
        markdown = inline_images(markdown, *images_from)
    create_markdown_artifact(key=artifact_key(key), markdown=markdown, description=description)


_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s:]+\.png)\)")


def inline_images(markdown: str, store: Store, prefix: str) -> str:
    """`![alt](plot.png)` with plot.png under `prefix` in the store becomes `![alt](data:image/png;base64,...)`; an
    image the store lacks, or one with a scheme, is left as written."""
    def inline(match: re.Match) -> str:
        key = f"{prefix.rstrip('/')}/{match.group(2)}"
        if not store.exists(key):
            return match.group(0)
        return f"![{match.group(1)}](data:image/png;base64,{base64.b64encode(store.get_bytes(key)).decode()})"

    return _IMAGE.sub(inline, markdown)


def publish_link(key: str, store: Store, store_key: str, description: str) -> None:
    """A link artifact to a store object (file:// for a local store, s3:// for S3)."""
    create_link_artifact(key=artifact_key(key), link=store.uri(store_key), link_text=store_key, description=description)
