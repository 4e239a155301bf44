"""Small helpers shared by the task adapters."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar
from uuid import UUID

from prefect import Task, get_run_logger
from prefect.artifacts import create_link_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, State, TaskRun
from prefect.exceptions import ObjectNotFound
from prefect.runtime import deployment, flow_run
from prefect.states import Crashed

from trainpipe.tasks.events import emit_incident
from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import StoreError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.launch.jobs import stop_left_jobs
from trainpipe.trainer.orchestrate.lease import FlowRunView, Lease, foreign_flow_run, printable
from trainpipe.trainer.orchestrate.policy import retryable
from trainpipe.trainer.orchestrate.records import RunRecords
from trainpipe.trainer.redact import redact_text
from trainpipe.trainer.tracking import TrackedRun

T = TypeVar("T")


def answered(value: T | Coroutine[Any, Any, T]) -> T:
    """The result of a Prefect call that has an async twin (``create_progress_artifact``, ``to_deployment``, …),
    called from synchronous code, where it answers at once; its type says it may be a coroutine."""
    if isinstance(value, Coroutine):  # called inside an event loop after all: a caller's mistake, not a run's
        value.close()
        raise RuntimeError("a Prefect call answered with a coroutine in synchronous code")
    return value


def _failed_with(state: State) -> BaseException | None:
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - the task's own error, for the policy to judge
        return exc
    return None


def retry_on_incident(task: Task, task_run: TaskRun, state: State) -> bool:
    """Prefect's retry condition of the train task: ``policy.retryable`` decides."""
    error = _failed_with(state)
    return error is not None and retryable(error, "train")


def retry_on_store_error(task: Task, task_run: TaskRun, state: State) -> bool:
    """Prefect's retry condition of the shard task: ``policy.retryable`` decides."""
    error = _failed_with(state)
    return error is not None and retryable(error, "shard")


def label_flow_run(tags: list[str]) -> None:
    """Add tags (profile, world size, run name) to the running flow run, so the UI can filter by them."""
    run_id = flow_run.id
    if run_id is None:
        return
    try:
        with get_client(sync_client=True) as client:
            current = client.read_flow_run(run_id).tags or []
            client.update_flow_run(run_id, tags=sorted({*current, *tags}))
    except Exception as exc:  # noqa: BLE001 - a label is not worth failing a run for
        get_run_logger().warning("could not tag the flow run (%s)", exc)


def served_form_values() -> dict[str, Any]:
    """The run form's defaults of the deployment this flow run came from (the served profile's values: a field
    left at one of them takes the chosen profile's own), or {} outside a deployment."""
    if deployment.id is None:
        return {}
    with get_client(sync_client=True) as client:
        served = client.read_deployment(deployment.id).parameters or {}
    return dict(served.get("params") or {})


def link_mlflow_run(tracked: TrackedRun) -> None:
    """A link artifact to the run's page in the MLflow UI (only a tracking server has one)."""
    try:
        url = tracked.web_url()
    except Exception as exc:  # noqa: BLE001 - a link is not worth failing a run for
        get_run_logger().warning("no link to the MLflow run (%s)", redact_text(str(exc)))
        return
    if url:
        create_link_artifact(url, link_text=f"MLflow run {tracked.id}", key="mlflow-run", description="MLflow run")


def _view(run: FlowRun) -> FlowRunView:
    return FlowRunView(
        id=str(run.id),
        name=run.name,
        flow_id=str(run.flow_id),
        deployment_id=str(run.deployment_id) if run.deployment_id else None,
        tags=tuple(run.tags or ()),
        final=run.state is not None and run.state.is_final(),
    )


