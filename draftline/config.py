"""Pydantic models for every pipeline stage and the whole pipeline (draftline.config_loading reads them from YAML)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from draftline.aux_ids import AuxLayerIds
from draftline.config_base import Strict
from draftline.online.config import OnlineConfig
from draftline.store import check_store_uri
from draftline.store.keys import STORE_URI_PATTERN

_SECRET_KEY = re.compile(r"(secret|password|passwd|token_value|access_key|api_key|credentials?|auth_string|"
                         r"session_token)$", re.I)
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# k, the draft tokens per step, by default; MAX_K bounds k and train.ttt_steps alike, so a training can unroll as deep
# as any engine may draft.
DEFAULT_K = 3
MAX_K = 16


class StoreConfig(Strict):
    """Where artifacts live: a local folder (default) or s3://bucket/prefix (credentials from the AWS environment)."""

    # The root's pattern needs look-ahead, which pydantic's default regex engine lacks.
    model_config = ConfigDict(Strict.model_config, regex_engine="python-re")
    root: str = Field("./runs", pattern=STORE_URI_PATTERN, description="A local folder or s3://bucket/prefix; every "
                      "artifact of a run goes under <root>/<run>/. S3 credentials come from the worker's AWS "
                      "environment, never from the config.")

    # Before the pattern, so that a malformed location gets check_store_uri's sentence rather than the pattern.
    @field_validator("root", mode="before")
    @classmethod
    def _valid_uri(cls, v):
        return check_store_uri(v) if isinstance(v, str) else v


class TargetConfig(Strict):
    """The target model: a transformers checkpoint directory on the worker's disk."""

    path: str = Field(description="The target's transformers checkpoint directory (config.json, *.safetensors, "
                      "tokenizer), on the disk of every worker that runs a stage.")
    name: str | None = Field(None, description="The target's name in reports and the run summary; null: the name "
                             "of path's directory.")
    dtype: Literal["bfloat16", "float32", "float16"] = Field(
        "bfloat16", description="Dtype the transformers backends of traces and extraction load the target in; the "
        "vLLM servers of those stages take it when their dtype is auto.")

    @property
    def display_name(self) -> str:
        return self.name or Path(self.path.rstrip("/")).name


