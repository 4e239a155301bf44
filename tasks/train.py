from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any, TypeVar, overload

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run, task_run
from prefect.states import Cancelled

from trainpipe.tasks.common import answered, fence_left_jobs, log_cancels_at_info, retry_on_incident
from trainpipe.tasks.events import emit_attempt, emit_incident
from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import RunCancelled, TrainingFailed, TrainingIncident
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.launch import launch
from trainpipe.trainer.launcher import AttemptOutcome, LaunchRequest, Watch
from trainpipe.trainer.orchestrate import termination
from trainpipe.trainer.orchestrate.policy import after_attempt, ended_before, for_attempt, retry_delay_s
from trainpipe.trainer.orchestrate.records import RunRecords
from trainpipe.trainer.orchestrate.summary import Trained, failed_attempts, recovery
from trainpipe.trainer.tracking import TrackedRun, watchdog_metrics

T = TypeVar("T")
log_cancels_at_info()
INCIDENT_COLUMNS = ("kind", "rank", "node", "step", "phase", "detected_after_s", "detail")


@task(
    name="train_model",
    task_run_name="train-{run_name}",
    retries=2,  # the flow sets train.max_retries from the profile; the backoff is decided in the task
    retry_delay_seconds=0,
    retry_condition_fn=retry_on_incident,
    cache_policy=NO_CACHE,
)
def train_model(profile: Profile, run_name: str, dataset_uri: str, mlflow_run_id: str | None = None) -> Trained | State:
    """One training attempt under torchrun, watched; a retry is a fresh launch that resumes from the last commit.
    A person's cancel ends it Cancelled: it returns that state, which the flow's call gets back."""
    logger = get_run_logger()
    attempt = task_run.run_count or 1
    records = RunRecords(profile.store, run_name)
    recorded: set[str] = set()
    tracked = TrackedRun.of(profile.tracking, mlflow_run_id)
    keep = Keep(logger, profile.hide)

    def record(incident: Incident, level: int | None = None) -> None:
        """Into the log, the run's records and the MLflow run, at once: warnings arrive from every host while the
        job runs (the watchdog's polls; node 0's progress file under a cluster launcher)."""
        if incident.id not in recorded:
            recorded.add(incident.id)
            level = level or (logging.ERROR if incident.fatal else logging.WARNING)
            logger.log(level, "incident: %s", incident.line())
            incident = incident.model_copy(update={"attempt": attempt})
            keep("recording the incident", records.add_incidents, incident)
            keep("the incident's event", emit_incident, run_name, incident, profile.hide)
            keep("the incidents in MLflow", publish_incidents, tracked, records)

    follow = FollowAttempt(run_name, profile.train.steps, logger)
    termination.arm()  # a SIGTERM stops the attempt at its next poll, even one whose exception was lost
    try:  # a cancel may come during the back-off or the fence too
        wait_before_retry(records, attempt, profile.train.retry_delay_s, logger)
        profile, changes = for_attempt(profile, records)
        for change in changes:
            logger.warning("%s", change)
        logger.info(
            "attempt %d: %d node(s) × %d process(es)", attempt, profile.cluster.nodes, profile.cluster.procs_per_node
        )
        # A cluster job an earlier orchestrator of this run left running (SIGKILLed, or its follower could not
        # stop it) would write checkpoints beside this attempt's: stopped first, or this attempt does not start.
        fence_left_jobs(profile, run_name, record)
        launched_at = time.time()
        request = LaunchRequest("train", profile, run_name, attempt, dataset_uri, mlflow_run_id)
        outcome = launch(request, Watch(on_line=logger.info, on_finding=record, on_progress=follow))
    except (RunCancelled, TerminationSignal, KeyboardInterrupt) as exc:  # TerminationSignal: a runner's SIGTERM
        by_a_person = isinstance(exc, RunCancelled) or (
            isinstance(exc, TerminationSignal) and follow.cancelled_by_a_person()
        )
        incident = follow.cancelled(attempt, exc)
        record(incident, logging.INFO if by_a_person else None)  # a person's stop is not a fault
        if by_a_person:
            termination.forget()  # dealt with: this process may run on (a test's, a served flow's last moments)
            # Prefect's task engine calls any termination signal a crash, at ERROR; a person's cancel is neither.
            return Cancelled(message=incident.detail)
        raise  # Ctrl-C, or a stop for a dead parent or a lost lease: those are what they are
    if outcome.result:  # its last words: the final step and that step's loss, as the log's last step line
        follow.publish(outcome.result.final_step, outcome.result.final_loss)
    for finding in outcome.findings:  # those not recorded as they came, e.g. an unclean exit after the final commit
        record(finding)
    history = keep("reading the run's incidents", records.incidents, default=[])  # before this attempt ended
    if outcome.incident is not None:
        record(outcome.incident)
    if outcome.flight:
        folder = keep("saving the flight recorders", records.save_flight_recorders, attempt, outcome.flight)
        if folder:
            logger.info("the ranks' flight recorders (their last collectives): %s", folder)
    publish(outcome, tracked, records, logger, profile.hide)
    this_attempt = outcome.record(launched_at, str(task_run.id) if task_run.id else None)
    if outcome.result is not None:
        keep("recording the attempt", records.add_attempt, this_attempt)
        result = outcome.result
        line = f"attempt {attempt} committed step {result.final_step}"
        keep("the attempt's event", emit_attempt, run_name, attempt, True, line, result.final_step)
        failed = failed_attempts(keep("reading the run's attempts", records.attempts, default=[]), attempt)
        if this_attempt.task_run_id:  # this task run's own tries, not an earlier pipeline run's
            failed = [r for r in failed if r.task_run_id in (None, this_attempt.task_run_id)]
        figures = recovery(failed, this_attempt, result.final_step, result.step_s_median)
        if figures.recoveries:
            logger.info(
                "recovered: %d lost step(s), %.1fs from fault to the first resumed step",
                figures.lost_steps,
                figures.recovery_s,
            )
        return Trained(result=result, attempt=attempt, recovery=figures, attempts=[*failed, this_attempt])

    assert outcome.incident is not None  # a training attempt without a result ended by an incident
    incident = outcome.incident.model_copy(update={"attempt": attempt})
    keep(
        "the incident artifact",
        create_table_artifact,
        [{k: getattr(incident, k) for k in INCIDENT_COLUMNS}],
        "training-incident",
        f"attempt {attempt} of {run_name}",
    )
    decision = after_attempt(incident, history, profile)
    update = {"decision": decision.line()[:300], "decided_at": time.time()}
    keep("recording the attempt", records.add_attempt, this_attempt.model_copy(update=update))
    line = profile.hide(f"{incident.line()}; {decision.line()}")
    keep("the attempt's event", emit_attempt, run_name, attempt, False, line)
    if decision.exclude_node:
        logger.warning("excluding node %s from the next attempt", decision.exclude_node)
        keep("recording the excluded node", records.exclude_node, decision.exclude_node)
    if decision.rollback_before is not None:
        logger.warning(
            "the next attempt resumes from the newest checkpoint before step %d and skips the data that fed it",
            decision.rollback_before,
        )
        records.roll_back(decision.rollback_before)  # not kept: a retry without it would train through the spike
    if decision.action == "stop":
        raise TrainingFailed(decision.reason)
    raise TrainingIncident(f"training attempt {attempt} failed: {decision.reason}", [incident])


