"""One orchestrator per run: ``runs/{run}/lease.json`` names who is training it.

The flow takes the lease before it writes anything of the run and renews it
while training; a lease not renewed for ``ttl_s`` (its holder was killed, its
machine lost), or whose process is gone on this host, is stale and is taken
over, and the caller learns whose it was so it can mark that flow run crashed.
A live lease held by someone else refuses the new run with one line.

Object stores have no atomic create-if-absent through fsspec, so two starts in
the same instant can both win; the write-then-read-back check narrows that
window to the store's own latency.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from trainer.errors import TrainpipeError
from trainer.layout import join
from trainer.proc import pid_alive
from trainer.store import filesystem, read_json, write_json

TTL_S = 120.0


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
        return f"owner {self.owner} (pid {self.pid} on {self.host}, renewed {age:.0f}s ago)"


class RunLease:
    """Take, renew and release the lease of ``run`` under ``run_dir``."""

    def __init__(self, run_dir: str, run: str, storage_options: dict | None, owner: str | None = None):
        self.fs, self.path = filesystem(join(run_dir, "lease.json"), storage_options)
        self.lease = Lease(run, owner or uuid.uuid4().hex)

    def current(self) -> Lease | None:
        try:
            body = read_json(self.fs, self.path)
            lease = Lease(**body)
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, OSError):
            return None  # a damaged lease protects nothing: treat as absent
        types = {"run": str, "owner": str, "host": str, "pid": int, "acquired": float, "renewed": float}
        for name, kind in types.items():
            value = getattr(lease, name)
            ok = type(value) in (int, float) and math.isfinite(value) if kind is float else type(value) is kind
            if not ok:
                return None  # damaged the same way: its fields are not what a lease holds
        return lease

    def acquire(self, ttl_s: float = TTL_S) -> Lease | None:
        """Take the lease; return the stale lease taken over (None if there was none). RunBusy if it is live."""
        held = self.current()
        if held is not None and held.owner != self.lease.owner and not held.stale(ttl_s):
            raise RunBusy(
                f"run {self.lease.run} is being trained by {held.line()}; cancel that run or wait for it to end "
                f"(a lease not renewed for {ttl_s:.0f}s is taken over)"
            )
        self._write()
        time.sleep(0.05)  # a racing writer's lease lands now, and the read below sees who won
        now = self.current()
        if now is None or now.owner != self.lease.owner:
            raise RunBusy(
                f"run {self.lease.run} was taken by {now.line() if now else 'another run'} as this one started"
            )
        return held if held is not None and held.owner != self.lease.owner else None

    @contextlib.contextmanager
    def kept(self, every_s: float = TTL_S / 4) -> Iterator[None]:
        """Renew the lease from a background thread while the block runs, release it after."""
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(every_s):
                with contextlib.suppress(Exception):  # a missed renewal is retried; the TTL allows several
                    self.renew()

        thread = threading.Thread(target=renew, name="run-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)
            with contextlib.suppress(Exception):  # an unreleased lease goes stale on its own
                self.release()

    def renew(self) -> None:
        self.lease.renewed = time.time()
        self._write()

    def release(self) -> None:
        held = self.current()
        if held is not None and held.owner == self.lease.owner:
            self.fs.rm(self.path)

    def _write(self) -> None:
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        write_json(self.fs, self.path, asdict(self.lease))
