"""desync: every live rank waits in a collective, but not in the same one (different step or kind: a skipped or
extra collective; said by the hang and crash checks through ``desync_of``); or a rank whose own mesh
coordinates (its first step's beacon) are not where the job's layout puts it (this module's check): its host
runs another profile, and its collectives will not meet the others'."""

from __future__ import annotations

from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.supervise.beacons import RankProgress
from trainpipe.trainer.supervise.checks.base import Check, CheckSpec, Poll, finding


class OffTheMesh(Check):
    def observe(self, poll: Poll) -> Incident | None:
        layout = self.watch.layout
        if layout is None:
            return None
        for r, p in sorted(poll.ranks.items()):
            said = p.extra.get("m")
            if said is not None and said != layout.place(r):
                return finding(
                    "desync",
                    r,
                    p,
                    f"rank {r} built its mesh at {said} (pp.dp_replicate.dp_shard.tp), the job's layout "
                    f"{layout.describe()} puts it at {layout.place(r)}: its host runs another profile",
                    0.0,
                    ranks=[r],
                )
        return None


def desync_of(ranks: dict[int, RankProgress], after: float) -> Incident | None:
    """A desync when every rank's last beacon is a collective but not the same one (a skipped or extra call)."""
    if len(ranks) < 2 or any(p.phase != "collective" for p in ranks.values()):
        return None
    positions = {r: position(p) for r, p in ranks.items()}
    if len(set(positions.values())) == 1:
        return None
    detail = "; ".join(f"rank {r} is in {describe(pos)}" for r, pos in sorted(positions.items()))
    first = min(positions, key=lambda r: positions[r])
    return finding("desync", first, ranks[first], f"collectives out of order: {detail}", after, ranks=sorted(positions))


def position(p: RankProgress) -> tuple[int, int, str]:
    """Where a rank waits: its step, the collective's number in the step, its kind."""
    return (p.step, int(p.extra.get("n", 0)), str(p.extra.get("c", "")))


def describe(pos: tuple[int, int, str]) -> str:
    step, n, kind = pos
    return f"collective #{n} ({kind or 'unknown'}) of step {step}"


CHECK = CheckSpec("off_the_mesh", 40, OffTheMesh)
