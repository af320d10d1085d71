"""Which aux layers vLLM feeds an EAGLE-3 drafter, for two exports of one drafter trained on non-default layers.

`export OUT` (where draftline is installed, CPU is enough) writes OUT/vllm, draftline's vLLM export of an untrained
drafter for the demo target with aux ids (1, 3, 6), and OUT/vllm-eagle-config-only, the same with the ids only in
`eagle_config` (draftline's export before 81efc49). `serve TARGET DRAFTER` (where vLLM runs; no draftline needed)
starts vLLM on TARGET with DRAFTER and one short generation; vLLM's own log line "Using Eagle3 auxiliary layers from
config|model: ..." is the result. The demo target's default layers are (2, 4, 5), so "from model: (2, 4, 5)" means
vLLM ignored the drafter's ids. Results: benchmarks/results/vllm-aux-layers-h200/ (2026-12-01, benchmarks/RESULTS.md).
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AUX_IDS = [1, 3, 6]


def export(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from draftline.config import DrafterConfig
    from draftline.drafter.eagle_format import save_eagle_dir
    from draftline.drafter.export import export_drafter
    from draftline.drafter.target_sizing import drafter_for_target
    from draftline.drafter.train import load_target_head

    demo = ROOT / "assets" / "demo-llama"
    cfg, embed, _ = load_target_head(demo)
    torch.manual_seed(0)
    model = drafter_for_target(cfg, DrafterConfig(), aux_layer_ids=AUX_IDS)
    model.load_target_weights(embed)
    with tempfile.TemporaryDirectory() as tmp:
        source = save_eagle_dir(model, Path(tmp) / "trained")
        (source / "draftline.json").write_text(json.dumps({"convention": "sglang", "run": "vllm-aux-layers probe"}))
        fixed = export_drafter(source, demo, out, formats=("vllm",))["vllm"]
    old = out / "vllm-eagle-config-only"
    shutil.rmtree(old, ignore_errors=True)
    shutil.copytree(fixed, old)
    config = json.loads((old / "config.json").read_text())
    config.pop("eagle_aux_hidden_state_layer_ids")
    (old / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {fixed} and {old}")


def serve(target: str, drafter: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, max_model_len=512, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.2,
              speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": 3})
    out = llm.generate(["def main():"], SamplingParams(max_tokens=16, temperature=0.0))
    print("RESULT", drafter, "tokens", len(out[0].outputs[0].token_ids), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "export":
        export(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: vllm_aux_layers.py export OUT | serve TARGET DRAFTER")
