"""Per-engine exports: explicit aux ids in each engine's convention, d2t rules, refusal of a wrong target, real vLLM loads."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftline.config import DrafterConfig
from draftline.drafter.export import export_drafter
from draftline.drafter.eagle_format import load_eagle_dir, save_eagle_dir
from draftline.drafter.target_sizing import drafter_for_target
from draftline.drafter.train import load_target_head
from draftline.drafter.vocab import build_vocab
from draftline.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
DEMO_LLAMA = REPO / "assets" / "demo-llama"
DEMO_DEEPSEEK = REPO / "assets" / "demo-deepseek"
DEMO_KIMI = REPO / "assets" / "demo-kimi"


def sglang_0_5_14_layers_to_capture(target_cfg: dict, ids: list[int]) -> list[int]:
    """What SGLang 0.5.14 does with eagle_aux_hidden_state_layer_ids before capturing the input of each layer
    (models/llama.py and models/deepseek_v2.py, set_eagle3_layers_to_capture; Kimi-K2.5 delegates to the latter).
    Transcribed from SGLang's source for these tests: SGLang itself cannot run on this machine, so this is a check
    against its documented rule, not a run of SGLang."""
    text = target_cfg.get("text_config", target_cfg)
    if text["model_type"] in ("deepseek_v2", "deepseek_v3"):
        return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)
    return [i + 1 for i in ids]


def source_drafter(tmp_path, draft_vocab=1024, aux_layer_ids=None, target=DEMO_LLAMA) -> Path:
    """An (untrained) drafter for a demo target in the training stage's layout: SGLang format plus draftline.json."""
    cfg, embed, _ = load_target_head(target)
    torch.manual_seed(0)
    model = drafter_for_target(cfg, DrafterConfig(draft_vocab_size=draft_vocab), aux_layer_ids)
    model.load_target_weights(embed)
    counts = torch.arange(cfg["vocab_size"]).flip(0) % 97  # any deterministic frequencies
    d2t, t2d, _ = build_vocab(counts, draft_vocab)
    model.set_vocab(d2t, t2d)
    out = tmp_path / "trained"
    save_eagle_dir(model, out)
    (out / "draftline.json").write_text(json.dumps({"convention": "sglang", "run": "unit"}))
    return out


def test_each_format_carries_ids_in_its_engines_convention(tmp_path):
    dirs = export_drafter(source_drafter(tmp_path), DEMO_LLAMA, tmp_path / "export")
    vllm_cfg = json.loads((dirs["vllm"] / "config.json").read_text())
    sglang_cfg = json.loads((dirs["sglang"] / "config.json").read_text())
    spec_cfg = json.loads((dirs["speculators"] / "config.json").read_text())
    assert vllm_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # inputs of layers 2, L//2, L-3
    assert sglang_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # outputs of the layers before
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    # vLLM's V2 model runner reads the ids only at the top level; SGLang and speculators have their own places.
    assert vllm_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert "eagle_aux_hidden_state_layer_ids" not in sglang_cfg
    assert "eagle_aux_hidden_state_layer_ids" not in spec_cfg["transformer_layer_config"]
    assert spec_cfg["speculators_model_type"] == "eagle3" and spec_cfg["norm_before_residual"] is False
    assert spec_cfg["speculators_config"]["verifier"]["name_or_path"] == str(DEMO_LLAMA)
    for cfg in (vllm_cfg, sglang_cfg):
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["draft_vocab_size"] == 1024 and cfg["target_hidden_size"] == 256 and cfg["vocab_size"] == 4096
    for fmt, d in dirs.items():
        lineage = json.loads((d / "draftline.json").read_text())
        assert lineage["format"] == fmt and lineage["target"]["num_layers"] == 8 and lineage["target"]["fingerprint"]
        assert lineage["code_version"] and lineage["run"] == "unit"
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= keys
    with safe_open(str(dirs["speculators"] / "model.safetensors"), "pt") as f:
        assert "layers.0.self_attn.q_proj.weight" in f.keys()
    # Our own sglang and vllm exports load back to the same head (ids converted back to vLLM's convention).
    a, b = load_eagle_dir(dirs["sglang"]), load_eagle_dir(dirs["vllm"])
    assert a.config.aux_layer_ids == b.config.aux_layer_ids == [2, 4, 5]


