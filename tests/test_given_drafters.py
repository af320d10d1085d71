"""Drafters draftline did not train, without a server: the comparison's verdict, `draftline convert` and
`draftline eval --drafter` on the command line, refusals before anything starts, and eval.reference.enabled."""
import json
import shutil
from pathlib import Path

import pytest
import yaml

from draftline import stages
from draftline.cli import main
from draftline.comparison import DrafterFigures, verdict
from draftline.config import PipelineConfig
from draftline.engines.base import Acceptance
from draftline.engines.client import RunMetrics
from draftline.eval_result import ConcurrencyPoint, EvalResult
from draftline.given_drafters import default_run, drafter_labels
from draftline.layout import eval_result_key, reference_result_key, training_record_key
from draftline.store import open_store
from tests.fixtures.public_drafters import rename_into_eagle_layout, republish_in_public_layout

REPO = Path(__file__).resolve().parents[1]
DEMO_LLAMA = REPO / "assets" / "demo-llama"


# ---- the verdict ---------------------------------------------------------------------------------------------------
def fig(engine="vLLM", accepted=0.50, spread=0.0, parity=1.0, threshold=0.8, status="ok", reason=None):
    if status != "ok":
        return DrafterFigures(engine=engine, status=status, reason=reason)
    return DrafterFigures(engine=engine, accepted=accepted, accepted_low=accepted - spread / 2,
                          accepted_high=accepted + spread / 2, parity=parity, parity_threshold=threshold,
                          parity_suspected=None if parity is None else parity < threshold)


def test_the_verdict_names_the_difference_in_both_engines_and_whether_parity_holds():
    both = {"vllm": (fig(), fig(accepted=0.56)), "sglang": (fig("SGLang"), fig("SGLang", accepted=0.56))}
    assert verdict("A", "B", both) == "B accepts 12% more tokens than A in both engines; parity holds for both"
    one = {"vllm": (fig(), fig(accepted=0.40))}
    assert verdict("trained", "weakened", one) == ("weakened accepts 20% fewer tokens than trained in vLLM; parity "
                                                   "holds for both")
    mixed = {"vllm": (fig(), fig(accepted=0.56)), "sglang": (fig("SGLang"), fig("SGLang", accepted=0.45))}
    assert verdict("A", "B", mixed) == ("B accepts 12% more tokens than A in vLLM and 10% fewer in SGLang; parity "
                                        "holds for both")


def test_differences_within_the_run_to_run_spread_are_the_same():
    alike = {"vllm": (fig(accepted=0.50, spread=0.04), fig(accepted=0.52, spread=0.02))}
    assert verdict("A", "B", alike) == ("A and B accept the same within the run-to-run spread (±8%) in vLLM; parity "
                                        "holds for both")
    # Exact repeats still leave a few percent for batching.
    exact = {"vllm": (fig(accepted=0.50), fig(accepted=0.51)), "sglang": (fig("SGLang"), fig("SGLang", accepted=0.6))}
    assert verdict("A", "B", exact) == ("B accepts 20% more tokens than A in SGLang, the same within the run-to-run "
                                        "spread (±3%) in vLLM; parity holds for both")


def test_both_below_the_reference_in_an_engine_blame_the_engine_and_one_below_says_whose():
    engine = {"vllm": (fig(parity=0.3), fig(accepted=0.6, parity=0.35)),
              "sglang": (fig("SGLang"), fig("SGLang", accepted=0.6))}
    assert verdict("A", "B", engine) == ("both fall below the reference in vLLM: the engine, not the drafters; B "
                                         "accepts 20% more tokens than A in SGLang; parity holds for both")
    only_b = {"vllm": (fig(), fig(accepted=0.3, parity=0.5))}
    assert verdict("A", "B", only_b) == ("B accepts 40% fewer tokens than A in vLLM; parity fails for B in vLLM "
                                         "(0.50 < 0.80): that engine misreads the drafter, so compare them with the "
                                         "reference decoder there")
    unmeasured = {"vllm": (fig(parity=None), fig(accepted=0.6, parity=None))}
    assert verdict("A", "B", unmeasured).endswith("parity is not measured for A in vLLM and for B in vLLM")
    skipped = {"sglang": (fig("SGLang", status="skipped", reason="skipped: needs a GPU worker with sglang"),
                          fig("SGLang", status="skipped", reason="skipped: needs a GPU worker with sglang"))}
    assert verdict("A", "B", skipped) == ("no engine measured both A and B (SGLang: A skipped: needs a GPU worker "
                                          "with sglang)")