class ServerSettings(Strict):
    """How an engine server is started and supervised: shared by trace generation, extraction and evaluation."""

    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the server splits the model over (vLLM "
                                      "--tensor-parallel-size, SGLang --tp-size), a size that gives each GPU whole "
                                      "attention heads of the target and the drafter; its worker needs tensor x "
                                      "pipeline x data parallel GPUs, the last two from extra_args.")
    max_model_len: int | None = Field(None, ge=16, description="The server's context length in tokens (vLLM "
                                      "--max-model-len); null: what the work needs, traces.max_total_tokens for "
                                      "traces, the longest trace plus one for extraction.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="The server's --dtype; auto: target.dtype for traces.vllm and extract.vllm, the engine's "
        "own choice from the checkpoint for eval.engines.")
    extra_args: list[str] = Field([], description="The engine's own flags for every server this section starts, e.g. "
                                  '["--gpu-memory-utilization", "0.9", "--quantization", "compressed-tensors"].')
    env: dict[str, str] = Field({}, description="Environment variables of the server's process, over the worker's; "
                                "keys that look like secrets are refused (set those in the worker's environment).")
    # Engines pin packages that conflict with each other and with Prefect, hence an interpreter of their own.
    python: str | None = Field(None, description="The interpreter of the engine's own environment, e.g. "
                               "/opt/sglang/bin/python (or name the engine's site in env's PYTHONPATH); null: the "
                               "interpreter running draftline, with the engine installed beside it.")
    # Supervision of the flaky model load.
    ready_timeout_s: float = Field(600.0, gt=0, description="Seconds a load may take until the server answers its "
                                   "health check, plus ready_timeout_s_per_gb per GB of weights; then it is killed "
                                   "and retried.")
    ready_timeout_s_per_gb: float = Field(120.0, ge=0, description="Seconds added to ready_timeout_s per GB (1e9 "
                                          "bytes) of weights the server loads (target and drafter).")
    no_progress_timeout_s: float = Field(300.0, gt=0, description="Seconds a loading server may print nothing to its "
                                         "log before it is killed as hung.")
    first_request_timeout_s: float = Field(120.0, gt=0, description="Seconds the first request (a two-token answer) "
                                           "may take once the server is ready; longer: the server is stuck.")
    retries: int = Field(2, ge=0, description="Further starts after a failed load; a load the engine refused as bad "
                         "input, or that failed the same way twice, is not retried.")
    retry_backoff_s: float = Field(5.0, ge=0, description="Seconds of the wait before a retry, doubled each attempt "
                                   "and times a random factor between 1 and 2.")

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

    prompts: str = Field(description="The prompts and conversations the target answers: a .jsonl, .json or .parquet "
                         "file or a folder a dataset was saved to with datasets' save_to_disk, local or s3://; each "
                         'record a raw "prompt", OpenAI "messages" or ShareGPT "conversations", ids unique '
                         "(docs/data-formats.md).")
    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="What answers: transformers (the target loaded in the worker's process, for "
        "small models) or vllm (a vLLM server: tensor parallel, quantized kernels).")
    endpoint: str | None = Field(None, description="With backend vllm: a running vLLM OpenAI server to ask, e.g. "
                                 "http://127.0.0.1:8000/v1; null: draftline starts one with traces.vllm.")
    vllm: ServerSettings = Field(ServerSettings(), description="The vLLM server draftline starts and supervises for "
                                 "this stage (backend vllm without an endpoint).")
    use_chat_template: bool = Field(True, description="Render message prompts with the target's chat template and a "
                                    "generation prompt; false: their contents joined by blank lines. Plain prompt "
                                    "text is never templated.")
    turns: Literal["last", "all"] = Field(
        "last", description="Which turns of a conversation are answered and trained on: last, its final turn (a "
        "conversation must then not end on an assistant turn); all, every assistant turn in order, each given the "
        "conversation so far with the earlier answers in it, and the end of a conversation that ends on a user turn.")
    responses: Literal["regenerate", "dataset"] = Field(
        "regenerate", description="Whose answers the drafter learns: regenerate, the target's own (the target answers "
        "each turn); dataset, the dataset's assistant turns as they are, with no generation (every record needs one; "
        "with turns: last, the final one).")
    chat_template: str | None = Field(None, description="A Jinja chat template file to render conversations with, "
                                      "here, in the reference decoder and in the engines (vLLM gets it as "
                                      "--chat-template; SGLang's prompts are rendered with it); on every worker's "
                                      "disk. null: the target tokenizer's own.")
    chat_template_kwargs: dict[str, Any] = Field({}, description='Variables the chat template is rendered with, e.g. '
                                                 '{"enable_thinking": false}; the engines\' chat requests carry the '
                                                 "same chat_template_kwargs, so train and serve render prompts alike.")
    reasoning_markers: tuple[str, str] = Field(("<think>", "</think>"), description="What opens and closes the "
                                               "target's thinking: with responses: dataset, a turn's reasoning_content "
                                               "goes between them, before its content, where the template omits it.")
    on_bad_record: Literal["fail", "skip"] = Field(
        "fail", description="A record that cannot be used (not JSON, an unknown role, an empty conversation, one "
        "that ends wrong for turns, one the template refuses): fail names its file, line or record and field before "
        "anything is generated; skip leaves it out, and traces/stats.json counts and lists what was skipped.")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="Sampling temperature of the answers; 0: greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling's probability mass, when temperature is "
                         "above 0.")
    max_new_tokens: int = Field(128, ge=1, le=65536, description="Most tokens of one answer; fewer where the prompt "
                                "and answer would pass max_total_tokens.")
    seed: int = Field(0, description="Seed of sampling; each prompt's seed derives from it and the prompt's id, so the "
                      "traces do not depend on batching, sharding or resumption.")
    max_prompts: int | None = Field(None, ge=1, description="Answer only the first this many prompts (duplicates "
                                    "dropped first); null: all.")
    min_response_tokens: int = Field(1, ge=0, description="Traces whose answer has fewer tokens than this are "
                                     "dropped.")
    max_total_tokens: int = Field(4096, ge=8, description="Longest trace in tokens, prompt and answer (at most one "
                                  "below the context vLLM serves the target at, which extraction needs); a prompt as "
                                  "long or longer is dropped.")
    drop_duplicates: bool = Field(True, description="Drop prompts whose text repeats an earlier one, and traces whose "
                                  "tokens repeat an earlier one of the same shard.")
    traces_per_shard: int = Field(256, ge=1, description="Prompts per trace shard, the unit a rerun skips once "
                                  "published.")
    batch_size: int = Field(16, ge=1, description="transformers: prompts per generate call when greedy (sampling "
                            "takes one at a time); vllm: requests in flight at once.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the transformers backend generates; auto: a GPU when one is visible, else the CPU. "
        "vLLM picks its own.")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_not_reserved(cls, v):
        from draftline.chat_template import RESERVED_KWARGS

        taken = sorted(set(v) & set(RESERVED_KWARGS))
        if taken:
            raise ValueError(f"traces.chat_template_kwargs sets {', '.join(taken)}, which draftline sets itself; "
                             "remove it")
        return v

    @model_validator(mode="after")
    def _turns_need_template(self):
        if not self.use_chat_template and (self.turns == "all" or self.responses == "dataset"):
            raise ValueError("traces.turns: all and traces.responses: dataset need the chat template to tell the "
                             "turns apart; set use_chat_template: true")
        return self

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

    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="transformers: hooks on the target loaded on one device; vllm: the target runs "
        "in a vLLM server (tensor and expert parallel, quantized kernels) whose extract_hidden_states method hands "
        "the states to draftline.")
    vllm: ServerSettings = Field(ServerSettings(), description="The vLLM server the vllm backend starts and "
                                 "supervises.")
    requests_in_flight: int = Field(64, ge=1, description="vllm backend: capture requests (one per trace) in flight "
                                    "at once.")
    spool_dir: str | None = Field(None, description="vllm backend: the local folder where vLLM's side writes each "
                                  "request's states before they are assembled into shards; null: a fresh folder "
                                  "under /dev/shm when it is writable, else the temp dir.")
    aux_layer_ids: list[int] | None = Field(None, description="The three target layers whose hidden states feed the "
                                            "drafter, in vLLM's convention (id k: the input of decoder layer k); "
                                            "null: 2, L//2 and L-3 of an L-layer target.")
    batch_tokens: int = Field(4096, ge=16, description="Padded tokens per forward batch of the transformers backend "
                              "(sequences x the longest; a longer trace goes alone); the vllm backend orders a "
                              "shard's rows in the same batches.")
    tokens_per_shard: int = Field(65536, ge=16, description="Tokens per hidden-state shard, about: whole traces in "
                                  "order, a shard closing before one would pass it; a rerun skips finished shards.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the transformers backend runs the target; auto: a GPU when one is visible, else "
        "the CPU.")
    writer_threads: int = Field(3, ge=1, description="Shards serialised and fsync'd at once, one per thread, while "
                                "the next shard computes: the disk stays busy.")
    max_batches_in_flight: int | None = Field(None, ge=1, description="transformers backend: host buffers of at most "
                                              "this many batches exist at once; null: bounded by writer_threads + 1 "
                                              "shards only.")
    storage: Literal["bf16", "fp8-e4m3"] = Field(
        "bf16", description="How shards store the hidden states: bf16 as captured, or fp8-e4m3 with one float32 "
        "scale per token and state (half the bytes a token: an extraction bound by the disk runs up to twice as "
        "fast).")

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_ids(cls, v):
        if v is not None:
            AuxLayerIds.of(v)  # the range waits for the target's layer count (AuxLayerIds.for_target)
        return v


