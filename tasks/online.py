"""Prefect tasks of online training: the engine side and the trainer, run at the same time by one flow, each with
its own log and progress, so that a failure names the side that failed."""
from __future__ import annotations

from prefect import get_run_logger, task
from prefect.states import Cancelled, State

from draftline import stages
from draftline.config import PipelineConfig
from tasks.common import CACHED_TASK, store_at

# No retries on either side: a rerun resumes the trainer from its last checkpoint and restarts the engine side with
# it, while a retry of one side alone would wait for the other, which has stopped. The engine side restarts its own
# server when it dies mid-feed, as every engine start is supervised. Both are cached alike: each completes only when
# the training did.


@task(name="online-engine", **CACHED_TASK)
def feed_engine(config: PipelineConfig) -> dict | State:
    """The capturing vLLM server feeding the trainer until it is done; cancelled, not failed, when the trainer failed
    (the trainer's task says why)."""
    result = stages.online_engine(config, store_at(config.store.root), say=get_run_logger().info)
    if result.get("trainer") != "finished":
        return Cancelled(message="the trainer stopped before it finished, so the engine side stopped with it; the "
                         "online-trainer task says why")
    return result


@task(name="online-trainer", **CACHED_TASK)
def train_from_engine(config: PipelineConfig) -> dict:
    """Train on what the engine side captures; a rerun resumes from the last checkpoint in the store."""
    return stages.online_trainer(config, store_at(config.store.root), on_line=get_run_logger().info)


def prepare(config: PipelineConfig) -> None:
    stages.online_prepare(config)


def trainer_done(config: PipelineConfig, completed: bool) -> None:
    """Tell the engine side the trainer has ended (a trainer served from cache or killed never says so itself)."""
    stages.online_trainer_ended(config, completed)


def clean_up(config: PipelineConfig) -> None:
    stages.online_clean_up(config)
