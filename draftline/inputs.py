"""What a pipeline config names on disk (target, prompts, warm start, store), checked in seconds without loading a model."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from draftline.aux_ids import AuxLayerIds
from draftline.config import PipelineConfig, ServerSettings
from draftline.engines.parallel import server_heads_problem
from draftline.errors import ConfigError
from draftline.served_context import LONGER_CONTEXT_ENV, context_lifted, engine_context


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


def _target(config: PipelineConfig, warm_start: bool = True) -> str:
    """The target checkpoint, its aux layers, the heads of every engine server and of the draft layer training will
    build (from the warm start when `warm_start` and it is on this machine)."""
    from draftline.target import _weight_files, num_layers, read_target_config

    root = Path(config.target.path)
    cfg = read_target_config(root)  # config.json, model_type; text_config for wrappers such as Kimi-K2.5
    if not _weight_files(root):
        raise ConfigError(f"target.path {root} has no weights (*.safetensors); point it at a full checkpoint")
    layers = num_layers(cfg)
    ids = AuxLayerIds.for_target(config.extract.aux_layer_ids, layers).as_list()
    drafter = _drafter_heads(config, cfg, ids, warm_start)
    for field_name, settings in engine_servers(config):
        # The draft layer runs beside the target in the evaluations' servers, at the target's tensor parallelism.
        models = [("the target", cfg)] + ([("the drafter", drafter)]
                                          if field_name.startswith("eval.") and drafter else [])
        for what, model in models:
            why = server_heads_problem(model, settings, f"{field_name}.tensor_parallel_size", what)
            if why:
                raise ConfigError(why)
    arch = (cfg.get("architectures") or ["?"])[0]
    return f"target.path {root}: {arch}, {layers} layers, aux layers {ids} (vLLM convention)"


def engine_servers(config: PipelineConfig) -> list[tuple[str, ServerSettings]]:
    """(field, ServerSettings) of every engine server the pipeline starts: traces (unless an endpoint answers them)
    and extraction through vLLM, each evaluation."""
    servers = [("traces.vllm", config.traces.vllm)] if config.traces.backend == "vllm" and not config.traces.endpoint \
        else []
    # Online training (train.source: engine) starts extract.vllm's server inside the training stage.
    online = config.train.source == "engine"
    servers += [("extract.vllm", config.extract.vllm)] if config.extract.backend == "vllm" or online else []
    return servers + [(f"eval.engines.{i}", e) for i, e in enumerate(config.eval.engines)]


def _context_problem(target: dict, field_name: str, settings: ServerSettings, here: bool = True) -> str | None:
    """A server's max_model_len beyond the target's context, which vLLM and SGLang refuse at start: an evaluation's
    only after traces, extraction and training."""
    engine = getattr(settings, "engine", "vllm")
    context = engine_context(target, engine)
    if not settings.max_model_len or context is None or settings.max_model_len <= context[0]:
        return None
    if context_lifted(settings, engine, here):
        return None
    env = LONGER_CONTEXT_ENV[engine]
    limit, source = context
    return (f"{field_name}.max_model_len {settings.max_model_len} is longer than the target's context ({limit} tokens, "
            f"from its {source}), which {engine} refuses to serve; set it to {limit} or less "
            f"(or {env}=1 in {field_name}.env if the target is known to read further)")


def _contexts(config: PipelineConfig, servers: list[tuple[str, ServerSettings]], here: bool) -> str:
    """The context length of each of these engine servers (from engine_servers) against the target's."""
    from draftline.target import read_target_config

    target = read_target_config(Path(config.target.path))
    for field_name, settings in servers:
        why = _context_problem(target, field_name, settings, here)
        if why:
            raise ConfigError(why)
    named = ", ".join(f + ".max_model_len" for f, _ in servers)
    context = engine_context(target, "vllm")
    if context is None:  # neither engine bounds the length then
        return f"{named}: the target's config.json states no context length"
    return f"{named}: within the target's context ({context[0]} tokens in vLLM)"


