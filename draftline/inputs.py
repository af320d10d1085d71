"""What a pipeline config names on disk (target, prompts, warm start, store), checked in seconds without loading a model."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from draftline.aux_ids import AuxLayerIds
from draftline.config import PipelineConfig
from draftline.errors import ConfigError


@dataclass
class InputReport:
    """One line per input: checked and fine, a problem (one sentence each), or left unchecked and why."""

    ok: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return ([f"ok: {x}" for x in self.ok] + [f"problem: {x}" for x in self.problems]
                + [f"unchecked: {x}" for x in self.unchecked])


def _check(report: InputReport, what: str, check) -> None:
    try:
        said = check()
    except ConfigError as exc:
        report.problems.append(str(exc).splitlines()[0])
    else:
        report.ok.append(said or what)


def _target(config: PipelineConfig) -> str:
    from draftline.target import _weight_files, num_layers, read_target_config

    root = Path(config.target.path)
    cfg = read_target_config(root)  # config.json, model_type; text_config for wrappers such as Kimi-K2.5
    if not _weight_files(root):
        raise ConfigError(f"target.path {root} has no weights (*.safetensors); point it at a full checkpoint")
    layers = num_layers(cfg)
    ids = AuxLayerIds.for_target(config.extract.aux_layer_ids, layers).as_list()
    arch = (cfg.get("architectures") or ["?"])[0]
    return f"target.path {root}: {arch}, {layers} layers, aux layers {ids} (vLLM convention)"


def _tokenizer(config: PipelineConfig) -> str:
    root = Path(config.target.path)
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ConfigError(f"target.path {root} has no tokenizer files; copy the model's tokenizer there")
    return f"target.path {root}: a tokenizer"


def _prompts(field_name: str, path: str) -> str:
    from draftline.traces import read_prompts

    try:
        prompts = read_prompts(path)
    except ConfigError as exc:  # read_prompts names traces.prompts; say which field this file came from
        raise ConfigError(str(exc).replace("traces.prompts", field_name)) from None
    return f"{field_name} {path}: {len(prompts)} prompts"


def _warm_start(path: str) -> str:
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"train.warm_start {path} has no config.json; point it at a drafter directory (the "
                          "EAGLE/SpecForge layout, the speculators format or a draftline export)")
    return f"train.warm_start {path}: a drafter directory (its weights are read by the training stage)"


def _cpu_kernels(config: PipelineConfig) -> str | None:
    """A vLLM evaluation on this machine's CPU that its kernels cannot serve, found before any training."""
    import json

    import torch

    from draftline.engines.preflight import cpu_block_size_conflict, runs_elsewhere

    on_cpu = [e for e in config.eval.engines
              if e.engine == "vllm" and not e.require_gpu and not runs_elsewhere(e) and not torch.cuda.is_available()]
    if not on_cpu:
        return None
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    target = json.loads(Path(config.target.path, "config.json").read_text())
    drafter = {"kv_lora_rank": 1} if config.drafter.attention == "mla" else {}
    why = cpu_block_size_conflict(target, drafter, amx)
    if why:
        raise ConfigError(f"eval.engines: {why}")
    return "eval.engines: no known vLLM CPU kernel conflict between this target and the draft layer"


def _store(root: str) -> str:
    from draftline.store import open_store

    open_store(root, check=True)  # S3: endpoint, credentials and bucket; a local folder is made on first write
    return f"store.root {root}: reachable" if root.startswith("s3://") else f"store.root {root}: a local folder"


# What each stage reads of the config's inputs on its own worker (a deployed stage checks these before its work):
# the stages that turn prompts into tokens need the target's tokenizer, the others its config and weights only.
STAGE_INPUTS = {
    "traces": ("target.path", "target.tokenizer", "traces.prompts", "store.root"),
    "extraction": ("target.path", "store.root"),
    "training": ("target.path", "train.warm_start", "store.root"),
    "reference": ("target.path", "target.tokenizer", "eval.prompts", "store.root"),
    "evaluation": ("target.path", "target.tokenizer", "eval.prompts", "store.root"),
}


def check_inputs(config: PipelineConfig, *, here: bool = True, reach_store: bool = False,
                 needs: tuple[str, ...] | None = None) -> InputReport:
    """Check every input the config names (or only those in `needs`, e.g. STAGE_INPUTS["traces"]). `here=False`:
    the stages run on other machines, so a path that does not exist on this one is reported as unchecked rather than
    as a problem."""
    wanted = (lambda name: True) if needs is None else (lambda name: name in needs)
    report = InputReport()
    paths = [("target.path", config.target.path, lambda: _target(config)),
             ("traces.prompts", config.traces.prompts, lambda: _prompts("traces.prompts", config.traces.prompts)),
             ("eval.prompts", config.eval.prompts, lambda: _prompts("eval.prompts", config.eval.prompts))]
    if config.train.warm_start:
        paths.append(("train.warm_start", config.train.warm_start, lambda: _warm_start(config.train.warm_start)))
    for name, path, check in paths:
        if not wanted(name):
            continue
        if not here and not Path(path).exists():
            report.unchecked.append(f"{name} {path} is not on this machine (the stage's worker must have it)")
            continue
        _check(report, name, check)
    if wanted("target.tokenizer") and Path(config.target.path).is_dir():
        _check(report, "target.tokenizer", lambda: _tokenizer(config))
    if wanted("eval.engines") and here and Path(config.target.path, "config.json").is_file():
        _check(report, "eval.engines", lambda: _cpu_kernels(config))
    root = config.store.root
    if wanted("store.root"):
        if root.startswith("s3://") and not reach_store:
            report.unchecked.append(f"store.root {root}: not contacted (add --check-store)")
        else:
            _check(report, "store.root", lambda: _store(root))
    return report


def require_inputs(config: PipelineConfig, what: str, *, here: bool = True,
                   needs: tuple[str, ...] | None = None) -> InputReport:
    """check_inputs, raising one ConfigError that lists every problem (one sentence each) before `what` starts."""
    report = check_inputs(config, here=here, needs=needs)
    if report.problems:
        raise ConfigError(f"{what} cannot start, its inputs are wrong:\n" + "\n".join(report.problems))
    return report
