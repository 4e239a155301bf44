"""The state of a rank's process, as this host sees it or as its host's supervisor said: alive, idle, stopped or
dead (the watchdog's hang and crash checks, and each host's progress to node 0)."""

from __future__ import annotations

import socket
import time

import psutil

from trainpipe.trainer.supervise.beacons import RankProgress


def rank_state(p: RankProgress) -> str:
    """alive | stopped | dead for a rank on this host, or as its host's supervisor reports it (else alive)."""
    if p.extra.get("state") in ("stopped", "dead"):
        return p.extra["state"]
    pid = p.extra.get("pid")
    if not pid or p.extra.get("machine", p.extra.get("host")) not in (None, socket.gethostname()):
        return "alive"
    try:
        return process_state(psutil.Process(int(pid)))
    except psutil.NoSuchProcess:
        return "dead"


def process_state(proc: psutil.Process) -> str:
    status = proc.status()
    if status == psutil.STATUS_ZOMBIE or status == psutil.STATUS_DEAD:
        return "dead"
    return "stopped" if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP) else "alive"


class CpuUse:
    """Whether a process used the CPU between two looks at it, at least ``MIN_LOOK_S`` apart (a later look
    starts a new span; one older than ``STALE_S`` only restarts the clock: it would count work from before)."""

    MIN_LOOK_S = 0.2
    STALE_S = 3.0
    IDLE_SHARE = 0.05  # of one CPU: a computing rank uses about one; one waiting on a lock or a socket, ~0

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, float]] = {}  # pid -> (monotonic, CPU seconds) at the last look

    def idle(self, proc: psutil.Process) -> bool | None:
        """True or False since the last look; None at a first or stale look (the clock starts)."""
        now, times = time.monotonic(), proc.cpu_times()
        used = times.user + times.system
        before = self._last.get(proc.pid)
        if before is not None and now - before[0] < self.MIN_LOOK_S:
            return None
        self._last[proc.pid] = (now, used)
        if before is None or now - before[0] > self.STALE_S:
            return None
        return (used - before[1]) / (now - before[0]) < self.IDLE_SHARE


def local_rank_states(cpu: CpuUse | None = None) -> dict[int, str]:
    """rank → alive | idle | stopped | dead of this supervisor's rank processes (named ``trainpipe-r{RANK}``);
    idle (no CPU used since the last call) only with ``cpu``, which remembers the calls."""
    states = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            name = proc.name()
            if name.startswith("trainpipe-r") and name[11:].isdigit():
                state = process_state(proc)
                if state == "alive" and cpu is not None and cpu.idle(proc):
                    state = "idle"
                states[int(name[11:])] = state
        except psutil.Error:
            continue
    return states
