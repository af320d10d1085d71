"""What benchmarks comparing two drafters on the demo share (thinking.py, images.py): the machine's name, a per-stage
timer, and the acceptance vLLM serves a run's drafter with."""
from __future__ import annotations

import contextlib
import platform
import time
from pathlib import Path


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


class StageTimes:
    """Seconds of each drafter's stages, printed as each ends."""

    def __init__(self, names):
        self.seconds: dict[str, dict[str, float]] = {name: {} for name in names}

    def timed(self, name: str, stage: str, fn):
        t = time.perf_counter()
        out = fn()
        self.seconds[name][stage] = round(time.perf_counter() - t, 1)
        print(f"[{name}] {stage}: {self.seconds[name][stage]} s", flush=True)
        return out


def vllm_acceptance(config, exports: dict, store, log_dir: Path, label: str, chat_template=None):
    """The EAGLE-3 server alone (acceptance needs no baseline) at concurrency 4 on the config's eval prompts: the
    summary the benchmarks record, and the measured runs and answers for what each adds."""
    from draftline import evaluate as eval_lib
    from draftline.engines.client import load_prompts
    from draftline.engines.vllm import VllmAdapter

    engine = next(e for e in config.eval.engines if e.engine == "vllm")
    engine = engine.model_copy(update={"concurrency": [4], "repeats": 1})
    prompts = load_prompts(config.eval.prompts, config.eval.max_prompts)
    runs = eval_lib.measure(VllmAdapter(), engine, Path(config.target.path), store.get_dir(exports["vllm"]), prompts,
                            config.eval, log_dir, store, f"{config.run}/{label}", chat_template,
                            logs_prefix=f"{config.run}/{label}/logs")
    metrics, acceptance, results = runs.runs[0]
    summary = {"engine_version": VllmAdapter().version(), "server_args": engine.extra_args,
               "mean_acceptance_length": acceptance.mean_acceptance_length if acceptance else None,
               "per_position_acceptance": acceptance.per_position if acceptance else None,
               "num_drafts": acceptance.num_drafts if acceptance else None, "concurrency": 4,
               "requests": len(results), "output_tokens": metrics.output_tokens}
    return summary, runs, results
