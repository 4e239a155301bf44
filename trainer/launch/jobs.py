"""A run's live cluster jobs (``{store}/runs/{run}/jobs.json``): one writer per run, jobs included.

The run's lease makes sure one orchestrator trains a run; it does not reach a
Slurm job or a TrainJob, which keep running when their orchestrator is
SIGKILLed (until ``train.timeout_s``). So a cluster launcher records each job
it submits (``remember``) before it follows it, and forgets it once the job is
seen to have ended (``forget``). Before a new attempt starts, and when a run is
taken over, ``stop_left_jobs`` stops every recorded job of the run that still
runs (scancel; a foreground deletion of the TrainJob), waits until it is gone,
and says which: a resume never trains beside a job of the orphaned orchestrator.

The store is not trusted (others can write the bucket): a record is validated
(a Slurm job id is digits, a TrainJob's namespace and name are DNS labels)
before it reaches a command or an API call, and a job is stopped only once the
cluster confirms it is one of this run's (its Slurm job name; the TrainJob's
``trainpipe/run`` annotation). A file that is not a list of such records stops
the run with one line: moving it aside could leave a second writer running.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainpipe.trainer import grammar
from trainpipe.trainer.config import Profile, StoreConfig
from trainpipe.trainer.errors import StoreError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.launch import held
from trainpipe.trainer.launcher import launcher_spec, registered
from trainpipe.trainer.store import read_json_uri, write_json_uri
from trainpipe.trainer.store_paths import RunPaths, join

log = logging.getLogger("trainpipe.jobs")


class LiveJob(BaseModel):
    """One submitted cluster job, by the identity its launcher needs to find and stop it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    launcher: str = Field(max_length=32, description="The launcher that submitted it (its registered kind).")
    attempt: int = Field(ge=1, le=100_000, description="The training attempt the job runs.")
    # The job's identity, whichever of these its launcher uses (its spec's ``job_line`` checks them): a Slurm
    # job's id; a TrainJob's namespace and name.
    job_id: str | None = Field(default=None, max_length=253)
    namespace: str | None = Field(default=None, max_length=253)
    name: str | None = Field(default=None, max_length=253)
    owner: str = Field(
        default="", max_length=100, description="The run's lease owner that submitted it (a flow run id)."
    )
    host: str = Field(default="", max_length=255, description="The orchestrator's host.")
    pid: int = Field(default=0, ge=0, description="The orchestrator's process.")
    submitted: float = Field(default_factory=time.time, allow_inf_nan=False)

    @model_validator(mode="after")
    def _identity(self) -> LiveJob:
        self.line()  # ValueError unless a registered launcher that records its jobs names this one
        if problem := grammar.control_problem([self.owner, self.host]):
            raise ValueError(problem)
        return self

    def line(self) -> str:
        spec = registered(self.launcher)
        if spec is None or spec.job_line is None:
            raise ValueError(f"{self.launcher[:32]!r} is not a launcher that records its jobs")
        return f"{spec.job_line(self)} (attempt {self.attempt})"

    def same(self, other: LiveJob) -> bool:
        return (self.launcher, self.job_id, self.namespace, self.name) == (
            other.launcher,
            other.job_id,
            other.namespace,
            other.name,
        )


def recorded(store: StoreConfig, run_name: str) -> list[LiveJob]:
    """The run's recorded jobs. StoreError (one line) when the file is not a list of job records."""
    uri = RunPaths(store.root, run_name).live_jobs
    try:
        body = read_json_uri(uri, store.storage_options, [])  # JSONDecodeError and UnicodeDecodeError: ValueErrors
        if not isinstance(body, list):
            raise ValueError("not a JSON list")
        return [LiveJob.model_validate(item) for item in body]
    except (ValueError, ValidationError) as exc:  # a ValidationError is a ValueError: said by its first error
        first = exc.errors()[0]["msg"][:200] if isinstance(exc, ValidationError) else str(exc)
        raise StoreError(
            f"{uri} is not a list of job records ({first}): stop the jobs it names by hand if they run "
            "(scancel, kubectl delete trainjob), then move it aside"
        ) from None