class DrafterConfig(Strict):
    """Shape of the EAGLE-3 head; sizes default to the target's."""

    draft_vocab_size: int = Field(32000, ge=2, description="Tokens the drafter can propose (rows of its lm_head): the "
                                  "most frequent answer tokens of the traces, at most the target's vocabulary.")
    intermediate_size: int | None = Field(None, ge=1, description="Width of the draft layer's MLP; null: the "
                                          "warm start's, else the target's.")
    num_attention_heads: int | None = Field(None, ge=1, description="Query heads of the draft layer, a divisor of "
                                            "the target's hidden size; null: the warm start's, else the target's.")
    num_key_value_heads: int | None = Field(None, ge=1, description="Key/value heads of the draft layer; null: the "
                                            "warm start's, else the target's; as many as the query heads where they "
                                            "do not divide those.")
    attention: Literal["llama", "mla"] = Field(
        "llama", description="The draft layer's attention: llama (every engine, the public EAGLE-3 drafters) or mla, "
        "DeepSeek's latent attention with the target's sizes (vLLM's Eagle3DeepseekV2ForCausalLM), for MLA targets "
        "whose engine needs one attention kind for target and drafter.")


class TrainConfig(Strict):
    """Drafter training with training-time test (TTT)."""

    ttt_steps: int = Field(7, ge=1, le=MAX_K, description="Draft steps unrolled by training-time test; validation "
                           "measures every depth up to it, so the offline estimate at k needs k <= ttt_steps.")
    step_weight_decay: float = Field(0.8, gt=0.0, le=1.0, description="Draft step j's loss weighs "
                                     "step_weight_decay^j (the first step 1).")
    learning_rate: float = Field(1e-4, gt=0.0, description="Peak learning rate of AdamW (betas 0.9, 0.95), reached "
                                 "after warmup_steps.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW's weight decay.")
    warmup_steps: int = Field(50, ge=0, description="Steps of linear warm-up to learning_rate; a cosine decay to "
                              "learning_rate x min_lr_ratio at max_steps follows.")
    max_steps: int = Field(1000, ge=1, description="Optimizer steps in all, one global batch each.")
    tokens_per_batch: int = Field(8192, ge=16, description="Tokens of one global batch, about: whole sequences, "
                                  "split among train.processes.")
    max_seq_len: int = Field(2048, ge=8, description="Sequences are cut to this many tokens and packed into rows of "
                             "this length (flex attention pads every row to it).")
    grad_clip: float = Field(0.5, gt=0.0, description="Largest norm of the gradient; a larger one is scaled down to "
                             "it.")
    val_every: int = Field(100, ge=1, description="Validate every this many steps, and at the last.")
    checkpoint_every: int = Field(200, ge=1, description="Checkpoint to the store every this many steps, and at the "
                                  "last; a rerun resumes from the newest.")
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of the tokens validation holds out: the "
                                "last sequences (shard order), whatever the shard size; 0: no validation.")
    logits_chunk_tokens: int = Field(1024, ge=1, description="Rows of target logits formed at once (bf16 on GPU); "
                                     "the loss over the draft vocabulary takes vocab_size / draft_vocab_size times "
                                     "the rows.")
    seed: int = Field(0, description="Seed of the drafter's initialisation and the data order.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where training runs; auto: a GPU when one is visible (each torchrun process its own), "
        "else the CPU.")
    warm_start: str | None = Field(None, description="A drafter directory (draftline's export, the EAGLE/SpecForge "
                                   "layout, the speculators format or an MLA head) whose weights "
                                   "start the training (its heads and MLP width unless drafter: sets them); null: "
                                   "from scratch.")
    warm_start_remap_vocab: bool = Field(False, description="A warm start with another draft vocabulary: copy the "
                                         "lm_head rows of shared tokens; false: its vocabulary is kept and must "
                                         "have drafter.draft_vocab_size tokens.")
    num_threads: int | None = Field(None, ge=1, description="CPU threads of torch in training; null: torch's "
                                    "default.")
    attention: Literal["auto", "eager", "flex"] = Field(
        "auto", description="Training's attention: flex (compiled) or eager (exact); auto: flex on a GPU, eager on "
        "the CPU.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="The cosine ends at learning_rate x min_lr_ratio.")
    log_every: int = Field(10, ge=1, description="Log loss, accuracy, tokens/s and ETA every this many steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept in the store, the newest; older ones are "
                                  "deleted.")
    source: Literal["shards", "engine"] = Field(
        "shards", description="What training reads: shards, the extraction stage's hidden-state shards; engine, a "
        "capturing vLLM server (extract.vllm) started beside the trainer, whose states go straight to training and "
        "are never stored (only the validation's, captured first).")
    online: OnlineConfig = Field(OnlineConfig(), description="Online training (source: engine): the hand-off between "
                                 "the engine and the trainer.")
    processes: int = Field(1, description="Training processes on the worker, one per GPU; more than one runs torchrun "
                           "(DDP: nccl on GPUs, gloo on CPU). The global batch stays tokens_per_batch, so a run "
                           "resumes with any count.")

    @field_validator("processes")
    @classmethod
    def _at_least_one_process(cls, v):
        if v < 1:
            raise ValueError("train.processes counts training processes, one per GPU; set it to 1 for a single "
                             "process, or to the number of GPUs to train on")
        return v


class ExportConfig(Strict):
    """Which engine formats to write; each carries aux-layer ids in its engine's own convention."""

    formats: list[Literal["vllm", "sglang", "speculators"]] = Field(
        ["vllm", "sglang", "speculators"], description="Drafter formats written, a directory each: vllm and sglang "
        "(each engine evaluates its own), speculators (Llama attention only).")


class EngineConfig(ServerSettings):
    """One engine evaluation: how to launch it and how to load it."""

    engine: Literal["vllm", "sglang"] = Field(description="The engine: vllm or sglang, each serving its own export "
                                              "of the drafter.")
    num_speculative_tokens: int = Field(DEFAULT_K, ge=1, le=MAX_K, description="k, the draft tokens the engine "
                                        "proposes per step (SGLang: chain drafting, k steps of top-1).")
    concurrency: list[int] = Field([1], description="Concurrency points, requests in flight at once: each has one "
                                   "unmeasured warm-up wave, then `repeats` measured runs, on both servers.")
    requests_per_point: int | None = Field(None, ge=1, description="Requests per concurrency point, at least (the "
                                           "prompts repeat round-robin); null: every prompt once, and at least two "
                                           "per slot.")
    repeats: int = Field(2, ge=1, description="Measured runs of those requests per concurrency point, on one server: "
                         "the report gives their median and min-max; with 1 it says there is no spread.")
    max_model_len: int = Field(2048, ge=16, description="Context length of the baseline and EAGLE-3 servers in "
                               "tokens (vLLM --max-model-len, SGLang --context-length), at most the target's: "
                               "validate refuses more, as both engines would at start.")
    # e.g. SGLang's --disable-overlap-schedule (benchmarks/RESULTS.md: the baseline always slower; EAGLE-3 faster with
    # a 1B target, slower with a 6.88B one) or --cuda-graph-backend-prefill breakable (SGLang 0.5.14 keeps an EAGLE-3
    # target's prefill CUDA graph only on that backend).
    speculative_extra_args: list[str] = Field([], description="Flags for the EAGLE-3 server only, after extra_args "
                                              "(which both servers get): settings that help one and hurt the other, "
                                              "e.g. SGLang's --disable-overlap-schedule.")
    require_gpu: bool = Field(False, description="Refuse to start without a visible CUDA GPU (tensor_parallel_size "
                              "of them, new enough for the engine); false: no such check.")
    sweep_k: list[int] | None = Field(None, description="The values of k the evaluation serves, one server each, "
                                      "measured at every concurrency point; 0 (no speculation) must be among them, "
                                      "and num_speculative_tokens is always added. The schedule by load takes the "
                                      "fastest per point; null: 0 and num_speculative_tokens (two servers).")
    preload_cpu_libraries: bool = Field(True, description="vLLM on a CPU: preload tcmalloc and Intel OpenMP "
                                        "(LD_PRELOAD) where they are installed, as vLLM's CPU installation guide "
                                        "asks; false: the worker's LD_PRELOAD as it is.")

    def server_args(self, speculative: bool) -> list[str]:
        """The arguments added to an engine server's own: extra_args, then for EAGLE-3 speculative_extra_args."""
        return list(self.extra_args) + (list(self.speculative_extra_args) if speculative else [])

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v):
        if not v or any(c < 1 for c in v):
            raise ValueError(f"{v} must be a non-empty list of positive integers, e.g. [1, 8, 32]")
        return v

    @field_validator("sweep_k")
    @classmethod
    def _sweep_with_zero(cls, v):
        if v is None:
            return v
        if 0 not in v:
            raise ValueError("it lacks 0 (no speculation), which every k of the sweep is measured against; add 0, "
                             "e.g. [0, 1, 3]")
        if any(k < 0 or k > MAX_K for k in v) or len(set(v)) != len(v):
            raise ValueError(f"each k must be a distinct number from 0 to {MAX_K}, e.g. [0, 1, 3]")
        return sorted(v)

    @property
    def ks(self) -> list[int]:
        """Every k the evaluation serves: 0, num_speculative_tokens and sweep_k."""
        return sorted(set(self.sweep_k or []) | {0, self.num_speculative_tokens})


