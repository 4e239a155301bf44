"""crash, before the job started: another host's supervisor closed its link before every rank started. That
host gave up (its agent could not join the rendezvous, its part failed) and the job cannot start, so this is
said at once rather than after ``watchdog.startup_timeout_s``; its own part of the attempt says why."""

from __future__ import annotations

from trainpipe.trainer.incidents import Incident, ranks_text
from trainpipe.trainer.supervise.checks.base import Check, CheckSpec, Poll


class LostHost(Check):
    def observe(self, poll: Poll) -> Incident | None:
        lost = self.watch.beacons.lost_links
        if not lost or len(poll.ranks) == self.watch.world_size:
            return None
        missing = sorted(set(range(self.watch.world_size)) - set(poll.ranks))
        detail = (
            "another host's supervisor ended before the job started (its link to node 0 closed); "
            f"rank(s) {ranks_text(missing)} never reported: that host gave up, see its part of the attempt"
        )
        # No node is named: node 0 only knows another host went away, not which (its own part names it).
        return Incident(
            kind="crash", detail=detail, phase="start", detected_after_s=round(poll.now - lost[0], 3), ranks=missing
        )


CHECK = CheckSpec("lost_host", 50, LostHost)
