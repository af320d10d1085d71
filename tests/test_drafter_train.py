"""Drafter training on real extracted shards: it learns, survives SIGKILL, warm-starts, and trains the same under DDP."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from draftline.config import DrafterConfig, TrainConfig
from draftline.drafter.eagle_format import load_eagle_dir
from draftline.drafter.train import train_drafter
from draftline.errors import ConfigError
from draftline.store import open_store

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(tokens_per_batch=512, max_seq_len=256, ttt_steps=3, num_threads=1, warmup_steps=2,
             learning_rate=3e-3, val_fraction=0.25, log_every=100)


@pytest.fixture(scope="module")
def trained(tiny_hidden_run):
    """One short training run that the tests below read (and warm-start from)."""
    store = open_store(str(tiny_hidden_run.store_root))
    cfg = TrainConfig(max_steps=30, val_every=5, checkpoint_every=30, **SMALL)
    summary = train_drafter(store, tiny_hidden_run.run, tiny_hidden_run.target_dir, DrafterConfig(draft_vocab_size=128),
                            cfg, out_prefix="tiny/train-base")
    return store, summary


def test_training_raises_the_offline_acceptance_estimate(trained):
    store, summary = trained
    first, last = summary["history"]["val"][0], summary["history"]["val"][-1]
    print(f"val step {first['step']}: loss {first['loss']:.3f} acc {first['accuracy']}; "
          f"step {last['step']}: loss {last['loss']:.3f} acc {last['accuracy']} "
          f"acceptance length {last['acceptance_length']:.3f}")
    assert last["loss"] < first["loss"] - 0.05
    assert last["accuracy"][0] > first["accuracy"][0]
    assert len(last["accuracy"]) == 3 and last["acceptance_length"] > 1.0
    assert json.loads(store.get_bytes("tiny/train-base/metrics.json"))["final_val"] == last
    assert store.read_manifest("tiny/train-base/drafter") is not None


def _resume_script(store_root, target_dir, prefix, max_steps) -> str:
    return textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from draftline.config import DrafterConfig, TrainConfig
        from draftline.drafter.train import train_drafter
        from draftline.store import open_store
        cfg = TrainConfig(max_steps={max_steps}, val_every=4, checkpoint_every=4, **{SMALL!r})
        s = train_drafter(open_store({str(store_root)!r}), "tiny", {str(target_dir)!r},
                          DrafterConfig(draft_vocab_size=128), cfg, out_prefix={prefix!r})
        print("RESUMED_FROM", s["resumed_from"])
    """)


def test_a_run_killed_mid_way_resumes_and_ends_like_an_uninterrupted_one(tiny_hidden_run, tmp_path):
    store = open_store(str(tiny_hidden_run.store_root))
    steps = 16
    script = tmp_path / "run.py"
    script.write_text(_resume_script(tiny_hidden_run.store_root, tiny_hidden_run.target_dir, "tiny/train-killed", steps))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    latest = "tiny/train-killed/checkpoints/latest.json"
    deadline = time.time() + 300
    while not store.exists(latest) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.stdout.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(store.get_bytes(latest))["step"]
    assert killed_at < steps

    resumed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"RESUMED_FROM {killed_at}" in resumed.stdout

    script.write_text(_resume_script(tiny_hidden_run.store_root, tiny_hidden_run.target_dir, "tiny/train-whole", steps))
    whole = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]

    a = json.loads(store.get_bytes("tiny/train-killed/metrics.json"))
    b = json.loads(store.get_bytes("tiny/train-whole/metrics.json"))
    print(f"killed at step {killed_at}; final val resumed {a['final_val']} vs uninterrupted {b['final_val']}")
    assert a["final_val"] == b["final_val"]  # bitwise: same numbers, not merely close
    assert [e["loss"] for e in a["history"]["train"]] == [e["loss"] for e in b["history"]["train"]]
    wa = load_eagle_dir(store.get_dir("tiny/train-killed/drafter")).state_dict()
    wb = load_eagle_dir(store.get_dir("tiny/train-whole/drafter")).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_warm_start_continues_from_an_exported_drafter(trained, tiny_hidden_run):
    from draftline.drafter.export import export_from_store

    store, base = trained
    exported = export_from_store(store, "tiny", tiny_hidden_run.target_dir, formats=("sglang",),
                                 train_prefix="tiny/train-base")
    source = store.get_dir(exported["sglang"])
    cfg = TrainConfig(max_steps=1, val_every=1, checkpoint_every=1, warm_start=str(source),
                      **{**SMALL, "learning_rate": 1e-9})
    warm = train_drafter(store, "tiny", tiny_hidden_run.target_dir, DrafterConfig(draft_vocab_size=128), cfg,
                         out_prefix="tiny/train-warm")
    assert warm["warm_start"]["rows_copied"] == 128
    # With a vanishing learning rate one step later the warm-started head scores like its source.
    assert warm["final_val"]["loss"] == pytest.approx(base["final_val"]["loss"], abs=1e-3)

    with pytest.raises(ConfigError, match="draft_vocab_size=128 but drafter.draft_vocab_size=64"):
        train_drafter(store, "tiny", tiny_hidden_run.target_dir, DrafterConfig(draft_vocab_size=64), cfg,
                      out_prefix="tiny/train-warm-64")
    remap = cfg.model_copy(update={"warm_start_remap_vocab": True})
    out = train_drafter(store, "tiny", tiny_hidden_run.target_dir, DrafterConfig(draft_vocab_size=64), remap,
                        out_prefix="tiny/train-warm-remap")
    assert out["warm_start"]["rows_copied"] == 64  # the top-64 ids are all inside the source's top-128


