"""The checkpoint interval's arithmetic (Young 1974, Daly 2006): shared by the ranks' schedule
(``trainer.loop.checkpoint_schedule``) and the run summary's what-if figures."""

from __future__ import annotations

import math


def young_daly_s(blocking_s: float, mtbf_s: float) -> float:
    """The checkpoint interval in seconds that loses the least expected time to saves and failures."""
    if blocking_s <= 0:
        blocking_s = 1e-3  # a save that costs nothing measurable: still not every instant
    if blocking_s >= 2 * mtbf_s:
        return mtbf_s
    return math.sqrt(2 * blocking_s * mtbf_s) - blocking_s


def expected_cost_s(interval_s: float, blocking_s: float, failures: int, training_s: float) -> float:
    """Seconds lost at one interval: a save's blocking every interval, and half an interval of work per failure
    (the work since the last commit, on average)."""
    return training_s / interval_s * blocking_s + failures * interval_s / 2 if interval_s > 0 else math.inf
