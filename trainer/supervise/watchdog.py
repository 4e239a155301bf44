"""The supervisor's watchdog: polls the ranks' beacons and asks each fault check whether the attempt must end.

It runs in the supervising process (outside the training ranks), is polled every ``watchdog.poll_s`` while the
job runs, and never touches the ranks except to name them. Every finding is an ``Incident``. The checks are
``trainer/supervise/checks/``, one file each (hang and exit, desync, crash, a lost host, straggler, loss health,
network and data stalls, GPU idle); each poll drains what the ranks reported once, asks the checks in their
order and stops at the first finding that ends the attempt. Under a ``parallel`` layout every incident about a
rank carries its mesh coordinates, and its line says where the rank sits (a hang names its pipeline stage).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.parallel_dims import Layout
from trainpipe.trainer.supervise.beacons import BeaconServer
from trainpipe.trainer.supervise.checks import check_specs
from trainpipe.trainer.supervise.checks.base import CheckSpec, Poll, Watch


class Watchdog:
    def __init__(
        self,
        cfg: WatchdogConfig,
        beacons: BeaconServer,
        world_size: int,
        can_shrink: bool = False,
        local_gpu_use: Callable[[], dict[int, float]] | None = None,
        layout: Layout | None = None,
        specs: list[CheckSpec] | None = None,
    ):
        """``local_gpu_use``: this host's ranks → their GPUs' recent utilization, when this host samples them;
        ``layout``: the ranks' parallel layout (where each rank sits in the mesh); ``specs``: the checks (by
        default, every one in ``trainer/supervise/checks/``), asked in their order."""
        meshed = layout if layout is not None and layout.meshed and layout.world_size == world_size else None
        self.watch = Watch(cfg, beacons, world_size, meshed, can_shrink, local_gpu_use)
        chosen = check_specs() if specs is None else sorted(specs, key=lambda s: (s.order, s.name))
        self.checks = [spec.build(self.watch) for spec in chosen]
        self.findings: list[Incident] = []  # what the checks kept: warnings, and fatal findings said as they came
        beacons.keep_reports = True

    def check(self) -> Incident | None:
        """Called every poll; returns a fatal finding, or None to keep going."""
        poll = self._poll()
        incident = None
        for check in self.checks:
            if (incident := check.observe(poll)) is not None:
                break
        self._keep(poll, incident)
        return incident

    def last_look(self) -> None:
        """After the job: what the polls did not reach (a fast attempt ends between two)."""
        poll = self._poll()
        for check in self.checks:
            check.last_look(poll)
        self._keep(poll, None)

    def windows(self) -> list[dict[str, Any]]:
        """Each window of steps the first check that keeps windows scored (the stragglers'), with the others'
        figures for the same window (where the time went)."""
        kept = [w for check in self.checks if (w := check.windows) is not None]
        if not kept:
            return []
        others = [{w["step"]: w for w in windows} for windows in kept[1:]]
        return [{**{k: v for o in others for k, v in o.get(w["step"], {}).items()}, **w} for w in kept[0]]

    def _poll(self) -> Poll:
        beacons = self.watch.beacons
        return Poll(time.monotonic(), beacons.snapshot(), beacons.drain_reports(), beacons.drain_compute())

    def _keep(self, poll: Poll, incident: Incident | None) -> None:
        self.findings += poll.kept
        for f in [*poll.kept, *([incident] if incident else [])]:
            self._place(f)

    def _place(self, incident: Incident) -> None:
        """Under a layout: the culprit's mesh coordinates on the incident, and its place in the line (once)."""
        layout = self.watch.layout
        if layout is None or incident.rank is None or incident.mesh is not None:
            return
        incident.mesh = layout.coordinates(incident.rank)
        incident.detail += f" [rank {incident.rank}: {place(layout, incident.rank)}]"


def place(layout: Layout, rank: int) -> str:
    """Where ``rank`` sits in ``layout``, e.g. ``pipeline stage 2 of 4, tp 1 of 2, dp_shard 0 of 8``."""
    coords = layout.coordinates(rank)
    parts = [f"pipeline stage {coords['pp']} of {layout.pp}"] if layout.pp > 1 else []
    parts += [f"{n} {coords[n]} of {s}" for n, s in zip(Layout.NAMES[1:], layout.sizes[1:], strict=True) if s > 1]
    return ", ".join(parts)
