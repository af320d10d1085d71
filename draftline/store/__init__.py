"""The artifact store: one interface over a local folder or s3://bucket/prefix, with sha256 manifests and atomic publishing."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from draftline.errors import ConfigError
from draftline.store.base import BackgroundFlush, ChunkReader, ObjectNotFound, Store, default_cache_dir
from draftline.store.keys import (
    MANIFEST_NAME, Manifest, ManifestEntry, _check_expected, _check_prefix, _is_manifest, _join, _relative,
    check_store_uri, sha256_file,
)
from draftline.store.local import LocalStore
from draftline.store.s3 import S3Store


# ---------------------------------------------------------------------------------------------- entry points


def open_store(uri: str = "./runs", *, client=None, cache_dir: str | os.PathLike | None = None, check: bool = True) -> Store:
    """Open a store at a local folder or s3://bucket/prefix; S3 is checked at once (endpoint, credentials, bucket)."""
    try:
        uri = check_store_uri(str(uri))
    except ValueError as exc:
        raise ConfigError(f"The store location is invalid: {exc}.") from exc
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        store = S3Store(bucket, prefix, client=client, cache_dir=cache_dir)
        return store.check() if check else store
    return LocalStore(uri)


def copy_tree(src: Store, src_prefix: str, dst: Store, dst_prefix: str) -> Manifest | None:
    """Copy every object under `src_prefix` to `dst_prefix` in another (or the same) store, manifests last.

    Objects listed in a source manifest are verified while they are copied (IntegrityError on mismatch); the
    manifests are copied verbatim once all their objects exist at the destination. Returns the destination's
    manifest at `dst_prefix`, if the source had one.
    """
    src_prefix, dst_prefix = _check_prefix(src_prefix), _check_prefix(dst_prefix)
    keys = src.list(src_prefix)
    manifests = [k for k in keys if _is_manifest(k)]
    expected: dict[str, ManifestEntry] = {}
    for mkey in manifests:
        mprefix = mkey[: -len(MANIFEST_NAME)].rstrip("/")
        manifest = src.read_manifest(mprefix)
        if manifest is not None:
            expected.update({e.key: e for e in manifest})

    def target(key: str) -> str:
        return _join(dst_prefix, _relative(src_prefix, key))

    with tempfile.TemporaryDirectory(prefix="draftline-copy-") as tmp:
        staged = Path(tmp) / "object"
        for key in keys:
            if _is_manifest(key):
                continue
            entry = src.get_file(key, staged, expect=expected.get(key))
            written = dst.put_file(target(key), staged)
            _check_expected(target(key), written.size, written.sha256, entry.with_key(target(key)), dst.uri(target(key)))
            staged.unlink(missing_ok=True)
    for mkey in sorted(manifests, key=lambda k: -k.count("/")):
        dst.put_bytes(target(mkey), src.get_bytes(mkey))
    return dst.read_manifest(dst_prefix)


__all__ = [
    "Store", "LocalStore", "S3Store", "Manifest", "ManifestEntry", "ObjectNotFound", "open_store", "copy_tree",
    "sha256_file", "default_cache_dir", "MANIFEST_NAME", "check_store_uri", "ChunkReader", "BackgroundFlush",
]