def test_ddp_with_two_gloo_processes_matches_a_single_process(tiny_hidden_run, tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent(f"""
        import faulthandler, json, os, sys
        faulthandler.enable(all_threads=True)  # a crashing rank's stacks, in the assertion's message
        sys.path.insert(0, {str(REPO)!r})
        from draftline.config import DrafterConfig, TrainConfig
        from draftline.drafter import train as T
        from draftline.store import open_store
        cfg = TrainConfig(max_steps=4, val_every=4, checkpoint_every=4, **{{**{SMALL!r}, "tokens_per_batch": 600, "max_seq_len": 100}})
        prefix = sys.argv[1]
        s = T.train_drafter(open_store({str(tiny_hidden_run.store_root)!r}), "tiny", {str(tiny_hidden_run.target_dir)!r},
                            DrafterConfig(draft_vocab_size=128), cfg, out_prefix=prefix)
        rank = int(os.environ.get("RANK", 0))
        # A file per rank: the two ranks' stdout lines can interleave in torchrun's output.
        with open(f"{{sys.argv[2]}}-{{rank}}.json", "w") as f:
            json.dump({{"rank": rank, "digest": s["weights_digest"],
                       "losses": [e["loss"] for e in s["history"]["train"]]}}, f)
        T.exit_rank(0)
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
                          str(script), "tiny/train-ddp", str(tmp_path / "ddp")], capture_output=True, text=True,
                         timeout=600, env=env)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = subprocess.run([sys.executable, str(script), "tiny/train-single", str(tmp_path / "single")],
                            capture_output=True, text=True, timeout=600, env=env)
    assert single.returncode == 0, single.stderr[-3000:]
    parse = lambda stem: [json.loads(p.read_text()) for p in sorted(tmp_path.glob(f"{stem}-*.json"))]
    ranks, (one,) = parse("ddp"), parse("single")
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert ranks[0]["digest"] == ranks[1]["digest"]  # both ranks hold identical weights
    print("ddp losses", ranks[0]["losses"], "single", one["losses"])
    assert ranks[0]["losses"] == pytest.approx(one["losses"], rel=1e-4)


@pytest.mark.s3
def test_training_streams_shards_from_s3_and_checkpoints_there(tiny_hidden_run, s3_uri):
    """The same stage against a real S3 endpoint (SeaweedFS with credentials): shards in, checkpoints and drafter out."""
    from draftline.store import copy_tree

    local = open_store(str(tiny_hidden_run.store_root))
    s3 = open_store(s3_uri)
    copy_tree(local, "tiny/hidden", s3, "tiny/hidden")
    cfg = TrainConfig(max_steps=3, val_every=3, checkpoint_every=2, **SMALL)
    summary = train_drafter(s3, "tiny", tiny_hidden_run.target_dir, DrafterConfig(draft_vocab_size=128), cfg)
    assert summary["steps"] == 3 and summary["final_val"]["tokens"] > 0
    assert json.loads(s3.get_bytes("tiny/train/checkpoints/latest.json"))["step"] == 3
    assert s3.exists("tiny/train/metrics.json")
    drafter = load_eagle_dir(s3.get_dir("tiny/train/drafter"))
    assert drafter.config.aux_layer_ids == [2, 4, 5]


def test_training_a_run_without_extracted_shards_names_the_missing_stage(tmp_path):
    from draftline.drafter.data import hidden_shard_keys
    from draftline.errors import ConfigError
    from draftline.store import open_store

    with pytest.raises(ConfigError, match=r"other-run/hidden/ holds no hidden-state shards; run the extraction stage"):
        hidden_shard_keys(open_store(str(tmp_path)), "other-run")


def _own_copy(tiny_hidden_run, tmp_path):
    """The tiny run's extracted shards (and their manifest) in a store of the test's own."""
    from draftline.store import copy_tree

    store = open_store(str(tmp_path / "store"))
    copy_tree(open_store(str(tiny_hidden_run.store_root)), "tiny/hidden", store, "tiny/hidden")
    return store


def test_a_hidden_shard_damaged_after_extraction_stops_training_naming_it(tiny_hidden_run, tmp_path):
    from draftline.errors import IntegrityError

    store = _own_copy(tiny_hidden_run, tmp_path)
    key = "tiny/hidden/shard-00000.safetensors"
    path = Path(store.path(key))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one bit of one hidden state: safetensors itself would read it without complaint
    path.write_bytes(bytes(data))
    cfg = TrainConfig(max_steps=2, val_every=2, checkpoint_every=2, **SMALL)
    with pytest.raises(IntegrityError, match=r"shard-00000\.safetensors"):
        train_drafter(store, "tiny", tiny_hidden_run.target_dir, DrafterConfig(draft_vocab_size=128), cfg)
    assert not store.exists("tiny/train/checkpoints/latest.json")  # nothing was trained on it


def test_shards_extracted_again_under_the_same_names_are_not_resumed_on(tiny_hidden_run, tmp_path):
    """A checkpoint belongs to the shards' contents: switching extract.storage rewrites every shard under its old name,
    and the training that follows refuses the old checkpoint in one sentence instead of resuming on other data."""
    from transformers import LlamaForCausalLM

    from draftline.config import ExtractConfig
    from draftline.extract import extract_hidden_states
    from draftline.store import copy_tree

    store = _own_copy(tiny_hidden_run, tmp_path)
    copy_tree(open_store(str(tiny_hidden_run.store_root)), "tiny/traces", store, "tiny/traces")
    cfg = TrainConfig(max_steps=4, val_every=4, checkpoint_every=4, **SMALL)
    first = train_drafter(store, "tiny", tiny_hidden_run.target_dir, DrafterConfig(draft_vocab_size=128), cfg)
    assert first["resumed_from"] is None and first["steps"] == 4
    again = extract_hidden_states(ExtractConfig(tokens_per_shard=600, batch_tokens=512, device="cpu",
                                                storage="fp8-e4m3"), tiny_hidden_run.target_dir, store, "tiny",
                                  dtype="float32",
                                  model=LlamaForCausalLM.from_pretrained(tiny_hidden_run.target_dir).to(torch.bfloat16))
    assert again["computed_shards"], again  # the same shard names, new contents
    with pytest.raises(ConfigError, match=r"step-00000004\.pt was written by a run with another config or data; use "
                                          r"a new run name, or delete .*checkpoints to start over"):
        train_drafter(store, "tiny", tiny_hidden_run.target_dir, DrafterConfig(draft_vocab_size=128), cfg)


def test_the_training_record_names_the_held_out_sequences_and_their_share(trained, tiny_hidden_run):
    """Validation takes the last sequences up to train.val_fraction of the tokens (tests/test_validation_split.py);
    metrics.json says which, as `<shard key>[start:stop]`, with their number and share of the tokens."""
    store, summary = trained
    shards = store.read_manifest(f"{tiny_hidden_run.run}/hidden").entries
    sequences, tokens = (sum(e.metadata[k] for e in shards) for k in ("sequences", "tokens"))
    assert sequences == tiny_hidden_run.sequences and tokens % sequences == 0  # the fixture's traces: one length
    assert summary["val_sequences"] == math.ceil(0.25 * sequences)
    assert summary["held_out_share"] == pytest.approx(summary["val_sequences"] / sequences)
    parts = [re.fullmatch(r"tiny/hidden/(shard-\d{5}\.safetensors)\[(\d+):(\d+)\]", p).groups()
             for p in summary["train_shards"] + summary["val_shards"]]
    assert [shard for shard, _, _ in parts] == sorted(shard for shard, _, _ in parts)
    assert sum(int(b) - int(a) for _, a, b in parts) == sequences
    assert sum(int(b) - int(a) for _, a, b in parts[len(summary["train_shards"]):]) == summary["val_sequences"]
    assert json.loads(store.get_bytes("tiny/train-base/metrics.json"))["val_shards"] == summary["val_shards"]
