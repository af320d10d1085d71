"""`draftline train` as a person runs it: in a terminal a progress bar with the step lines above it, and piped the
step lines alone (before, the command printed nothing for the whole of training)."""
from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.fixtures.drafter import HiddenRun

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def _config(tmp_path: Path, data: HiddenRun) -> Path:
    config = yaml.safe_load((ROOT / "configs/demo.yaml").read_text())
    config.update(run=data.run, store={"root": str(data.store_root)},
                  target={"path": str(data.target_dir), "dtype": "float32"})
    config["drafter"] = {"draft_vocab_size": 64}
    config["train"].update(max_steps=STEPS, log_every=2, warmup_steps=1, tokens_per_batch=256, max_seq_len=64,
                           val_every=STEPS, checkpoint_every=STEPS)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train(tmp_path: Path, data: HiddenRun, run: str, stderr) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "draftline.cli", "train", str(_config(tmp_path, data)), "--run", run],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                            env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})


def test_train_in_a_terminal_shows_a_progress_bar_under_its_step_lines(tmp_path, tiny_hidden_run):
    import shutil

    # Its own copy of the run: the session's shared one must not gain this test's checkpoints.
    shutil.copytree(tiny_hidden_run.store_root / tiny_hidden_run.run, tmp_path / "store" / "bar")
    data = HiddenRun(tmp_path / "store", "bar", tiny_hidden_run.target_dir, tiny_hidden_run.sequences)
    master, slave = pty.openpty()
    proc = _train(tmp_path, data, "bar", slave)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=600) == 0, out.decode(errors="replace")[-3000:]
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))
    assert f"step {STEPS}/{STEPS} loss" in text and "ETA" in text, text[-3000:]
    assert re.search(rf"training\s+━+\s+{STEPS}/{STEPS}", text), text[-3000:]  # the bar, complete
    assert re.search(rf"training\s+[━╸╺]+\s+2/{STEPS}", text), text[-3000:]  # and on its way


def test_train_piped_prints_its_step_lines_without_a_bar(tmp_path, tiny_hidden_run):
    import shutil

    shutil.copytree(tiny_hidden_run.store_root / tiny_hidden_run.run, tmp_path / "store" / "piped")
    data = HiddenRun(tmp_path / "store", "piped", tiny_hidden_run.target_dir, tiny_hidden_run.sequences)
    proc = _train(tmp_path, data, "piped", subprocess.PIPE)
    _, err = proc.communicate(timeout=600)
    text = err.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert [int(m) for m in re.findall(rf"step (\d+)/{STEPS} loss", text)] == [2, 4, 6], text[-3000:]
    assert "━" not in text and "\x1b[" not in text