def _drafter_heads(config: PipelineConfig, target: dict, aux_ids: list[int], warm_start: bool) -> dict | None:
    """The heads of the draft layer training will build (its sizing refusals, such as heads that do not divide the
    hidden size or MLA on a target without a latent, raised now rather than after traces and extraction); None for a
    warm start out of scope or not on this machine, whose sizes are checked when its export is evaluated."""
    from draftline.drafter.target_sizing import config_for_target
    from draftline.drafter.warm_start import warm_start_config

    start = config.train.warm_start
    if start and not (warm_start and Path(start, "config.json").is_file()):
        return None
    try:
        layer = warm_start_config(start, target, config.drafter, aux_ids) if start else \
            config_for_target(target, config.drafter, aux_ids)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # a size of the wrong type in a config.json: one line, not a traceback
        source = f"train.warm_start {start}" if start else f"target.path {config.target.path}"
        raise ConfigError(f"{source}: a size in its config.json cannot be read ({exc}); correct that file") from None
    if layer.attention == "mla":  # one latent: only the query heads split
        return {"num_attention_heads": layer.num_attention_heads, "kv_lora_rank": layer.kv_lora_rank}
    return {"num_attention_heads": layer.num_attention_heads, "num_key_value_heads": layer.num_key_value_heads}


def _tokenizer(config: PipelineConfig) -> str:
    root = Path(config.target.path)
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ConfigError(f"target.path {root} has no tokenizer files; copy the model's tokenizer there")
    return f"target.path {root}: a tokenizer"


# `config validate` and a stage's own check read this many records of each prompt set, not a whole dataset.
VALIDATE_RECORDS = 1000


def _reading(config: PipelineConfig, field_name: str) -> dict:
    """How the stage that reads `field_name` reads it: traces as traces.turns and responses say, eval at last turns."""
    t = config.traces
    if field_name == "traces.prompts":
        return {"turns": t.turns, "responses": t.responses, "on_bad_record": t.on_bad_record}
    return {"turns": "last", "responses": "regenerate", "on_bad_record": "fail"}


def _prompts(config: PipelineConfig, field_name: str, path: str) -> str:
    from draftline.conversations import read_prompt_set

    prompts = read_prompt_set(path, field_name, limit=VALIDATE_RECORDS, **_reading(config, field_name))
    _images(config, field_name, path, prompts)
    said = f"{field_name} {path}: {len(prompts)} records" + (" (the first ones read)" if prompts.read
                                                            >= VALIDATE_RECORDS else "")
    if prompts.skipped:
        said += f", {len(prompts.skipped)} bad ones to skip (the first: {prompts.skipped[0]})"
    return said


def _images(config: PipelineConfig, field_name: str, path: str, prompts) -> None:
    """Image parts go to the engines' chat API: refused for a text-only target; else each image is read and checked
    (the eval prompts' always, the traces' as traces.on_bad_record says)."""
    from draftline.images import engine_messages, image_parts, prompts_base, target_takes_images, text_only_refusal

    records = [r for r in prompts if image_parts(r.get("messages") or [])]
    if not records:
        return
    if Path(config.target.path, "config.json").is_file() and not target_takes_images(config.target.path):
        raise text_only_refusal(records[0], prompts.origin(records[0]["id"]), config.target.path)
    for record in records:
        try:
            engine_messages(record, prompts.origin(record["id"]), prompts_base(path))
        except ConfigError:
            if field_name == "eval.prompts" or config.traces.on_bad_record != "skip":
                raise


def _template_file(path: str) -> str:
    if not Path(path).is_file():
        raise ConfigError(f"traces.chat_template {path}: no such file; point it at a Jinja chat template")
    return f"traces.chat_template {path}: a file"