def remember(
    profile: Profile,
    run_name: str,
    attempt: int,
    *,
    job_id: str | None = None,
    namespace: str | None = None,
    name: str | None = None,
) -> LiveJob:
    """Record a job the launcher submitted (or is about to create), before it follows it."""
    job = LiveJob(
        launcher=profile.launcher.kind,
        attempt=attempt,
        job_id=job_id,
        namespace=namespace,
        name=name,
        owner=_lease_owner(profile, run_name),
        host=socket.gethostname(),
        pid=os.getpid(),
    )
    jobs = [j for j in recorded(profile.store, run_name) if not j.same(job)]
    _write(profile.store, run_name, [*jobs, job])
    return job


def forget(store: StoreConfig, run_name: str, job: LiveJob) -> None:
    """The job has ended (or was stopped and is gone): it no longer needs stopping."""
    jobs = recorded(store, run_name)
    if any(j.same(job) for j in jobs):
        _write(store, run_name, [j for j in jobs if not j.same(job)])


def forget_quietly(store: StoreConfig, run_name: str, job: LiveJob) -> None:
    """``forget``, where a failure must not replace the attempt's own outcome: the record stays, and the next
    attempt finds the job gone and forgets it then."""
    try:
        forget(store, run_name, job)
    except Exception as exc:  # noqa: BLE001 - bookkeeping; the attempt's outcome stands
        log.warning("could not forget %s in the run's job records (%s); the next attempt will", job.line(), exc)


def _write(store: StoreConfig, run_name: str, jobs: list[LiveJob]) -> None:
    write_json_uri(RunPaths(store.root, run_name).live_jobs, store.storage_options, [j.model_dump() for j in jobs])


def _lease_owner(profile: Profile, run_name: str) -> str:
    """Who holds the run's lease (this orchestrator, when the flow runs it): said when its job is found orphaned."""
    try:
        uri = join(RunPaths(profile.store.root, run_name).dir, "lease.json")
        lease = read_json_uri(uri, profile.store.storage_options, {})
        owner = lease.get("owner") if isinstance(lease, dict) else None
    except Exception:  # noqa: BLE001 - informational only
        return ""
    return owner[:100] if isinstance(owner, str) and grammar.control_problem(owner) is None else ""


class Fence(NamedTuple):
    """What ``stop_left_jobs`` did: an incident for each job it stopped, a line for each record it left alone."""

    stopped: list[Incident]
    left_alone: list[str]


def stop_left_jobs(profile: Profile, run_name: str) -> Fence:
    """Stop every recorded job of the run that still runs, and forget every record it has dealt with.

    Raises LaunchError (one line) when a job could not be checked or stopped, and StoreError when the records
    cannot be read: a new attempt must not start beside a writer that may still run."""
    fence = Fence([], [])
    for job in recorded(profile.store, run_name):
        if held.holds(job):  # this process's own, kept for the run's next attempt
            continue
        if job.launcher != profile.launcher.kind:  # planted, or left by a run on another cluster: no command runs
            raise StoreError(
                f"{RunPaths(profile.store.root, run_name).live_jobs} records {job.line()} of launcher "
                f"{job.launcher}, not this run's ({profile.launcher.kind}): stop it by hand if it runs (scancel, "
                "kubectl delete trainjob), then move the file aside"
            )
        stop_left = launcher_spec(job.launcher).stop_left  # a record names a launcher that records jobs
        assert stop_left is not None
        found = stop_left(profile, run_name, job)
        if found is not None:
            stopped, line = found
            if stopped:
                fence.stopped.append(Incident(kind="takeover", detail=line, node=job.host or None, fatal=False))
            else:
                fence.left_alone.append(line)
        forget(profile.store, run_name, job)
    return fence
