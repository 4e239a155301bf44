"""Progress beacons: every rank reports (step, phase, time) to the supervisor over TCP.

Why TCP to the supervisor rather than torch's rendezvous store: the watchdog must
keep working exactly when torch.distributed is wedged, it lives outside the
training processes, and a plain socket crosses nodes (the supervisor's address
is handed to every rank in ``TRAINPIPE_BEACON=host:port``).

A beacon is sent only by the training loop itself at a phase boundary, never by a
background thread: a rank stuck in a collective or frozen by SIGSTOP goes
silent, which is the signal.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

PHASES = ("start", "data", "forward", "backward", "collective", "optimizer", "checkpoint", "eval", "done")
ENV = "TRAINPIPE_BEACON"


class Beacon:
    """The rank's sender. ``beacon(step, phase)`` costs one small non-blocking send."""

    def __init__(self, rank: int, address: str | None = None):
        self.rank = rank
        self._sock: socket.socket | None = None
        address = address if address is not None else os.environ.get(ENV)
        if not address:
            return
        host, port = address.rsplit(":", 1)
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=5)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            self._sock = None  # no supervisor (plain torchrun): beacons are simply off
            return
        from trainer.proc import node_name

        self(-1, "start", pid=os.getpid(), host=node_name(), machine=socket.gethostname())

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def __call__(self, step: int, phase: str, **extra: Any) -> None:
        if self._sock is None:
            return
        msg = {"r": self.rank, "s": step, "p": phase, "t": time.time(), **extra}
        try:
            self._sock.sendall((json.dumps(msg, separators=(",", ":")) + "\n").encode())
        except OSError:
            self._sock = None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


@dataclass
class RankProgress:
    rank: int
    step: int = -1
    phase: str = "start"
    time: float = 0.0  # sender's wall clock of the last beacon
    received: float = 0.0  # our monotonic clock when it arrived
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "phase": self.phase, "time": self.time, **self.extra}


class BeaconServer:
    """The supervisor's receiver: the last beacon of every rank, and the first step seen."""

    def __init__(self, host: str = "127.0.0.1"):
        self._srv = socket.create_server((host, 0))
        self._srv.settimeout(0.2)
        self.address = f"{host}:{self._srv.getsockname()[1]}"
        self.ranks: dict[int, RankProgress] = {}
        self.first_step_at: float | None = None  # wall clock of the first beacon of a training step
        self.first_step: int | None = None
        self._compute: list[tuple[int, int, float]] = []  # (rank, step, compute seconds) not yet drained
        self._step_times: deque[float] = deque(maxlen=20)
        self._last_data_t: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, name="beacon-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            t = threading.Thread(target=self._read, args=(conn,), name="beacon-read", daemon=True)
            t.start()
            self._threads.append(t)

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(0.5)
        buf = b""
        with conn:
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(65536)
                except (TimeoutError, socket.timeout):
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    self._record(json.loads(line))

    def _record(self, msg: dict[str, Any]) -> None:
        rank = int(msg.pop("r"))
        with self._lock:
            p = self.ranks.setdefault(rank, RankProgress(rank))
            p.step, p.phase, p.time, p.received = int(msg.pop("s")), str(msg.pop("p")), float(msg.pop("t")), time.monotonic()
            p.extra.update(msg)
            if self.first_step_at is None and p.phase == "data":
                self.first_step_at, self.first_step = p.time, p.step
            if "cs" in msg:
                self._compute.append((rank, p.step, float(msg["cs"])))
            if rank == 0 and p.phase == "data":
                if self._last_data_t is not None:
                    self._step_times.append(p.time - self._last_data_t)
                self._last_data_t = p.time

    def drain_compute(self) -> list[tuple[int, int, float]]:
        with self._lock:
            out, self._compute = self._compute, []
        return out

    def step_times(self) -> list[float]:
        with self._lock:
            return list(self._step_times)

    def snapshot(self) -> dict[int, RankProgress]:
        with self._lock:
            return {r: RankProgress(p.rank, p.step, p.phase, p.time, p.received, dict(p.extra)) for r, p in self.ranks.items()}

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        for t in self._threads:
            t.join(timeout=1)
