"""Recovery figures of a run that needed retries: what the faults cost."""

from __future__ import annotations

from typing import Any


def recovery_figures(incidents: list[dict[str, Any]], result: dict[str, Any], first_step_at: float | None, attempt: int) -> dict[str, Any]:
    """For the successful ``attempt`` after ``attempt - 1`` failed ones (the newest attempt incidents):
    ``recoveries``; ``lost_steps`` (steps begun after the last commit, so computed again); ``recovery_s``
    (from the last fault's detection to this attempt's first step); and the same per failed attempt."""
    attempts = [i for i in incidents if "time_epoch" in i]  # failed attempts, not warnings such as stragglers
    failed = attempts[-(attempt - 1):] if attempt > 1 else []
    resumed = [i.get("start_step") or 0 for i in failed[1:]] + [result.get("start_step", 0)]
    next_first = [i.get("first_step_at") for i in failed[1:]] + [first_step_at]
    per = []
    for inc, r, nxt in zip(failed, resumed, next_first):
        gap = nxt - inc["time_epoch"] if nxt and inc.get("time_epoch") else 0.0
        per.append({"time_epoch": inc.get("time_epoch"), "lost_steps": max(0, (inc.get("last_step") or 0) - r),
                    "recovery_s": max(0.0, gap)})
    first_start = (failed[0].get("start_step") or 0) if failed else result.get("start_step", 0)
    return {"recoveries": len(failed), "lost_steps": sum(p["lost_steps"] for p in per),
            "recovery_s": per[-1]["recovery_s"] if per else 0.0, "per_incident": per,
            "steps_this_run": max(0, result.get("final_step", 0) - first_start)}


def goodput(steps: int, step_s: float, per_incident: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """``goodput``: committed steps at their typical cost over the wall time; ``wasted_s``: what each fault
    cost (its lost steps at the typical step time plus the time until training ran again), and in total."""
    productive = steps * step_s
    wasted = [p["lost_steps"] * step_s + p["recovery_s"] for p in per_incident]
    return {"goodput": min(1.0, productive / wall_s) if wall_s > 0 else 0.0, "productive_s": productive,
            "wasted_s": sum(wasted), "wasted_per_incident_s": wasted}
