"""SeaweedFS S3 as a service for infra/local: seaweedfs.py's server, stopped cleanly on SIGTERM, ready-file when up.

    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... python infra/local/run_s3.py --dir D --port P --bucket B --ready-file F
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

# up.sh runs this file as a script: the repository root goes on the path so that the infra package imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infra.local.seaweedfs import LocalS3  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="data folder (kept between runs)")
    parser.add_argument("--port", type=int, required=True, help="S3 port on 127.0.0.1")
    parser.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    parser.add_argument("--ready-file", required=True, help="written once S3 answers; removed on stop")
    args = parser.parse_args(argv)
    access_key, secret_key = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not (access_key and secret_key):
        print("run_s3.py: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the credentials the server enforces)",
              file=sys.stderr)
        return 2
    stop = threading.Event()
    # Started in the background by up.sh, where SIGINT is ignored: SIGTERM (down.sh) is the stop signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = LocalS3(args.dir, keep_data=True, access_key=access_key, secret_key=secret_key, s3_port=args.port)
    with server:
        for bucket in args.bucket:
            server.create_bucket(bucket)
        with open(args.ready_file, "w") as f:
            f.write(server.endpoint_url + "\n")
        print(f"SeaweedFS S3 ready at {server.endpoint_url} (data in {server.data_dir})", flush=True)
        while not stop.wait(1.0):
            if server.process is None or server.process.poll() is not None:
                print(f"SeaweedFS exited unexpectedly; see {server.log_path}", file=sys.stderr, flush=True)
                break
    try:
        os.unlink(args.ready_file)
    except FileNotFoundError:
        pass
    return 0 if stop.is_set() else 1


if __name__ == "__main__":
    sys.exit(main())
