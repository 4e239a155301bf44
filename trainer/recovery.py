"""Recovery figures of a run that needed retries: what the faults cost."""

from __future__ import annotations

from typing import Any


def recovery_figures(incidents: list[dict[str, Any]], result: dict[str, Any], first_step_at: float | None, attempt: int) -> dict[str, Any]:
    """For the successful ``attempt`` after ``attempt - 1`` failed ones (the newest incidents):
    ``recoveries``, ``lost_steps`` (steps begun after the last commit, so computed again) and
    ``recovery_s`` (from the last fault's detection to this attempt's first step)."""
    attempts = [i for i in incidents if "time_epoch" in i]  # failed attempts, not warnings such as stragglers
    failed = attempts[-(attempt - 1):] if attempt > 1 else []
    resumed = [i.get("start_step") or 0 for i in failed[1:]] + [result.get("start_step", 0)]
    lost = sum(max(0, (i.get("last_step") or 0) - r) for i, r in zip(failed, resumed))
    last = failed[-1] if failed else None
    recovery_s = first_step_at - last["time_epoch"] if last and first_step_at and last.get("time_epoch") else 0.0
    first_start = (failed[0].get("start_step") or 0) if failed else result.get("start_step", 0)
    return {"recoveries": len(failed), "lost_steps": lost, "recovery_s": max(0.0, recovery_s),
            "steps_this_run": max(0, result.get("final_step", 0) - first_start)}


def goodput(steps: int, step_s: float, lost_steps: int, recovery_s: float, wall_s: float) -> dict[str, float]:
    """``goodput``: committed steps at their typical cost over the wall time; ``wasted_s``: what faults cost."""
    productive = steps * step_s
    return {"goodput": min(1.0, productive / wall_s) if wall_s > 0 else 0.0, "productive_s": productive,
            "wasted_s": lost_steps * step_s + recovery_s}
