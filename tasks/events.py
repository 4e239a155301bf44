"""trainpipe's own Prefect events: one per incident and one per training attempt's outcome.

The run is the resource (``trainpipe.run.NAME``), related to the flow run, task
run, flow, deployment and tags of the run context. The automations of
``flows/automations.py`` trigger on them, and the UI's event feed lists them
beside Prefect's own. Each is posted to the API's ``/events`` at once, not
queued in Prefect's events worker: a cancel's incident comes in a flow run's
last moments, and a served flow run exits through multiprocessing's
``os._exit`` before that queue is sent (it was lost so in CI). Sending never
fails a task and waits at most ``SEND_TIMEOUT_S``.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from trainpipe.trainer.incidents import QUIET_KINDS, Incident

INCIDENT_EVENT = "trainpipe.incident"  # .KIND follows: trainpipe.incident.straggler
ATTEMPT_EVENT = "trainpipe.attempt"  # .succeeded or .failed
SEND_TIMEOUT_S = 5.0  # a server that is away holds a task no longer than this per event

log = logging.getLogger("trainpipe.events")


def related_resources() -> list[dict[str, str]]:
    """The flow run, its flow, deployment and tags, and the task run, of this thread's run context."""
    from prefect.context import FlowRunContext, TaskRunContext

    related: list[dict[str, str]] = []
    if (flow_ctx := FlowRunContext.get()) is not None and flow_ctx.flow_run is not None:
        run = flow_ctx.flow_run
        related.append({"prefect.resource.id": f"prefect.flow-run.{run.id}", "prefect.resource.role": "flow-run",
                        "prefect.resource.name": run.name})  # fmt: skip
        related.append({"prefect.resource.id": f"prefect.flow.{run.flow_id}", "prefect.resource.role": "flow",
                        "prefect.resource.name": flow_ctx.flow.name if flow_ctx.flow else ""})  # fmt: skip
        if run.deployment_id is not None:
            related.append({"prefect.resource.id": f"prefect.deployment.{run.deployment_id}",
                            "prefect.resource.role": "deployment"})  # fmt: skip
        related += [{"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"} for tag in run.tags]
    if (task_ctx := TaskRunContext.get()) is not None:
        task = task_ctx.task_run
        related.append({"prefect.resource.id": f"prefect.task-run.{task.id}", "prefect.resource.role": "task-run",
                        "prefect.resource.name": task.name})  # fmt: skip
    return related


def send_event(event: str, resource: dict[str, str], payload: dict[str, Any]) -> None:
    """Post one event now to the Prefect server of ``PREFECT_API_URL``, with this run's related resources; at most
    ``SEND_TIMEOUT_S``. Without that variable (Prefect's embedded server, in this process) Prefect's events worker
    sends it, at this process's normal exit: a client of its own here would start a second embedded server."""
    from prefect.client.orchestration import get_client
    from prefect.events import Event, emit_event

    if not os.environ.get("PREFECT_API_URL"):
        emit_event(event, resource=resource, payload=payload)
        return
    fields = {"event": event, "resource": resource, "related": related_resources(), "payload": payload}
    body = Event.model_validate(fields).model_dump(mode="json")

    gave_up = threading.Event()  # the caller went on: its line was said, the thread's retries end unseen

    def post() -> None:
        try:
            with get_client(sync_client=True) as client:
                client.request("POST", "/events", json=[body])
        except Exception as exc:  # noqa: BLE001 - an event is a report: the run goes on without it
            if not gave_up.is_set():
                log.warning("event %s not sent (%s); the run goes on without it", event, type(exc).__name__)

    # In the caller's context: its Prefect settings (a flow run's, a temporary server's) name the server, where a
    # bare thread would read the process's global ones.
    sending = threading.Thread(target=contextvars.copy_context().run, args=(post,), daemon=True)
    sending.start()
    sending.join(SEND_TIMEOUT_S)
    if sending.is_alive():  # a server that never answers, or one away (Prefect's client retries a refused connection)
        gave_up.set()
        log.warning("event %s not sent within %gs; the run goes on without it", event, SEND_TIMEOUT_S)


def run_resource(run_name: str, **labels: str) -> dict[str, str]:
    """The run as an event's resource; ``run_name`` is a checked run name (letters, digits, ``. _ -``)."""
    return {"prefect.resource.id": f"trainpipe.run.{run_name}", "prefect.resource.name": run_name, **labels}


def emit_incident(run_name: str, incident: Incident, hide: Callable[[object], str] = str) -> None:
    """``trainpipe.incident.KIND``, labelled with whether it is a quiet fault (one no dashboard shows on its own:
    ``QUIET_KINDS``) and whether it ended the attempt. ``hide`` redacts the detail, as for the log."""
    resource = run_resource(
        run_name,
        **{
            "trainpipe.kind": incident.kind,
            "trainpipe.quiet": str(incident.kind in QUIET_KINDS).lower(),
            "trainpipe.fatal": str(incident.fatal).lower(),
        },
    )
    payload = {
        "line": hide(incident.line())[:500],
        "node": incident.node[:64] if incident.node else None,  # a forged host part may name any node
        "rank": incident.rank,
        "step": incident.step,
        "attempt": incident.attempt,
    }
    send_event(f"{INCIDENT_EVENT}.{incident.kind}", resource, payload)


def emit_attempt(run_name: str, attempt: int, succeeded: bool, line: str, final_step: int | None = None) -> None:
    """``trainpipe.attempt.succeeded`` or ``.failed``: what the attempt ended with, and for a failed one what the
    retry policy decided (``line``)."""
    outcome = "succeeded" if succeeded else "failed"
    payload = {"attempt": attempt, "line": line[:500], "final_step": final_step}
    send_event(f"{ATTEMPT_EVENT}.{outcome}", run_resource(run_name), payload)
