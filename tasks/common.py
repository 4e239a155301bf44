"""Small helpers shared by the task adapters."""

from __future__ import annotations

from prefect import Task
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from trainer.errors import TrainingIncident


def retry_on_incident(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry what the run policy called retryable (``TrainingIncident``), never bad input or a stop."""
    try:
        state.result()
    except TrainingIncident:
        return True
    except Exception:  # noqa: BLE001 - anything else is not worth another attempt
        return False
    return False
