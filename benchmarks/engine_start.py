"""vLLM's start on a GPU machine, phase by phase, in the order the servers start on one machine (the first is that
machine's first vLLM start), and decoding without speculation on the first server at the given concurrencies.

    python3 benchmarks/engine_start.py --target-shape 8b --starts graphs graphs eager --out engine-start.json
    (--starts eager capture capture: the pipeline's order, a traces server then the extraction's capture server)

Each start is timed from the process's launch to its first answered completion; its phases come from the
timestamps of vLLM's own log lines (whole seconds): the API process's imports, the engine process's start, the
weights' load, torch.compile (compiled or read from the cache), the KV cache's profile, CUDA-graph capture and the
API's own start. No Prefect: the GPU machine runs it with vLLM's offline site on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from extract_vllm import build_target, describe_target, target_folder  # noqa: E402  (benchmarks/extract_vllm.py)

# (phase that ends at this line, the line's pattern), in the order vLLM 0.25 logs them.
MARKS = [
    ("api_imports", r"\[api_utils\.py:\d+\]"),
    ("engine_process", r"Initializing a V1 LLM engine"),
    ("model_load", r"Model loading took"),
    ("compile", r"torch\.compile took [\d.]+ s in total"),
    ("kv_profile", r"Available KV cache memory"),
    ("graph_capture", r"Graph capturing finished"),
    ("engine_ready", r"init engine \(profile, create kv cache, warmup model\) took"),
    ("api_ready", r"Application startup complete"),
]
# Where vLLM, FlashInfer, torch's inductor and Triton keep what a start compiles (each defaults under the home folder).
CACHE_ENV = ("XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE", "TORCHINDUCTOR_CACHE_DIR",
             "TRITON_CACHE_DIR")
STAMP = re.compile(r"(?:INFO|WARNING|ERROR|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d)")
FIGURES = {
    "weights_load_s": r"Model loading took [\d.]+ GiB and ([\d.]+) seconds",
    "compile_s": r"torch\.compile took ([\d.]+) s in total",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}


def _stamp(line: str, year: int) -> float | None:
    m = STAMP.search(line)
    if m is None:
        return None
    return datetime.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S").timestamp()


def phases(log_text: str, launched_at: float, ready_at: float) -> dict:
    """Seconds from the launch to each mark vLLM logged (its first occurrence), the phases between consecutive marks
    (the first: the API process's start and imports), vLLM's own figures, and whether torch.compile read its graphs
    from the cache."""
    year = datetime.fromtimestamp(launched_at).year
    lines = log_text.splitlines()
    at: dict[str, float] = {}
    for name, pattern in MARKS:
        last = None  # uvicorn's lines carry no time: such a line takes the last stamped line's
        for line in lines:
            last = _stamp(line, year) or last
            if re.search(pattern, line):
                if last is not None:
                    at[name] = round(last - launched_at, 1)
                break
    spans, before = {}, 0.0
    for name, _ in MARKS:
        if name in at:
            spans[name] = round(at[name] - before, 1)
            before = at[name]
    spans["first_request"] = round(ready_at - launched_at - before, 1)
    figures = {}
    for name, pattern in FIGURES.items():
        found = [float(x) for x in re.findall(pattern, log_text)]
        if found:
            figures[name] = round(sum(found), 2)
    return {"marks_s": at, "phases_s": spans, "vllm_figures": figures,
            "compile_from_cache": "Directly load the compiled graph" in log_text}


def decode(server, served: str, prompts, concurrency: list[int], tokens: int, repeats: int,
           temperature: float = 0.0) -> list[dict]:
    from draftline.engines.client import OpenAIRequester, requests_for, run_load

    requester = OpenAIRequester(model=served, max_tokens=tokens, temperature=temperature,
                                extra_body={"ignore_eos": True})
    points = []
    for c in concurrency:
        load = prompts[:16] if c == 1 else requests_for(prompts, c)  # one in flight: 16 answers make the figure
        runs = [run_load(server.base_url, load, c, requester)[0] for _ in range(repeats + 1)][1:]  # first: warm-up
        rates = [r.output_tokens_per_s for r in runs]
        points.append({"concurrency": c, "requests": len(load), "output_tokens": runs[0].output_tokens,
                       "tokens_per_s": sum(rates) / len(rates), "tokens_per_s_runs": rates})
        print(json.dumps({"decoding": points[-1]}), flush=True)
    return points


def _capture_spec(settings, target: Path):
    """The extraction stage's server: the target with draftline's capture connector (the default aux layers)."""
    from draftline.aux_ids import AuxLayerIds
    from draftline.engines.vllm import capture_server_spec
    from draftline.extract_vllm import write_final_norm
    from draftline.target import read_target_config

    layers = read_target_config(target)["num_hidden_layers"]
    spool = Path(tempfile.mkdtemp(prefix="spool-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    return capture_server_spec(settings, target, AuxLayerIds.for_target(None, layers).as_list() + [layers], spool, 2048,
                               write_final_norm(target, spool))


def main(argv=None) -> int:
    from draftline.config import ServerSettings
    from draftline.engines.client import load_prompts
    from draftline.engines.launch import launch
    from draftline.engines.vllm import generation_server_spec, installed_version
    from draftline.target import read_target_config

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-shape", default="8b", help="the demo Llama inflated to this shape (1b, 8b), or demo: as it is (a CPU smoke run); or a "
                        "random Qwen3-MoE: moe (GPU), moe-tiny (CPU)")
    p.add_argument("--starts", nargs="+", default=["graphs", "graphs", "eager"], choices=["graphs", "eager", "capture"],
                   help="one server per word, in this order: CUDA graphs and torch.compile, --enforce-eager, or the "
                        "extraction's capture server (--enforce-eager, draftline's connector)")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 32], help="decoding on the first server (none: no decoding)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", default=str(ROOT / "assets" / "prompts" / "eval_prompts.jsonl"))
    p.add_argument("--max-prompts", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workdir", default=None)
    p.add_argument("--target-dir", default=None,
                   help="build the target into this folder, or reuse the one a run before built there")
    p.add_argument("--label", default="", help="what this run's environment was (e.g. which caches were empty)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="engine-start-", dir=args.workdir))
    t = time.perf_counter()
    shape = None if args.target_shape == "demo" else args.target_shape
    built = target_folder(Path(args.target_dir or work), shape)
    target = built if shape and (built / "config.json").exists() else build_target(Path(args.target_dir or work), shape)
    build_s = time.perf_counter() - t
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    weight_bytes = sum(f.stat().st_size for f in target.glob("*.safetensors"))
    prompts = load_prompts(args.prompts, args.max_prompts)
    result = {"hardware": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(), "host": platform.node(), "torch": torch.__version__,
              "vllm": installed_version(), "target": describe_target(shape),
              "target_config": read_target_config(target),
              "weight_bytes": weight_bytes, "target_build_s": round(build_s, 1), "label": args.label,
              "cache_env": {k: os.environ[k] for k in CACHE_ENV if k in os.environ}, "starts": []}
    out = Path(args.out)
    for i, mode in enumerate(args.starts):
        extra = ["--gpu-memory-utilization", "0.6"] + (["--enforce-eager"] if mode != "graphs" else [])
        settings = ServerSettings(dtype="bfloat16", extra_args=extra, retries=0, ready_timeout_s=900)
        spec = generation_server_spec(settings, target, 2048) if mode != "capture" else _capture_spec(settings, target)
        spec.name = f"vllm-start{i + 1}-{mode}"
        launched_at = time.time()
        with launch(spec, settings, work / "logs") as server:
            ready_at = time.time()
            log = (work / "logs" / f"{spec.name}-attempt1.log").read_text(errors="replace")
            entry = {"order": i + 1, "mode": mode, "start_s": round(ready_at - launched_at, 1),
                     **phases(log, launched_at, ready_at)}
            print(json.dumps({"start": entry}), flush=True)
            if i == 0 and args.concurrency and mode != "capture":
                entry["decoding"] = decode(server, "target", prompts, args.concurrency, args.max_new_tokens,
                                           args.repeats)
        result["starts"].append(entry)
        out.write_text(json.dumps(result, indent=1) + "\n")  # what finished survives a call's time limit
    print(table(result["starts"]))
    return 0


def table(starts: list[dict]) -> str:
    """The starts side by side: seconds to each phase's end, the total last."""
    names = [name for name, _ in MARKS] + ["first_request"]
    rows = [["phase"] + [f"{s['order']}. {s['mode']}" for s in starts]]
    rows += [[name] + [str(s["phases_s"].get(name, "-")) for s in starts] for name in names]
    rows.append(["start"] + [str(s["start_s"]) for s in starts])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


if __name__ == "__main__":
    raise SystemExit(main())
