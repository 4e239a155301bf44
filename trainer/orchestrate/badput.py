"""Where a pipeline run's wall time went (docs/architecture.md §6): productive training and badput buckets.

After Google's ml-goodput-measurement taxonomy, adapted to this pipeline. The flow marks its critical path as
consecutive segments (``Marks``); the train segment is split by the attempts' records (``AttemptRecord``: when
each was launched, its first step, the fault, its detection and its end) and the final attempt's result (rank
0's restore, data wait, checkpoint blocking and evaluation seconds, and its last commit). Every second between
the run's start and its report is in exactly one bucket or in productive time; what a record cannot place (an
attempt recorded by an older version, clocks that disagree) is ``other``.

Buckets:
- orchestration: the command's and the flow's start (Prefect's embedded server included), opening the MLflow
  run, the train task's start and its retry delays, the report;
- shard, preflight, validate, publish: those stages, where they are on the critical path (preflight runs beside the
  sharding: only the wait for its result counts);
- queue: a cluster job's wait for its allocation (Slurm) or its pods' scheduling (Kubernetes): from the
  attempt's launch until its last host's supervisor started (``AttemptRecord.started_at``);
- startup: an attempt's launch (or the end of its queue) to its first step (imports, rendezvous, process group,
  model build), less restore;
- restore: loading the checkpoint an attempt resumes from;
- data_wait, checkpoint, evaluation: inside the final attempt's steps, rank 0's wait for batches, the time the
  loop was blocked by saves, and the evaluations;
- wasted_progress: steps a failed attempt trained after its last commit (trained again by the next one);
- detection: from the fault (the culprit's last beacon) to the incident;
- teardown: from the incident (or the final commit) to the attempt's end.

In a failed attempt, restore is part of startup; its data wait, saves and evaluations come from rank 0's running
totals in its last step's beacon (``AttemptRecord.data_wait_s`` …), so those of its last step are not in them.
They come out of the steps it kept first, then out of the wasted ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from trainpipe.trainer.incidents import AttemptRecord
from trainpipe.trainer.protocol import TrainResult

BUCKETS: tuple[str, ...] = (
    "orchestration",
    "shard",
    "preflight",
    "queue",
    "startup",
    "restore",
    "data_wait",
    "checkpoint",
    "evaluation",
    "wasted_progress",
    "detection",
    "teardown",
    "validate",
    "publish",
    "other",
)

_invoked_at: float | None = None


def mark_invoked(at: float | None) -> None:
    """The command that runs the flow in this process started at ``at`` (``trainpipe run``'s process start;
    None: forget it)."""
    global _invoked_at
    _invoked_at = at


def invoked_at(default: float) -> float:
    """When the command running this flow started, if it said so and it is plausible; else ``default``."""
    at = _invoked_at
    return at if at is not None and default - 3600 <= at <= default else default


@dataclass
class Marks:
    """The flow's critical path: ``close(bucket)`` ends the segment begun at the previous mark (or ``start``)."""

    start: float
    segments: list[tuple[str, float, float]] = field(default_factory=list)

    def close(self, bucket: str, at: float | None = None) -> None:
        begun = self.segments[-1][2] if self.segments else self.start
        end = max(begun, time.time() if at is None else at)
        self.segments.append((bucket, begun, end))


@dataclass
class Badput:
    """Seconds per bucket for the run and for each attempt; productive time; the wall they add up to."""

    wall_s: float
    productive_s: float
    buckets: dict[str, float]
    attempts: list[dict[str, float]]  # per attempt: {"attempt", "productive", bucket: seconds}

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def closure(self) -> float:
        """(productive + buckets) / wall: 1.0 when every second is accounted for once."""
        return (self.productive_s + sum(self.buckets.values())) / self.wall_s if self.wall_s > 0 else 1.0

    def as_dict(self) -> dict[str, object]:
        return {
            "wall_s": round(self.wall_s, 3),
            "productive_s": round(self.productive_s, 3),
            "buckets": {k: round(v, 3) for k, v in self.buckets.items()},
            "attempts": [{k: round(v, 3) for k, v in a.items()} for a in self.attempts],
        }


def _clamp(at: float | None, lo: float, hi: float) -> float | None:
    return None if at is None else _bound(at, lo, hi)


def _bound(at: float, lo: float, hi: float) -> float:
    return min(max(at, lo), hi)


