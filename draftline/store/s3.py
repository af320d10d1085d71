"""The store under s3://bucket/prefix, with its boto3 client, its transfer settings and S3 errors as one sentence each."""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import uuid
from datetime import datetime, timezone
from pathlib import Path

from draftline.errors import IntegrityError, StoreError
from draftline.store.base import (
    _CACHE_INDEX, ObjectNotFound, Store, _atomic_local_write, _HashingReader, default_cache_dir,
)
from draftline.store.keys import (
    _TMP_MARK, MANIFEST_NAME, ManifestEntry, _check_expected, _check_key, _check_prefix, _join, sha256_file,
)


def _endpoint_of(client) -> str:
    return str(getattr(client.meta, "endpoint_url", "") or "")


class S3Store(Store):
    """A store under s3://bucket/prefix through boto3, configured the standard AWS way (env, profile, AWS_ENDPOINT_URL)."""

    def __init__(self, bucket: str, prefix: str = "", client=None, cache_dir: str | os.PathLike | None = None):
        self.bucket = bucket
        self.prefix = _check_prefix(prefix)
        self.client = client if client is not None else _default_client()
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.transfer = _transfer_config()

    def __repr__(self) -> str:
        return f"S3Store({self.uri()!r}, endpoint={_endpoint_of(self.client)!r})"

    def _key(self, key: str) -> str:
        return _join(self.prefix, _check_key(key))

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self._key(key) if key else self.prefix}".rstrip("/")

    def check(self) -> "S3Store":
        """Fail early with one clear sentence if the endpoint, credentials or bucket are wrong."""
        with _s3_errors(self, self.uri()):
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        return self

    def put_stream(self, key, stream, metadata=None):
        full = self._key(key)
        reader = _HashingReader(stream)
        # upload_fileobj streams (multipart above the threshold); an object appears only when the upload completes,
        # and a failed upload is aborted, so a reader never sees part of it.
        with _s3_errors(self, self.uri(key)):
            self.client.upload_fileobj(reader, self.bucket, full, Config=self.transfer)
        return ManifestEntry(key=key, size=reader.size, sha256=reader.sha256, metadata=dict(metadata or {}))

    def open(self, key):
        with _s3_errors(self, self.uri(key)):
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]

    def get_bytes(self, key, expect=None):
        buf = io.BytesIO()
        with _s3_errors(self, self.uri(key)):
            self.client.download_fileobj(self.bucket, self._key(key), buf, Config=self.transfer)
        data = buf.getvalue()
        _check_expected(key, len(data), hashlib.sha256(data).hexdigest(), expect, self.uri(key))
        return data

    def get_file(self, key, local_path, expect=None):
        dest = Path(local_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}{_TMP_MARK}{uuid.uuid4().hex[:12]}"
        try:
            # Ranged, parallel download by the transfer manager, into a temp name; renamed only once verified.
            with _s3_errors(self, self.uri(key)):
                self.client.download_file(self.bucket, self._key(key), str(tmp), Config=self.transfer)
            size, digest = tmp.stat().st_size, sha256_file(tmp)
            _check_expected(key, size, digest, expect, self.uri(key))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return ManifestEntry(key=key, size=size, sha256=digest, metadata=dict(expect.metadata) if expect else {})

    def _head(self, key: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            with _s3_errors(self, self.uri(key), missing_ok=True):
                return self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError:
            return None

    def exists(self, key):
        return self._head(key) is not None

    def size(self, key):
        head = self._head(key)
        if head is None:
            raise ObjectNotFound(f"No object at {self.uri(key)}; write it first or check the run name.")
        return int(head["ContentLength"])

    def _list_objects(self, prefix: str) -> dict[str, dict]:
        full = _join(self.prefix, prefix) if prefix else self.prefix
        out: dict[str, dict] = {}
        with _s3_errors(self, self.uri(prefix) if prefix else self.uri()):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=(full + "/") if full else ""
            ):
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(self.prefix) + 1:] if self.prefix else obj["Key"]
                    out[key] = obj
        return out

    def _list_sizes(self, prefix):
        return {k: int(o["Size"]) for k, o in self._list_objects(prefix).items()}

    def delete(self, key):
        with _s3_errors(self, self.uri(key)):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def clean_partial(self, prefix="", older_than_s=24 * 3600):
        full = _join(self.prefix, _check_prefix(prefix)) if prefix else self.prefix
        cutoff = datetime.now(timezone.utc).timestamp() - older_than_s
        removed = 0
        with _s3_errors(self, self.uri(prefix) if prefix else self.uri()):
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=(full + "/") if full else ""
            )
            for page in pages:
                for upload in page.get("Uploads", []):
                    if upload["Initiated"].timestamp() <= cutoff:
                        # Aborting frees the parts an interrupted multipart upload left on the server.
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                        removed += 1
        return removed

    def __getstate__(self):
        # boto3 clients do not pickle; a copy in another process builds its own from that process's AWS config.
        state = dict(self.__dict__)
        state.pop("client", None)
        state.pop("transfer", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.client = _default_client()
        self.transfer = _transfer_config()

    def get_dir(self, prefix, local_dir=None):
        """Download the manifest's objects into `local_dir` or the cache and verify them.

        Each local file is recorded in `.draftline-cache.json` with the object's ETag, size and sha256; a file is
        downloaded again only when the stored object (ETag/size) or its manifest entry changed, or the local copy did.
        """
        prefix = _check_prefix(prefix)
        manifest = self.read_manifest(prefix)
        if manifest is None:
            raise ObjectNotFound(f"Nothing was published at {self.uri(prefix)} (no {MANIFEST_NAME}); run the stage that writes it.")
        dest = Path(local_dir) if local_dir is not None else self._cache_path(prefix)
        dest.mkdir(parents=True, exist_ok=True)
        index_path = dest / _CACHE_INDEX
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError):
            index = {}
        listed = self._list_objects(prefix)
        new_index = {}
        for entry in manifest:
            rel = manifest.relative_key(entry.key)
            obj = listed.get(entry.key)
            if obj is None:
                raise IntegrityError(f"The manifest at {self.uri(prefix)} names {self.uri(entry.key)} but the object is missing; re-run the stage that wrote it.")
            local = dest / rel
            record = {"etag": obj.get("ETag", ""), "size": int(obj["Size"]), "sha256": entry.sha256}
            old = index.get(rel)
            fresh = (
                old is not None and local.is_file()
                and {k: old.get(k) for k in record} == record
                and local.stat().st_size == entry.size
                and old.get("mtime_ns") == local.stat().st_mtime_ns
            )
            if not fresh:
                self.get_file(entry.key, local, expect=entry)
            new_index[rel] = {**record, "mtime_ns": local.stat().st_mtime_ns}
        if local_dir is None:
            # The cache folder is ours: drop files an earlier version of this directory had and this one lacks.
            for rel in set(index) - set(new_index):
                (dest / rel).unlink(missing_ok=True)
        _atomic_local_write(index_path, io.BytesIO(json.dumps(new_index, indent=1).encode()))
        return dest

    def get_objects(self, key: str) -> Path:
        """The object at `key`, or every object under it as a folder (files another tool wrote, no manifest needed),
        in the cache; a file whose object kept its ETag and size is not downloaded again. Returns the local path."""
        key = _check_prefix(key)
        head = self._head(key) if key else None
        objects = {key: head} if head is not None else self._list_objects(key)
        if not objects:
            raise ObjectNotFound(f"No object at {self.uri(key)} and none under it; check the location.")
        root = self._cache_path(key)
        for name, obj in objects.items():
            local = root if name == key else root / name[len(key) + 1:] if key else root / name
            stamp = f"{obj.get('ETag', '')}:{obj.get('ContentLength', obj.get('Size'))}"
            marker = local.parent / f".{local.name}.etag"
            if not (local.is_file() and marker.is_file() and marker.read_text() == stamp):
                self.get_file(name, local)
                _atomic_local_write(marker, io.BytesIO(stamp.encode()))
        return root

    def _cache_path(self, prefix: str) -> Path:
        endpoint = re.sub(r"[^A-Za-z0-9.-]+", "_", _endpoint_of(self.client).split("://")[-1]) or "aws"
        return self.cache_dir / "s3" / endpoint / self.bucket / (_join(self.prefix, prefix) or "_root")


