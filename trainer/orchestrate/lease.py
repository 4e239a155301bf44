"""One orchestrator per run: ``runs/{run}/lease.json`` names who is training it.

The flow takes the lease before it writes anything of the run and renews it
while training. Every change to the lease is a compare-and-swap on the file the
writer last read, so of two starts in the same instant exactly one wins:

- a local store creates the file exclusively (``os.link`` of a complete
  temporary file) and replaces or deletes it under an ``flock`` on a sibling
  lock file, comparing contents first;
- S3 creates with ``If-None-Match: *`` and replaces or deletes with
  ``If-Match: <ETag>``;
- other fsspec stores get the same protocol without the atomicity (a write, then
  a read-back check), which narrows the race to the store's latency.

A lease not renewed for ``ttl_s`` (its holder was killed, its machine lost), or
whose process is gone on this host, is stale and is taken over; the caller
learns whose it was to record the takeover. A renewal that finds the lease is
no longer its own reports the loss: that orchestrator must stop writing.

The lease file is in the store, which others can write: what it says is a
claim, never an authority. Whose flow run a stale lease names is checked
against the Prefect API before anything is done to it (``foreign_flow_run``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem

from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.proc import pid_alive
from trainpipe.trainer.store import NotARecord, filesystem, read_record
from trainpipe.trainer.store_paths import join

TTL_S = 120.0
LEASE_MAX_BYTES = 64 * 1024  # a lease is a few hundred bytes


class RunBusy(TrainpipeError):
    """Another live orchestrator holds the run's lease."""


