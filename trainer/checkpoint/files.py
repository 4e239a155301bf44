"""Reading a checkpoint's files from a store that is not trusted (docs/security.md): by name inside one folder,
regular files only, never more bytes than the file is said to have.

Local stores open every part of the name below the folder without following a symbolic link (``O_NOFOLLOW``) and
take only a regular file (``fstat``): a name linked to ``/dev/zero`` or a pipe would be read forever, one linked
elsewhere reads a file that is not the checkpoint's. Object stores have neither, but an object's listed size is
checked before it is read. Light on purpose (no torch): the catalog uses it too.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from fsspec.implementations.local import LocalFileSystem

from trainpipe.trainer import store_retry
from trainpipe.trainer.errors import CheckpointError
from trainpipe.trainer.store import RetryingFileSystem

CHUNK = 4 << 20
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class ChecksumMismatch(CheckpointError):
    """A checkpoint file is not what its manifest says was written (its sha256, its size, or not a file at all)."""


def inside_folder(rel: str) -> bool:
    """Whether a relative name stays inside the folder it is relative to (no ``..``, not absolute)."""
    return bool(rel) and not rel.startswith("/") and posixpath.normpath(rel) == rel and rel.split("/")[0] != ".."


def file_size(fs: Any, base: str, rel: str, size: int | None = None, limit: int | None = None, kind: str = "") -> int:
    """The size of the regular file ``rel`` under the folder ``base``, checked against ``size`` (the manifest's)
    and ``limit``; FileNotFoundError when there is none, ChecksumMismatch saying what is wrong with it otherwise."""
    with _checked(fs, base, rel, size, limit, kind) as (_, n):
        return n


def read_file(fs: Any, base: str, rel: str, size: int | None = None, limit: int | None = None, kind: str = "") -> bytes:
    """The whole regular file ``rel`` under the folder ``base``, at most its checked size (``file_size``)."""
    with _checked(fs, base, rel, size, limit, kind) as (fh, n):
        if fh is None:  # an object store: one ranged GET, retried whole
            if n == 0:
                return b""
            return store_retry.call(
                f"reading {_named(fs, base, rel)}", _raw(fs).cat_file, _path(base, rel), start=0, end=n
            )
        return fh.read(n)


def sha256_of(fs: Any, base: str, rel: str, size: int | None = None) -> str:
    """The sha256 of the regular file ``rel`` under the folder ``base``, read in chunks up to its checked size."""
    with _checked(fs, base, rel, size, None, "") as (fh, n):
        if fh is not None:
            return _sha256(fh, n)
        path = _path(base, rel)

        def remote() -> str:  # the whole stream again on a transient error: a stream cannot resume
            with _raw(fs).open(path, "rb") as stream:
                return _sha256(stream, n)

        return store_retry.call(f"hashing {_named(fs, base, rel)}", remote)


@contextmanager
def open_file(fs: Any, base: str, rel: str, size: int | None = None) -> Iterator[tuple[IO[bytes], int]]:
    """(a stream of the regular file ``rel`` under ``base``, its checked size): to read a large file in pieces.
    On an object store the stream is not retried: a caller that fails part way reads the file again."""
    with _checked(fs, base, rel, size, None, "") as (fh, n):
        if fh is not None:
            yield fh, n
            return
        with _raw(fs).open(_path(base, rel), "rb") as stream:
            yield stream, n


def _sha256(fh: IO[bytes], n: int) -> str:
    digest = hashlib.sha256()
    while n > 0 and (block := fh.read(min(CHUNK, n))):
        digest.update(block)
        n -= len(block)
    return digest.hexdigest()


@contextmanager
def _checked(
    fs: Any, base: str, rel: str, size: int | None, limit: int | None, kind: str
) -> Iterator[tuple[IO[bytes] | None, int]]:
    """(open file or None on an object store, bytes to read) once ``rel`` is known to be a regular file inside
    ``base`` of the right size."""
    if not inside_folder(rel):
        raise ChecksumMismatch(f"file {rel} lies outside its checkpoint folder")
    if isinstance(fs, LocalFileSystem):
        fd = _open_below(base, rel)
        try:  # checked before fdopen, which refuses a folder with an error of its own
            st = os.fstat(fd)
            _require(rel, stat.S_ISREG(st.st_mode), st.st_size, size, limit, kind)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as fh:
            yield fh, st.st_size
        return
    path = _path(base, rel)
    info = store_retry.call(f"info {_named(fs, base, rel)}", _raw(fs).info, path)
    n = info.get("size")
    _require(rel, info.get("type") == "file" and type(n) is int and n >= 0, n, size, limit, kind)
    yield None, n


def _require(rel: str, regular: bool, n: Any, size: int | None, limit: int | None, kind: str) -> None:
    if not regular:
        raise ChecksumMismatch(f"file {rel} is not a regular file (a symbolic link, folder, pipe or device)")
    if limit is not None and n > limit:
        raise ChecksumMismatch(f"{rel} is {n} bytes, more than a {kind}'s {limit}")
    if size is not None and n != size:
        raise ChecksumMismatch(f"file {rel} has {n} bytes, its manifest says {size}")


def _open_below(base: str, rel: str) -> int:
    """A descriptor of ``rel`` opened from ``base`` one name at a time, following no symbolic link (the folder
    ``base`` itself included); non-blocking, so that a pipe does not wait for a writer."""
    try:
        fd = os.open(base, _OPEN | os.O_DIRECTORY)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ChecksumMismatch(f"its folder {base} is a symbolic link, not a folder of its own") from None
        raise
    *folders, name = rel.split("/")
    try:
        for folder in folders:
            inner = os.open(folder, _OPEN | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.open(name, _OPEN | os.O_NONBLOCK, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):  # a link, or a file where a folder should be
            raise ChecksumMismatch(
                f"file {rel} is not a regular file (a symbolic link, folder, pipe or device)"
            ) from None
        raise
    finally:
        os.close(fd)


def _raw(fs: Any) -> Any:
    """The filesystem itself: this module retries each call on its own terms."""
    return fs.fs if isinstance(fs, RetryingFileSystem) else fs


def _path(base: str, rel: str) -> str:
    return f"{base.rstrip('/')}/{rel}"


def _named(fs: Any, base: str, rel: str) -> str:
    """The file as a person finds it in the store: with its scheme (``s3://bucket/…``)."""
    return _raw(fs).unstrip_protocol(_path(base, rel))
