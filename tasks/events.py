"""trainpipe's own Prefect events: one per incident and one per training attempt's outcome.

The run is the resource (``trainpipe.run.NAME``); Prefect adds the flow run,
its flow, deployment and tags as related resources from the run context. The
automations of ``flows/automations.py`` trigger on them, and the UI's event
feed lists them beside Prefect's own. Emitting never fails a task: the events
client sends in the background and drops what the server does not take.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prefect.events import emit_event

from trainpipe.trainer.incidents import QUIET_KINDS, Incident

INCIDENT_EVENT = "trainpipe.incident"  # .KIND follows: trainpipe.incident.straggler
ATTEMPT_EVENT = "trainpipe.attempt"  # .succeeded or .failed


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
    emit_event(f"{INCIDENT_EVENT}.{incident.kind}", resource=resource, payload=payload)


def flush_events(timeout_s: float = 5.0) -> None:
    """Wait up to ``timeout_s`` for the events this process emitted to reach the server. A served flow run exits
    through multiprocessing's ``os._exit``, which runs no exit hook: an event emitted in its last moments (a
    cancel's incident) would be lost in the events worker's queue."""
    from prefect.events.worker import EventsWorker

    try:
        waiting = threading.Thread(target=EventsWorker.instance().wait_until_empty, daemon=True)
        waiting.start()
        waiting.join(timeout_s)  # a server that is away does not hold the run's end longer than this
    except Exception as exc:  # noqa: BLE001 - the run's own outcome stands; its events are a report
        logging.getLogger("trainpipe.events").debug("events not flushed (%s)", exc)


def emit_attempt(run_name: str, attempt: int, succeeded: bool, line: str, final_step: int | None = None) -> None:
    """``trainpipe.attempt.succeeded`` or ``.failed``: what the attempt ended with, and for a failed one what the
    retry policy decided (``line``)."""
    outcome = "succeeded" if succeeded else "failed"
    payload = {"attempt": attempt, "line": line[:500], "final_step": final_step}
    emit_event(f"{ATTEMPT_EVENT}.{outcome}", resource=run_resource(run_name), payload=payload)