def test_export_refuses_a_target_whose_layer_count_contradicts_the_ids(tmp_path):
    shallow = tmp_path / "shallow"
    shutil.copytree(DEMO_LLAMA, shallow)
    cfg = json.loads((shallow / "config.json").read_text())
    (shallow / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    with pytest.raises(ConfigError, match="contradict a target with 5 layers"):
        export_drafter(source_drafter(tmp_path), shallow, tmp_path / "export")


def test_full_vocabulary_exports_have_no_d2t(tmp_path):
    dirs = export_drafter(source_drafter(tmp_path, draft_vocab=4096), DEMO_LLAMA, tmp_path / "export",
                          formats=("vllm",))
    with safe_open(str(dirs["vllm"] / "model.safetensors"), "pt") as f:
        assert "d2t" not in f.keys() and "t2d" not in f.keys()


@pytest.mark.vllm
def test_both_vllm_model_runners_read_the_aux_ids_of_the_vllm_export(tmp_path):
    """vLLM 0.25's GPU model runner read the ids only at the config's top level and, finding none in an export that had
    them only in eagle_config, fed the drafter the target's default layers (its H200 log: "Using Eagle3 auxiliary
    layers from model"). Both runners' own readers, as installed here, must find the export's ids."""
    from types import SimpleNamespace

    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # Not the demo target's default layers (2, 4, 5), which a reader that found nothing would fall back to.
    dirs = export_drafter(source_drafter(tmp_path, aux_layer_ids=[1, 3, 6]), DEMO_LLAMA, tmp_path / "export",
                          formats=("vllm",))
    # The draft config as vLLM builds it for method eagle3 (SpeculativeConfig wraps the loaded config).
    draft = EAGLEConfig(get_config(str(dirs["vllm"]), trust_remote_code=False), method="eagle3", model_type="eagle")
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=draft))
    assert get_eagle3_aux_layers_from_config(spec) == (1, 3, 6)  # the V2 runner
    assert GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec)) == (1, 3, 6)


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_loads_the_sglang_and_speculators_exports(tmp_path):
    """The vllm-format export is served in the end-to-end tests; here vLLM loads the other two formats."""
    dirs = export_drafter(source_drafter(tmp_path), DEMO_LLAMA, tmp_path / "export", formats=("sglang", "speculators"))
    script = tmp_path / "load.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        from vllm import LLM, SamplingParams
        if __name__ == "__main__":
            fmt, path = sys.argv[1], sys.argv[2]
            llm = LLM(model={str(DEMO_LLAMA)!r}, max_model_len=512, dtype="bfloat16", disable_log_stats=False, enforce_eager=True,
                      speculative_config={{"method": "eagle3", "model": path, "num_speculative_tokens": 3}})
            out = llm.generate(["def main():"], SamplingParams(max_tokens=24, temperature=0.0))
            drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
            print("RESULT", json.dumps({{"format": fmt, "tokens": len(out[0].outputs[0].token_ids), "drafts": drafts}}))
    """))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    for fmt in ("sglang", "speculators"):
        # Generous: a cold engine start compiles the model, which takes many minutes on a busy 2-core machine.
        proc = subprocess.run([sys.executable, str(script), fmt, str(dirs[fmt])], capture_output=True, text=True,
                              timeout=1800, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        (line,) = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
        result = json.loads(line.split(" ", 1)[1])
        print(result)
        assert result["tokens"] == 24 and result["drafts"] > 0


@pytest.mark.parametrize("target", [DEMO_LLAMA, DEMO_DEEPSEEK, DEMO_KIMI], ids=lambda p: p.name)
@pytest.mark.parametrize("aux_ids", [[2, 4, 5], [3, 4, 5], [4, 5, 6]])
def test_sglang_contract_not_run_against_sglang_the_export_makes_sglang_capture_the_trained_layers(
        tmp_path, target, aux_ids):
    """Not run against SGLang (it cannot run here): checked against SGLang 0.5.14's rule for reading the ids, which
    differs between its Llama and DeepSeek-V3 models; a plain "minus one" export feeds a DeepSeek target's drafter the
    wrong layers whenever the first aux layer is not 2."""
    dirs = export_drafter(source_drafter(tmp_path, aux_layer_ids=aux_ids, target=target), target, tmp_path / "export",
                          formats=("sglang",))
    written = json.loads((dirs["sglang"] / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    target_cfg = json.loads((target / "config.json").read_text())
    assert sglang_0_5_14_layers_to_capture(target_cfg, written) == aux_ids
    lineage = json.loads((dirs["sglang"] / "draftline.json").read_text())
    assert lineage["aux_layer_ids_vllm"] == aux_ids and lineage["aux_layer_ids"] == written
    # draftline reads its own export back to the trained layers, and the engine preflight accepts it for SGLang.
    assert load_eagle_dir(dirs["sglang"]).config.aux_layer_ids == aux_ids
    from draftline.engines.preflight import check_drafter
    assert check_drafter("sglang", dirs["sglang"], target, trained_vllm_ids=aux_ids)["convention"] == lineage["convention"]


def test_a_first_aux_layer_sglang_cannot_express_for_deepseek_targets_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match=r"first aux layer other than 1 in extract.aux_layer_ids"):
        export_drafter(source_drafter(tmp_path, aux_layer_ids=[1, 4, 5], target=DEMO_DEEPSEEK), DEMO_DEEPSEEK,
                       tmp_path / "export", formats=("sglang",))