class Keep:
    """Runs a bookkeeping step whose failure (the store away, a full disk, MLflow refusing) is a warning: it must
    never replace the attempt's own outcome, which is what the user needs to see. The warning is one line, through
    ``hide``: an MLflow client's exception quotes the URL it called, a shared profile's password with it."""

    def __init__(self, logger, hide: Callable[[object], str]):
        self.logger, self.hide = logger, hide

    @overload
    def __call__(self, what: str, fn: Callable[..., T], *args: Any, default: T) -> T: ...
    @overload
    def __call__(self, what: str, fn: Callable[..., T], *args: Any, default: None = None) -> T | None: ...
    def __call__(self, what: str, fn: Callable[..., T], *args: Any, default: T | None = None) -> T | None:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the attempt's outcome stands
            first = self.hide(str(exc).splitlines()[0])[:200] if str(exc) else ""
            self.logger.warning("%s failed (%s: %s); the attempt's outcome stands", what, type(exc).__name__, first)
            return default


def wait_before_retry(records: RunRecords, attempt: int, backoff_s: float, logger) -> None:
    """The retry's backoff, decided by what ended the last attempt (``policy.retry_delay_s``): Prefect retries
    this task at once, and the wait, when there is one, happens here."""
    try:  # this task run's earlier tries
        before = ended_before(records.attempts(), str(task_run.id), attempt)
    except Exception:  # noqa: BLE001 - the store away: what ended them is unknown, so back off
        before: list[Incident | None] = [None] * (attempt - 1)
    if (delay := retry_delay_s(before, backoff_s)) > 0:
        last = before[-1]
        logger.info(
            "attempt %d starts in %.1fs (after %s)", attempt, delay, last.kind if last else "an unread incident"
        )
        time.sleep(delay)


