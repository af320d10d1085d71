"""`python -m flows.nightly` refuses bad input before any engine starts: every problem a line, exit 2, nothing run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("prefect")
import flows.nightly  # noqa: E402
from draftline.regression import RegressionDetected  # noqa: E402
from flows.nightly import main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _config(tmp_path: Path, traces_prompts: str | None = None, **eval_fields) -> Path:
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data["store"] = {"root": str(tmp_path / "store")}
    data["eval"].update(eval_fields)
    if traces_prompts:
        data["traces"]["prompts"] = traces_prompts
    path = tmp_path / "nightly.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _exports(tmp_path: Path, formats: list[str]) -> Path:
    root = tmp_path / "export"
    for fmt in formats:
        (root / fmt).mkdir(parents=True)
        (root / fmt / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    return root


def test_a_drafter_folder_without_exports_is_refused_with_exit_2_before_any_engine(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code = main([str(_config(tmp_path)), str(tmp_path / "no-such-export")])
    err = capsys.readouterr().err
    assert code == 2
    assert f"drafter {tmp_path / 'no-such-export'} holds no engine export" in err


def test_a_missing_engine_export_and_a_missing_prompts_file_are_each_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    config = _config(tmp_path, prompts=str(tmp_path / "missing.jsonl"),
                     engines=[{"engine": "vllm"}, {"engine": "sglang"}])
    code = main([str(config), str(_exports(tmp_path, ["vllm"]))])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("draftline: ")]
    assert code == 2
    assert any("eval.prompts" in x and "missing.jsonl" in x for x in lines), lines
    assert any("has no sglang export but eval.engines lists sglang" in x for x in lines), lines


def test_what_the_nightly_does_not_read_does_not_stop_it(tmp_path, capsys, monkeypatch):
    """No traces prompts (the nightly generates no traces) and good exports: the check lets the night start."""
    monkeypatch.chdir(REPO)
    started = []

    def night(config, drafter, history_prefix, accept_new_baseline):
        started.append(drafter)
        raise RegressionDetected("tonight fell")  # stands in for the evaluation, which this test does not run

    monkeypatch.setattr(flows.nightly, "nightly_regression", night)
    exports = _exports(tmp_path, ["vllm", "sglang"])
    code = main([str(_config(tmp_path, traces_prompts=str(tmp_path / "no-traces-prompts.jsonl"))), str(exports)])
    assert started == [str(exports)]
    assert code == 1 and "draftline: tonight fell" in capsys.readouterr().err