def _failed_attempt(rec: AttemptRecord, start: float, lost_steps: int, step_s: float) -> dict[str, float]:
    """A failed attempt from its launch (``start``) to its end: startup, kept and wasted steps, detection,
    teardown."""
    end = max(start, rec.ended_at)
    detected = _clamp(rec.incident.at if rec.incident else None, start, end) or end
    first = _clamp(rec.first_step_at, start, detected)
    queued = (_clamp(rec.started_at, start, first or detected) or start) - start
    row = {"queue": queued, "startup": (first or detected) - start - queued, "teardown": end - detected}
    if first is not None:
        fault = _clamp(rec.fault_at, first, detected) or detected
        trained = fault - first
        wasted = min(trained, lost_steps * step_s)
        parts = _within(
            trained,
            {
                "data_wait": rec.data_wait_s or 0.0,
                "checkpoint": rec.checkpoint_s or 0.0,
                "evaluation": rec.eval_s or 0.0,
            },
        )
        from_kept = min(sum(parts.values()), trained - wasted)
        row.update(parts)
        row["wasted_progress"] = wasted - (sum(parts.values()) - from_kept)
        row["productive"] = trained - wasted - from_kept
        row["detection"] = detected - fault
    return row


def _within(span: float, parts: dict[str, float]) -> dict[str, float]:
    """``parts`` of a span, scaled down to fit it (clocks or overlapping measures: never more than the span)."""
    overlap = max(0.0, sum(parts.values()) - span)
    return {k: v * (span / (span + overlap)) for k, v in parts.items()} if overlap else parts


def _final_attempt(rec: AttemptRecord, start: float, result: TrainResult) -> dict[str, float]:
    """The attempt that completed, from its launch (``start``): startup and restore, its steps split by what
    rank 0 measured, teardown."""
    end = max(start, rec.ended_at)
    if result.started_at is None or not result.step_starts_s:  # nothing trained (a retry after the final commit)
        queued = (_clamp(rec.started_at, start, end) or start) - start
        return {"queue": queued, "startup": end - start - queued}
    first = _bound(result.started_at + result.step_starts_s[0], start, end)
    committed = _bound(result.started_at + result.attempt_s, first, end)
    queued = (_clamp(rec.started_at, start, first) or start) - start
    restore = min(result.restore_s, first - start - queued)
    stalls = sum(result.checkpoint_stalls_s)
    steps = committed - first
    parts = _within(
        steps,
        {
            "data_wait": min(result.data_wait_s, steps),
            "checkpoint": min(stalls, steps),
            "evaluation": min(result.eval_s, steps),
        },
    )
    return {
        "queue": queued,
        "startup": first - start - queued - restore,
        "restore": restore,
        **parts,
        "productive": steps - sum(parts.values()),
        "teardown": end - committed,
    }


def account(
    marks: Marks,
    end: float,
    attempts: list[AttemptRecord],
    result: TrainResult,
    lost_steps: list[int],
    step_s: float,
) -> Badput:
    """The run's badput from the flow's ``marks`` (a ``train`` segment among them), this pipeline run's
    ``attempts`` in order (the last one completed, with ``result``) and each failed attempt's lost steps."""
    buckets = dict.fromkeys(BUCKETS, 0.0)
    productive, rows = 0.0, []
    segments = [*marks.segments]
    if not segments or segments[-1][2] < end:
        segments.append(("orchestration", segments[-1][2] if segments else marks.start, end))
    for bucket, begun, ended in segments:
        begun, ended = min(begun, end), min(ended, end)  # a mark past the run's end (clocks) is cut at it
        if bucket != "train":
            buckets[bucket if bucket in buckets else "other"] += ended - begun
            continue
        cursor, unplaced = begun, False
        for i, rec in enumerate(attempts):
            launched = rec.launched_at
            if launched is None or not (cursor <= launched <= ended):
                unplaced = True  # recorded by an older version, or clocks that disagree: its time is ``other``
                continue
            # Before it: the task's start or a retry's delay, unless an attempt that could not be placed ran there.
            buckets["other" if unplaced else "orchestration"] += launched - cursor
            unplaced = False
            last = i == len(attempts) - 1
            row = (
                _final_attempt(rec, launched, result) if last else _failed_attempt(rec, launched, lost_steps[i], step_s)
            )
            for name, seconds in row.items():
                if name == "productive":
                    productive += seconds
                else:
                    buckets[name] += seconds
            rows.append({"attempt": float(rec.attempt), **{k: round(v, 6) for k, v in row.items()}})
            cursor = min(max(cursor, rec.ended_at), ended)
        buckets["other" if unplaced else "orchestration"] += ended - cursor  # the task returning its result
    return Badput(end - marks.start, productive, buckets, rows)
