"""`draftline config init`: a starter config that `config validate` accepts, with the target's aux layers and the
worker's GPUs filled in, and `--set` overrides that fail like the file does."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from draftline.aux_ids import default_aux_layer_ids
from draftline.cli import apply_settings, load_with_overrides, main
from draftline.config import PipelineConfig
from draftline.config_loading import load_config, parse_config
from draftline.errors import ConfigError
from draftline.stages import engine_gpus

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
SHAPES = ROOT / "tests" / "fixtures" / "targets"
TRAIN_PROMPTS = str(ROOT / "assets" / "prompts" / "train_prompts.jsonl")
EVAL_PROMPTS = str(ROOT / "assets" / "prompts" / "eval_prompts.jsonl")
# The demo targets the demo configs run (configs/demo*.yaml), and the one more in assets/.
DEMO_TARGETS = sorted({load_config(p).target.path for p in (ROOT / "configs").glob("demo*.yaml")}
                      | {f"assets/{p.name}" for p in (ROOT / "assets").glob("demo-*") if (p / "config.json").is_file()})


def _init(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["config", "init", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _validate(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["config", "validate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _checkpoint(tmp_path: Path, shape: str) -> Path:
    """A folder laid out like the real checkpoint: its config.json, an empty weight file (the validation checks that
    it is there; nothing reads it) and the demo's tokenizer (the validation renders the prompts' chat template)."""
    model = tmp_path / shape
    model.mkdir()
    shutil.copy(SHAPES / shape / "config.json", model / "config.json")
    (model / "model-00001-of-00001.safetensors").touch()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets" / "demo-llama" / name, model / name)
    return model


def test_the_demo_targets_are_those_the_demo_configs_run():
    assert {"assets/demo-llama", "assets/demo-kimi"} <= set(DEMO_TARGETS)


@pytest.mark.parametrize("target", DEMO_TARGETS)
def test_a_starter_config_for_each_demo_target_validates_here_on_cpu_and_elsewhere_on_gpus(target, tmp_path,
                                                                                              capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the demo targets' paths are relative to the repository root, as in configs/demo.yaml
    cpu, gpus = tmp_path / "cpu.yaml", tmp_path / "gpus.yaml"
    code, out, err = _init(capsys, "--target", target, "--gpus", "0", "--out", str(cpu))
    assert code == 0, err
    assert out.startswith(f"{cpu}: written; fill in the lines marked FILL IN")
    # Here, with the prompts filled in: every input is checked (the target's layers and files, the prompts, the
    # vLLM CPU kernels for this target and draft layer) and nothing is a problem.
    prompts = [f"--set=traces.prompts={TRAIN_PROMPTS}", f"--set=eval.prompts={EVAL_PROMPTS}",
               f"--set=store.root={tmp_path / 'runs'}"]
    code, out, err = _validate(capsys, str(cpu), *prompts)
    assert code == 0, err
    assert f"ok: target.path {target}:" in out and ", 8 layers, aux layers [2, 4, 5] (vLLM convention)" in out
    assert "unchecked" not in out and f"{cpu}: valid" in out
    # As written, on a machine other than the workers': valid, the placeholder prompts left unchecked.
    assert _init(capsys, "--target", target, "--gpus", "8", "--out", str(gpus))[0] == 0
    code, out, err = _validate(capsys, str(gpus), "--elsewhere")
    assert code == 0, err
    assert "unchecked: traces.prompts prompts/train.jsonl is not on this machine" in out
    assert "problem:" not in out and f"{gpus}: valid" in out

    on_cpu, on_gpus = load_config(cpu), load_config(gpus)
    assert on_cpu.extract.aux_layer_ids == on_gpus.extract.aux_layer_ids == default_aux_layer_ids(8) == [2, 4, 5]
    assert on_cpu.train.device == "cpu" and on_cpu.train.processes == 1
    assert on_gpus.train.device == "cuda" and on_gpus.train.processes == 8
    # The demo targets' 4 attention heads split over 4 GPUs at most: 2 copies of each server take the worker's 8.
    assert on_gpus.traces.vllm.tensor_parallel_size == on_gpus.extract.vllm.tensor_parallel_size == 4
    assert [e.tensor_parallel_size for e in on_gpus.eval.engines] == [4, 4]
    vllm_args, sglang_args = (" ".join(e.extra_args) for e in on_gpus.eval.engines)
    assert "--data-parallel-size 2" in vllm_args and "--dp-size 2" in sglang_args
    assert "--data-parallel-size 2" in " ".join(on_gpus.extract.vllm.extra_args)
    assert [engine_gpus(e) for e in on_gpus.eval.engines] == [8, 8]  # what each evaluation asks of its pool
    assert [(e.engine, e.require_gpu) for e in on_cpu.eval.engines] == [("vllm", False), ("sglang", True)]


@pytest.mark.parametrize("shape, layers, ids, sglang_ids", [
    ("llama-3.1-8b", 32, [2, 16, 29], [1, 15, 28]),
    ("kimi-k2.5", 61, [2, 30, 58], [1, 29, 57]),
])
def test_a_starter_config_for_a_real_targets_shape_names_its_layers_and_parallel_sizes(shape, layers, ids, sglang_ids,
                                                                                       tmp_path, capsys):
    """Llama-3.1-8B (32 layers) and Kimi-K2.5 (a multimodal wrapper whose text_config is a 61-layer DeepSeek-V3):
    the ids are the inputs of layers 2, L//2 and L-3 of the text model in vLLM's convention, checked by `config
    validate` against the checkpoint; the comment gives them as SGLang reads them."""
    model = _checkpoint(tmp_path, shape)
    out_file = tmp_path / f"{shape}.yaml"
    assert _init(capsys, "--target", str(model), "--gpus", "8", "--out", str(out_file))[0] == 0
    text = out_file.read_text()
    assert default_aux_layer_ids(layers) == ids
    assert f"aux_layer_ids: {ids}" in text and f"SGLang reads these layers as {sglang_ids}" in text
    assert "FILL IN" in text and text.count("prompts: prompts/") == 2
    code, out, err = _validate(capsys, str(out_file), "--elsewhere")
    assert code == 0, err
    arch = json.loads((model / "config.json").read_text())["architectures"][0]
    assert f"ok: target.path {model}: {arch}, {layers} layers, aux layers {ids} (vLLM convention)" in out
    assert "problem:" not in out

    cfg = load_config(out_file)
    assert cfg.run == f"{shape}-eagle3" and cfg.target.path == str(model)
    assert cfg.traces.backend == cfg.extract.backend == "vllm" and cfg.traces.vllm == cfg.extract.vllm
    assert cfg.train.processes == 8 and {e.tensor_parallel_size for e in cfg.eval.engines} == {8}
    assert not any("--data-parallel-size" in e.extra_args for e in [cfg.extract.vllm, *cfg.eval.engines])
    assert cfg.drafter.draft_vocab_size == 32000
    # As many requests in flight as the shipped GPU configs keep: at the default 16, Kimi's traces would plan 3x longer.
    assert cfg.traces.batch_size == load_config(ROOT / "configs" / f"{shape}.yaml").traces.batch_size == 256
    moe = shape == "kimi-k2.5"  # 384 routed experts: vLLM spreads them over the 8 GPUs
    assert ("--enable-expert-parallel" in cfg.extract.vllm.extra_args) == moe
    assert ("--enable-expert-parallel" in cfg.eval.engines[0].extra_args) == moe


def test_one_engine_one_gpu_and_a_checkpoint_with_its_own_code(tmp_path, capsys):
    model = _checkpoint(tmp_path, "kimi-k2.5")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "configuration.Config"}}))
    code, out, _ = _init(capsys, "--target", str(model), "--engine", "sglang")
    assert code == 0
    cfg = parse_config(yaml.safe_load(out), PipelineConfig, "stdout")
    assert [e.engine for e in cfg.eval.engines] == ["sglang"]
    assert cfg.train.processes == 1 and cfg.extract.vllm.tensor_parallel_size == 1
    assert "--enable-expert-parallel" not in cfg.extract.vllm.extra_args  # one GPU: nothing to spread
    assert "--trust-remote-code" in cfg.extract.vllm.extra_args
    assert "--trust-remote-code" in cfg.eval.engines[0].extra_args


def test_init_refuses_to_overwrite_a_file_in_one_sentence(tmp_path, capsys):
    out_file = tmp_path / "mine.yaml"
    out_file.write_text("run: mine\n")
    code, out, err = _init(capsys, "--target", str(ROOT / "assets" / "demo-llama"), "--out", str(out_file))
    assert code == 2 and out == ""
    assert err.splitlines() == [f"draftline: {out_file} already exists and is left as it is; pass another --out or "
                                "remove it first"]
    assert out_file.read_text() == "run: mine\n"


def test_init_names_a_missing_target(tmp_path, capsys):
    code, _, err = _init(capsys, "--target", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.yaml"))
    assert code == 2 and "no such directory" in err and not (tmp_path / "x.yaml").exists()


# --set: any field, for one run, with the file's errors.

def _error_after_source(exc: ConfigError, source: str) -> str:
    message = str(exc)
    assert message.startswith(f"{source}: "), message
    return message.removeprefix(f"{source}: ")


def test_set_overrides_any_field_with_yaml_values(tmp_path):
    cfg = load_with_overrides(str(DEMO), settings=[
        "train.max_steps=7", "train.learning_rate=3e-4", "eval.engines.0.concurrency=[1, 8]", "run=again",
        "extract.aux_layer_ids=[2, 3, 5]", "eval.max_prompts=null", "regression.parity_floor=auto"])
    assert cfg.train.max_steps == 7 and cfg.train.learning_rate == 3e-4 and cfg.run == "again"
    assert cfg.eval.engines[0].concurrency == [1, 8] and cfg.eval.engines[1].concurrency == [1, 4]
    assert cfg.extract.aux_layer_ids == [2, 3, 5] and cfg.eval.max_prompts is None
    assert cfg.regression.parity_floor == "auto"
    assert cfg.train.tokens_per_batch == load_config(DEMO).train.tokens_per_batch  # the rest stays the file's
    # --store and --run first, then each --set in order.
    cfg = load_with_overrides(str(DEMO), store=str(tmp_path), run="first", settings=["run=second"])
    assert cfg.store.root == str(tmp_path) and cfg.run == "second"


def test_set_changes_only_the_place_it_names_where_yaml_anchors_share_a_section():
    kimi = ROOT / "configs" / "kimi-k2.5.yaml"  # traces.vllm: &engine8 ... extract.vllm: *engine8
    cfg = load_with_overrides(str(kimi), settings=["extract.vllm.tensor_parallel_size=4"])
    assert cfg.extract.vllm.tensor_parallel_size == 4 and cfg.traces.vllm.tensor_parallel_size == 8


def test_a_bad_key_or_type_in_set_gets_the_sentence_the_file_gets(tmp_path):
    source = f"{DEMO} with overrides"
    for setting, edit in [("train.max_stepz=3", lambda d: d["train"].update(max_stepz=3)),
                          ("train.max_steps=many", lambda d: d["train"].update(max_steps="many")),
                          ("eval.engines.1.concurency=[1]", lambda d: d["eval"]["engines"][1].update(concurency=[1])),
                          ("trian.max_steps=3", lambda d: d.update(trian={"max_steps": 3}))]:
        with pytest.raises(ConfigError) as by_set:
            load_with_overrides(str(DEMO), settings=[setting])
        data = yaml.safe_load(DEMO.read_text())
        edit(data)
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError) as by_file:
            load_config(bad)
        said = _error_after_source(by_set.value, source)
        assert said == _error_after_source(by_file.value, str(bad)) and len(said.splitlines()) == 1, said
    assert said == "unknown key 'trian'; did you mean 'train'?"


@pytest.mark.parametrize("setting, fragment", [
    ("train.max_steps", "is not KEY.PATH=VALUE; write e.g. --set train.max_steps=100"),
    ("train..max_steps=3", "is not KEY.PATH=VALUE"),
    ("run=[unclosed", "the value is not valid YAML"),
    ("run.name=x", "run is a value ('demo'), not a section; set run itself"),
    ("eval.engines.2.concurrency=[1]", "eval.engines is a list of 2 entries, so '2' names none of them"),
    ("eval.engines.vllm.concurrency=[1]", "so 'vllm' names none of them; index it from 0 to 1"),
])
def test_a_setting_that_names_no_place_is_one_sentence(setting, fragment):
    with pytest.raises(ConfigError) as info:
        load_with_overrides(str(DEMO), settings=[setting])
    assert fragment in str(info.value) and len(str(info.value).splitlines()) == 1


def test_set_on_the_command_line_of_validate_and_of_every_stage(capsys):
    code, out, _ = _validate(capsys, str(DEMO), "--set", "train.max_steps=9", "--set", "eval.max_prompts=4")
    assert code == 0 and "max_steps: 9" in out and "max_prompts: 4" in out
    code, _, err = _validate(capsys, str(DEMO), "--set", "train.max_stepz=9")
    assert code == 2
    assert err.splitlines() == [f"draftline: {DEMO} with overrides: unknown key 'train.max_stepz'; "
                                "did you mean 'max_steps'?"]
    from draftline.cli import _STAGES, build_parser

    for stage in _STAGES:
        args = build_parser().parse_args([stage, str(DEMO), "--set", "a.b=1", "--set", "c=2"])
        assert args.settings == ["a.b=1", "c=2"]


def test_apply_settings_leaves_the_data_it_was_given_as_it_was():
    data = {"train": {"max_steps": 1}, "eval": {"engines": [{"engine": "vllm"}]}}
    before = json.dumps(data)
    after = apply_settings(data, ["train.max_steps=2", "eval.engines.0.engine=sglang", "drafter.attention=mla"])
    assert json.dumps(data) == before
    assert after == {"train": {"max_steps": 2}, "eval": {"engines": [{"engine": "sglang"}]},
                     "drafter": {"attention": "mla"}}
