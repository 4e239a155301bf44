"""Small helpers shared by the task adapters."""

from __future__ import annotations

import os
import signal
import threading
import time
from uuid import UUID

from prefect import Task, get_run_logger
from prefect.artifacts import create_link_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import TaskRun
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run
from prefect.states import State

from trainer.config import Profile
from trainer.errors import StoreError, StoreUnavailable, TrainingIncident
from trainer.incidents import Incident
from trainer.orchestrate.lease import Lease
from trainer.orchestrate.records import RunRecords
from trainer.tracking import TrackedRun


def retry_on_incident(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry what the run policy called retryable (``TrainingIncident``) and a store that stayed away through
    every retry of one operation (``StoreUnavailable``); never bad input or a stop."""
    try:
        state.result()
    except (TrainingIncident, StoreUnavailable):
        return True
    except Exception:  # noqa: BLE001 - anything else is not worth another attempt
        return False
    return False


def retry_on_store_error(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry a stage the store failed (unreachable, or a write that did not land); bad input fails at once."""
    try:
        state.result()
    except StoreError:
        return True
    except Exception:  # noqa: BLE001 - bad data or a bug: the same again would fail the same way
        return False
    return False


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


def link_mlflow_run(tracked: TrackedRun) -> None:
    """A link artifact to the run's page in the MLflow UI (only a tracking server has one)."""
    try:
        url = tracked.web_url()
    except Exception as exc:  # noqa: BLE001 - a link is not worth failing a run for
        get_run_logger().warning("no link to the MLflow run (%s)", exc)
        return
    if url:
        create_link_artifact(url, link_text=f"MLflow run {tracked.id}", key="mlflow-run", description="MLflow run")


def mark_flow_run_crashed(flow_run_id: str, message: str) -> None:
    """End a flow run whose process died (it still shows Running) as Crashed, saying why."""
    from prefect.states import Crashed

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(flow_run_id))
            if run.state is not None and not run.state.is_final():
                client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                get_run_logger().warning("flow run %s (%s) marked crashed: %s", run.name, run.id, message)
    except (ValueError, ObjectNotFound):
        return  # not a flow run id (a lease from outside Prefect), or another server's run
    except Exception as exc:  # noqa: BLE001 - cleaning up after a dead run must not stop this one
        get_run_logger().warning("could not mark flow run %s crashed (%s)", flow_run_id, exc)


def record_takeover(profile: Profile, run_name: str, stale: Lease, flow_run_name: str) -> None:
    """A run taken over from an orchestrator that stopped renewing its lease: an incident in the run's records,
    and that flow run (it still shows Running) marked Crashed."""
    detail = f"flow run {flow_run_name} took over run {run_name} from {stale.line()}, which stopped renewing it"
    get_run_logger().warning("%s", detail)
    try:
        RunRecords(profile.store, run_name).add_incidents(
            Incident(kind="takeover", detail=detail, node=stale.host, fatal=False)
        )
    except (StoreError, OSError) as exc:
        get_run_logger().warning("could not record the takeover (%s)", exc)
    mark_flow_run_crashed(stale.owner, f"its process stopped; flow run {flow_run_name} took over run {run_name}")


def stop_for_lost_lease(holder: Lease) -> None:
    """This orchestrator stalled past the lease's TTL and another one took the run over: stop (SIGTERM, as a
    cancellation) rather than write into a run someone else now trains."""
    get_run_logger().error("the run's lease was taken over by %s: stopping so that one writer trains it", holder.line())
    os.kill(os.getpid(), signal.SIGTERM)


def stop_with_parent(poll_s: float = 1.0) -> None:
    """When a runner or worker started this flow-run process, stop (SIGTERM: Prefect ends the run, our code tears
    the job down) if that parent dies, instead of training on as an orphan nobody can cancel."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