def mark_flow_run_crashed(stale: Lease, run_name: str, message: str) -> str | None:
    """End the flow run a stale lease names as Crashed (its process died; it still shows Running), saying why, when
    that flow run is this run's (``foreign_flow_run``). Otherwise leave it as it is and return the warning said:
    the lease comes from the store, and anyone who can write the bucket can name another team's flow run there."""
    logger = get_run_logger()
    try:
        with get_client(sync_client=True) as client:
            ours = _view(client.read_flow_run(UUID(str(flow_run.id)))) if flow_run.id else None
            try:
                theirs = _view(client.read_flow_run(UUID(stale.owner)))
            except (ValueError, ObjectNotFound):  # not a flow run id, or no flow run of this server
                theirs = None
            if why := foreign_flow_run(stale, run_name, ours, theirs):
                said = f"the stale lease named flow run {printable(stale.owner)}, which is not this run's ({why})"
                said += ": left as it is"
                logger.warning("%s", said)
                return said
            if theirs is not None and not theirs.final:
                client.set_flow_run_state(UUID(theirs.id), Crashed(message=message), force=True)
                logger.warning("flow run %s (%s) marked crashed: %s", theirs.name, theirs.id, message)
    except Exception as exc:  # noqa: BLE001 - cleaning up after a dead run must not stop this one
        logger.warning("could not mark flow run %s crashed (%s)", printable(stale.owner), exc)
    return None


def record_takeover(profile: Profile, run_name: str, stale: Lease, flow_run_name: str) -> None:
    """A run taken over from an orchestrator that stopped renewing its lease: that flow run (it still shows Running)
    marked Crashed when it is this run's, an incident in the run's records, and every cluster job the dead
    orchestrator left running stopped (LaunchError when one cannot be: no second writer)."""
    detail = f"flow run {flow_run_name} took over run {run_name} from {stale.line()}, which stopped renewing it"
    message = f"its process stopped; flow run {flow_run_name} took over run {run_name}"
    if left_alone := mark_flow_run_crashed(stale, run_name, message):
        detail += f"; {left_alone}"
    get_run_logger().warning("%s", detail)
    incident = Incident(kind="takeover", detail=detail, node=stale.host, fatal=False)
    try:
        RunRecords(profile.store, run_name).add_incidents(incident)
    except (StoreError, OSError) as exc:
        get_run_logger().warning("could not record the takeover (%s)", profile.hide(exc))
    emit_incident(run_name, incident, profile.hide)

    def record(incident: Incident) -> None:
        get_run_logger().warning("incident: %s", incident.line())
        try:
            RunRecords(profile.store, run_name).add_incidents(incident)
        except (StoreError, OSError) as exc:
            get_run_logger().warning("could not record the stopped job (%s)", profile.hide(exc))
        emit_incident(run_name, incident, profile.hide)

    fence_left_jobs(profile, run_name, record)


def fence_left_jobs(profile: Profile, run_name: str, record: Callable[[Incident], None]) -> None:
    """Stop every cluster job of the run that an orchestrator left running (its own follower would have stopped it):
    ``record`` gets an incident for each job stopped; a record naming another run's job is a warning. Raises
    LaunchError or StoreError (one line) when a job may still run: a new attempt must not start beside it."""
    fence = stop_left_jobs(profile, run_name)
    for line in fence.left_alone:
        get_run_logger().warning("%s", line)
    for incident in fence.stopped:
        record(incident)


def stop_for_lost_lease(holder: Lease) -> None:
    """This orchestrator stalled past the lease's TTL and another one took the run over: stop (SIGTERM, as a
    cancellation) rather than write into a run someone else now trains."""
    get_run_logger().error("the run's lease was taken over by %s: stopping so that one writer trains it", holder.line())
    os.kill(os.getpid(), signal.SIGTERM)


def stop_with_parent(poll_s: float = 1.0) -> None:
    """When a runner or worker started this flow-run process (under `serve`, through its forkserver:
    docs/architecture.md §1), stop (SIGTERM: Prefect ends the run, our code tears
    the job down) if that parent dies, instead of training on as an orphan nobody can cancel."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class CancelIsNotAnError(logging.Filter):
    """Prefect's task engine logs a task's end at ERROR unless it Completed; a task a person cancelled ended as
    asked, and its "Finished in state Cancelled(…)" line is INFO here (the UI's log filter and any alert on
    ERROR lines then see a cancel for what it is)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and str(record.msg).startswith("Finished in state Cancelled("):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def log_cancels_at_info() -> None:
    """Installs ``CancelIsNotAnError`` on Prefect's task-run logger, once."""
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, CancelIsNotAnError) for f in logger.filters):
        logger.addFilter(CancelIsNotAnError())
