"""crash: a worker process is gone while the job still runs (a rank that finished is not); when the backend
aborted on mismatched collectives rather than hang, a desync."""

from __future__ import annotations

import time

from trainpipe.trainer.incidents import Incident, ranks_text
from trainpipe.trainer.supervise.checks.base import Check, CheckSpec, Poll, finding
from trainpipe.trainer.supervise.checks.desync import desync_of
from trainpipe.trainer.supervise.rank_states import rank_state


class Crash(Check):
    def observe(self, poll: Poll) -> Incident | None:
        ranks = poll.ranks
        dead = sorted(r for r, p in ranks.items() if p.phase != "finish" and rank_state(p) == "dead")
        if not dead:
            return None
        desync = desync_of(ranks, time.monotonic() - ranks[dead[0]].received)
        if desync is not None:  # the backend aborted on mismatched collectives rather than hang
            return desync
        # By the time we look, torchrun may already have stopped the survivors: list every dead rank; the
        # first to stop beaconing is the likelier origin (torchrun's root-cause report decides, when it has one).
        r = min(dead, key=lambda k: ranks[k].received)
        p = ranks[r]
        return finding(
            "crash",
            r,
            p,
            f"rank(s) {ranks_text(dead)} exited; rank {r} (pid {p.extra.get('pid')}) last reported step {p.step} "
            f"phase {p.phase}",
            time.monotonic() - p.received,
            ranks=dead,
        )


CHECK = CheckSpec("crash", 30, Crash)