class ReferenceConfig(Strict):
    """The engine-independent reference decoder used for parity."""

    enabled: bool | Literal["auto"] = Field(
        "auto", description="Run the reference decoder: true, false, or auto: skip it, in one sentence, when the target "
        "does not fit the reference device's memory in float32 (Kimi-K2.5 on one GPU). Without it parity compares the "
        "engines with the training's offline estimate where the drafter has one, and the report says which basis it "
        "used.")

    num_speculative_tokens: int = Field(DEFAULT_K, ge=1, le=MAX_K, description="k of the reference decoder, one of "
                                        "the engines' num_speculative_tokens: parity compares like with like.")
    max_prompts: int | None = Field(None, ge=1, description="Decode only the first this many eval prompts; null: "
                                    "eval.max_prompts.")
    batch_size: int = Field(1, ge=1, description="Prompts the reference decoder decodes together.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the reference decoder runs (in float32); auto: a GPU when one is visible, else the "
        "CPU.")
    aux_shifts: list[int] = Field([-1, 1], description="Also decode with the drafter fed layers this far from its "
                                  "trained ones (a convention mix-up moves every id by one): what wrong ids cost here "
                                  "sets the parity threshold; []: no such decodes.")
    other_precision: bool = Field(True, description="Also decode in bfloat16: how far numerics alone move "
                                  "acceptance, the spread parity must tolerate.")

    @field_validator("aux_shifts")
    @classmethod
    def _nonzero_shifts(cls, shifts: list[int]) -> list[int]:
        if any(s == 0 for s in shifts) or len(set(shifts)) != len(shifts):
            raise ValueError(f"aux_shifts={shifts} must be distinct non-zero layer offsets, e.g. [-1, 1]")
        return shifts