def _chat_template(config: PipelineConfig, wanted) -> str:
    """The template renders and opens the answer, and renders the first prompt of each record read of the prompt sets
    `wanted` names (those the checked stages read)."""
    from draftline import turns as turn_lib
    from draftline.chat_template import ChatTemplate
    from draftline.conversations import BadRecord, read_prompt_set

    template = ChatTemplate.of(config.traces)
    if not config.traces.use_chat_template:
        return "traces.use_chat_template is false: the contents of messages are joined, not templated"
    root = Path(config.target.path)
    try:
        # The fast tokenizer's class alone where its files are: the auto classes import every model's code (seconds).
        if (root / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast as Tokenizer
        else:
            from transformers import AutoTokenizer as Tokenizer
        tok = Tokenizer.from_pretrained(root)
    except Exception as exc:  # transformers raises what the files happen to trip (KeyError, OSError, ...)
        raise ConfigError(f"target.path {config.target.path}: its tokenizer does not load ({type(exc).__name__}: "
                          f"{exc}); copy the model's own tokenizer files there") from None
    template.check(tok)
    refused = []
    for field_name, path in (("traces.prompts", config.traces.prompts), ("eval.prompts", config.eval.prompts)):
        if not wanted(field_name) or path.startswith("s3://") or not Path(path).exists():
            continue
        reading = {**_reading(config, field_name), "on_bad_record": "skip"}  # _prompts reports what is unreadable
        prompts = read_prompt_set(path, field_name, limit=VALIDATE_RECORDS, **reading)
        for record in prompts:
            try:
                slots = turn_lib.answer_slots(record, reading["turns"], reading["responses"])
                d = turn_lib.Dialogue(record, prompts.origin(record["id"]), slots)  # the engines take images too
                if d.slots:
                    turn_lib.turn_prompt(d, 0, tok, template, True)
            except BadRecord as bad:
                if field_name == "eval.prompts" or config.traces.on_bad_record != "skip":
                    raise
                refused.append(bad)
    said = f"traces.chat_template: {template.describe(tok)['template']} with kwargs {template.kwargs} renders the prompts"
    return said + (f"; {len(refused)} records it refuses will be skipped" if refused else "")


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
    "traces": ("target.path", "target.tokenizer", "traces.prompts", "traces.chat_template", "store.root",
               "traces.vllm"),
    "extraction": ("target.path", "store.root", "extract.vllm"),
    "training": ("target.path", "train.warm_start", "store.root", "extract.vllm"),
    "reference": ("target.path", "target.tokenizer", "eval.prompts", "traces.chat_template", "store.root"),
    "evaluation": ("target.path", "target.tokenizer", "eval.prompts", "traces.chat_template", "store.root",
                   "eval.engines.max_model_len"),
}


def check_inputs(config: PipelineConfig, *, here: bool = True, reach_store: bool = False,
                 needs: tuple[str, ...] | None = None) -> InputReport:
    """Check every input the config names (or only those in `needs`, e.g. STAGE_INPUTS["traces"]). `here=False`:
    the stages run on other machines, so a path that does not exist on this one is reported as unchecked rather than
    as a problem."""
    wanted = (lambda name: True) if needs is None else (lambda name: name in needs)
    report = InputReport()
    paths = [("target.path", config.target.path, lambda: _target(config, wanted("train.warm_start"))),
             ("traces.prompts", config.traces.prompts, lambda: _prompts(config, "traces.prompts",
                                                                        config.traces.prompts)),
             ("eval.prompts", config.eval.prompts, lambda: _prompts(config, "eval.prompts", config.eval.prompts))]
    if config.train.warm_start:
        paths.append(("train.warm_start", config.train.warm_start, lambda: _warm_start(config.train.warm_start)))
    if config.traces.chat_template:
        paths.append(("traces.chat_template", config.traces.chat_template,
                      lambda: _template_file(config.traces.chat_template)))
    target_failed = False
    for name, path, check in paths:
        if not wanted(name):
            continue
        if path.startswith("s3://") and not reach_store:
            report.unchecked.append(f"{name} {path}: not contacted (add --check-store)")
            continue
        if not here and not path.startswith("s3://") and not Path(path).exists():
            report.unchecked.append(f"{name} {path} is not on this machine (the stage's worker must have it)")
            continue
        before = len(report.problems)
        _check(report, name, check)
        target_failed |= name == "target.path" and len(report.problems) > before
    if wanted("target.tokenizer") and Path(config.target.path).is_dir():
        _check(report, "target.tokenizer", lambda: _tokenizer(config))
        if wanted("traces.chat_template") and not report.problems and (not config.traces.chat_template
                                                                       or Path(config.traces.chat_template).is_file()):
            _check(report, "traces.chat_template", lambda: _chat_template(config, wanted))
    # Each stage checks its own servers' contexts (the evaluations' key is apart from eval.engines' CPU kernel check).
    servers = [(f, settings) for f, settings in engine_servers(config)
               if wanted("eval.engines.max_model_len" if f.startswith("eval.engines.") else f)]
    if servers and not target_failed and Path(config.target.path, "config.json").is_file():
        _check(report, "engine contexts", lambda: _contexts(config, servers, here))
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
