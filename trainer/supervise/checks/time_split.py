"""network, data_stall: where each rank's step time went, from the figures its beacons carry for each step it
finished (``trainer.supervise.time_split``): collectives slower than the others' (a slow link), or the steps'
time going to waiting for data."""

from __future__ import annotations

from typing import Any

from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.supervise.checks.base import Check, CheckSpec, Poll, Watch
from trainpipe.trainer.supervise.time_split import TimeSplit


class WhereTheTimeWent(Check):
    def __init__(self, watch: Watch):
        super().__init__(watch)
        self.split = TimeSplit(watch.cfg, watch.world_size)

    @property
    def windows(self) -> list[dict[str, Any]]:
        return self.split.windows

    def observe(self, poll: Poll) -> Incident | None:
        for report in poll.reports:
            self.split.observe(report)
        found = self.split.check()
        for f in found:
            poll.keep(f)
        return next((f for f in found if f.fatal), None)


CHECK = CheckSpec("time_split", 21, WhereTheTimeWent)