class EvalConfig(Strict):
    """Evaluation: prompts, sampling, engines, and the parity check against the reference decoder."""

    prompts: str = Field(description="The evaluation prompts, read like traces.prompts (files, datasets, s3://): "
                         'each record "messages" or "conversations" (sent to the chat endpoint, with traces\' chat '
                         'template and kwargs) or "prompt" (a raw completion), answered at its last turn.')
    max_prompts: int | None = Field(None, ge=1, description="Use only the first this many prompts; null: all.")
    max_new_tokens: int = Field(128, ge=1, description="Most tokens of each answer, in the engines and the reference "
                                "decoder; training's replayed estimate reads as many of each validation answer.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of the engines and the reference "
                               "decoder; 0: greedy.")
    use_chat_template: bool = Field(True, description="The reference decoder renders message prompts with the "
                                    "target's chat template, as the engines' chat endpoints do; false: their "
                                    "contents joined.")
    engines: list[EngineConfig] = Field([EngineConfig(engine="vllm"), EngineConfig(engine="sglang")],
                                        description="The engines evaluated, each a baseline and an EAGLE-3 server on "
                                        "the same prompts.")
    reference: ReferenceConfig = Field(ReferenceConfig(), description="The reference decoder parity compares the "
                                       "engines with.")
    engines_in_parallel: bool = Field(True, description="Evaluate the engines at once; false: one after the other, "
                                      "for engines that share a GPU, where servers running at once would time each "
                                      "other's contention and share its memory.")
    parity_threshold: float | Literal["auto"] = Field(
        "auto", description="Parity (the engine's accepted draft tokens per step over the reference decoder's) below "
        "which an integration fault is suspected; auto: set from what wrong aux-layer ids cost this target "
        "(reference.aux_shifts) and the measured spread, between 0.5 and 0.9 (0.8 when neither was measured).")

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

    max_acceptance_drop: float = Field(0.10, ge=0.0, le=1.0, description="Largest relative fall of the mean "
                                       "acceptance length, the engine's and the reference decoder's (0.1: 10%), "
                                       "against the last good run or the rolling median.")
    max_speedup_drop: float = Field(0.15, ge=0.0, le=1.0, description="Largest relative fall of the speedup at each "
                                    "concurrency, against runs on the same hardware.")
    max_throughput_drop: float = Field(0.20, ge=0.0, le=1.0, description="Largest relative fall of the EAGLE-3 "
                                       "output tokens/s at each concurrency, against runs on the same hardware.")
    parity_floor: float | Literal["auto"] = Field(
        0.8, description="Parity below which a night fails, whatever its history; auto: the parity threshold that "
        "night's evaluation set for its target (measured where eval.parity_threshold is auto), else 0.8.")
    max_estimate_gap_drop: float = Field(0.10, ge=0.0, le=1.0, description="Largest relative fall of the engine's "
                                         "mean acceptance length over the training's offline estimate (same drafter "
                                         "and k): validation no longer predicts what the engine accepts.")
    median_window: int = Field(7, ge=1, description="The rolling median takes the last this many good runs.")
    max_schedule_shortfall: float = Field(0.05, ge=0.0, le=1.0, description="A night fails when the verified "
                                          "schedule by load is slower than no speculation at a concurrency point "
                                          "beyond the measured spread and by more than this share of its tokens per "
                                          "second.")

    @field_validator("parity_floor")
    @classmethod
    def _floor_in_range(cls, value):
        if value != "auto" and not 0.0 <= value <= 1.0:
            raise ValueError(f"parity_floor={value} must be \"auto\" or a number in [0, 1], e.g. 0.8")
        return value


