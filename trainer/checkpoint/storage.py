"""DCP's fsspec storage, reading and writing each byte once: files are hashed as they are written and verified as
they are read, and every file is one call retried whole through transient store errors (``trainer.store_retry``).

- ``HashingWriter``: DCP's ``FsspecWriter``; ``hashes()`` and ``sizes()`` give this rank's files, their sha256
  and their sizes once the save is written, so the commit manifest needs no read-back. On an object store a file
  is uploaded in parts as it is written (``_Upload``); a local file streams to disk.
- ``SafeReader`` (``trainer.checkpoint.loading``): DCP's ``FsspecReader`` (metadata unpickled safely); each file
  DCP opens must be one the commit manifest lists, is read whole (a regular file inside the checkpoint's folder,
  up to the size the manifest states: ``trainer.checkpoint.files``), checked against its sha256, and served from
  memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import posixpath
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, cast

import fsspec.asyn
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

from trainpipe.trainer import store_retry
from trainpipe.trainer.checkpoint.files import ChecksumMismatch, inside_folder, read_file
from trainpipe.trainer.store import client_options

PART_BYTES = 32 << 20  # S3 multipart part size (S3's minimum is 5 MiB; at most 10,000 parts: files up to 320 GiB)


class _Upload:
    """A file DCP writes into an object store, hashed as the bytes come and sent in parts of ``PART_BYTES`` as
    they fill (S3 multipart, two parts in flight on background threads), so serializing and uploading overlap
    and memory holds a few parts, not the file. Each part, and the completion, is retried whole
    (``trainer.store_retry``); a file smaller than one part is one PUT. ``abort`` drops the parts of a failed upload,
    which never becomes an object."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path
        self.bucket, self.key, _ = fs.split_path(path)
        self.buf, self.sha, self.size = bytearray(), hashlib.sha256(), 0
        self.upload_id: str | None = None
        self.parts: list[Future] = []
        self._pool: ThreadPoolExecutor | None = None

    def write(self, b: Any) -> int:
        n = len(memoryview(b).cast("B"))
        self.buf += b
        self.sha.update(b)
        self.size += n
        while len(self.buf) >= PART_BYTES:
            self._send(bytes(self.buf[:PART_BYTES]))
            del self.buf[:PART_BYTES]
        return n

    def _s3(self, method: str, **kwargs: Any) -> Any:
        return fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, method, Bucket=self.bucket, Key=self.key, **kwargs)

    def _send(self, data: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = store_retry.call(
                f"starting the upload of {self.path}", self._s3, "create_multipart_upload"
            )["UploadId"]
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-part")
        assert self._pool is not None  # made with the upload's id
        number = len(self.parts) + 1
        if len(self.parts) >= 2:
            self.parts[-2].result()  # two parts in flight at most: memory stays a few parts
        self.parts.append(self._pool.submit(self._part, number, data))

    def _part(self, number: int, data: bytes) -> dict[str, Any]:
        what = f"uploading part {number} of {self.path}"
        out = store_retry.call(what, self._s3, "upload_part", PartNumber=number, UploadId=self.upload_id, Body=data)
        return {"PartNumber": number, "ETag": out["ETag"]}

    def finish(self) -> None:
        """Upload what is left and make the object appear (all of it, or nothing)."""
        if self.upload_id is None:
            store_retry.call(f"uploading {self.path}", self.fs.pipe_file, self.path, self.buf)
            return
        if self.buf or not self.parts:
            self._send(bytes(self.buf))
            self.buf = bytearray()
        parts = [f.result() for f in self.parts]
        store_retry.call(
            f"completing the upload of {self.path}",
            self._s3,
            "complete_multipart_upload",
            UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
        )
        self.fs.invalidate_cache(self.path)
        if self._pool is not None:
            self._pool.shutdown()

    def abort(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
        if self.upload_id is not None:
            with contextlib.suppress(Exception):  # best effort: the upload is failing already
                self._s3("abort_multipart_upload", UploadId=self.upload_id)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:  # ``finish`` ends the upload, after DCP is done with the stream
        pass

    @property
    def closed(self) -> bool:
        return False


class _HashingFile:
    """A local file DCP writes into, hashed (and counted) on its way to disk."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.sha, self.size = fh, hashlib.sha256(), 0

    def write(self, b: Any) -> int:
        self.sha.update(b)
        self.size += len(memoryview(b).cast("B"))
        return self.fh.write(b)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno (DCP fsyncs), …
        return getattr(self.fh, name)


class StoreFiles(FileSystem):
    """DCP's fsspec ``FileSystem`` with each file hashed on write, verified on read (against ``expected``,
    relative names → sha256, and ``sizes``, relative names → bytes) and transferred in one retried call."""

    def __init__(self, expected: dict[str, str] | None = None, sizes: dict[str, int] | None = None) -> None:
        super().__init__()
        self.base = ""
        self.expected, self.sizes = expected, sizes or {}
        self.written: dict[str, str] = {}  # relative name → sha256
        self.written_sizes: dict[str, int] = {}  # relative name → bytes
        self._lock = threading.Lock()  # DCP may write from several threads

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        uri = os.fspath(path)
        self.fs, base = url_to_fs(uri, **client_options(uri, kwargs))
        self.base = str(base)  # one URL: one path
        return path

    @property
    def store(self) -> AbstractFileSystem:
        """The folder's filesystem (DCP calls ``init_path`` before any other method)."""
        assert self.fs is not None, "init_path was not called"
        return self.fs

    def _rel(self, path: str | os.PathLike) -> str:
        return posixpath.relpath(self._bare(os.fspath(path)), self.base)

    def _bare(self, path: str) -> str:
        return cast(str, self.store._strip_protocol(path))  # one path in, one out (a list only for a list)

    def _local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = os.fspath(path)
        if "r" in mode:
            yield io.BytesIO(self._read_verified(path))
            return
        if self._local():
            self.store.makedirs(posixpath.dirname(self._bare(path)), exist_ok=True)
            with self.store.open(path, mode) as fh:
                stream = _HashingFile(fh)
                yield stream
        else:
            stream = _Upload(self.store, path)
            try:
                yield stream
                stream.finish()
            except BaseException:
                stream.abort()
                raise
        with self._lock:
            self.written[self._rel(path)] = stream.sha.hexdigest()
            self.written_sizes[self._rel(path)] = stream.size

    def _read_verified(self, path: str) -> bytes:
        """The file at ``path``, read only by its name inside the checkpoint's folder and, with ``expected``, only
        when the manifest lists it (checked before a byte is read)."""
        rel = self._rel(path)
        if not inside_folder(rel):
            raise ChecksumMismatch(f"file {rel} lies outside its checkpoint folder")
        if self.expected is not None and rel not in self.expected:
            raise ChecksumMismatch(f"file {rel} is not in its manifest")
        try:
            data = read_file(self.store, self.base, rel, self.sizes.get(rel))
        except FileNotFoundError:
            if self.expected is not None:
                raise ChecksumMismatch(f"file {rel} is missing") from None
            raise
        if self.expected is not None and self.expected[rel] != hashlib.sha256(data).hexdigest():
            raise ChecksumMismatch(f"file {rel} fails its sha256 (truncated or altered)")
        return data

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        store_retry.call(f"renaming {path}", self.store.mv, os.fspath(path), os.fspath(new_path))
        with self._lock:
            if (sha := self.written.pop(self._rel(path), None)) is not None:
                self.written[self._rel(new_path)] = sha
                self.written_sizes[self._rel(new_path)] = self.written_sizes.pop(self._rel(path))

    def exists(self, path: str | os.PathLike) -> bool:
        return store_retry.call(f"exists {path}", self.store.exists, os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        store_retry.call(f"deleting {path}", self.store.rm_file, os.fspath(path))
        with self._lock:
            self.written.pop(self._rel(path), None)
            self.written_sizes.pop(self._rel(path), None)

    def mkdir(self, path: str | os.PathLike) -> None:
        if self._local():  # an object store has no folders (and s3fs's makedirs may create a bucket)
            self.store.makedirs(os.fspath(path), exist_ok=True)


class HashingWriter(FsspecWriter):
    """DCP's fsspec writer that knows the sha256 of every file this rank wrote (``hashes``)."""

    def __init__(self, path: str, **storage_options: Any) -> None:
        super().__init__(path, **storage_options)
        self.fs = StoreFiles()
        self.path = self.fs.init_path(path, **storage_options)

    def hashes(self) -> dict[str, str]:
        return dict(self.fs.written)

    def sizes(self) -> dict[str, int]:
        return dict(self.fs.written_sizes)
