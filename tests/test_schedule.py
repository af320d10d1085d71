"""The schedule by load: derived from a k sweep (ties within the spread go to the smaller k, k=0 wins where speculation
is slower, ranges merged), written as vLLM's num_speculative_tokens_per_batch_size and SGLang's adaptive config,
verified by serving it, refused for bad sweeps, and carried by the report and the export. No engine runs here."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftline.config import EngineConfig
from draftline.errors import ConfigError, EngineError
from draftline.schedule import (
    NOT_RUN_ON_SGLANG, SweepPoint, compare, derive_schedule, falls_below, min_ratio_to_best_fixed, min_speedup,
    ranges_of, schedule_summary, serve_commands, serve_files, sglang_adaptive_config, verification_from_sweep,
    vllm_speculative_config,
)

REPO = Path(__file__).resolve().parents[1]


def sweep(table: dict[int, dict[int, list[float]]]) -> list[SweepPoint]:
    """{k: {concurrency: [tokens/s of each repeat]}} as sweep points (the median of two repeats is their mean)."""
    return [SweepPoint(k=k, concurrency=c, tokens_per_s=sum(runs) / len(runs), runs=runs)
            for k, by_c in table.items() for c, runs in by_c.items()]


def test_a_tie_within_the_measured_spread_goes_to_the_smaller_k():
    # At concurrency 1 k=3 is fastest by median (130) but k=1's fastest repeat (129) reaches its slowest (128).
    s = derive_schedule(sweep({0: {1: [100, 101]}, 1: {1: [120, 129]}, 3: {1: [128, 132]}}), "vllm")
    assert s.choices[0].best_k == 3 and s.choices[0].within_spread == [1, 3] and s.choices[0].k == 1
    assert s.ranges == [(1, 1, 1)] and s.repeats == 2
    # Without the overlap the faster k stands.
    s = derive_schedule(sweep({0: {1: [100, 101]}, 1: {1: [120, 121]}, 3: {1: [128, 132]}}), "vllm")
    assert s.choices[0].k == 3 and s.choices[0].speedup == pytest.approx(130 / 100.5)


def test_no_speculation_wins_where_speculation_is_slower_or_only_as_fast_within_the_spread():
    points = sweep({0: {1: [100, 100], 4: [300, 320], 16: [900, 900]},
                    3: {1: [140, 150], 4: [308, 318], 16: [600, 610]}})
    s = derive_schedule(points, "vllm")
    assert [(c.concurrency, c.k) for c in s.choices] == [(1, 3), (4, 0), (16, 0)]
    assert s.choices[1].best_k == 3 and s.choices[1].within_spread == [0, 3]  # 320 reaches 308: a tie, so k=0
    assert s.choices[2].best_k == 0 and s.choices[2].speedup == 1.0
    # A k whose median is below no speculation's is never chosen, however wide its spread.
    wide = sweep({0: {1: [100, 104]}, 3: {1: [150, 160]}}) + [
        SweepPoint(k=2, concurrency=1, tokens_per_s=98, runs=[90, 98, 200])]
    chosen = derive_schedule(wide, "vllm").choices[0]
    assert chosen.within_spread == [2, 3] and chosen.k == 0


def test_ranges_start_at_one_take_the_smaller_k_between_points_and_merge_equal_neighbours():
    from draftline.schedule import Choice

    def choices(pairs):
        return [Choice(concurrency=c, k=k, speedup=1, best_k=k, best_speedup=1, within_spread=[k]) for c, k in pairs]

    assert ranges_of(choices([(1, 3), (8, 3), (32, 0)])) == [(1, 8, 3), (9, 32, 0)]
    assert ranges_of(choices([(1, 3), (8, 1), (32, 1)])) == [(1, 1, 3), (2, 32, 1)]
    # Between 4 (k=2) and 16 (k=5) the sizes 5-15 were not measured: the smaller k, merged with 4's range.
    assert ranges_of(choices([(4, 2), (16, 5)])) == [(1, 15, 2), (16, 16, 5)]
    assert ranges_of(choices([(1, 0)])) == [(1, 1, 0)]
    s = derive_schedule(sweep({0: {1: [100], 4: [300]}, 3: {1: [150], 4: [200]}}), "vllm")
    assert s.ranges == [(1, 1, 3), (2, 4, 0)] and s.k_at(1) == 3 and s.k_at(3) == 0 and s.k_at(64) == 0
    assert s.describe() == "k=3 at batch size 1, off (k=0) at batch sizes 2 and above"
    assert s.repeats == 1


def test_vllm_gets_a_speculative_config_with_batch_size_ranges_and_a_plain_one_for_a_single_k():
    mixed = derive_schedule(sweep({0: {1: [100], 8: [800]}, 2: {1: [130], 8: [810]}, 4: {1: [150], 8: [600]}}),
                            "vllm")
    assert mixed.ranges == [(1, 1, 4), (2, 8, 2)]
    assert vllm_speculative_config(mixed, "/d") == {
        "method": "eagle3", "model": "/d", "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 8, 2]]}
    one = derive_schedule(sweep({0: {1: [100], 8: [800]}, 3: {1: [130], 8: [900]}}), "vllm")
    assert vllm_speculative_config(one, "/d") == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    off = derive_schedule(sweep({0: {1: [100], 8: [800]}, 3: {1: [90], 8: [500]}}), "vllm")
    assert vllm_speculative_config(off, "/d") is None
    [(when, line)] = serve_commands(mixed, "/t", "/d", ["--max-model-len", "1024"])
    assert when == "every load" and line.startswith("vllm serve /t --max-model-len 1024 --speculative-config '{")
    assert json.loads(line.split("--speculative-config ", 1)[1].strip("'")) == vllm_speculative_config(mixed, "/d")
    assert "--speculative-config" not in serve_commands(off, "/t", "/d", [])[0][1]


@pytest.mark.vllm
def test_vllms_own_schedule_reader_accepts_the_ranges_and_gives_each_batch_size_its_k():
    pytest.importorskip("vllm")
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    s = derive_schedule(sweep({0: {1: [100], 4: [300], 16: [900]}, 1: {1: [120], 4: [330], 16: [880]},
                               3: {1: [140], 4: [310], 16: [700]}}), "vllm")
    config = vllm_speculative_config(s, "/d")
    dense = build_dynamic_sd_schedule_lookup(config["num_speculative_tokens_per_batch_size"], vllm_max_batch_size=64,
                                             vllm_num_speculative_tokens=config["num_speculative_tokens"])
    assert dense[1:] == [s.k_at(b) for b in range(1, 65)]
    assert (dense[1], dense[4], dense[16], dense[64]) == (3, 1, 0, 0)


def test_sglang_gets_an_adaptive_config_keyed_by_batch_size_and_launch_lines_that_say_they_were_not_run():
    s = derive_schedule(sweep({0: {1: [100], 8: [800], 32: [2000]}, 1: {1: [120], 8: [880], 32: [1900]},
                               3: {1: [140], 8: [820], 32: [1500]}}), "sglang")
    assert s.ranges == [(1, 1, 3), (2, 8, 1), (9, 32, 0)]
    # SGLang routes a batch to the largest key at or below its size; one candidate per key keeps the measured steps.
    assert sglang_adaptive_config(s) == {"1": {"candidate_steps": [3]}, "2": {"candidate_steps": [1]},
                                         "9": {"candidate_steps": [0]}}
    s.supported = True
    [(when, line)] = serve_commands(s, "/t", "/d", ["--context-length", "2048"])
    assert when == "every load (adaptive)"
    assert line == ("python -m sglang.launch_server --model-path /t --context-length 2048 --speculative-algorithm "
                    "EAGLE3 --speculative-draft-model-path /d --speculative-num-steps 3 --speculative-eagle-topk 1 "
                    "--speculative-num-draft-tokens 4 --speculative-adaptive --speculative-adaptive-config "
                    "/d/serve/sglang-adaptive.json")
    # A version without adaptive speculation: the best fixed setting per load, one line each.
    s.supported = False
    lines = serve_commands(s, "/t", "/d", [])
    assert [w for w, _ in lines] == ["concurrency 1", "concurrency 8", "concurrency 32"]
    assert "--speculative-num-steps 1" in lines[1][1] and "--speculative" not in lines[2][1]
    s.commands = lines
    files = serve_files(s, "/d")
    assert json.loads(files["sglang-adaptive.json"]) == sglang_adaptive_config(s)
    assert NOT_RUN_ON_SGLANG in files["README.md"] and files["sglang-launch.sh"].count("sglang.launch_server") == 3


def test_verification_against_no_speculation_and_the_best_fixed_k():
    points = sweep({0: {1: [100, 102], 4: [300, 306]}, 3: {1: [140, 150], 4: [250, 260]}})
    s = derive_schedule(points, "vllm")
    served = [SweepPoint(k=3, concurrency=1, tokens_per_s=146, runs=[144, 148]),
              SweepPoint(k=0, concurrency=4, tokens_per_s=280, runs=[270, 290])]
    from draftline.schedule import Verification

    s.verification = Verification(source="server", points=served)
    s.comparisons = compare(s, points)
    one, four = s.comparisons
    assert one.speedup == pytest.approx(146 / 101) and one.best_fixed_k == 3
    assert one.ratio_to_best_fixed == pytest.approx(146 / 145) and one.fixed_speedup == {3: pytest.approx(145 / 101)}
    # At 4 the schedule's k=0 range still ran slower than the k=0 server, beyond the spread: that is a shortfall.
    assert four.speedup_max == pytest.approx(290 / 300) and falls_below(four, 0.05)
    assert not falls_below(one, 0.05) and not falls_below(four, 0.10)
    # The best single setting at 4 is no speculation itself: the ratio compares with it, never only with k > 0.
    assert four.best_fixed_k == 0 and four.ratio_to_best_fixed == pytest.approx(280 / 303)
    assert min_speedup(s) == pytest.approx(280 / 303) and min_ratio_to_best_fixed(s) == pytest.approx(280 / 303)
    # A schedule of one k is verified by the sweep's own server of that k.
    flat = derive_schedule(sweep({0: {1: [100], 4: [300]}, 3: {1: [150], 4: [350]}}), "vllm")
    flat.verification = verification_from_sweep(flat, sweep({0: {1: [100], 4: [300]}, 3: {1: [150], 4: [350]}}),
                                                 "one setting")
    assert [p.tokens_per_s for p in flat.verification.points] == [150, 350]


# ---------------------------------------------------------------------------------------------- serving the sweep


def _runs(tps: dict[int, list[float]], drafted: float | None = None):
    """A fake ServerRuns: per concurrency the median run and each repeat, with an acceptance when drafted."""
    from draftline.engines.base import Acceptance

    runs, repeats = [], []
    for c, values in tps.items():
        metric = SimpleNamespace(concurrency=c, output_tokens_per_s=sorted(values)[len(values) // 2])
        acc = (Acceptance(source="t", mean_acceptance_length=1.5, num_drafts=10, num_draft_tokens=round(10 * drafted))
               if drafted else None)
        runs.append((metric, acc, []))
        repeats.append([(SimpleNamespace(concurrency=c, output_tokens_per_s=v), []) for v in values])
    return SimpleNamespace(runs=runs, repeats=repeats, log_facts={})


def test_the_sweep_serves_each_further_k_once_and_the_schedule_only_where_it_mixes_k(tmp_path):
    from draftline.sweep import schedule_of, serve_further_ks

    cfg = EngineConfig(engine="vllm", num_speculative_tokens=3, concurrency=[1, 4], sweep_k=[0, 1, 3])
    calls = []

    def serve(drafter, engine_cfg, schedule, label):
        calls.append((label, engine_cfg.num_speculative_tokens, schedule))
        return _runs({1: [150, 152], 4: [290, 300]}, drafted=2.2)

    further = serve_further_ks(serve, cfg, tmp_path)
    assert list(further) == [1] and calls[0][:2] == ("eagle3-k1", 1)
    servers = {0: _runs({1: [100, 100], 4: [300, 302]}), 3: _runs({1: [130, 131], 4: [200, 205]}, 3.0), **further}
    points, s, runs = schedule_of(servers, cfg, serve, tmp_path / "t", tmp_path / "d", "0.32.0", True)
    assert s.ranges == [(1, 1, 1), (2, 4, 0)] and runs is not None
    label, k, served = calls[-1]
    assert (label, k, served.ranges) == ("schedule", 1, s.ranges)
    assert s.verification.source == "server" and [p.k for p in s.verification.points] == [1, 0]
    assert s.verification.points[0].draft_tokens_per_draft == pytest.approx(2.2)
    assert [c.concurrency for c in s.comparisons] == [1, 4] and s.commands[0][0] == "every load"
    # One k everywhere: the sweep's server of that k is the verification, and nothing more starts.
    calls.clear()
    servers[1] = _runs({1: [150, 152], 4: [400, 410]})
    _, flat, runs = schedule_of(servers, cfg, serve, tmp_path / "t", tmp_path / "d", "0.32.0", True)
    assert flat.uniform and runs is None and calls == [] and flat.verification.source == "sweep"
    assert "which the sweep's own server of k=1 served" in flat.verification.why_sweep


def test_an_engine_without_schedule_support_is_named_with_the_version_that_has_it_and_the_run_goes_on(tmp_path):
    from draftline.sweep import schedule_of

    cfg = EngineConfig(engine="vllm", num_speculative_tokens=3, concurrency=[1, 4])
    servers = {0: _runs({1: [100], 4: [300]}), 3: _runs({1: [150], 4: [200]}, 3.0)}

    def serve(*args):
        raise AssertionError("no schedule server for an engine that cannot serve one")

    _, s, runs = schedule_of(servers, cfg, serve, tmp_path, tmp_path, "0.20.1", False)
    assert runs is None and s.verification.source == "sweep"
    assert s.support_note.startswith("vLLM 0.20.1 cannot change k by load: it has no speculative_config."
                                     "num_speculative_tokens_per_batch_size (vLLM 0.25.0 has it).")
    assert "this evaluation's figures are those of the fixed k=3" in s.support_note
    assert [w for w, _ in s.commands] == ["concurrency 1", "concurrency 4"]

    # A schedule server that fails to start leaves the sweep's figures and says why.
    def broken(drafter, engine_cfg, schedule, label):
        raise EngineError("vllm-schedule failed to start after 1 attempt(s): ValueError: bad schedule\nlog tail")

    _, s, runs = schedule_of(servers, cfg, broken, tmp_path, tmp_path, "0.32.0", True)
    assert runs is None and s.verification.source == "sweep"
    assert s.support_note.startswith("The server with the schedule did not start (vllm-schedule failed to start")


def test_engine_command_lines_carry_the_schedule(tmp_path):
    from draftline.engines import sglang, vllm

    s = derive_schedule(sweep({0: {1: [100], 4: [300]}, 3: {1: [150], 4: [200]}}), "vllm")
    cfg = EngineConfig(engine="vllm", num_speculative_tokens=3)
    argv = vllm.command(cfg, tmp_path / "t", tmp_path / "d", "t", 8000, python="py", schedule=s)
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 4, 0]]
    spec = vllm.VllmAdapter().server_spec(cfg, tmp_path / "t", tmp_path / "d", "t", schedule=s)
    assert spec.name == "vllm-schedule"
    sg = sglang.SglangAdapter().server_spec(EngineConfig(engine="sglang"), tmp_path / "t", tmp_path / "d", "t",
                                             schedule=s)
    argv = sg.command(8000)
    path = Path(argv[argv.index("--speculative-adaptive-config") + 1])
    assert "--speculative-adaptive" in argv and json.loads(path.read_text()) == sglang_adaptive_config(s)


# ---------------------------------------------------------------------------------------------- config


def test_config_validate_refuses_a_sweep_without_zero_or_deeper_than_training_in_one_sentence_naming_the_field():
    from draftline.config_loading import load_config

    def engines(sweep_k):
        return {"eval": {"engines": [{"engine": "vllm", "num_speculative_tokens": 3, "sweep_k": sweep_k}]}}

    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs" / "demo.yaml", overrides=engines([1, 3]))
    assert str(info.value).count("\n") == 0
    assert "eval.engines.0.sweep_k=[1, 3] is invalid: it lacks 0 (no speculation)" in str(info.value)
    with pytest.raises(ConfigError, match=r"eval.engines\[0\].sweep_k=\[0, 3, 5\] has k=5, deeper than the drafter is "
                                          r"trained for \(train.ttt_steps=3\)"):
        load_config(REPO / "configs" / "demo.yaml", overrides=engines([0, 3, 5]))
    cfg = load_config(REPO / "configs" / "demo.yaml", overrides=engines([0, 1]))
    assert cfg.eval.engines[0].ks == [0, 1, 3]
    assert EngineConfig(engine="vllm").ks == [0, 3]  # the default sweep: the evaluation's own two servers


# ---------------------------------------------------------------------------------------------- report and export


def _result(tmp_path: Path):
    from tests.test_evaluate import _drafter, _result as eval_result
    from draftline.sweep import schedule_of

    cfg = EngineConfig(engine="vllm", num_speculative_tokens=3, concurrency=[1, 4], sweep_k=[0, 1, 3])
    servers = {0: _runs({1: [100, 101], 4: [300, 302]}), 1: _runs({1: [120, 122], 4: [300, 315]}, 1.0),
               3: _runs({1: [140, 145], 4: [200, 205]}, 3.0)}

    def serve(drafter, engine_cfg, schedule, label):
        return _runs({1: [141, 143], 4: [304, 306]}, 2.0)

    points, schedule, _ = schedule_of(servers, cfg, serve, tmp_path / "target", tmp_path / "drafter", "0.32.0", True)
    return eval_result(_drafter(tmp_path, "vllm")).model_copy(update={"sweep": points, "schedule": schedule})


def test_report_has_the_sweep_picture_the_schedule_table_and_the_serve_line(tmp_path):
    from draftline.report import report_markdown, write_report
    from draftline.schedule_report import summary_lines
    from draftline.store import open_store

    r = _result(tmp_path)
    md = report_markdown([r])
    section = md.split("## Speculation by load")[1].split("\n## ")[0]
    assert "![speedup by k and concurrency](schedule_sweep.png)" in section
    assert "### vLLM 0.32.0: k=3 at batch size 1, off (k=0) at batch sizes 2 and above" in section
    assert "Verified by serving: a server of its own was started with the schedule" in section
    # The fake servers' median is their faster repeat of two.
    assert "| 1 | 101.0 | 1.21x | 1.44x (chosen) | 3 | 143.0 | 1.42x (1.40x-1.43x) | 0.99 (k=3) |" in section
    assert "| 4 | 302.0 | 1.04x | 0.68x | 0 | 306.0 | 1.01x (1.01x-1.02x) | 0.97 (k=1) |" in section
    assert "vllm serve " in section and "num_speculative_tokens_per_batch_size" in section
    assert "r/export/vllm/serve/" in section
    lines = summary_lines([r])
    assert lines[0].startswith("vLLM schedule: k=3 at batch size 1, off (k=0) at batch sizes 2 and above; "
                               "verified (served on its own server): 1.42x at concurrency 1")
    assert lines[-1].startswith("  serve (every load): vllm serve ")
    store = open_store(str(tmp_path / "store"))
    keys = write_report([r], store, "r")
    assert "schedule_sweep.png" in keys and store.get_bytes(keys["schedule_sweep.png"])[:4] == b"\x89PNG"
    # A result without a sweep (written before it) has neither section nor picture.
    bare = r.model_copy(update={"sweep": [], "schedule": None})
    assert "Speculation by load" not in report_markdown([bare])
    assert "schedule_sweep.png" not in write_report([bare], store, "r2")


def test_the_runs_own_export_carries_the_schedule_in_its_serve_folder_and_keeps_its_fingerprint(tmp_path):
    from draftline.regression.inputs import _fingerprint
    from draftline.stages import publish_serve_folder
    from draftline.store import open_store

    store = open_store(str(tmp_path / "store"))
    export = store.put_dir("r/export/vllm", _write(tmp_path / "export", {"config.json": "{}", "model.safetensors": "w"}))
    before = _fingerprint(store, "r/export/vllm", store.list(""))
    r = _result(tmp_path)
    keys = publish_serve_folder(store, "r/export/vllm", r.schedule, tmp_path / "export")
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == ["README.md", "schedule.json", "speculative_config.json",
                                                         "vllm-serve.sh"]
    local = store.get_dir("r/export/vllm", tmp_path / "copy")  # by its manifest: the serve/ folder comes along
    config = json.loads((local / "serve" / "speculative_config.json").read_text())
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 4, 0]]
    assert config["model"] == str((tmp_path / "export").resolve())
    assert "vllm serve" in (local / "serve" / "README.md").read_text()
    assert _fingerprint(store, "r/export/vllm", store.list("")) == before
    assert export is not None


def test_the_report_step_writes_the_serve_folder_into_the_runs_own_export_only(tmp_path):
    # The evaluation workers' identity writes only evaluations, so the serve/ folder is written at the report.
    from draftline.config_loading import load_config
    from draftline.stages import publish_own_schedule
    from draftline.store import open_store

    config = load_config(REPO / "configs" / "demo.yaml", overrides={"run": "r", "store": {"root": str(tmp_path / "s")}})
    store = open_store(config.store.root)
    r = _result(tmp_path)
    assert publish_own_schedule(config, store, r) == []  # no export of its own (a nightly's production drafter)
    store.put_dir("r/export/vllm", _write(tmp_path / "export", {"config.json": "{}"}))
    assert "r/export/vllm/serve/schedule.json" in publish_own_schedule(config, store, r)
    assert publish_own_schedule(config, store, r.model_copy(update={"schedule": None})) == []


def _write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


# ---------------------------------------------------------------------------------------------- the nightly


def test_the_nightly_records_the_schedule_and_fails_with_its_own_cause_when_it_is_slower_than_no_speculation(
        tmp_path):
    from draftline.config import RegressionConfig
    from draftline.regression import History, comparison_markdown, judge_all, record
    from draftline.schedule import Verification
    from draftline.store import open_store
    from tests.test_regression import eval_result

    points = sweep({0: {1: [100, 102], 4: [300, 306]}, 3: {1: [140, 150], 4: [250, 260]}})
    schedule = derive_schedule(points, "vllm")
    held = schedule.model_copy(update={"verification": Verification(source="server", points=[
        SweepPoint(k=3, concurrency=1, tokens_per_s=146, runs=[144, 148]),
        SweepPoint(k=0, concurrency=4, tokens_per_s=299, runs=[296, 302])])})
    held.comparisons = compare(held, points)
    history = History(open_store(str(tmp_path / "store")), "history")
    cfg = RegressionConfig()
    night = eval_result().model_copy(update={"sweep": points, "schedule": held})
    verdict = judge_all([night], history, cfg, lineage="demo", drafter="d", target="t")
    assert verdict.engines[0].status == "baseline" and not verdict.regressed
    record(verdict, [night], history)
    [rec] = history.records("t", "vllm", "demo")
    assert rec.figures.schedule == [(1, 1, 3), (2, 4, 0)] and len(rec.figures.schedule_comparisons) == 2
    assert "vllm schedule by load (recorded): k=3 at batch size 1" in comparison_markdown(verdict, cfg)
    # The schedule's k=0 range ran slower than the k=0 server beyond the spread: the night fails, saying so.
    slow = schedule.model_copy(update={"verification": Verification(source="server", points=[
        SweepPoint(k=3, concurrency=1, tokens_per_s=146, runs=[144, 148]),
        SweepPoint(k=0, concurrency=4, tokens_per_s=260, runs=[255, 265])])})
    slow.comparisons = compare(slow, points)
    verdict = judge_all([night.model_copy(update={"schedule": slow})], history, cfg, lineage="demo", drafter="d",
                        target="t")
    engine = verdict.engines[0]
    assert verdict.regressed and [c.kind for c in engine.causes] == ["schedule-below-baseline"]
    assert engine.causes[0].explanation.startswith(
        "the verified schedule (k=3 at batch size 1, off (k=0) at batch sizes 2 and above) served at concurrency 4 "
        "(k=0) 0.86x no speculation's tokens per second, 0.88x at its fastest repeat")
    assert verdict.event_payload()["engines"]["vllm"]["schedule"] == [[1, 1, 3], [2, 4, 0]]
    assert "the schedule by load is slower than no speculation" in verdict.message()


# ---------------------------------------------------------------------------------------------- CPU libraries


def test_vllm_on_a_cpu_gets_tcmalloc_then_intel_openmp_preloaded_once_and_nothing_where_none_is_found(
        tmp_path, monkeypatch):
    from draftline.engines import cpu_preload, vllm

    prefix = tmp_path / "venv"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "lib" / "libiomp5.so").write_bytes(b"")
    assert cpu_preload.find_iomp(str(prefix / "bin" / "python")) == prefix / "lib" / "libiomp5.so"
    monkeypatch.setattr(cpu_preload, "find_tcmalloc", lambda: Path("/usr/lib/x/libtcmalloc_minimal.so.4"))
    monkeypatch.setattr(cpu_preload, "find_iomp", lambda python=None: prefix / "lib" / "libiomp5.so")
    value, added = cpu_preload.cpu_preload("/opt/libother.so")
    assert value == f"/usr/lib/x/libtcmalloc_minimal.so.4:{prefix}/lib/libiomp5.so:/opt/libother.so"
    assert cpu_preload.cpu_preload("/a/libtcmalloc.so:/b/libiomp5.so") == ("/a/libtcmalloc.so:/b/libiomp5.so", [])
    monkeypatch.setattr(vllm, "on_cpu", lambda: True)
    spec = vllm.VllmAdapter().server_spec(EngineConfig(engine="vllm"), tmp_path, None, "t")
    assert spec.env["LD_PRELOAD"].startswith("/usr/lib/x/libtcmalloc_minimal.so.4:")
    off = vllm.VllmAdapter().server_spec(EngineConfig(engine="vllm", preload_cpu_libraries=False), tmp_path, None, "t")
    assert "LD_PRELOAD" not in off.env
    # An engine in an environment of its own, or nothing found: the worker's LD_PRELOAD as it is.
    own = EngineConfig(engine="vllm", python="/opt/engine/bin/python")
    assert "LD_PRELOAD" not in vllm.VllmAdapter().server_spec(own, tmp_path, None, "t").env
    monkeypatch.setattr(cpu_preload, "find_tcmalloc", lambda: None)
    monkeypatch.setattr(cpu_preload, "find_iomp", lambda python=None: None)
    assert cpu_preload.preload_env(None, {}) == {}


def test_the_run_summary_prints_each_schedule_its_verification_and_the_line_to_serve_it(tmp_path, capsys):
    from draftline.config_loading import load_config
    from draftline.schedule_report import summary_lines
    from draftline.run_summary import print_summary

    config = load_config(REPO / "configs" / "demo.yaml", overrides={"store": {"root": str(tmp_path / "runs")}})
    report = {"rows": [], "report_key": "demo/eval/report/report.md", "schedules": summary_lines([_result(tmp_path)])}
    print_summary(config, report)
    out = capsys.readouterr().out
    assert "vLLM schedule: k=3 at batch size 1, off (k=0) at batch sizes 2 and above; verified (served on its own " \
           "server): 1.42x at concurrency 1 (best single setting k=3: 1.44x), 1.01x at concurrency 4" in out.replace("\n", " ")
    assert "serve (every load): vllm serve " in out


def test_a_schedule_its_own_server_serves_slower_than_no_speculation_is_replaced_by_the_best_single_setting(tmp_path):
    """vLLM runs the drafter at every step of a k=0 range (to keep its cache in step): on a 2-core CPU such a range
    served 0.62x of a server without the drafter. What was served is kept; the export carries the best single k."""
    from draftline.config import RegressionConfig
    from draftline.regression import History, judge_all
    from draftline.schedule import best_uniform
    from draftline.store import open_store
    from draftline.sweep import schedule_of
    from tests.test_regression import eval_result

    cfg = EngineConfig(engine="vllm", num_speculative_tokens=3, concurrency=[1, 4])
    servers = {0: _runs({1: [375, 380], 4: [560, 575]}), 3: _runs({1: [398, 400], 4: [540, 545]}, 3.0)}

    def serve(drafter, engine_cfg, schedule, label):
        return _runs({1: [230, 232], 4: [550, 556]}, 3.0)

    points, s, runs = schedule_of(servers, cfg, serve, tmp_path, tmp_path, "0.32.0", True)
    assert runs is not None and s.rejected.ranges == [(1, 1, 3), (2, 4, 0)]
    assert s.rejected.verification.source == "server" and s.rejected.comparisons[0].speedup == pytest.approx(232 / 380)
    # k=3 is below no speculation at 4 beyond the spread: the best single setting is no speculation.
    assert s.ranges == [(1, 4, 0)] and s.verification.source == "sweep"
    assert s.verification.why_sweep.startswith(
        "the derived schedule (k=3 at batch size 1, off (k=0) at batch sizes 2 and above) served 0.61x at "
        "concurrency 1, 0.97x at concurrency 4 of no speculation's tokens per second on its own server, so the best "
        "single setting of the sweep replaces it: no speculation at every load")
    assert "--speculative-config" not in s.commands[0][1]
    assert "(replacing the derived k=3 at batch size 1, off (k=0) at batch sizes 2 and above, which its own server " \
           "served at 0.61x at concurrency 1, 0.97x at concurrency 4)" in schedule_summary(s)
    # A k within the spread of no speculation everywhere, and faster somewhere, is the best single setting.
    assert best_uniform(sweep({0: {1: [100, 110], 4: [300, 320]}, 3: {1: [140, 150], 4: [295, 305]}}),
                        "vllm").ranges == [(1, 4, 3)]
    # The nightly fails on what the schedule's own server served, and says what the export carries instead.
    night = eval_result().model_copy(update={"sweep": points, "schedule": s})
    verdict = judge_all([night], History(open_store(str(tmp_path / "store")), "h"), RegressionConfig(),
                        lineage="demo", drafter="d", target="t")
    [cause] = verdict.engines[0].causes
    assert cause.kind == "schedule-below-baseline"
    assert cause.explanation.endswith("; the evaluation replaced it with off (k=0) at every batch size, which "
                                      "the export carries")


def test_the_report_gives_the_acceptance_each_k_needs_to_pay_and_the_terminal_names_a_load_where_none_pays(tmp_path):
    from draftline.report import report_markdown
    from draftline.schedule_report import summary_lines

    r = _result(tmp_path)  # every drafting server accepted 1.5 tokens a step
    section = report_markdown([r]).split("## Speculation by load")[1].split("\n## ")[0]
    # Break-even = acceptance length x no speculation's tok/s / the k's tok/s: at 1, 1.5 x 101 / 122 and / 145.
    assert "| 1 | 1.24 (1.50) | 1.04 (1.50) |" in section
    assert "| 4 | 1.44 (1.50) | 2.21 (1.50) |" in section
    assert not any("no k pays" in line for line in summary_lines([r]))  # k=1 pays at 4, if within the spread
    slower = r.model_copy(update={"sweep": [p.model_copy(update={"tokens_per_s": 250.0})
                                            if (p.k, p.concurrency) == (1, 4) else p for p in r.sweep]})
    assert ("  no k pays at concurrency 4: k=1 breaks even at an acceptance length of 1.81, the drafter's is 1.50"
            in summary_lines([slower]))
