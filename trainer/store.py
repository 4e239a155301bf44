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
from typing import Any, BinaryIO, cast

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from trainpipe.trainer import store_retry
from trainpipe.trainer.errors import StoreError, StoreUnavailable
from trainpipe.trainer.store_paths import join

# The calls trainpipe makes on a remote store, each retried whole through transient errors (``trainer.store_retry``).
# ``open`` is not among them: a stream cannot be retried from the middle, so small files are read and written
# whole (cat_file, pipe_file) and the large ones by code that retries its own unit (a shard, a checkpoint file).
RETRIED = frozenset(
    {"cat_file", "pipe_file", "exists", "ls", "find", "info", "du", "size", "isdir", "isfile", "rm_file", "rmdir"}
)


class RetryingFileSystem:
    """A remote fsspec filesystem whose calls in ``RETRIED`` are retried through transient errors; every other
    attribute is the filesystem's own."""

    def __init__(self, fs: fsspec.AbstractFileSystem):
        self.fs = fs

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.fs, name)
        if name not in RETRIED:
            return attr

        def retried(path: Any, *args: Any, **kwargs: Any) -> Any:
            return store_retry.call(f"{name} {self.fs.unstrip_protocol(str(path))}", attr, path, *args, **kwargs)

        return retried


def open_binary(fs: fsspec.AbstractFileSystem, path: str, mode: str = "rb") -> BinaryIO:
    """``fs.open`` in a binary mode, typed so (fsspec's own annotation is a text file's)."""
    return cast(BinaryIO, fs.open(path, mode))


def filesystem(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a URI; local paths become absolute, remote filesystems retry (RETRIED)."""
    if "://" not in uri:
        uri = os.path.abspath(uri)
    try:
        fs, path = url_to_fs(uri, **client_options(uri, storage_options))
    except (ImportError, ValueError) as exc:
        raise StoreError(f"cannot open store {uri}: {exc}") from None
    path = str(path)  # one URI: one path
    if isinstance(fs, LocalFileSystem):
        return fs, path
    return cast(fsspec.AbstractFileSystem, RetryingFileSystem(fs)), path  # it stands in for the one it wraps


def client_options(uri: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The storage options trainpipe opens ``uri`` with: the profile's, plus bounded S3 client timeouts and no
    retries of botocore's own (``trainer.store_retry`` retries, and logs each)."""
    options = dict(storage_options or {})
    return store_retry.s3_client_defaults(options) if uri.split("://", 1)[0] in ("s3", "s3a") else options


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    return os.path.abspath(uri.removeprefix("file://"))


def sha256_file(fs: fsspec.AbstractFileSystem, path: str, chunk: int = 1 << 22) -> str:
    if isinstance(fs, RetryingFileSystem):  # read whole, so that a transient error retries the read
        return store_retry.call(f"hashing {path}", _sha256_stream, fs.fs, path, chunk)
    return _sha256_stream(fs, path, chunk)


def _sha256_stream(fs: fsspec.AbstractFileSystem, path: str, chunk: int) -> str:
    digest = hashlib.sha256()
    with open_binary(fs, path) as fh:
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
    if not isinstance(fs, LocalFileSystem):  # no folders to make (s3fs's makedirs would even create a bucket)
        fs.pipe_file(path, text.encode("utf-8"))
        return
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
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
    raw = fs.fs if isinstance(fs, RetryingFileSystem) else fs
    store_retry.call(f"copy {raw.unstrip_protocol(source)}", raw.copy, source, target)  # server-side: whatever its size
    fs.rm_file(source)


RECORD_MAX_BYTES = 64 * 2**20  # a dataset manifest of ~300,000 shards; every other record is far smaller


class NotARecord(StoreError):
    """A record in the store is not a regular file of at most its size limit (a FIFO, a device, a link, a folder,
    an oversized file): whoever may write the store planted it, or a hand edit went wrong."""


def read_record(fs: Any, path: str, limit: int = RECORD_MAX_BYTES) -> bytes:
    """The bytes of the small record at ``path`` (a lease, a run's records, a dataset manifest, node 0's progress),
    read as checkpoint files are (``trainer.checkpoint.files``): a regular file only, its own name not a link, a
    FIFO refused instead of waited on, at most ``limit`` bytes whatever it holds. FileNotFoundError when there is
    none; NotARecord (one line, naming it) when it is there but not a record (docs/security.md)."""
    from trainpipe.trainer.checkpoint.files import ChecksumMismatch, read_file  # files imports this module

    base, name = posixpath.split(path.rstrip("/"))
    if isinstance(fs, LocalFileSystem) and not os.path.isdir(base):  # no folder (or a file in its place): no record
        raise FileNotFoundError(path)
    try:
        return read_file(fs, base, name, limit=limit, kind="record")
    except ChecksumMismatch as exc:
        said = str(exc).removeprefix("file ")
        said = said.replace(name, path, 1) if said.startswith(f"{name} ") else f"{path}: {said}"
        raise NotARecord(f"{said}; move it aside to go on") from None


def read_json(fs: Any, path: str, limit: int = RECORD_MAX_BYTES) -> Any:
    """The JSON record at ``path``, read by ``read_record``. ValueError when it is not JSON, nested deeper than the
    parser's stack (a planted ``[[[[…``) included."""
    body = read_record(fs, path, limit).decode("utf-8")
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError("nested too deep to be a record") from None


def read_json_uri(uri: str, storage_options: dict[str, Any] | None, default: Any) -> Any:
    """The JSON document at ``uri``, or ``default`` when there is none."""
    fs, path = filesystem(uri, storage_options)
    try:
        return read_json(fs, path)
    except FileNotFoundError:
        return default


def write_json_uri(uri: str, storage_options: dict[str, Any] | None, obj: Any) -> None:
    fs, path = filesystem(uri, storage_options)
    write_json(fs, path, obj)


def check_writable(root: str, storage_options: dict[str, Any] | None = None, budget_s: float = 2.0) -> None:
    """Write, read back and delete a marker under ``root``; raise StoreError with a hint if any step fails.
    Transient errors are retried for ``budget_s`` at most, quietly: this check answers in one line."""
    fs, base = filesystem(root, storage_options)
    probe = join(base, f".trainpipe-write-probe-{os.getpid()}-{os.urandom(4).hex()}")  # a name none can plant
    try:
        with store_retry.limited(budget_s):
            if isinstance(fs, LocalFileSystem):
                fs.makedirs(base, exist_ok=True)
            # An object store has no folders to make, and s3fs's makedirs would create a missing bucket: a typo in
            # store.root must be an error, not a new bucket.
            fs.pipe_file(probe, b"ok")
            ok = fs.cat_file(probe) == b"ok"
            remove(fs, probe)
    except StoreUnavailable as exc:
        raise StoreError(
            f"store {root} is not reachable ({exc.reason}); "
            "check the endpoint (AWS_ENDPOINT_URL_S3 or storage_options), the network and store.root"
        ) from None
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
