"""What the evaluation identity may do in the artifact store, as SeaweedFS identities and as an S3 (IAM) policy.

The pipeline's identity writes every stage. The evaluation identity, used by the flow runs that only evaluate (the
engines and the reference decoder, the nightly's engines), reads the store (the exports it serves, the training record
it compares with) and writes only evaluations and regression pages: `<run>/eval/...` and `<run>/regression/...`. A
compromised or buggy evaluation then cannot overwrite traces, hidden states, checkpoints or exports.

    python infra/s3_policy.py --bucket draftline --prefix team   # the policy in infra/k8s (IAM JSON)

infra/local (run_s3.py) gives SeaweedFS the same rules as an identity of its `-s3.config`.
"""
from __future__ import annotations

import argparse
import json
import sys

# Key patterns under the store's root that the evaluation identity may write; `*` stands for any run name (and, in
# both SeaweedFS and IAM, matches across `/`).
EVALUATION_WRITES = ("*/eval/*", "*/regression/*")


def _under(prefix: str, pattern: str) -> str:
    prefix = prefix.strip("/")
    return f"{prefix}/{pattern}" if prefix else pattern


def seaweedfs_identity(access_key: str, secret_key: str, bucket: str, prefix: str = "",
                       name: str = "draftline-evaluation") -> dict:
    """The evaluation identity as an entry of SeaweedFS's `-s3.config` identities: read and list the bucket, write
    only the evaluation key patterns (SeaweedFS checks `Write:bucket/pattern` on every put, multipart part and
    delete)."""
    return {
        "name": name,
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": [f"Read:{bucket}", f"List:{bucket}",
                    *(f"Write:{bucket}/{_under(prefix, p)}" for p in EVALUATION_WRITES)],
    }


def iam_policy(bucket: str, prefix: str = "") -> dict:
    """The evaluation identity as an S3 identity policy (AWS IAM; MinIO and Ceph take the same document)."""
    store = _under(prefix, "*")
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "ListTheStore", "Effect": "Allow", "Action": ["s3:ListBucket"],
             "Resource": [f"arn:aws:s3:::{bucket}"],
             # The bare prefix too: opening the store lists it (S3Store.check).
             "Condition": {"StringLike": {"s3:prefix": [prefix.strip("/"), store] if prefix else ["*"]}}},
            {"Sid": "ReadTheStore", "Effect": "Allow", "Action": ["s3:GetObject"],
             "Resource": [f"arn:aws:s3:::{bucket}/{store}"]},
            {"Sid": "WriteEvaluationsOnly", "Effect": "Allow",
             "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
             "Resource": [f"arn:aws:s3:::{bucket}/{_under(prefix, p)}" for p in EVALUATION_WRITES]},
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the S3 (IAM) policy of draftline's evaluation identity.")
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--prefix", default="", help="the store's prefix in the bucket (store.root s3://BUCKET/PREFIX)")
    args = parser.parse_args(argv)
    json.dump(iam_policy(args.bucket, args.prefix), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
