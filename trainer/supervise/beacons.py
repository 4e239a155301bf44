"""The supervisor's receiver of the ranks' progress beacons (the sender is ``trainer.loop.beacon``).

Why TCP to the supervisor rather than torch's rendezvous store: the watchdog
must keep working exactly when torch.distributed is wedged, and it lives
outside the training processes. The server binds loopback: the ranks it hears
are this host's (``TRAINPIPE_BEACON=127.0.0.1:port``).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trainer.protocol import decode_beacon

MAX_LINE = 1 << 16  # a beacon is ~100 bytes; a longer "line" is not one of ours


@dataclass
class RankProgress:
    rank: int
    step: int = -1
    phase: str = "start"
    time: float = 0.0  # sender's wall clock of the last beacon
    received: float = 0.0  # our monotonic clock when it arrived
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def host(self) -> str | None:
        return self.extra.get("host")

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "phase": self.phase, "time": self.time, **self.extra}


class BeaconServer:
    """The last beacon of every rank, the first step seen, compute times and recent step times."""

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
            except TimeoutError:
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
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if len(buf) > MAX_LINE:
                    return
                for line in lines:
                    if (msg := decode_beacon(line)) is not None:
                        self._record(*msg)

    def _record(self, rank: int, step: int, phase: str, t: float, extra: dict[str, Any]) -> None:
        with self._lock:
            p = self.ranks.setdefault(rank, RankProgress(rank))
            p.step, p.phase, p.time, p.received = step, phase, t, time.monotonic()
            p.extra.update(extra)
            if self.first_step_at is None and phase == "data":
                self.first_step_at, self.first_step = t, step
            if "cs" in extra:
                self._compute.append((rank, step, float(extra["cs"])))
            if rank == 0 and phase == "data":
                if self._last_data_t is not None:
                    self._step_times.append(t - self._last_data_t)
                self._last_data_t = t

    def drain_compute(self) -> list[tuple[int, int, float]]:
        with self._lock:
            out, self._compute = self._compute, []
        return out

    def step_times(self) -> list[float]:
        with self._lock:
            return list(self._step_times)

    def snapshot(self) -> dict[int, RankProgress]:
        with self._lock:
            return {
                r: RankProgress(p.rank, p.step, p.phase, p.time, p.received, dict(p.extra))
                for r, p in self.ranks.items()
            }

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        for t in self._threads:
            t.join(timeout=1)