@dataclass
class Lease:
    run: str
    owner: str  # the Prefect flow run id, or a random id outside Prefect
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    acquired: float = field(default_factory=time.time)
    renewed: float = field(default_factory=time.time)

    def stale(self, ttl_s: float, now: float | None = None) -> bool:
        if (now or time.time()) - self.renewed > ttl_s:
            return True
        return self.host == socket.gethostname() and not pid_alive(self.pid)

    def line(self) -> str:
        age = time.time() - self.renewed
        return f"owner {printable(self.owner)} (pid {self.pid} on {printable(self.host)}, renewed {age:.0f}s ago)"

    def body(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()


def printable(text: str, limit: int = 100) -> str:
    """``text`` from the store as one short line: a planted lease must not write lines of its own into a log or an
    incident."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit]) + ("…" if len(text) > limit else "")


@dataclass(frozen=True)
class FlowRunView:
    """What the takeover needs to know of a Prefect flow run (``trainer/`` never imports Prefect)."""

    id: str
    name: str
    flow_id: str
    deployment_id: str | None
    tags: tuple[str, ...] = ()
    final: bool = False


def foreign_flow_run(stale: Lease, run: str, ours: FlowRunView | None, theirs: FlowRunView | None) -> str | None:
    """Why the flow run a stale lease of ``run`` names is not this run's, so a takeover must leave it alone; None
    when it is (an earlier flow run of the same flow and deployment, named or tagged for ``run``).

    The lease comes from the store: anyone who can write the bucket can plant one naming any flow run id, and
    marking a live flow run of another team Crashed would stop it being watched and cancelled."""
    if stale.run != run:
        return f"the lease is for run {printable(stale.run)!r}, not {run!r}"
    if ours is None:
        return "this run is not a Prefect flow run"
    if theirs is None:
        return "no such flow run on this Prefect server"
    if theirs.id == ours.id:
        return "it is this flow run"
    if theirs.flow_id != ours.flow_id:
        return "it is a run of another flow"
    if theirs.deployment_id != ours.deployment_id:
        return "it is a run of another deployment (or not of this one)"
    if theirs.name != run and f"run:{run}" not in theirs.tags:
        return f"it is flow run {printable(theirs.name)!r}, of another run"
    stores = [{t for t in view.tags if t.startswith("store:")} for view in (ours, theirs)]
    if all(stores) and not stores[0] & stores[1]:
        return "it trains a run of that name in another store"
    return None


_FIELDS = {"run": str, "owner": str, "host": str, "pid": int, "acquired": float, "renewed": float}


def parse_lease(body: bytes) -> Lease | None:
    """The lease in ``body``; None when it is not one (a damaged lease protects nothing)."""
    try:
        raw = json.loads(body)
        lease = Lease(**raw)
    except (ValueError, TypeError):
        return None
    for name, kind in _FIELDS.items():
        value = getattr(lease, name)
        ok = type(value) in (int, float) and math.isfinite(value) if kind is float else type(value) is kind
        if not ok:
            return None
    return lease


class LeaseFile:
    """Compare-and-swap on one small file: ``read`` gives its body and a version to pass back."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str):
        self.fs, self.path = fs, path

    def read(self) -> tuple[bytes | None, str | None]:
        """(body, version), or (None, None) when there is no lease; NotARecord when the file is not one that can
        be read at once (a FIFO would hold ``trainpipe run`` forever, a device would fill its memory)."""
        try:
            body = read_record(self.fs, self.path, LEASE_MAX_BYTES)
        except FileNotFoundError:
            return None, None
        return body, hashlib.sha256(body).hexdigest()

    def create(self, body: bytes) -> str | None:
        """Write ``body`` if there is no file; its version, or None when there was one."""
        if self.fs.exists(self.path):
            return None
        self.fs.pipe_file(self.path, body)
        return self._check(body)

    def replace(self, body: bytes, version: str) -> str | None:
        """Write ``body`` if the file is still at ``version``; the new version, or None when it was not."""
        if self.read()[1] != version:
            return None
        self.fs.pipe_file(self.path, body)
        return self._check(body)

    def _check(self, body: bytes) -> str | None:
        now, version = self.read()
        return version if now == body else None

    def delete(self, version: str) -> bool:
        if self.read()[1] != version:
            return False
        self.fs.rm_file(self.path)
        return True


class LocalLeaseFile(LeaseFile):
    """Atomic on one host (and on a shared file system with working ``flock``)."""

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        folder = os.path.dirname(self.path)
        os.makedirs(folder, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)  # the run's folder is the lock: no file to leave behind
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _publish(self, body: bytes, exclusive: bool) -> str | None:
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            if not exclusive:
                os.replace(tmp, self.path)
            else:
                try:
                    os.link(tmp, self.path)  # fails if the lease exists: an exclusive create of complete contents
                except FileExistsError:
                    return None
            return hashlib.sha256(body).hexdigest()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def create(self, body: bytes) -> str | None:
        with self._locked():
            return self._publish(body, exclusive=True)

    def replace(self, body: bytes, version: str) -> str | None:
        with self._locked():
            return self._publish(body, exclusive=False) if self.read()[1] == version else None

    def delete(self, version: str) -> bool:
        with self._locked():
            if self.read()[1] != version:
                return False
            os.unlink(self.path)
            return True


class S3LeaseFile(LeaseFile):
    """S3 conditional writes: ``If-None-Match: *`` to create, ``If-Match: <ETag>`` to replace or delete."""

    fs: Any  # an s3fs S3FileSystem: its S3 calls are its own, not fsspec's interface

    def _key(self) -> dict[str, str]:
        bucket, key, _ = self.fs.split_path(self.path)
        return {"Bucket": bucket, "Key": key}

    def read(self) -> tuple[bytes | None, str | None]:
        async def get() -> tuple[bytes, str]:
            out = await self.fs._call_s3("get_object", **self._key())
            try:
                if not 0 <= out.get("ContentLength", 0) <= LEASE_MAX_BYTES:
                    size = out["ContentLength"]
                    raise NotARecord(f"{self.path} is {size} bytes, not a lease; move it aside to go on")
                return await out["Body"].read(), out["ETag"]
            finally:
                out["Body"].close()

        try:
            return cast(tuple[bytes, str], fsspec.asyn.sync(self.fs.loop, get))
        except FileNotFoundError:
            return None, None

    def _conditional(self, method: str, **kwargs: bytes | str) -> str | None:
        """The call's new ETag ("" for a delete), or None when its condition failed."""
        try:
            out = self.fs.call_s3(method, **self._key(), **kwargs)
        except (FileExistsError, FileNotFoundError):  # If-None-Match on a key that exists, If-Match on one gone
            return None
        except OSError as exc:
            if _precondition_failed(exc):
                return None
            raise
        finally:
            self.fs.invalidate_cache(self.path)
        return out.get("ETag", "")

    def create(self, body: bytes) -> str | None:
        return self._conditional("put_object", Body=body, IfNoneMatch="*")

    def replace(self, body: bytes, version: str) -> str | None:
        return self._conditional("put_object", Body=body, IfMatch=version)

    def delete(self, version: str) -> bool:
        return self._conditional("delete_object", IfMatch=version) is not None


def _precondition_failed(exc: OSError) -> bool:
    """S3 answers a failed condition with 412, or 409 when a concurrent conditional write is in flight."""
    response = getattr(exc.__cause__, "response", None) or {}
    code = response.get("Error", {}).get("Code", "")
    return code in ("PreconditionFailed", "ConditionalRequestConflict")  # not errno: s3fs gives EINVAL to many


def lease_file(fs: fsspec.AbstractFileSystem, path: str) -> LeaseFile:
    if isinstance(fs, LocalFileSystem):
        return LocalLeaseFile(fs, path)
    if "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return S3LeaseFile(fs, path)
    return LeaseFile(fs, path)


class RunLease:
    """Take, renew and release the lease of ``run`` under ``run_dir``."""

    def __init__(self, run_dir: str, run: str, storage_options: dict | None, owner: str | None = None):
        fs, path = filesystem(join(run_dir, "lease.json"), storage_options)
        self.file = lease_file(fs, path)
        self.lease = Lease(run, owner or uuid.uuid4().hex)
        self.version: str | None = None  # of the lease this orchestrator last wrote

    def current(self) -> Lease | None:
        body, _ = self.file.read()
        return None if body is None else parse_lease(body)

    def check_free(self, ttl_s: float = TTL_S) -> None:
        """RunBusy when someone else holds a live lease (a check before starting; ``acquire`` decides)."""
        self._refuse_if_held(self.current(), ttl_s)

    def _refuse_if_held(self, held: Lease | None, ttl_s: float) -> None:
        if held is not None and held.owner != self.lease.owner and not held.stale(ttl_s):
            raise RunBusy(
                f"run {self.lease.run} is being trained by {held.line()}; cancel that run or wait for it to "
                f"end (a lease not renewed for {ttl_s:.0f}s is taken over)"
            )

    def acquire(self, ttl_s: float = TTL_S) -> Lease | None:
        """Take the lease; return the stale lease taken over (None if there was none). RunBusy if it is live."""
        for _ in range(5):  # each pass either wins, refuses, or saw another writer change the file
            body, version = self.file.read()
            held = None if body is None else parse_lease(body)
            self._refuse_if_held(held, ttl_s)
            self.lease.acquired = self.lease.renewed = time.time()
            mine = self.lease.body()
            won = self.file.create(mine) if version is None else self.file.replace(mine, version)
            if won is not None:
                self.version = won
                return held if held is not None and held.owner != self.lease.owner else None
        now = self.current()
        raise RunBusy(f"run {self.lease.run} was taken by {now.line() if now else 'another run'} as this one started")

    def renew(self) -> Lease | None:
        """Renew the lease; None when done, else the lease that replaced this one (it is no longer ours)."""
        self.lease.renewed = time.time()
        mine = self.lease.body()
        if self.version is not None and (won := self.file.replace(mine, self.version)) is not None:
            self.version = won
            return None
        return self.current() or Lease(self.lease.run, "nobody (the lease file is gone)")

    @contextlib.contextmanager
    def kept(self, on_lost: Callable[[Lease], None], every_s: float = TTL_S / 4) -> Iterator[None]:
        """Renew the lease from a background thread while the block runs, release it after.

        When a renewal finds the lease taken over (this process stalled past the TTL and someone else started
        the run), ``on_lost`` is called once with the new holder and renewals stop.
        """
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(every_s):
                try:
                    lost = self.renew()
                except Exception:  # noqa: BLE001 - a missed renewal is retried; the TTL allows several
                    continue
                if lost is not None:
                    on_lost(lost)
                    return

        thread = threading.Thread(target=renew, name="run-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)
            with contextlib.suppress(Exception):  # an unreleased lease goes stale on its own
                self.release()

    def release(self) -> None:
        if self.version is not None and self.file.delete(self.version):
            self.version = None
