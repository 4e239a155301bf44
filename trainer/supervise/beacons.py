"""The supervisor's receiver of the ranks' progress beacons (the sender is ``trainer.loop.beacon``).

Why TCP to the supervisor rather than torch's rendezvous store: the watchdog
must keep working exactly when torch.distributed is wedged, and it lives
outside the training processes. On one host the server binds loopback
(``TRAINPIPE_BEACON=127.0.0.1:port``). Across hosts, node 0's supervisor runs
the job's one watchdog: its server binds node 0's address (``cluster.master_addr``)
on a known port, every rank of every host sends to it, and every other host's
supervisor holds a ``WatchdogLink`` to it, which closes when node 0's part of
the attempt ends. Every connection opens with the attempt's token.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from trainpipe.trainer.proc import node_name
from trainpipe.trainer.protocol import (
    decode_beacon,
    decode_gpu_use,
    decode_host_status,
    encode_gpu_use,
    encode_host_status,
)

log = logging.getLogger("trainpipe.supervisor")

MAX_LINE = 1 << 16  # a beacon is ~100 bytes; a longer "line" is not one of ours
# A rank sends the token as soon as it connects: a connection still without it after this long is not a rank,
# and is closed (however slowly it trickles bytes), so that idle connections cannot hold the port.
GREETING_S = 3.0
# Connections not yet greeted, at most; one more closes the oldest of them. They are counted apart from the
# greeted ones, so a flood of connections without the token never takes the slot a rank's connection needs.
MAX_PENDING = 16
# Step reports kept between two polls of the watchdog, at most (4,096 ranks at 2 steps a second: 4,096 a poll).
MAX_REPORTS = 1 << 18


@dataclass(frozen=True)
class StepReport:
    """One rank's figures for one finished step, from the first beacon of its next step."""

    rank: int
    step: int
    host: str | None
    loss: float | None = None
    grad_norm: float | None = None
    data_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    data_fetch_s: float = 0.0  # of data_s: fetching shards from the store
    data_verify_s: float = 0.0  # of data_s: checking their sha256


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
    """The last beacon of every rank, the first step seen, compute times and recent step times.

    Other local processes can reach the port (docs/security.md), so it accepts only what this attempt's ranks
    send: a connection must open with the attempt's token within GREETING_S, beacons are typed and
    range-checked (``protocol.decode_beacon``), a connection speaks for one rank and a rank for one connection,
    a rank's pid is taken only from a process that descends from this supervisor, and connections and line
    lengths are capped: greeted connections by ``max_connections``, those not yet greeted by MAX_PENDING apart
    (the oldest is closed for a new one). Anything else is dropped and logged.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        world_size: int | None = None,
        token: str | None = None,
        port: int = 0,
        unix: bool = False,
    ):
        # unix: a socket in a folder only this user may enter (``unix:PATH``), which a single-host job's ranks
        # reach from a network namespace of their own (trainer.supervise.isolation) and no other user reaches
        self._folder = tempfile.mkdtemp(prefix="trainpipe-beacons-") if unix else None
        if self._folder is not None:
            self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._srv.bind(os.path.join(self._folder, "beacons.sock"))
            self._srv.listen(128)
            self.address = f"unix:{self._srv.getsockname()}"
        else:
            self._srv = socket.create_server((host, port))
            self.address = f"{host}:{self._srv.getsockname()[1]}"
        self._srv.settimeout(0.2)
        self.token = token or secrets.token_hex(16)
        self.world_size = world_size
        self.max_connections = 2 * world_size + 8 if world_size else 64
        self.node = node_name()
        self.dropped = 0  # beacons and connections refused
        self.lost_links: list[float] = []  # when another host's link closed while this server ran (monotonic)
        self.ranks: dict[int, RankProgress] = {}
        self.first_step_at: float | None = None  # wall clock of the first beacon of a training step
        self.first_step: int | None = None
        self._compute: list[tuple[int, int, float]] = []  # (rank, step, compute seconds) not yet drained
        self._reports: list[StepReport] = []  # per finished step, not yet drained
        self.keep_reports = False  # set by the watchdog that drains them: nobody else reads them
        self._step_times: deque[float] = deque(maxlen=20)
        self._last_data_t: float | None = None
        self._gpu_use: dict[int, tuple[float, float]] = {}  # rank -> (when, its GPU's use), from other hosts' links
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._open, self._serial = 0, 0  # greeted connections; connections accepted so far
        self._pending: dict[int, socket.socket] = {}  # serial -> a connection not yet greeted, oldest first
        self._quiet_until = 0.0  # flood warnings are logged at most once a second
        self._owners: dict[int, int] = {}  # rank -> the connection that speaks for it
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
            self._serial += 1
            with self._lock:
                self._pending[self._serial] = conn
                oldest = None
                if len(self._pending) > MAX_PENDING:
                    oldest = self._pending.pop(next(iter(self._pending)))
            if oldest is not None:
                # Its reader sees the connection end and leaves; a rank's own greets within milliseconds.
                self._drop(f"a connection without the token: more than {MAX_PENDING} waiting", flood=True)
                _shut(oldest)
            t = threading.Thread(target=self._read, args=(conn, self._serial), name="beacon-read", daemon=True)
            t.start()
            self._threads = [*(x for x in self._threads if x.is_alive()), t]

    def _drop(self, why: str, flood: bool = False) -> None:
        with self._lock:
            self.dropped += 1
            now = time.monotonic()
            quiet = flood and now < self._quiet_until
            if flood and not quiet:
                self._quiet_until = now + 1.0
        if not quiet:
            log.warning("beacon server: dropped %s", why)

    def _greeted(self, serial: int) -> bool:
        """Move a connection from the pending ones to the greeted ones, when there is a slot for it."""
        with self._lock:
            if self._pending.pop(serial, None) is None:
                return False  # closed meanwhile for a newer connection
            full = self._open >= self.max_connections
            self._open += 0 if full else 1
        if full:
            self._drop(f"more than {self.max_connections} connections")
        return not full

    def _read(self, conn: socket.socket, serial: int) -> None:
        conn.settimeout(0.5)
        buf, greeted, rank, warned, link = b"", False, None, False, False
        deadline = time.monotonic() + GREETING_S
        try:
            with conn:
                while not self._stop.is_set():
                    if not greeted:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            self._drop(f"a connection that sent no token within {GREETING_S:g} s", flood=True)
                            return
                        conn.settimeout(min(left, 0.5))
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
                        self._drop(f"a connection sending a line over {MAX_LINE} bytes")
                        return
                    for line in lines:
                        if not greeted:
                            if not hmac.compare_digest(line.strip(), self.token.encode()):
                                self._drop("a connection without this attempt's token")
                                return
                            if not self._greeted(serial):
                                return
                            greeted = True
                            conn.settimeout(0.5)
                            continue
                        if rank is None and (states := decode_host_status(line, self.world_size)) is not None:
                            self._host_status(states)
                            link = True
                            continue
                        if rank is None and (use := decode_gpu_use(line, self.world_size)) is not None:
                            at = time.monotonic()
                            with self._lock:
                                self._gpu_use.update((r, (at, pct)) for r, pct in use.items())
                            link = True
                            continue
                        msg = decode_beacon(line, self.world_size)
                        if msg is not None and rank is None and not self._claim(msg[0], serial):
                            self._drop(f"a second connection speaking for rank {msg[0]}")
                            return
                        if msg is None or (rank is not None and msg[0] != rank):
                            self.dropped += 1
                            if not warned:
                                warned = True
                                log.warning("beacon server: dropped a malformed or out-of-range beacon: %.200r", line)
                            continue
                        rank = msg[0]
                        self._record(*msg)
        finally:
            with self._lock:
                if greeted:
                    self._open -= 1
                else:
                    self._pending.pop(serial, None)
                if link and not self._stop.is_set():  # another host's supervisor ended its part (or died)
                    self.lost_links.append(time.monotonic())

    def _host_status(self, states: dict[int, str]) -> None:
        """Another host's word on its ranks' processes: what ``psutil`` tells for this host's own."""
        with self._lock:
            for r, state in states.items():
                self.ranks.setdefault(r, RankProgress(r)).extra["state"] = state

    def _claim(self, rank: int, serial: int) -> bool:
        """A rank is spoken for by the first connection that names it, for the rest of the attempt."""
        with self._lock:
            return self._owners.setdefault(rank, serial) == serial

    def _pid_of_ours(self, pid: int) -> bool:
        """Whether ``pid`` is a process this supervisor started (the job's ranks descend from it)."""
        try:
            return any(p.pid == os.getpid() for p in psutil.Process(pid).parents())
        except (psutil.Error, ValueError):
            return False

    def _record(self, rank: int, step: int, phase: str, t: float, extra: dict[str, Any]) -> None:
        if "pid" in extra:
            known = self.ranks.get(rank)
            if (known and "pid" in known.extra and known.extra["pid"] != extra["pid"]) or not self._pid_of_ours(
                extra["pid"]
            ):
                if extra.get("host", self.node) == self.node:  # a process here that is not one of ours
                    self._drop(f"pid {extra['pid']} claimed by rank {rank}: not a process of this job")
                # Another host's rank: its pid means nothing here, and this supervisor never signals it.
                extra = {k: v for k, v in extra.items() if k != "pid"}
        with self._lock:
            p = self.ranks.setdefault(rank, RankProgress(rank))
            p.step, p.phase, p.time, p.received = step, phase, t, time.monotonic()
            p.extra.update(extra)
            if self.first_step_at is None and phase == "data":
                self.first_step_at, self.first_step = t, step
            if "cs" in extra:
                self._compute.append((rank, step, extra["cs"]))
            wanted = self.keep_reports and len(self._reports) < MAX_REPORTS  # a poll drains them; a flood is dropped
            if wanted and phase == "data" and step > 1 and ("l" in extra or "cw" in extra):
                self._reports.append(
                    StepReport(
                        rank,
                        step - 1,
                        p.host,
                        extra.get("l"),
                        extra.get("g"),
                        extra.get("dw"),
                        extra.get("cp"),
                        extra.get("cw"),
                        extra.get("df", 0.0),
                        extra.get("dv", 0.0),
                    )
                )
            if rank == 0 and phase == "data":
                if self._last_data_t is not None:
                    self._step_times.append(t - self._last_data_t)
                self._last_data_t = t

    def drain_compute(self) -> list[tuple[int, int, float]]:
        with self._lock:
            out, self._compute = self._compute, []
        return out

    def drain_reports(self) -> list[StepReport]:
        with self._lock:
            out, self._reports = self._reports, []
        return out

    def gpu_use(self, fresh_s: float = 20.0) -> dict[int, float]:
        """Rank → its GPU's recent utilization (%), as the other hosts' supervisors sent it in the last
        ``fresh_s`` (a host that went quiet has no figures)."""
        since = time.monotonic() - fresh_s
        with self._lock:
            return {r: pct for r, (at, pct) in self._gpu_use.items() if at >= since}

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
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