def test_labels_and_the_default_run_name_each_drafter():
    assert drafter_labels(["/m/kimi-eagle3", "s3://b/runs/demo/export/vllm", "/x/kimi-eagle3/"]) == \
        ["kimi-eagle3", "export-vllm", "kimi-eagle3-2"]
    assert default_run(["/m/kimi-eagle3"]) == "eval-kimi-eagle3"
    assert default_run(["/m/a", "/m/b"]) == "compare-a-vs-b"


# ---- the command line: convert, and eval --drafter's refusals before anything starts -------------------------------
@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """draftline's vLLM export of an untrained drafter for demo-llama (ids 2, 4, 5)."""
    import torch

    from draftline.config import DrafterConfig
    from draftline.drafter.eagle_format import save_eagle_dir
    from draftline.drafter.export import export_drafter
    from draftline.drafter.target_sizing import drafter_for_target
    from draftline.drafter.train import load_target_head
    from draftline.drafter.vocab import build_vocab

    root = tmp_path_factory.mktemp("given")
    cfg, embed, _ = load_target_head(DEMO_LLAMA)
    torch.manual_seed(0)
    model = drafter_for_target(cfg, DrafterConfig(draft_vocab_size=512), [2, 4, 5])
    model.load_target_weights(embed)
    model.set_vocab(*build_vocab(torch.arange(cfg["vocab_size"]) % 89, 512)[:2])
    trained = save_eagle_dir(model, root / "trained")
    (trained / "draftline.json").write_text(json.dumps({"convention": "sglang"}))
    return export_drafter(trained, DEMO_LLAMA, root / "export", formats=("vllm",))["vllm"]


