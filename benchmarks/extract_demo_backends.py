"""Both extraction backends on the demo's own traces, timed as a stage, twice each: which one the demo should use.

Run after `make demo` (it reads ./runs/demo/traces):  .venv/bin/python benchmarks/extract_demo_backends.py
Each run copies the traces into a fresh store under the temp dir; the transformers backend keeps its loaded target
between its two runs (so its second run shows the stage without the load), the vLLM backend starts its server each
time (engine_start_s) and then captures (capture_s).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftline.config_loading import load_config  # noqa: E402
from draftline.extract import extract_hidden_states  # noqa: E402
from draftline.store import open_store  # noqa: E402


def main() -> None:
    cfg = load_config(REPO / "configs" / "demo.yaml")
    traces = REPO / "runs" / "demo" / "traces"
    if not (traces / "manifest.json").is_file():
        sys.exit(f"{traces} has no manifest.json: run `make demo` first")
    with tempfile.TemporaryDirectory(prefix="draftline-extract-demo-") as work:
        for i, backend in enumerate(("transformers", "vllm", "transformers", "vllm")):
            run = f"{backend}-{i}"
            shutil.copytree(traces, Path(work) / run / "traces")
            stage = cfg.extract.model_copy(update={"backend": backend, "vllm": cfg.traces.vllm})
            t = time.perf_counter()
            r = extract_hidden_states(stage, str(REPO / cfg.target.path), open_store(work), run)
            print(f"{backend}: stage {time.perf_counter() - t:.1f} s, {r['tokens_computed']} tokens in {r['shards']} "
                  f"shards, engine start {r.get('engine_start_s')} s, capture {r.get('capture_s')} s", flush=True)


if __name__ == "__main__":
    main()
