"""Object-store access through fsspec: every path in trainpipe is a URI.

Local paths, ``file://`` and ``s3://`` (s3fs) all go through the same calls, so
the local profile exercises the code path a cluster uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from trainer.errors import StoreError


def join(root: str, *parts: str) -> str:
    root = root.rstrip("/")
    return posixpath.join(root, *[p.strip("/") for p in parts])


def filesystem(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a URI; local paths become absolute."""
    if "://" not in uri:
        uri = os.path.abspath(uri)
    try:
        return url_to_fs(uri, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise StoreError(f"cannot open store {uri}: {exc}") from None


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    return os.path.abspath(uri.removeprefix("file://"))


def sha256_file(fs: fsspec.AbstractFileSystem, path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_json(fs: fsspec.AbstractFileSystem, path: str, obj: Any) -> None:
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with fs.open(path, "w") as fh:
        fh.write(json.dumps(obj, indent=2, sort_keys=True))


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    with fs.open(path, "r") as fh:
        return json.load(fh)


def check_writable(root: str, storage_options: dict[str, Any] | None = None) -> None:
    """Write, read back and delete a marker under ``root``; raise StoreError with a hint if any step fails."""
    fs, base = filesystem(root, storage_options)
    probe = join(base, ".trainpipe-write-probe")
    try:
        fs.makedirs(base, exist_ok=True)
        with fs.open(probe, "wb") as fh:
            fh.write(b"ok")
        with fs.open(probe, "rb") as fh:
            ok = fh.read() == b"ok"
        fs.rm(probe)
    except Exception as exc:  # noqa: BLE001 - any backend error means the store is unusable
        raise StoreError(
            f"store {root} is not writable ({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "check store.root and its credentials"
        ) from None
    if not ok:
        raise StoreError(f"store {root} returned different bytes than written")