class ChildRunsConfig(Strict):
    """How long the pipeline waits for a stage or engine it starts as a flow run on another pool (`stage_runs` or
    `engine_runs: deployments`) before it cancels that run and fails with the cause."""

    start_timeout_s: float = Field(600.0, gt=0, description="Seconds a child run may wait, scheduled, for a worker "
                                   "to take it (the pool's worker is gone or cannot); waiting for a deployment's "
                                   "concurrency slot does not count.")
    timeout_s: float = Field(72 * 3600.0, gt=0, description="Seconds from a child run's creation to its end: the "
                             "longest a stage may take (training a real target takes hours); 72 hours by default.")


class PipelineConfig(Strict):
    """The whole job: traces → extraction → training → export → evaluation."""

    run: str = Field("demo", description="The run's name: its artifacts live under <store.root>/<run>/ and a rerun "
                     "of the name resumes it; letters, digits, '.', '_', '-', at most 128.")
    store: StoreConfig = Field(StoreConfig(), description="Where artifacts live.")
    target: TargetConfig = Field(description="The target model the drafter is trained for.")
    traces: TracesConfig = Field(description="Trace generation: the target answers the training prompts.")
    extract: ExtractConfig = Field(ExtractConfig(), description="Hidden-state extraction from the traces.")
    drafter: DrafterConfig = Field(DrafterConfig(), description="The EAGLE-3 head's shape.")
    train: TrainConfig = Field(TrainConfig(), description="Drafter training.")
    export: ExportConfig = Field(ExportConfig(), description="The engine formats the drafter is written in.")
    eval: EvalConfig = Field(description="Evaluation in the engines and the reference decoder.")
    regression: RegressionConfig = Field(RegressionConfig(), description="The nightly's regression limits.")
    child_runs: ChildRunsConfig = Field(ChildRunsConfig(), description="Limits on the flow runs the pipeline starts "
                                        "on other pools.")

    @field_validator("run")
    @classmethod
    def _run_name(cls, v):
        if not _RUN_NAME.match(v):
            raise ValueError(f"{v!r} is not a usable run name; use letters, digits, '.', '_' or '-' (at most 128)")
        return v

    @model_validator(mode="after")
    def _sweep_within_training(self):
        for i, engine in enumerate(self.eval.engines):
            deeper = [k for k in engine.sweep_k or [] if k > self.train.ttt_steps]
            if deeper:
                raise ValueError(f"eval.engines[{i}].sweep_k={engine.sweep_k} has k={deeper[0]}, deeper than the "
                                 f"drafter is trained for (train.ttt_steps={self.train.ttt_steps}); drop it or raise "
                                 "train.ttt_steps")
        return self

    @model_validator(mode="after")
    def _mla_formats(self):
        if self.drafter.attention == "mla" and "speculators" in self.export.formats:
            raise ValueError("export.formats lists speculators, whose format describes Llama-layer heads only, but "
                             "drafter.attention is mla; remove speculators from export.formats or use attention: llama")
        return self