def _shut(conn: socket.socket) -> None:
    """End a connection another thread reads: its recv returns at once, and that thread closes it."""
    with contextlib.suppress(OSError):  # already ended by its peer
        conn.shutdown(socket.SHUT_RDWR)


class WatchdogLink:
    """Another host's connection to node 0's job watchdog, open while node 0's part of the attempt runs.

    It connects (retrying until ``within_s``), sends the token, then the state of this host's rank processes
    twice a second (node 0's watchdog cannot see them, so a stopped rank here is named as such there). Node 0's
    supervisor closes it when its part of the attempt ends, whether the ranks finished or its watchdog stopped
    them.
    ``ended_at`` is then set (monotonic clock), and this host's supervisor stops what is left of its job.
    """

    def __init__(
        self,
        address: str,
        token: str,
        within_s: float,
        states: Callable[[], dict[int, str]] | None = None,
        gpu_use: Callable[[], dict[int, float]] | None = None,
    ):
        host, port = address.rsplit(":", 1)
        self.states = states  # this host's ranks → alive | stopped | dead, sent about twice a second
        self.gpu_use = gpu_use  # this host's ranks → their GPUs' recent utilization, sent with them
        self.address, self._target, self._token = address, (host, int(port)), token
        self.deadline = time.monotonic() + within_s
        self.connected = False
        self.ended_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog-link", daemon=True)
        self._thread.start()

    @property
    def token(self) -> str:
        """The token this host's ranks greet node 0's watchdog with."""
        return self._token

    @property
    def never_connected(self) -> bool:
        return not self.connected and time.monotonic() > self.deadline

    def _run(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self.deadline:
            try:
                sock = socket.create_connection(self._target, timeout=2)
                break
            except OSError:
                self._stop.wait(0.5)
        else:
            return
        with sock:
            sock.sendall(self._token.encode() + b"\n")
            self.connected = True
            sock.settimeout(0.5)
            while not self._stop.is_set():
                try:
                    if self.states is not None:
                        sock.sendall(encode_host_status(self.states()))
                    if self.gpu_use is not None and (use := self.gpu_use()):
                        sock.sendall(encode_gpu_use(use))
                    if not sock.recv(1024):
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
        if not self._stop.is_set():
            self.ended_at = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)
