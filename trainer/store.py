"""Object-store access through fsspec: every path in trainpipe is a URI.

Local paths, ``file://`` and ``s3://`` (s3fs) all go through the same calls, so
the local profile exercises the code path a cluster uses.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import shutil
import threading
from typing import Any

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from trainer.errors import StoreError
from trainer.layout import join


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
    """Write JSON so that a reader never sees half of it.

    An object-store PUT is atomic already; a local file is written beside its
    target and renamed over it, so a killed writer leaves the old file intact.
    """
    write_text(fs, path, json.dumps(obj, indent=2, sort_keys=True))


def write_text(fs: fsspec.AbstractFileSystem, path: str, text: str) -> None:
    """Write a small UTF-8 text file atomically, as ``write_json`` does."""
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, text.encode("utf-8"))
        return
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"  # threads of one process may write the same file
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def remove(fs: fsspec.AbstractFileSystem, path: str, recursive: bool = False) -> None:
    """Delete exactly ``path`` (and, with ``recursive``, what lies under it).

    fsspec's ``rm`` expands ``*``, ``?`` and ``[`` as a glob, so a store root or a folder name holding one would
    delete other runs' files: every file is deleted by its literal name instead.
    """
    if isinstance(fs, LocalFileSystem):
        if recursive and os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        return
    for name in sorted(fs.find(path), reverse=True) if recursive else [path]:
        if fs.exists(name):  # find lists no folders, but a remote "folder" marker may remain
            fs.rm_file(name)
    if recursive and fs.exists(path) and fs.isdir(path):
        with contextlib.suppress(FileNotFoundError, OSError):  # an empty object-store "folder" may not exist at all
            fs.rmdir(path)


def move(fs: fsspec.AbstractFileSystem, source: str, target: str) -> None:
    """Move one file by its literal name (fsspec's ``mv`` would expand glob characters, as ``rm`` does)."""
    if isinstance(fs, LocalFileSystem):
        os.replace(source, target)
        return
    fs.pipe_file(target, fs.cat_file(source))
    fs.rm_file(source)


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    with fs.open(path, "r") as fh:
        return json.load(fh)


def read_json_uri(uri: str, storage_options: dict[str, Any] | None, default: Any) -> Any:
    """The JSON document at ``uri``, or ``default`` when there is none."""
    fs, path = filesystem(uri, storage_options)
    if not fs.exists(path):
        return default
    return read_json(fs, path)


def write_json_uri(uri: str, storage_options: dict[str, Any] | None, obj: Any) -> None:
    fs, path = filesystem(uri, storage_options)
    write_json(fs, path, obj)


def check_writable(root: str, storage_options: dict[str, Any] | None = None) -> None:
    """Write, read back and delete a marker under ``root``; raise StoreError with a hint if any step fails."""
    fs, base = filesystem(root, storage_options)
    probe = join(base, ".trainpipe-write-probe")
    try:
        if isinstance(fs, LocalFileSystem):
            fs.makedirs(base, exist_ok=True)
        # An object store has no folders to make, and s3fs's makedirs would create a missing bucket: a typo in
        # store.root must be an error, not a new bucket.
        with fs.open(probe, "wb") as fh:
            fh.write(b"ok")
        with fs.open(probe, "rb") as fh:
            ok = fh.read() == b"ok"
        remove(fs, probe)
    except Exception as exc:  # noqa: BLE001 - any backend error means the store is unusable
        if isinstance(exc, FileNotFoundError) and not isinstance(fs, LocalFileSystem):
            raise StoreError(
                f"store {root}: bucket {base.split('/', 1)[0]!r} does not exist (or these credentials cannot see "
                "it); create it or fix store.root"
            ) from None
        raise StoreError(
            f"store {root} is not writable ({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "check store.root and its credentials"
        ) from None
    if not ok:
        raise StoreError(f"store {root} returned different bytes than written")
