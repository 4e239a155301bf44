"""Failures as data (docs/architecture.md §5): one ``Incident`` type from the ranks to the run summary.

A rank reports its own expected failure as an incident, the watchdog reports
what it sees as incidents, the supervisor turns the end of an attempt into one,
and the task, the policy and the summary pass the same records along. Nothing
downstream reads log text to decide anything.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainpipe.trainer.parallel_dims import MeshAxis

Kind = Literal[
    "crash",  # a worker process died (signal or exit code)
    "hang",  # no rank advanced within the allowance
    "desync",  # ranks wait in different collectives
    "straggler",  # one rank computes slower than the others
    "nan",  # the loss went non-finite
    "error",  # a rank's own expected error (bad data, unloadable checkpoint, store failure, …)
    "timeout",  # the attempt ran past train.timeout_s
    "exit",  # training finished and committed, but the job did not end cleanly
    "aborted",  # another host's part of the attempt ended first; this host's ranks were stopped
    "exclude",  # preflight took failing nodes out of the cluster
    "cancelled",  # a person (or Prefect) cancelled the run; the job was stopped, checkpoints kept
    "takeover",  # a new orchestrator took the run over from one that stopped renewing its lease
    "checkpoint_failed",  # a checkpoint did not upload or commit; the previous one stays, training went on
    "store_outage",  # a checkpoint upload ran long (store slow or away): saves were skipped meanwhile
    "loss_spike",  # the loss or the gradient norm far above its rolling median
    "flatline",  # the training loss stopped improving beyond its noise
    "sdc",  # data-parallel replicas hold different weights (silent data corruption)
    "network",  # collectives slowed down while compute and data stayed flat (a slow link or fabric)
    "data_stall",  # a rank waits for its data a large share of each step
    "gpu_idle",  # GPUs near 0% busy while the steps slowed down: they wait for something else
]

# The faults no dashboard shows on their own: the run goes on, slower or wrong. Each is worth telling a person
# at once (flows/automations.py notifies on them); a crash, hang or timeout ends the attempt and says so anyway.
QUIET_KINDS: frozenset[str] = frozenset(
    {
        "straggler",
        "network",
        "data_stall",
        "gpu_idle",
        "flatline",
        "loss_spike",
        "sdc",
        "store_outage",
        "checkpoint_failed",
    }
)


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class Incident(BaseModel):
    """One thing that went wrong, where and when: the record every layer passes along.

    Unknown keys are dropped, so records written by an earlier trainpipe still read.
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # records come from the store: finite only

    kind: Kind
    detail: str = Field(description="One line a person can act on.")
    rank: int | None = Field(default=None, description="The culprit rank (global), when one is known.")
    node: str | None = Field(default=None, description="The culprit's node.")
    step: int | None = Field(default=None, description="The step the culprit was at (1-based).")
    phase: str | None = Field(default=None, description="Its phase then (data, forward, collective, …).")
    detected_after_s: float | None = Field(default=None, description="From the last sign of progress to detection.")
    attempt: int | None = Field(default=None, description="The training attempt (1 = first try).")
    wasted_s: float | None = Field(
        default=None, description="What the fault cost: lost steps at the typical step time plus recovery."
    )
    wasted_usd: float | None = Field(default=None, description="wasted_s at cost.gpu_hour_usd for the whole cluster.")
    ranks: list[int] = Field(default_factory=list, description="Every rank involved.")
    mesh: dict[MeshAxis, Annotated[int, Field(ge=0, le=1 << 20)]] | None = Field(
        default=None, description="Under a parallel layout: the culprit's coordinates (pp, dp_replicate, dp_shard, tp)."
    )
    host_health: str | None = Field(
        default=None,
        max_length=1000,
        description="The culprit host's GPU health check that failed right after the fault (NVML): the host is "
        "broken, not a bystander, and a retry on it would fail again.",
    )
    fatal: bool = Field(default=True, description="It ended the attempt (False: a warning, training went on).")
    error: str | None = Field(
        default=None,
        description="For kind 'error': the rank's error class, e.g. DataError; for a crash: the signal that killed "
        "the rank or the job, e.g. SIGKILL.",
    )
    at: float = Field(default_factory=time.time, description="Wall clock of detection (seconds since the epoch).")
    time: str = Field(default_factory=_now_iso, description="The same, as ISO 8601.")
    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])

    @model_validator(mode="before")
    @classmethod
    def _earlier_format(cls, data: object) -> object:
        if isinstance(data, dict) and "at" not in data and isinstance(data.get("time_epoch"), int | float):
            return {**data, "at": data["time_epoch"]}  # before 0.1 records kept the detection time there
        return data

    def line(self) -> str:
        where = f" on rank {self.rank}" if self.rank is not None else ""
        return f"{self.kind}{where}: {self.detail}"


def ranks_text(ranks: list[int], shown: int = 8) -> str:
    """``[0, 1, 2]``, or for a large job ``[0, 1, 2, 3, 4, 5, 6, … 4095] (4,095 ranks)``: one readable line."""
    if len(ranks) <= shown:
        return str(list(ranks))
    head = ", ".join(map(str, ranks[: shown - 1]))
    return f"[{head}, … {ranks[-1]}] ({len(ranks):,} ranks)"


class AttemptRecord(BaseModel):
    """What one training attempt did, for recovery figures: where it started, how far it got, how it ended."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # records come from the store: finite only

    attempt: int
    start_step: int | None = Field(default=None, description="The step it resumed from (0: from scratch).")
    launched_at: float | None = Field(default=None, description="Wall clock of its launch by the train task.")
    started_at: float | None = Field(
        default=None, description="A cluster job: when its last host's supervisor started, the end of its queue."
    )
    first_step_at: float | None = Field(default=None, description="Wall clock of its first training step.")
    last_step: int | None = Field(default=None, ge=0, le=10**12, description="The highest step any rank began.")
    fault_at: float | None = Field(
        default=None, description="Wall clock of the culprit's last beacon before the fault."
    )
    ended_at: float = Field(default_factory=time.time)
    data_wait_s: float | None = Field(
        default=None, ge=0, le=1e7, description="Rank 0's wait for batches until its last step."
    )
    eval_s: float | None = Field(default=None, ge=0, le=1e7, description="Rank 0's evaluations until its last step.")
    checkpoint_s: float | None = Field(default=None, ge=0, le=1e7, description="Its loop blocked by saves (rank 0).")
    decision: str | None = Field(default=None, max_length=300, description="What the policy decided after it failed.")
    decided_at: float | None = Field(default=None, description="Wall clock of that decision.")
    task_run_id: str | None = Field(default=None, max_length=64, description="The Prefect task run of the attempt.")
    job: str | None = Field(
        default=None, max_length=300, description="The launcher's job: torchrun's pid, a Slurm job id."
    )
    resume_verified: bool | None = Field(
        default=None, description="It resumed from a checkpoint whose state hash it verified (False: one with none)."
    )
    resumed_tier: Literal["memory", "peer", "store"] | None = Field(
        default=None,
        description="Where that checkpoint lay: a snapshot in host memory, one gathered from a peer host's copy, "
        "or the store.",
    )
    incident: Incident | None = Field(default=None, description="What ended it; None when it completed.")
