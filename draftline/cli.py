"""`draftline ...`: the command line for running pipeline stages locally and checking configs."""
from __future__ import annotations

import argparse
import sys

from draftline.errors import ConfigError, report_failure

_STAGES = {
    "run": "run the whole pipeline as a Prefect flow (traces, extraction, training, export, evaluation)",
    "traces": "generate traces: the target answers the prompts (self-distillation)",
    "extract": "extract the target's aux and last hidden states for every trace into shards",
    "train": "train the EAGLE-3 drafter on the extracted shards (resumes from its last checkpoint)",
    "export": "write the trained drafter in each engine's format (vllm, sglang, speculators)",
    "eval": "evaluate the drafter in the engines and with the reference decoder; writes EvalResults",
    "report": "render the evaluation report (markdown + PNG) from stored EvalResults",
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftline",
        description="Train EAGLE-3 drafters and check that they speed up the target in vLLM and SGLang.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in _STAGES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("config", help="pipeline config (YAML), e.g. configs/demo.yaml")
        p.add_argument("--store", help="override store.root: a local folder or s3://bucket/prefix")
        p.add_argument("--run", help="override the run name (artifacts go to <store>/<run>/<stage>/)")
    cfg = sub.add_parser("config", help="check configuration files", description="check configuration files")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    v = cfg_sub.add_parser("validate", help="validate a pipeline config and print it with defaults filled in")
    v.add_argument("config", help="pipeline config (YAML)")
    v.add_argument("--quiet", action="store_true", help="print nothing on success")
    v.add_argument("--elsewhere", action="store_true",
                   help="the stages run on other machines: paths missing here are reported as unchecked, not as problems")
    v.add_argument("--check-store", action="store_true", help="also contact an S3 store (endpoint, credentials, bucket)")
    return parser


def load_with_overrides(path: str, store: str | None = None, run: str | None = None):
    """Load a pipeline config and apply the command-line overrides, validating them like the file."""
    from draftline.config import PipelineConfig, load_config, parse_config

    cfg = load_config(path)
    if store is None and run is None:
        return cfg
    data = cfg.model_dump(mode="json")
    if store is not None:
        data["store"] = {"root": store}
    if run is not None:
        data["run"] = run
    return parse_config(data, PipelineConfig, f"{path} (with command-line overrides)")


def _validate(args) -> int:
    import yaml

    from draftline.inputs import check_inputs

    cfg = load_with_overrides(args.config)
    report = check_inputs(cfg, here=not args.elsewhere, reach_store=args.check_store)
    if report.problems:
        for line in report.problems:
            print(f"draftline: {line}", file=sys.stderr)
        print(f"{args.config}: {len(report.problems)} problem(s) with what it names; the file itself is valid",
              file=sys.stderr)
        return 2
    if not args.quiet:
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        print("\n".join(report.lines()))
        print(f"{args.config}: valid" + (f", {len(report.unchecked)} input(s) unchecked" if report.unchecked else ""))
    return 0


def _run_stage(args) -> int:
    cfg = load_with_overrides(args.config, args.store, args.run)
    from draftline import stages
    from draftline.progress import terminal_progress

    if args.command == "run":
        # The pipeline in a process of its own, which prints through Prefect and its own sentence; its exit code is ours.
        return stages.run_stage(args.command, cfg).returncode
    with terminal_progress():
        stages.run_stage(args.command, cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "config":
            return _validate(args)
        return _run_stage(args)
    except Exception as exc:  # noqa: BLE001 - every failure becomes its sentence and exit code
        return report_failure(exc, bad_input=isinstance(exc, ConfigError))


if __name__ == "__main__":
    sys.exit(main())
