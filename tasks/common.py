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

from trainer.errors import TrainingIncident
from trainer.tracking import TrackedRun


def retry_on_incident(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry what the run policy called retryable (``TrainingIncident``), never bad input or a stop."""
    try:
        state.result()
    except TrainingIncident:
        return True
    except Exception:  # noqa: BLE001 - anything else is not worth another attempt
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


def stop_with_parent(poll_s: float = 1.0) -> None:
    """When a runner or worker started this flow-run process, stop (SIGTERM: Prefect ends the run, our code tears
    the job down) if that parent dies, instead of training on as an orphan nobody can cancel."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
