"""What every watchdog check is: built once per attempt from the ``Watch``, asked at every poll to ``observe``
the ``Poll`` and decide (docs/watchdog.md)."""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.incidents import Incident, Kind
from trainpipe.trainer.parallel_dims import Layout
from trainpipe.trainer.proc import node_name
from trainpipe.trainer.supervise.beacons import BeaconServer, RankProgress, StepReport
from trainpipe.trainer.supervise.rank_states import CpuUse


@dataclass
class Watch:
    """What the checks of one attempt's watchdog share: its settings, the beacons of its ranks and the job's
    shape. ``layout``: the ranks' parallel layout, when they form a mesh; ``local_gpu_use``: this host's ranks →
    their GPUs' recent utilization, when this host samples them; ``can_shrink``: whether a node may be left out
    of the next attempt (``profile_files.can_shrink``)."""

    cfg: WatchdogConfig
    beacons: BeaconServer
    world_size: int
    layout: Layout | None = None
    can_shrink: bool = False
    local_gpu_use: Callable[[], dict[int, float]] | None = None
    started: float = field(default_factory=time.monotonic)
    cpu: CpuUse = field(default_factory=CpuUse)  # this host's rank processes: computing, or idle

    def median_step_s(self) -> float | None:
        """Rank 0's median step interval of late, once there are three."""
        times = self.beacons.step_times()
        return statistics.median(times) if len(times) >= 3 else None


@dataclass
class Poll:
    """One look at the ranks: each one's last beacon, and what they reported since the last look (drained once,
    for every check): each finished step's figures, and each step's compute time."""

    now: float
    ranks: dict[int, RankProgress]
    reports: list[StepReport]
    compute: list[tuple[int, int, float]]  # (rank, step, compute seconds)
    kept: list[Incident] = field(default_factory=list)

    def keep(self, incident: Incident) -> None:
        """A finding to keep with the watchdog's (a warning; or a fatal one that is also returned)."""
        self.kept.append(incident)


class Check(ABC):
    """One fault check. ``observe`` returns the finding that ends the attempt, or None; it keeps warnings with
    ``poll.keep``. ``last_look`` runs once the job has ended (what a poll did not reach); ``windows`` are its
    figures per window of steps (``{"step": last step, ...}``), for the run's metrics."""

    def __init__(self, watch: Watch):
        self.watch = watch

    @abstractmethod
    def observe(self, poll: Poll) -> Incident | None: ...

    def last_look(self, poll: Poll) -> None:
        return None

    @property
    def windows(self) -> list[dict[str, Any]] | None:
        return None


@dataclass(frozen=True)
class CheckSpec:
    """A check's module registers one: its name, its place in a poll (a lower ``order`` is asked first, so its
    fatal finding ends the attempt before a later one's), and how it is built."""

    name: str
    order: int
    build: Callable[[Watch], Check]


def finding(kind: Kind, rank: int | None, p: RankProgress | None, detail: str, after: float, **more: Any) -> Incident:
    """An incident about ``rank`` as its last beacon ``p`` placed it."""
    return Incident(
        kind=kind,
        rank=rank,
        node=(p.host if p else None) or node_name(),
        step=p.step if p and p.step > 0 else None,  # -1: the start beacon, before any step
        phase=p.phase if p else "start",
        detail=detail,
        detected_after_s=round(after, 3),
        **more,
    )
