"""The inputs a flow reads (target, prompts, warm start, store), checked as its first task on the worker that reads them."""
from __future__ import annotations

from prefect import get_run_logger, task

from draftline.config import PipelineConfig
from draftline.inputs import STAGE_INPUTS, require_inputs


@task(name="check-inputs")
def check_inputs(config: PipelineConfig, stage: str | None = None, here: bool = True) -> list[str]:
    """Fail the flow in seconds, naming every wrong input, before minutes of loading and computing start.

    stage None: everything the run reads; `here=False` when its stages run on other workers, where a path missing on
    this one may well exist (those workers check it themselves when their stage starts)."""
    needs = STAGE_INPUTS[stage] if stage else None
    report = require_inputs(config, f"the {stage} stage" if stage else f"run {config.run}", here=here, needs=needs)
    logger = get_run_logger()
    if stage is None:  # the run's own check says what each input is, once
        for line in report.lines():
            logger.info("input %s", line)
    else:  # a stage's check repeats it only where it found something to say
        logger.info("inputs of the %s stage: %d ok", stage, len(report.ok))
        for line in report.unchecked:
            logger.info("input unchecked: %s", line)
    return report.lines()
