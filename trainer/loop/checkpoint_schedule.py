"""When the loop commits a checkpoint: every N steps, or at the Young/Daly interval from measured costs.

With a save that blocks training for δ seconds and failures every M seconds on average, the interval that loses
the least time to both is about τ = √(2δM) − δ (Young 1974, with Daly's 2006 first-order correction; valid for
δ < 2M, and once per M beyond). ``checkpoint.every_steps: auto`` measures δ (the slowest rank's median blocking
time of its saves so far) and the step time while training, and sets the interval in steps: first a few steps
in (taking one step's time as δ until a save has been measured), then after every save. Every rank uses the
same figures (``agree``: the maximum over the ranks), so every rank saves at the same step. The interval is never
shorter than a save takes from its start to its commit: a save asked for while the previous one still uploads is
skipped (``Checkpointer.save``), after waiting for it up to a second, so an interval below that buys nothing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from trainpipe.trainer.checkpoint.interval import young_daly_s

PROBE_STEPS = 5  # steps timed before auto's first decision (the first step is warm-up)


class CheckpointSchedule:
    """Which steps save. ``every``: a number of steps, or ``"auto"``; ``agree`` turns this rank's figures into
    the ones every rank uses (an all-reduce of the maximum)."""

    def __init__(
        self, every: int | str, mtbf_s: float, start_step: int, agree: Callable[[list[float]], list[float]]
    ) -> None:
        self.auto = every == "auto"
        self.every_steps: int | None = None if self.auto else int(every)
        self.mtbf_s, self.agree = mtbf_s, agree
        self._next: int | None = start_step + PROBE_STEPS if self.auto else None
        self._decided_with = 0  # saves measured at the last decision

    def due(self, step: int) -> bool:
        """Save after ``step``? (The final step always saves: the loop says so itself.)"""
        if not self.auto:
            return step % self.every_steps == 0  # type: ignore[operator]
        return self._next is not None and step >= self._next and self.every_steps is not None

    def observe(
        self,
        step: int,
        step_times_s: list[float],
        stalls_s: list[float],
        costs_s: list[float] | None = None,
        durations_s: list[float] | None = None,
    ) -> None:
        """After ``step`` (every step: cheap unless a decision is due): decide the interval when auto's probe
        ends, and again after each save (``stalls_s``: this rank's blocking time per save so far, which every
        rank has as many of at a step). ``costs_s``: what a save costs training when that is more than its
        blocking time (the saves this rank has seen committed so far; any number: the ranks agree on the
        figure, not on the list). ``durations_s``: each committed save's time from its start to its commit (any
        number), the floor of the interval."""
        if not self.auto or self._next is None or step < self._next:
            return
        if self.every_steps is not None and len(stalls_s) <= self._decided_with:
            return  # the due step's save has not been measured yet
        step_s = statistics.median(step_times_s) if step_times_s else 0.0
        paid = costs_s or stalls_s
        blocking = statistics.median(paid) if paid else step_s  # before any save: one step's time
        took = statistics.median(durations_s) if durations_s else 0.0
        blocking, step_s, took = self.agree([blocking, step_s, took])
        self._decided_with = len(stalls_s)
        interval_s = young_daly_s(blocking, self.mtbf_s)
        self.every_steps = max(1, round(interval_s / step_s), math.ceil(took / step_s)) if step_s > 0 else 1
        self._next = step + self.every_steps
