"""loss_spike, flatline: rank 0's loss and gradient norm of each step it finished, as its beacons carry them
(``trainer.loss_health``). The ranks check what ends an attempt (a spike under 'rollback'); this check, what
only warns (``checked_by_watchdog``)."""

from __future__ import annotations

from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.loss_health import checked_by_watchdog
from trainpipe.trainer.supervise.checks.base import Check, CheckSpec, Poll, Watch


class LossHealth(Check):
    def __init__(self, watch: Watch):
        super().__init__(watch)
        self.health = checked_by_watchdog(watch.cfg)

    def observe(self, poll: Poll) -> Incident | None:
        if self.health is None:
            return None
        fatal = None
        for report in poll.reports:
            if report.rank == 0 and report.loss is not None:
                found = self.health.observe(report.step, report.loss, report.grad_norm, report.host)
                if found is not None:
                    poll.keep(found)
                    fatal = fatal or (found if found.fatal else None)
        return fatal


CHECK = CheckSpec("loss_health", 20, LossHealth)