def test_convert_on_the_command_line_says_where_the_ids_came_from(export, tmp_path, capsys):
    public = republish_in_public_layout(export, tmp_path / "public")
    assert main(["convert", str(public), "--to", "sglang", str(tmp_path / "out"), "--target", str(DEMO_LLAMA)]) == 2
    err = capsys.readouterr().err
    assert "names no aux-layer ids" in err and "--aux-layer-ids and --convention vllm|sglang" in err
    assert main(["convert", str(public), "--to", "sglang", str(tmp_path / "out"), "--target", str(DEMO_LLAMA),
                 "--aux-layer-ids", "2,4,5", "--convention", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "the sglang format of" in out and "aux-layer ids [1, 3, 4] in the sglang convention" in out
    assert "aux-layer ids [2, 4, 5] as given (--aux-layer-ids, vllm convention)" in out


def _config(tmp_path: Path, **eval_extra) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p1", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cfg = {"run": "trained-run", "store": {"root": str(tmp_path / "runs")}, "target": {"path": str(DEMO_LLAMA)},
           "traces": {"prompts": str(prompts)}, "eval": {"prompts": str(prompts), "engines": [{"engine": "vllm"}],
                                                          **eval_extra}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_eval_drafter_refuses_a_bad_drafter_in_one_sentence_before_anything_starts(export, tmp_path, capsys):
    config = _config(tmp_path)
    good = rename_into_eagle_layout(export, tmp_path / "good", ids_convention="sglang")
    wide = Path(shutil.copytree(good, tmp_path / "wide"))
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "vocab_size": 8192}))
    # The second drafter is refused before the first is measured: nothing of either run exists.
    assert main(["eval", str(config), "--drafter", str(good), "--drafter", str(wide)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "wide/config.json: vocab_size 8192 but the target" in err[0], err
    runs = tmp_path / "runs" / "compare-good-vs-wide"
    assert not list(runs.rglob("result.json")) and not list(runs.rglob("report.md"))
    assert main(["eval", str(config), "--aux-layer-ids", "2,4,5", "--convention", "vllm"]) == 2
    assert "describe a drafter given with --drafter" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", str(config), "--drafter", str(good), "--aux-layer-ids", "2;4;5"])


# ---- eval.reference.enabled ----------------------------------------------------------------------------------------
def _metrics(c: int, tps: float) -> RunMetrics:
    return RunMetrics(concurrency=c, requests=4, output_tokens=int(tps * 2), duration_s=2.0, output_tokens_per_s=tps,
                      requests_per_s=2.0, latency_mean_s=0.5, latency_p50_s=0.5, latency_p90_s=0.6, ttft_mean_s=0.05,
                      ttft_p50_s=0.05, tpot_mean_s=0.01)


def _engine_result(run: str, lineage: dict) -> EvalResult:
    acc = Acceptance(source="vLLM /metrics counter deltas", mean_acceptance_length=1.5, per_position=[0.3, 0.15, 0.05],
                     num_drafts=100, num_accepted_tokens=50)
    point = ConcurrencyPoint(concurrency=1, baseline=_metrics(1, 100.0), speculative=_metrics(1, 120.0), speedup=1.2,
                             acceptance=acc, identical_outputs=1.0)
    return EvalResult(run=run, engine="vllm", engine_version="0.32.0", status="ok", hardware="CPU test (2 cores)",
                      target="huge", target_path="/t", drafter="d", drafter_path="/nowhere", drafter_lineage=lineage,
                      prompt_set="prompts.jsonl", num_speculative_tokens=3, points=[point], acceptance=acc)


def test_auto_skips_the_reference_for_a_target_larger_than_the_device_and_parity_uses_the_training_estimate(tmp_path):
    huge = tmp_path / "kimi-k2.5"
    huge.mkdir()
    shutil.copy(REPO / "tests" / "fixtures" / "targets" / "kimi-k2.5" / "config.json", huge / "config.json")
    (huge / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 595 * 10**9},
                                                                    "weight_map": {}}))
    cfg = PipelineConfig.model_validate(yaml.safe_load(_config(tmp_path).read_text()))
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"path": str(huge)}), "run": "given"})
    store = open_store(cfg.store.root)
    key = stages.reference(cfg, {}, store)  # nothing is loaded: the check reads the index alone
    skipped = json.loads(store.get_bytes(key))
    assert skipped["status"] == "skipped" and key == reference_result_key("given")
    assert skipped["reason"].startswith("the reference decoder was skipped: the target needs about 1,190 GB in "
                                        "float32, more than the ")
    # The drafter's lineage names its training record, whose replayed estimate at k=3 becomes parity's basis.
    record = {"final_val": {"accuracy": [0.6, 0.5, 0.4], "replayed": {"acceptance_length_by_k": [1.4, 1.5, 1.6]}}}
    store.put_bytes("trained/train/metrics.json", json.dumps(record).encode())
    lineage = {"training_metrics": store.uri("trained/train/metrics.json")}
    store.put_bytes(eval_result_key("given", "vllm"), _engine_result("given", lineage).model_dump_json().encode())
    out = stages.report(cfg, store, [eval_result_key("given", "vllm")], key)
    result = EvalResult.model_validate_json(store.get_bytes(eval_result_key("given", "vllm")))
    assert result.parity.basis == "training's replayed estimate" and result.parity.value == pytest.approx(0.5 / 0.6)
    assert "the engine accepts what the training's replayed estimate accepts" in result.parity.verdict
    assert "**Parity basis.** the reference decoder was skipped" in out["markdown"]
    assert "parity compares the engines with the training's replayed estimate of acceptance length at k=3, 1.600" \
        in out["markdown"]
    assert out["rows"][0]["status"] == "skipped" and "training's replayed estimate" in out["rows"][0]["note"]
    assert not store.exists(training_record_key("given"))


