"""benchmarks/eval_offline.sh and infra/offline/unpack-site.sh up to the point where a GPU engine would start: the
failures a user meets on an air-gapped GPU machine must stop early, in one sentence, with the evidence kept."""
from __future__ import annotations

import hashlib
import io
import lzma
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "eval_offline.sh"


def _parts(tmp_path: Path, files: dict[str, str], part_bytes: int = 200) -> Path:
    """Parts and SHA256SUMS laid out like infra/offline/pack-site.sh's: an xz'd tar of `site/`, split."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"site/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    packed = lzma.compress(buf.getvalue())
    parts = tmp_path / "parts"
    parts.mkdir()
    sums = []
    for i in range(0, len(packed), part_bytes):
        name = f"part{i // part_bytes:02d}"
        (parts / name).write_bytes(packed[i:i + part_bytes])
        sums.append(f"{hashlib.sha256(packed[i:i + part_bytes]).hexdigest()}  {name}")
    (parts / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return parts


def _run(tmp_path: Path, engine: str, parts: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "ENGINE_SITE": str(tmp_path / "site"), "HOME": str(tmp_path)}
    return subprocess.run(["bash", str(SCRIPT), engine, str(parts), str(tmp_path / "saved"), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)


def test_an_unknown_engine_is_refused_before_anything_is_unpacked(tmp_path):
    r = _run(tmp_path, "tgi", tmp_path / "nowhere")
    assert r.returncode == 2 and "ENGINE is vllm or sglang, not 'tgi'" in r.stderr
    assert not (tmp_path / "site").exists()


def _varied_text(lines: int) -> str:  # compresses to several parts
    return "".join(f"v{i} = {hashlib.sha256(str(i).encode()).hexdigest()!r}\n" for i in range(lines))


def test_a_damaged_part_is_named_and_nothing_is_unpacked(tmp_path):
    parts = _parts(tmp_path, {"sglang/__init__.py": _varied_text(50)})
    assert (parts / "part02").is_file()
    (parts / "part01").write_bytes(b"garbage")
    r = _run(tmp_path, "sglang", parts)
    assert r.returncode == 1 and "is missing or damaged; copy it again" in r.stderr
    assert not (tmp_path / "site").exists()


def test_only_the_listed_parts_are_joined_and_the_site_appears_whole(tmp_path):
    parts = _parts(tmp_path, {"pkg/__init__.py": _varied_text(50)})
    (parts / "part99").write_bytes(b"a stray file from an earlier copy")
    r = subprocess.run(["bash", str(ROOT / "infra" / "offline" / "unpack-site.sh"), str(parts), str(tmp_path / "site")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "pkg" / "__init__.py").read_text() == _varied_text(50)
    assert not (tmp_path / "site.partial").exists()


def test_an_engine_that_does_not_import_stops_before_the_evaluation_with_the_reason_kept(tmp_path):
    parts = _parts(tmp_path, {"sglang/__init__.py": "raise ImportError('libcuda.so.1: cannot open shared object file')\n"})
    r = _run(tmp_path, "sglang", parts)
    assert (tmp_path / "site" / "sglang" / "__init__.py").is_file()  # unpacked from the parts
    assert r.returncode == 1 and "sglang does not import over this machine's packages" in r.stderr
    kept = (tmp_path / "out" / "imports-sglang.txt").read_text()
    assert "libcuda.so.1: cannot open shared object file" in kept
    assert not (tmp_path / "out" / "eval-sglang.json").exists()


def test_speculative_args_that_start_with_dashes_reach_the_evaluation_as_one_value(tmp_path):
    """SGLang's --disable-overlap-schedule for the EAGLE-3 server only: argparse refuses a separate one-word value
    that looks like an option, so the script must hand it over as --speculative-args=VALUE (a GPU run hit this)."""
    import json
    import sys

    parts = _parts(tmp_path, {f"{m}/__init__.py": "__version__ = 'fixture'\n"
                              for m in ("sglang", "sgl_kernel", "flashinfer", "transformers")}
                   | {"sglang/launch_server.py": ""})
    # python3 runs the import probe as usual; in place of the GPU evaluation it records the arguments it was given.
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    record = tmp_path / "argv.json"
    shim.write_text(f"""#!/bin/sh
case "$1" in
  *eval_gpu.py) exec {sys.executable} -c 'import json, sys; json.dump(sys.argv[1:], open("{record}", "w"))' "$@" ;;
  *) exec {sys.executable} "$@" ;;
esac
""")
    shim.chmod(0o755)
    env = {"PATH": f"{shim.parent}:/usr/bin:/bin", "ENGINE_SITE": str(tmp_path / "site"), "HOME": str(tmp_path),
           "SPECULATIVE_ARGS": "--disable-overlap-schedule"}
    r = subprocess.run(["bash", str(SCRIPT), "sglang", str(parts), str(tmp_path / "saved"), str(tmp_path / "out"),
                        "--mem-fraction-static", "0.5"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    argv = json.loads(record.read_text())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from eval_gpu import parse_args
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    args = parse_args(argv[1:])
    assert args.engine == "sglang"
    assert args.speculative_args == "--disable-overlap-schedule"
    assert args.extra_args == ["--mem-fraction-static", "0.5"]
