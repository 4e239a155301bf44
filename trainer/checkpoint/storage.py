"""DCP's fsspec storage, reading and writing each byte once: files are hashed as they are written and verified as
they are read, and every file is one call retried whole through transient store errors (``trainer.retry``).

- ``HashingWriter``: DCP's ``FsspecWriter``; ``hashes()`` gives this rank's files and their sha256 once the
  save is written, so the commit manifest needs no read-back. On an object store a file is kept in memory
  and uploaded in one ``pipe_file`` (s3fs uploads it in parts above 100 MiB); a local file streams to disk.
- ``VerifyingReader``: DCP's ``FsspecReader`` (metadata unpickled safely, ``trainer.checkpoint.loading``);
  each file DCP opens is read whole, checked against the commit manifest's sha256, and served from memory.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

from trainer import retry
from trainer.errors import CheckpointError
from trainer.store import client_options


class ChecksumMismatch(CheckpointError):
    """A checkpoint file read back is not what its manifest says was written."""


class _Upload:
    """A file DCP writes into: the bytes, for one whole upload that can be retried, hashed as they come."""

    def __init__(self) -> None:
        self.data, self.sha = bytearray(), hashlib.sha256()

    def write(self, b: Any) -> int:
        self.data += b
        self.sha.update(b)
        return len(memoryview(b).cast("B"))

    def tell(self) -> int:
        return len(self.data)

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:  # the upload happens after DCP is done with the stream
        pass

    @property
    def closed(self) -> bool:
        return False


class _HashingFile:
    """A local file DCP writes into, hashed on its way to disk."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.sha = fh, hashlib.sha256()

    def write(self, b: Any) -> int:
        self.sha.update(b)
        return self.fh.write(b)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno (DCP fsyncs), …
        return getattr(self.fh, name)


class StoreFiles(FileSystem):
    """DCP's fsspec ``FileSystem`` with each file hashed on write, verified on read (against ``expected``,
    relative names → sha256) and transferred in one retried call."""

    def __init__(self, expected: dict[str, str] | None = None) -> None:
        super().__init__()
        self.base = ""
        self.expected = expected
        self.written: dict[str, str] = {}  # relative name → sha256
        self._lock = threading.Lock()  # DCP may write from several threads

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        uri = os.fspath(path)
        self.fs, self.base = url_to_fs(uri, **client_options(uri, kwargs))
        return path

    def _rel(self, path: str | os.PathLike) -> str:
        return posixpath.relpath(self.fs._strip_protocol(os.fspath(path)), self.base)

    def _local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = os.fspath(path)
        if "r" in mode:
            yield io.BytesIO(self._read_verified(path))
            return
        if self._local():
            self.fs.makedirs(posixpath.dirname(self.fs._strip_protocol(path)), exist_ok=True)
            with self.fs.open(path, mode) as fh:
                stream = _HashingFile(fh)
                yield stream
        else:
            stream = _Upload()
            yield stream
            retry.call(f"uploading {path}", self.fs.pipe_file, path, stream.data)
        with self._lock:
            self.written[self._rel(path)] = stream.sha.hexdigest()

    def _read_verified(self, path: str) -> bytes:
        rel = self._rel(path)
        try:
            data = self.fs.cat_file(path) if self._local() else retry.call(f"reading {path}", self.fs.cat_file, path)
        except FileNotFoundError:
            if self.expected is not None and rel in self.expected:
                raise ChecksumMismatch(f"file {rel} is missing") from None
            raise
        if self.expected is not None and self.expected.get(rel) != hashlib.sha256(data).hexdigest():
            why = "fails its sha256 (truncated or altered)" if rel in self.expected else "is not in its manifest"
            raise ChecksumMismatch(f"file {rel} {why}")
        return data

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        retry.call(f"renaming {path}", self.fs.mv, os.fspath(path), os.fspath(new_path))
        with self._lock:
            if (sha := self.written.pop(self._rel(path), None)) is not None:
                self.written[self._rel(new_path)] = sha

    def exists(self, path: str | os.PathLike) -> bool:
        return retry.call(f"exists {path}", self.fs.exists, os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        retry.call(f"deleting {path}", self.fs.rm_file, os.fspath(path))
        with self._lock:
            self.written.pop(self._rel(path), None)

    def mkdir(self, path: str | os.PathLike) -> None:
        if self._local():  # an object store has no folders (and s3fs's makedirs may create a bucket)
            self.fs.makedirs(os.fspath(path), exist_ok=True)


class HashingWriter(FsspecWriter):
    """DCP's fsspec writer that knows the sha256 of every file this rank wrote (``hashes``)."""

    def __init__(self, path: str, **storage_options: Any) -> None:
        super().__init__(path, **storage_options)
        self.fs = StoreFiles()
        self.path = self.fs.init_path(path, **storage_options)

    def hashes(self) -> dict[str, str]:
        return dict(self.fs.written)