def test_without_a_reference_or_an_estimate_parity_is_not_measured_and_the_report_says_why(tmp_path):
    cfg = PipelineConfig.model_validate(yaml.safe_load(_config(tmp_path, reference={"enabled": False}).read_text()))
    store = open_store(cfg.store.root)
    key = stages.reference(cfg, {}, store)
    assert json.loads(store.get_bytes(key))["reason"] == ("the reference decoder did not run "
                                                          "(eval.reference.enabled is false)")
    store.put_bytes(eval_result_key(cfg.run, "vllm"), _engine_result(cfg.run, {}).model_dump_json().encode())
    out = stages.report(cfg, store, [eval_result_key(cfg.run, "vllm")], key)
    assert EvalResult.model_validate_json(store.get_bytes(eval_result_key(cfg.run, "vllm"))).parity is None
    assert "the drafter has no training estimate at k=3 either, so parity is not measured" in out["markdown"]


def test_the_comparison_page_gives_each_engines_difference_with_its_spread(tmp_path):
    from draftline.comparison import Compared, write_comparison
    from draftline.parity import with_parity

    reference = {"mean_acceptance_length": 1.5, "per_position_acceptance": [0.3, 0.15, 0.05]}
    a = with_parity(_engine_result("r/a", {}), reference, 0.8)
    b = _engine_result("r/b", {})
    weaker = b.acceptance.model_copy(update={"mean_acceptance_length": 1.4})
    point = b.points[0].model_copy(update={"acceptance": weaker, "speedup": 1.1, "speedup_min": 1.0,
                                           "speedup_max": 1.15, "acceptance_runs": [weaker, weaker]})
    b = with_parity(b.model_copy(update={"acceptance": weaker, "points": [point]}),
                    {**reference, "mean_acceptance_length": 1.42}, 0.8)
    store = open_store(str(tmp_path / "runs"))
    out = write_comparison([Compared("a", "/m/a", "the EAGLE layout", [a], reference),
                            Compared("b", "/m/b", "the speculators format", [b], {**reference,
                                                                                  "mean_acceptance_length": 1.42})],
                           store, "r/comparison", "The same everything.")
    assert out["verdicts"] == ["b against a: b accepts 20% fewer tokens than a in vLLM; parity holds for both"]
    page = store.get_bytes("r/comparison/report.md").decode()
    assert "| reference decoder | 0.500 | 0.420 | -0.080 | -16% | | |" in page
    assert "| vllm 0.32.0 | 0.500 | 0.400 | -0.100 | -20% | 1.00 | 0.95 |" in page
    assert "| vllm 0.32.0 | 1 | 1.20x | 1.10x (1.00-1.15) | -0.10 |" in page
    assert "- **b**: /m/b, the speculators format." in page
    assert json.loads(store.get_bytes("r/comparison/comparison.json"))["pairs"][0]["a"] == "a"


@pytest.mark.s3
def test_a_drafter_in_s3_is_read_like_a_folder(export, tmp_path, s3_uri, capsys):
    specforge = rename_into_eagle_layout(export, tmp_path / "sf", layer_prefix="layers.0.", ids_convention="sglang")
    store = open_store(s3_uri)
    for f in specforge.iterdir():
        store.put_file(f"published/sf/{f.name}", f)
    source = f"{s3_uri}/published/sf"
    assert main(["convert", source, "--to", "vllm", str(tmp_path / "out"), "--target", str(DEMO_LLAMA)]) == 0
    lineage = json.loads((tmp_path / "out" / "draftline.json").read_text())
    assert lineage["source"] == source and lineage["aux_layer_ids_vllm"] == [2, 4, 5]
    assert "inferred: ids only in eagle_config" in lineage["aux_layer_ids_source"]
    assert main(["convert", f"{s3_uri}/nothing", "--to", "vllm", str(tmp_path / "none"),
                 "--target", str(DEMO_LLAMA)]) == 2
    assert "nothing: nothing stored there; pass the S3 folder" in capsys.readouterr().err