def publish(
    outcome: AttemptOutcome, tracked: TrackedRun, records: RunRecords, logger, hide: Callable[[object], str] = str
) -> None:
    """The attempt's health metrics and incidents in MLflow; a tracking failure is a warning, never a failed attempt."""
    try:
        # the watchdog's windows: straggler scores, and where the time went, over the ranks
        tracked.log_steps([(window["step"], watchdog_metrics(window)) for window in outcome.scores])
        if outcome.incident is not None or outcome.findings:
            publish_incidents(tracked, records)
        if outcome.incident is not None:
            tracked.set_tags({"trainpipe.last_failure": outcome.incident.line()})
    except Exception as exc:  # noqa: BLE001 - tracking must never decide a training attempt
        logger.warning("MLflow logging of attempt %d failed (%s); the run goes on", outcome.attempt, hide(exc))


def publish_incidents(tracked: TrackedRun, records: RunRecords) -> None:
    """The run's incidents so far as the MLflow run's ``incidents.json`` (nothing read when tracking is off)."""
    if tracked.id:
        tracked.log_dict([i.model_dump(mode="json") for i in records.incidents()], "incidents.json")


class FollowAttempt:
    """Called at every watchdog poll: a Prefect progress artifact (step/total, loss), and a stop when the flow run
    is being cancelled (a flow run the CLI runs in its own process has no runner to stop it)."""

    def __init__(self, run_name: str, total_steps: int, logger, every_s: float = 3.0):
        self.run_name, self.total, self.logger, self.every_s = run_name, total_steps, logger, every_s
        self.progress: dict[int, dict] = {}
        self._last = float("-inf")  # the first call publishes, however short the host's uptime
        self._artifact = None

    def __call__(self, progress: dict[int, dict]) -> None:
        self.progress = progress
        if (signum := termination.stop_requested()) is not None:  # its handler's exception was lost (the module)
            raise TerminationSignal(signum) if signum == signal.SIGTERM else KeyboardInterrupt
        if time.monotonic() - self._last < self.every_s:
            return
        self._last = time.monotonic()
        if progress:  # none without a watchdog (watchdog.enabled: false): no step to show
            self.publish()
        try:
            cancelling = self._cancelling()
        except Exception as exc:  # noqa: BLE001 - the API being away must not stop training
            self.logger.debug("could not read the flow run's state (%s)", exc)
            return
        if cancelling:
            raise RunCancelled(f"run {self.run_name} was cancelled; the same run name resumes from its last commit")

    @property
    def step(self) -> int:
        return max((p.get("step", -1) for p in self.progress.values()), default=-1)

    def publish(self, final_step: int | None = None, final_loss: float | None = None) -> None:
        """The progress artifact: step/total and the last loss; once the attempt committed ``final_step``, that
        step's loss (``final_loss``: a beacon polled before it may be a few steps older)."""
        step, loss = final_step or max(self.step, 0), self.progress.get(0, {}).get("l")
        if final_step:
            loss = final_loss
        text = f"step {step}/{self.total}" + (f", loss {loss:.4f}" if isinstance(loss, float) else "")
        share = 100.0 * min(step / self.total, 1.0)
        try:
            if self._artifact is None:
                self._artifact = answered(create_progress_artifact(share, key="training-progress", description=text))
            else:
                update_progress_artifact(self._artifact, share, description=text)
        except Exception as exc:  # noqa: BLE001 - the API being away must not stop training
            self.logger.debug("progress not published (%s)", exc)

    def cancelled_by_a_person(self) -> bool:
        """Whether this process was signalled because the flow run is being cancelled (from the UI or API): the
        runner's or worker's word before its SIGTERM (Prefect's control channel), else the flow run's state;
        False when neither can be read."""
        try:
            from prefect._internal.control_listener import get_intent  # private: any failure reads as "no"

            if get_intent() == "cancel":
                return True
        except Exception:  # noqa: BLE001 - an older or newer Prefect without it: ask the API
            pass
        try:
            return self._cancelling()
        except Exception:  # noqa: BLE001 - the API away: not known to be a cancel
            return False

    def _cancelling(self) -> bool:
        if flow_run.id is None:
            return False
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run.id).state
        # Cancelled too: a runner may mark the run Cancelled between two of these reads (every ``every_s``) while
        # its signal did not end this process; the job must stop either way.
        return state is not None and (state.is_cancelling() or state.is_cancelled())

    def cancelled(self, attempt: int, exc: BaseException) -> Incident:
        step = self.step
        where = f" at step {step}" if step > 0 else " before the first step"
        return Incident(
            kind="cancelled",
            detail=f"run cancelled{where} ({type(exc).__name__}); the job was stopped, committed checkpoints kept",
            step=step if step > 0 else None,
            attempt=attempt,
            ranks=sorted(self.progress),
        )
