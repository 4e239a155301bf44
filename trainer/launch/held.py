"""The cluster jobs a run holds across its attempts (docs/architecture.md §4): a Slurm job or a TrainJob whose
hosts stay up between attempts and fork each one warm.

``keep(profile)`` opens the block in which the run's train attempts may share a job (the flow opens it around
training, through ``trainer.launch.warm_attempts``); a launcher ``take``s the job it left for the run, ``put``s it
back when every host answered, and every job still held is ended when the block ends. ``holds`` tells the fence
against left-over jobs (``trainer.launch.jobs.stop_left_jobs``) which recorded job is this process's own.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from trainpipe.trainer.config import MAX_RETRY_DELAY_S, Profile

if TYPE_CHECKING:  # jobs.py asks ``holds`` which of its records are this process's own
    from trainpipe.trainer.launch.jobs import LiveJob


class HeldJob(Protocol):
    key: str  # what the job was made from: an attempt whose key differs needs a job of its own
    live: LiveJob | None  # its record in the run's jobs.json

    def end(self, replaced: bool = False) -> None: ...  # replaced: a job of the run takes its place


log = logging.getLogger("trainpipe.held")
# The store's and MLflow's credentials a cluster job's hosts get from the orchestrator's environment (sbatch's
# environment, the TrainJob's Secret): part of a held job's key, so rotated ones get a job of their own.
CREDENTIAL_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)
_held: dict[str, HeldJob] | None = None
_since: dict[int, float] = {}  # when each held job's last attempt ended (monotonic)


@contextlib.contextmanager
def keep(profile: Profile) -> Iterator[None]:
    """Inside this block a launcher may keep a run's job for its next attempt (``cluster.warm_host``)."""
    global _held
    if _held is not None or not profile.cluster.warm_host:
        yield
        return
    _held = {}
    try:
        yield
    finally:
        held, _held = _held, None
        _since.clear()
        for job in held.values():
            try:
                job.end()
            except Exception as exc:  # noqa: BLE001 - the run's outcome stands; the job's record stays for the fence
                log.warning("a job held for the run could not be ended (%s); the run's next start stops it", exc)


def idle_s(profile: Profile) -> float:
    """How long a held job's hosts wait for the next attempt before they end: the longest backoff before a retry
    and five minutes (an orchestrator that died leaves no job up for long)."""
    t = profile.train
    return min(MAX_RETRY_DELAY_S, t.retry_delay_s * 2 ** min(max(t.max_retries - 1, 0), 30)) + IDLE_MARGIN_S


IDLE_MARGIN_S = 300.0  # the train task's bookkeeping between two attempts (records, flight recorders, the fence)
ASK_MARGIN_S = 120.0  # a job is not asked again this close to its hosts' idle limit: they may be ending


def part_wait_s(profile: Profile) -> float:
    """How long the other hosts' parts of an attempt are waited for once one host's is there: a host's part ends
    at most ``watchdog.exit_timeout_s`` after its torchrun was asked to (then a host that says nothing is lost)."""
    return profile.watchdog.exit_timeout_s + 30.0


def keeping() -> bool:
    return _held is not None


def take(run_name: str, profile: Profile, fits: Callable[[HeldJob], bool]) -> HeldJob | None:
    """The job held for the run, if ``fits(job)`` (it is this launcher's, made as this attempt's would be, and
    still running) and its hosts are still sure to be waiting; any other is ended (one idle for nearly their
    limit too: a request now might arrive as they leave)."""
    job = _held.pop(run_name, None) if _held is not None else None
    if job is None:
        return None
    try:
        if time.monotonic() - _since.pop(id(job), 0.0) <= idle_s(profile) - ASK_MARGIN_S and fits(job):
            return job
    except BaseException:
        job.end()
        raise
    job.end(replaced=True)  # the attempt that asked starts a job of its own
    return None


def put(run_name: str, job: HeldJob) -> None:
    if _held is None:
        job.end()
    else:
        _held[run_name], _since[id(job)] = job, time.monotonic()


def holds(job: LiveJob) -> bool:
    """Whether ``job`` is one this process holds for its run's next attempt (not one left running)."""
    return _held is not None and any(h.live is not None and h.live.same(job) for h in _held.values())
