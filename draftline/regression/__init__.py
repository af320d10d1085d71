"""Nightly regression: an append-only history of evaluation figures per (target, engine, drafter lineage) in the
store, and a verdict that compares tonight's figures with the last good run and a rolling median, naming the cause.

The cause is told apart with the reference decoder, which does not depend on any engine:
- parity drop: the engine accepts less than the reference on the same drafter -> integration (engine or export);
- reference drop: the reference accepts less too -> the drafter or the target changed;
- throughput-only drop: acceptance held, the tokens per second fell -> engine (or machine) performance;
- estimate gap: the engine's acceptance over the training's offline estimate fell -> what the drafter validated on
  no longer predicts what it is served with.
"""
from __future__ import annotations

# EvalResult too, because tasks/regression.py reads it as regression.EvalResult.
from draftline.eval_result import EvalResult
from draftline.regression.history import (
    History, HistoryRecord, figures_of, lineage_name, offline_acceptance_length, offline_estimate,
)
from draftline.regression.inputs import ProductionDrafter, load_results, production_drafter
from draftline.regression.judgement import EVENT_NAME, RegressionDetected, Verdict, judge, judge_all, record
from draftline.regression.report import comparison_markdown, comparison_rows, write_comparison

# The names the tasks, flows and tests import from draftline.regression.
__all__ = [
    "EVENT_NAME", "EvalResult", "History", "HistoryRecord", "ProductionDrafter", "RegressionDetected", "Verdict",
    "comparison_markdown", "comparison_rows", "figures_of", "judge", "judge_all", "lineage_name", "load_results",
    "offline_acceptance_length", "offline_estimate", "production_drafter", "record", "write_comparison",
]
