"""The evaluation identity's least privilege, enforced by a real S3 endpoint (the suite's SeaweedFS, whose session
server carries infra/s3_policy.py's evaluation identity): it reads a run and writes its evaluations and regression
pages, and every write of it anywhere else, training artifacts first, is refused by S3."""
from __future__ import annotations

import pytest

from draftline.errors import StoreError
from draftline.layout import eval_result_key, export_prefix, regression_prefix, training_record_key
from draftline.store import S3Store, open_store


def _as_evaluation(s3_server, s3_uri) -> S3Store:
    bucket, _, prefix = s3_uri.removeprefix("s3://").partition("/")
    return S3Store(bucket, prefix, client=s3_server.client(s3_server.evaluation_key, s3_server.evaluation_secret))


def test_the_evaluation_identity_cannot_overwrite_training_artifacts(s3_server, s3_uri):
    pipeline = open_store(s3_uri)
    pipeline.put_bytes(training_record_key("run"), b'{"steps": 10}')
    pipeline.put_bytes(f"{export_prefix('run', 'vllm')}/config.json", b"{}")
    evaluation = _as_evaluation(s3_server, s3_uri).check()

    # It reads what it evaluates.
    assert evaluation.get_bytes(training_record_key("run")) == b'{"steps": 10}'
    assert evaluation.list("run/export") == [f"{export_prefix('run', 'vllm')}/config.json"]
    # It writes (and replaces, and deletes) evaluations and regression pages, multipart uploads included.
    evaluation.put_bytes(eval_result_key("run", "vllm"), b"{}")
    evaluation.put_bytes(f"{regression_prefix('run')}/comparison.md", b"# night")
    evaluation.put_chunks("run/eval/vllm/responses/big.json", [b"x" * (17 * 1024 * 1024)])
    evaluation.delete(eval_result_key("run", "vllm"))

    # Everything else is refused by S3: the training record, the exports, new keys beside them, the run's lease.
    for key in (training_record_key("run"), f"{export_prefix('run', 'vllm')}/config.json", "run/train/new.bin",
                "run/lease.json", "run/evaluation-elsewhere.json"):
        with pytest.raises(StoreError, match=r"was denied \(AccessDenied\)"):
            evaluation.put_bytes(key, b"overwritten")
    with pytest.raises(StoreError, match=r"was denied \(AccessDenied\)"):
        evaluation.delete(training_record_key("run"))
    assert pipeline.get_bytes(training_record_key("run")) == b'{"steps": 10}'
    assert pipeline.get_bytes(f"{export_prefix('run', 'vllm')}/config.json") == b"{}"
