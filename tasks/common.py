"""What every draftline task shares: retry only transient failures, cache on inputs + source, artifacts that link the
store, the library's log lines in the run's log, and each stage's wall time with its cache hits."""
from __future__ import annotations

import base64
import contextlib
import functools
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy
from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging.handlers import APILogHandler
from prefect.tasks import exponential_backoff

# transformers resolves its names lazily and that first import is not thread-safe; tasks run in threads, so
# the names the stages use are resolved here, once, on import.
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

from draftline.errors import BUG_LINE, DraftlineError, is_transient
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


# The state names of this process's cached tasks as they complete: "Cached" when the result came from cache and
# the task's body did not run.
_OUTCOMES: list[str] = []


def _record_outcome(task, task_run, state) -> None:
    _OUTCOMES.append(state.name)


# The options of every task whose result a rerun may take from cache.
CACHED_TASK: dict[str, Any] = {"cache_policy": CACHED, "persist_result": True, "on_completion": [_record_outcome]}


@contextlib.contextmanager
def timed_stage(name: str, rows: list[dict]) -> Iterator[None]:
    """Append {stage, wall_s, cached} to rows once the stage's block is done: cached is True when Prefect served
    every task the stage ran from cache, None when the stage ran its tasks in other processes (deployments)."""
    first, started = len(_OUTCOMES), time.monotonic()
    yield
    outcomes = _OUTCOMES[first:]
    rows.append({"stage": name, "wall_s": round(time.monotonic() - started, 1),
                 "cached": all(o == "Cached" for o in outcomes) if outcomes else None})


class _RunLogHandler(APILogHandler):
    """Prefect's API log handler, for records logged inside a flow or task run only (the library also logs from
    plain threads and outside any run, where Prefect would warn on every line)."""

    def emit(self, record: logging.LogRecord) -> None:
        if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
            super().emit(record)


def relay_library_logs() -> None:
    """draftline's own log lines (training steps, shards done, engine start phases) at INFO and above go to the
    terminal and to the run's log in the Prefect UI, as Prefect's own lines do."""
    library = logging.getLogger("draftline")
    if not any(isinstance(h, _RunLogHandler) for h in library.handlers):
        library.addHandler(_RunLogHandler())
    if library.level == logging.NOTSET or library.level > logging.INFO:
        library.setLevel(logging.INFO)


# Flow runs of this process whose log ends with their final table.
_FINAL_TABLE_RUNS: set[str] = set()


def final_table_logged(flow_run_id: str) -> None:
    """The flow run has logged its final table, which stays its log's last line. The lines logged so far are sent to
    the API now, before the run turns Completed: a worker stopped as soon as it sees that state (a pod scaled down, a
    test's teardown) would otherwise take the last batch, the table, with it."""
    _FINAL_TABLE_RUNS.add(str(flow_run_id))
    APILogHandler().flush()


class _DraftlineErrorsWithoutTraceback(logging.Filter):
    """A draftline error is the user's to act on and says so in its sentence: the first line Prefect logs about it in a
    flow run is that sentence alone (no repr, no traceback), and Prefect's later lines re-raising it in the same run
    are dropped; its "Finished in state Failed(...)" line stays. Any other exception is a bug: its traceback stays,
    with a line saying so. A run that logged its final table (final_table_logged) ends its log with it: Prefect's
    "Finished in state Completed()" after it is dropped (the run's state says so in the UI and in `--watch`)."""

    def __init__(self) -> None:
        super().__init__()
        self._logged: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if "_record_outcome" in str(record.msg):  # Prefect announces every hook it runs; this one is bookkeeping
            return False
        if (str(getattr(record, "flow_run_id", None)) in _FINAL_TABLE_RUNS and not hasattr(record, "task_run_id")
                and str(record.msg).startswith("Finished in state Completed(")):
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, DraftlineError):
            record.exc_info, record.exc_text = None, None
            key = (str(getattr(record, "flow_run_id", None)), str(exc))
            if key in self._logged:
                return False
            self._logged.add(key)
            record.msg, record.args = str(exc), ()
        elif isinstance(exc, Exception) and not getattr(record, "_draftline_marked", False):
            record.msg = f"{record.msg}\n{BUG_LINE}"
            record._draftline_marked = True
        return True


def quiet_draftline_errors() -> None:
    """Install the filter on the loggers Prefect's engines report task and flow failures on (once per process)."""
    shared = _DraftlineErrorsWithoutTraceback()  # one, so that a task's failure line and its flow's are told apart
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DraftlineErrorsWithoutTraceback) for f in logger.filters):
            logger.addFilter(shared)


relay_library_logs()
quiet_draftline_errors()


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
