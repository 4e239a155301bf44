"""straggler: a rank's typical compute time in a window of steps (the median, not the mean: a few slow steps,
such as those beside a checkpoint commit, are not a slow rank; its time waiting in collectives does not count)
over ``straggler_factor`` × the median of the other ranks (leave-one-out, so a slow rank at world size 2 is not
half of its own baseline) for ``straggler_patience`` windows. Under a ``parallel`` layout a rank is compared with
its data-parallel peers only (the same pipeline stage and tp index: the same work); the ranks of a replica (its
tp ranks and pipeline stages) wait on each other inside a step, so when they are slow together they are named
together, not the one that waits."""

from __future__ import annotations

import logging
import statistics
from typing import Any

from trainpipe.trainer.incidents import Incident, ranks_text
from trainpipe.trainer.proc import node_name
from trainpipe.trainer.supervise.checks.base import Check, CheckSpec, Poll, Watch

log = logging.getLogger("trainpipe.supervisor")


class Stragglers(Check):
    def __init__(self, watch: Watch):
        super().__init__(watch)
        self._compute: dict[int, dict[int, float]] = {}  # rank -> step -> compute seconds
        self._latest: dict[int, int] = {}  # rank -> the last step it reported compute for
        self._next_window: int | None = None
        self._strikes: dict[int, int] = {}
        self._flagged: set[int] = set()
        self._no_peers_said = False
        self.scores: list[dict[str, Any]] = []  # per window: last step, compute / others' median, compute ms

    @property
    def windows(self) -> list[dict[str, Any]]:
        return self.scores

    def observe(self, poll: Poll) -> Incident | None:
        flagged = self._score(poll)
        return flagged if flagged is not None and flagged.fatal else None

    def last_look(self, poll: Poll) -> None:
        """After the job: score the full windows the polls did not reach (a fast attempt ends between two)."""
        self._score(poll)

    def _score(self, poll: Poll) -> Incident | None:
        """Score each full window of ``straggler_window`` steps once every rank has reported all of it."""
        for rank, step, compute_s in poll.compute:
            self._compute.setdefault(rank, {})[step] = compute_s
            self._latest[rank] = max(self._latest.get(rank, 0), step)
        w, cfg = self.watch.cfg.straggler_window, self.watch.cfg
        if len(self._latest) < self.watch.world_size:
            return None
        if self._next_window is None:  # skip the window holding the attempt's first (warm-up) step
            self._next_window = (min(min(s) for s in self._compute.values()) - 1) // w + 1
        reached = min(self._latest.values())
        flagged = None
        while (self._next_window + 1) * w <= reached:
            lo, hi = self._next_window * w + 1, (self._next_window + 1) * w
            self._next_window += 1
            typical = {
                r: statistics.median(v)
                for r, steps in self._compute.items()
                if (v := [c for s, c in steps.items() if lo <= s <= hi])
            }
            for steps in self._compute.values():  # scored: keep memory and each poll's work flat over a run
                for s in [s for s in steps if s <= hi]:
                    del steps[s]
            if len(typical) < self.watch.world_size:
                continue
            baseline = self._peer_medians(typical)
            scores = {r: m / baseline[r] if baseline[r] > 0 else 1.0 for r, m in typical.items()}
            self.scores.append(
                {
                    "step": hi,
                    "score": {r: round(v, 4) for r, v in scores.items()},
                    "compute_ms": {r: round(m * 1000, 3) for r, m in typical.items()},
                }
            )
            struck = []
            for r, score in sorted(scores.items()):
                self._strikes[r] = self._strikes.get(r, 0) + 1 if score > cfg.straggler_factor else 0
                if self._strikes[r] >= cfg.straggler_patience and r not in self._flagged:
                    struck.append(r)
            for group in self._replica_groups(struck):
                self._flagged.update(group)
                flagged = self._straggler(group, scores, typical, baseline, hi)
                poll.keep(flagged)
        return flagged

    def _peer_medians(self, typical: dict[int, float]) -> dict[int, float]:
        """Each rank's baseline: the median of its peers' typical compute (leave-one-out); under a layout its
        data-parallel peers only (same pipeline stage and tp index), and its own when it has none."""
        layout = self.watch.layout
        if layout is None:
            return leave_one_out_medians(typical)
        groups: dict[tuple[int, int], dict[int, float]] = {}
        for r, m in typical.items():
            c = layout.coordinates(r)
            groups.setdefault((c["pp"], c["tp"]), {})[r] = m
        if any(len(g) == 1 for g in groups.values()) and not self._no_peers_said:
            self._no_peers_said = True
            log.info("stragglers: no data-parallel peers to compare ranks with under %s", layout.describe())
        return {r: m for g in groups.values() for r, m in leave_one_out_medians(g).items()}

    def _replica_groups(self, struck: list[int]) -> list[list[int]]:
        """The ranks flagged in one window, those of one data-parallel replica together: its tensor-parallel ranks
        and pipeline stages wait on each other (tp collectives, pipeline sends, neither timed apart from
        compute), so a slow one makes them slow together. One list per incident."""
        if self.watch.layout is None:
            return [[r] for r in struck]
        groups: dict[tuple[int, int], list[int]] = {}
        for r in struck:
            c = self.watch.layout.coordinates(r)
            groups.setdefault((c["dp_replicate"], c["dp_shard"]), []).append(r)
        return list(groups.values())

    def _straggler(
        self, group: list[int], scores: dict[int, float], typical: dict[int, float], baseline: dict[int, float],
        step: int,
    ) -> Incident:  # fmt: skip
        """The straggler incident of ``group``: one rank, or a tensor-parallel group slow together."""
        cfg = self.watch.cfg
        r, w = group[0], cfg.straggler_window
        peers = "its data-parallel peers" if self.watch.layout is not None else "the other ranks"
        if len(group) == 1:
            detail = (
                f"rank {r} computes {scores[r]:.2f}x the median of {peers} "
                f"({typical[r] * 1000:.0f} ms vs {baseline[r] * 1000:.0f} ms a step) "
                f"for {self._strikes[r]} windows of {w} steps; policy {cfg.on_straggler}"
            )
        else:
            detail = (
                f"ranks {ranks_text(group)} of one data-parallel replica compute {scores[r]:.2f}x the median of "
                f"{peers} ({typical[r] * 1000:.0f} ms vs {baseline[r] * 1000:.0f} ms a step) for "
                f"{self._strikes[r]} windows of {w} steps: they wait on each other (tensor-parallel collectives, "
                f"pipeline sends), so which of them is slow is not told apart; policy {cfg.on_straggler}"
            )
        snapshot = self.watch.beacons.snapshot()
        hosts = sorted({h for x in group if (h := snapshot[x].host if x in snapshot else None)})
        # 'exclude' needs a smaller world to relaunch on; with no node to spare it only warns.
        fatal = cfg.on_straggler == "abort" or (cfg.on_straggler == "exclude" and self.watch.can_shrink)
        if fatal and cfg.on_straggler == "exclude" and len(hosts) > 1:  # no one node to leave out
            fatal = False
            detail += f"; they span hosts {', '.join(hosts)}, so no node is excluded"
        return Incident(
            kind="straggler",
            rank=r,
            node=hosts[0] if hosts else node_name(),
            step=step,
            phase="compute",
            detail=detail,
            detected_after_s=0.0,
            fatal=fatal,
            ranks=group,
        )


def leave_one_out_medians(values: dict[int, float]) -> dict[int, float]:
    """For each key, the median of the other keys' values (its own when it is alone): O(n log n), so that a
    window of thousands of ranks is scored within a poll."""
    order = sorted(values, key=values.__getitem__)
    v = [values[k] for k in order]
    n = len(v)
    if n == 1:
        return {order[0]: v[0]}
    out = {}
    for i, k in enumerate(order):
        # the others, in order, are v without index i: their j-th is v[j] below i, v[j + 1] from i on
        def nth(j: int, i: int = i) -> float:
            return v[j] if j < i else v[j + 1]

        m = n - 1
        out[k] = nth(m // 2) if m % 2 else (nth(m // 2 - 1) + nth(m // 2)) / 2
    return out


CHECK = CheckSpec("straggler", 10, Stragglers)
