"""Where each stage's artifacts live under a run in the store."""
from __future__ import annotations

import time

TRACES_STAGE = "traces"
HIDDEN_STAGE = "hidden"
# Online training keeps only its validation's hidden states, captured first so that every estimate reads the same.
HELD_OUT_STAGE = "hidden-val"
TRAIN_STAGE = "train"
EXPORT_STAGE = "export"
EVAL_STAGE = "eval"
REGRESSION_STAGE = "regression"

TRAINING_RECORD = "metrics.json"
TRAINED_DRAFTER = "drafter"


RUN_LEASE = "lease.json"


def run_lease_key(run: str) -> str:
    """`<run>/lease.json`: which live run owns the run name (draftline.run_lock), present while it runs."""
    return f"{run}/{RUN_LEASE}"


def stage_prefix(run: str, stage: str) -> str:
    """`<run>/<stage>`: the folder of one stage's artifacts (its shards, completion records and manifest)."""
    return f"{run}/{stage}"


def traces_prefix(run: str) -> str:
    """`<run>/traces`: the trace shards and their manifest."""
    return stage_prefix(run, TRACES_STAGE)


def trace_stats_key(run: str) -> str:
    """`<run>/traces/stats.json`: what the trace stage returned, written after every shard."""
    return f"{traces_prefix(run)}/stats.json"


def hidden_prefix(run: str) -> str:
    """`<run>/hidden`: the hidden-state shards and their manifest."""
    return stage_prefix(run, HIDDEN_STAGE)


def hidden_manifest_key(run: str) -> str:
    """`<run>/hidden/manifest.json`: exists only once every hidden-state shard does."""
    return f"{hidden_prefix(run)}/manifest.json"


def hidden_plan_key(run: str) -> str:
    """`<run>/hidden/_plan.json`: the cached grouping of traces into hidden-state shards."""
    return f"{hidden_prefix(run)}/_plan.json"


def this_start(logs_prefix: str) -> str:
    """`<logs_prefix>/<UTC time now>`: a folder of server logs per start of a stage, so that a retry keeps the log of
    the attempt it retries."""
    return f"{logs_prefix}/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"


def traces_logs_prefix(run: str) -> str:
    """`<run>/traces/logs`: the logs of the vLLM servers the traces stage started, a folder per start time."""
    return f"{traces_prefix(run)}/logs"


def hidden_logs_prefix(run: str) -> str:
    """`<run>/hidden/logs`: the capturing vLLM server's logs, a folder per start time (this_start)."""
    return f"{hidden_prefix(run)}/logs"


def held_out_prefix(run: str) -> str:
    """`<run>/hidden-val`: online training's validation hidden states (shards and manifest), the only states it keeps."""
    return stage_prefix(run, HELD_OUT_STAGE)


def train_prefix(run: str) -> str:
    """`<run>/train`: checkpoints, the training record and the trained drafter."""
    return stage_prefix(run, TRAIN_STAGE)


def training_record_in(prefix: str) -> str:
    """`<prefix>/metrics.json`: the training record under a training output prefix."""
    return f"{prefix}/{TRAINING_RECORD}"


def trained_drafter_in(prefix: str) -> str:
    """`<prefix>/drafter`: the trained drafter under a training output prefix."""
    return f"{prefix}/{TRAINED_DRAFTER}"


def training_record_key(run: str) -> str:
    """`<run>/train/metrics.json`: the run's training record."""
    return training_record_in(train_prefix(run))


def trained_drafter_prefix(run: str) -> str:
    """`<run>/train/drafter`: the run's trained drafter, before any export."""
    return trained_drafter_in(train_prefix(run))


def export_prefix(run: str, fmt: str) -> str:
    """`<run>/export/<fmt>`: the drafter exported in one engine's format."""
    return f"{stage_prefix(run, EXPORT_STAGE)}/{fmt}"


def eval_prefix(run: str, engine: str) -> str:
    """`<run>/eval/<engine>`: one engine's evaluation (result, logs, raw responses)."""
    return f"{stage_prefix(run, EVAL_STAGE)}/{engine}"


def eval_logs_prefix(run: str, engine: str) -> str:
    """`<run>/eval/<engine>/logs`: the logs of the servers an evaluation started, a folder per start time."""
    return f"{eval_prefix(run, engine)}/logs"


def eval_result_key(run: str, engine: str) -> str:
    """`<run>/eval/<engine>/result.json`: one engine's EvalResult."""
    return f"{eval_prefix(run, engine)}/result.json"


def reference_result_key(run: str) -> str:
    """`<run>/eval/reference/result.json`: the reference decoder's acceptance."""
    return eval_result_key(run, "reference")


def report_prefix(run: str) -> str:
    """`<run>/eval/report`: the evaluation report's page, plots and results."""
    return f"{stage_prefix(run, EVAL_STAGE)}/report"


def report_page_key(run: str) -> str:
    """`<run>/eval/report/report.md`: the evaluation report's markdown page."""
    return f"{report_prefix(run)}/report.md"


def report_results_key(run: str) -> str:
    """`<run>/eval/report/results.json`: every engine's EvalResult as the report shows it (with parity)."""
    return f"{report_prefix(run)}/results.json"


def regression_prefix(run: str) -> str:
    """`<run>/regression`: the nightly's comparison page, figures and plot."""
    return stage_prefix(run, REGRESSION_STAGE)