def _transfer_config():
    from boto3.s3.transfer import TransferConfig

    # 16 MiB parts: a 100 MB object goes up in 7 parts; S3's 10,000-part limit is then reached only at 160 GB.
    mib16 = 16 * 1024 * 1024
    return TransferConfig(multipart_threshold=mib16, multipart_chunksize=mib16, max_concurrency=4)


def _default_client():
    import boto3
    from botocore.config import Config

    import botocore.session
    from botocore.exceptions import ProfileNotFound

    core = botocore.session.get_session()
    try:
        profile = core.get_scoped_config()
    except ProfileNotFound as exc:
        raise StoreError(
            f"The AWS profile {core.profile!r} (AWS_PROFILE) is not in the AWS config files; "
            "fix AWS_PROFILE or add the profile with `aws configure --profile NAME`.", transient=False,
        ) from exc
    session = boto3.session.Session(botocore_session=core)
    # Standard retries (with backoff) unless the AWS config sets its own; a short connect timeout so that a
    # dead endpoint fails fast.
    retry_set = any(os.environ.get(v) for v in ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE")) or any(
        k in profile for k in ("max_attempts", "retry_mode")
    )
    retries = None if retry_set else {"max_attempts": 4, "mode": "standard"}
    config = Config(retries=retries, connect_timeout=5, read_timeout=60)
    client = session.client("s3", config=config)
    endpoint = _endpoint_of(client)
    if endpoint and "amazonaws.com" not in endpoint:
        # Self-hosted S3 (SeaweedFS, MinIO, Ceph) rarely serves bucket-named hostnames: address buckets by path.
        client = session.client("s3", config=config.merge(Config(s3={"addressing_style": "path"})))
    return client


