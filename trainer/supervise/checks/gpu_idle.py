"""gpu_idle: the GPUs near 0% busy while the steps slowed down (``trainer.supervise.gpu_use``), when this host
samples its GPUs; a warning, looked at once a second at most (the samplers sample every 2 s)."""

from __future__ import annotations

import logging

from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.supervise.checks.base import Check, CheckSpec, Poll, Watch
from trainpipe.trainer.supervise.gpu_use import GpuIdle

log = logging.getLogger("trainpipe.supervisor")


class GpuIdleCheck(Check):
    def __init__(self, watch: Watch):
        super().__init__(watch)
        self.gpu_idle, self.checked, self.sampling = GpuIdle(watch.cfg), 0.0, watch.local_gpu_use

    def observe(self, poll: Poll) -> Incident | None:
        if self.sampling is None or self.gpu_idle.flagged or poll.now - self.checked < 1.0:
            return None
        self.checked = poll.now
        beacons = self.watch.beacons
        try:
            use = {**beacons.gpu_use(), **self.sampling()}
            quiet = any(p.phase in ("checkpoint", "eval") for p in poll.ranks.values())
            hosts = {r: p.host for r, p in poll.ranks.items()}
            found = self.gpu_idle.check(beacons.step_times(), use, hosts, quiet)
        except Exception as exc:  # noqa: BLE001 - a sensor's trouble is never the job's: stop looking, say why
            log.warning("the gpu_idle check is off for this attempt (%s)", exc)
            self.sampling = None
            return None
        if found is not None:
            poll.keep(found)
        return None


CHECK = CheckSpec("gpu_idle", 90, GpuIdleCheck)  # last: a warning never delays the checks that end an attempt