_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "TokenRefreshRequired"}
_TRANSIENT_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "503", "500", "502", "504", "Throttling"}


class _s3_errors:
    """Turns botocore failures into StoreError with one sentence, marked transient only when a retry may help."""

    def __init__(self, store: S3Store, where: str, missing_ok: bool = False):
        self.store, self.where, self.missing_ok = store, where, missing_ok

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            return False
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import (
            BotoCoreError, ClientError, ConnectionError as BotoConnectionError, NoCredentialsError,
            PartialCredentialsError, ReadTimeoutError,
        )

        endpoint = _endpoint_of(self.store.client) or "the default AWS endpoint"
        if isinstance(exc, S3UploadFailedError):
            # The transfer manager flattens the ClientError into text; recover the error code from it.
            match = re.search(r"\(([A-Za-z0-9]+)\)", str(exc))
            code = match.group(1) if match else ""
            raise self._for_code(code, str(exc), endpoint) from exc
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if self.missing_ok and code in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._for_code(code, str(exc), endpoint) from exc
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            raise StoreError(
                f"No usable AWS credentials were found for {self.where}; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                "or AWS_PROFILE (never in a config file).", transient=False,
            ) from exc
        if isinstance(exc, (BotoConnectionError, ReadTimeoutError)):
            raise StoreError(
                f"Could not reach the S3 endpoint {endpoint} for {self.where} ({type(exc).__name__}); check that it "
                "is running and that AWS_ENDPOINT_URL points at it.", transient=True,
            ) from exc
        if isinstance(exc, BotoCoreError):
            raise StoreError(f"The S3 request for {self.where} failed: {exc}.", transient=True) from exc
        return False

    def _for_code(self, code: str, detail: str, endpoint: str) -> StoreError:
        bucket = self.store.bucket
        if code in _CREDENTIAL_CODES:
            return StoreError(
                f"Access to {self.where} failed: the S3 endpoint {endpoint} rejected the credentials ({code}); "
                "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE.", transient=False,
            )
        if code in ("AccessDenied", "403", "AllAccessDisabled"):
            return StoreError(
                f"Access to {self.where} was denied ({code}) by {endpoint}; the credentials lack permission for "
                f"bucket {bucket!r}, or are wrong: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE.",
                transient=False,
            )
        if code == "NoSuchBucket":
            return StoreError(
                f"The bucket {bucket!r} does not exist at {endpoint}; create it (e.g. `aws s3 mb s3://{bucket}`) "
                "or fix store.root.", transient=False,
            )
        if code in ("404", "NoSuchKey", "NotFound"):
            return ObjectNotFound(f"No object at {self.where}; write it first or check the run name.")
        transient = code in _TRANSIENT_CODES or code.startswith("5")
        return StoreError(f"The S3 request for {self.where} failed at {endpoint} ({code or 'unknown error'}): {detail}", transient=transient)
