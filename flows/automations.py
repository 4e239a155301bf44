"""The Prefect automations trainpipe ships: notifications, and a silent flow run marked Crashed.

``ensure_automations`` creates or replaces them on the Prefect server by name
(``trainpipe up`` and ``trainpipe automations`` call it):

- ``trainpipe: run failed or crashed``: Prefect's own ``prefect.flow-run.Failed``
  and ``.Crashed`` events of the ``trainpipe`` flow: a notification.
- ``trainpipe: quiet fault``: trainpipe's ``trainpipe.incident.KIND`` events
  (``tasks/events.py``) of a quiet kind (a straggler, a slow link, corrupted
  replicas, a flatlined loss: ``QUIET_KINDS``): a notification naming the run,
  the kind, the rank and node.
- ``trainpipe: silent flow run is Crashed``: a ``trainpipe`` flow run that sent
  a heartbeat and then nothing (neither a heartbeat nor a final state) for
  ``silent_after_s`` is marked Crashed, so the UI stops showing a dead run as
  Running. Flow runs send heartbeats every 30 s under ``serve`` and ``run``.

The notifications go to the webhook whose URL ``TRAINPIPE_NOTIFY_URL`` holds
when the command runs (Slack, Mattermost or any endpoint that takes a JSON
POST with ``text``, ``subject`` and ``body``). The URL often carries a token:
it is kept in the block's secret values (``trainpipe-notify``, a Custom Webhook
block), never printed, and never on a command line. Without it the two
notification automations are left as they are (none, the first time).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from trainpipe.trainer.errors import TrainpipeError

if TYPE_CHECKING:
    from uuid import UUID

    from prefect.events.schemas.automations import AutomationCore

# Prefect is imported in the functions that use it: Prefect reads its settings (the server's URL) once, on import,
# and the CLI checks its input before it points Prefect at the `up` server.

NOTIFY_URL_ENV = "TRAINPIPE_NOTIFY_URL"
NOTIFY_BLOCK = "trainpipe-notify"
FAILED = "trainpipe: run failed or crashed"
QUIET = "trainpipe: quiet fault"
SILENT = "trainpipe: silent flow run is Crashed"
HEARTBEAT_S = 30  # a flow run's heartbeat interval under serve, run and a worker (Prefect's least)
HEARTBEATS = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}
SILENT_AFTER_S = 3 * HEARTBEAT_S  # the silent-run automation's window: three heartbeats missed
FLOW: dict[str, str | list[str]] = {"prefect.resource.role": "flow", "prefect.resource.name": "trainpipe"}
FINAL = ("Completed", "Failed", "Cancelled", "Crashed")


@dataclass(frozen=True)
class Ensured:
    """What ``ensure_automations`` left on the server: the automations' names, and whether they notify."""

    names: list[str]
    notifying: bool

    def line(self) -> str:
        text = "automations: " + ", ".join(f"'{n}'" for n in self.names)
        if self.notifying:
            return text + f" (notifications to the webhook in {NOTIFY_URL_ENV})"
        return text + f" (no notifications: set {NOTIFY_URL_ENV} to a webhook URL, then `trainpipe automations`)"


def silent_run_crashed(silent_after_s: float = SILENT_AFTER_S) -> AutomationCore:
    """Prefect's heartbeat recipe: after a heartbeat, expect another (or a final state) within the window."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    trigger = EventTrigger(
        after={"prefect.flow-run.heartbeat"},
        expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in FINAL)},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related=FLOW,
        for_each={"prefect.resource.id"},
        posture=Posture.Proactive,
        threshold=1,
        within=timedelta(seconds=silent_after_s),
    )
    message = (
        f"no heartbeat for {silent_after_s:.0f} s: its process is gone; the same run name resumes from its last commit"
    )
    return AutomationCore(
        name=SILENT,
        description="A trainpipe flow run whose process died (SIGKILL, OOM, a lost host) stops showing Running.",
        trigger=trigger,
        actions=[ChangeFlowRunState(state=StateType.CRASHED, name=None, message=message, force=False)],
    )


def notify_failed(block_id: UUID) -> AutomationCore:
    """A notification through the block ``block_id`` when a trainpipe flow run ends Failed or Crashed."""
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    trigger = EventTrigger(
        expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related=FLOW,
        posture=Posture.Reactive,
        threshold=1,
    )
    body = (
        f"trainpipe run {_text('flow_run.name')} ended {{{{ flow_run.state.name }}}}: "
        f"{_text('flow_run.state.message')}\n{{{{ flow_run|ui_url }}}}"
    )
    return AutomationCore(
        name=FAILED,
        description="A notification when a trainpipe flow run fails or crashes.",
        trigger=trigger,
        actions=[
            SendNotification(block_document_id=block_id, subject=f"trainpipe: {_text('flow_run.name')}", body=body)
        ],
    )


def notify_quiet(block_id: UUID) -> AutomationCore:
    """A notification through the block ``block_id`` for each quiet-fault incident event."""
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    from trainpipe.tasks.events import INCIDENT_EVENT

    trigger = EventTrigger(
        expect={f"{INCIDENT_EVENT}.*"},
        match={"prefect.resource.id": "trainpipe.run.*", "trainpipe.quiet": "true"},
        posture=Posture.Reactive,
        threshold=1,
    )
    run = _text("event.resource['prefect.resource.name']")
    node = _text("event.payload.node or 'unknown'")
    body = f"trainpipe run {run}: {_text('event.payload.line')} (node {node})"
    return AutomationCore(
        name=QUIET,
        description="A notification for each quiet fault a trainpipe run records (trainpipe.incident.* events).",
        trigger=trigger,
        actions=[SendNotification(block_document_id=block_id, subject=f"trainpipe: {run}", body=body)],
    )


def _text(expression: str) -> str:
    """A template's value as chat text: at most 300 characters, with Slack's and Mattermost's markup characters
    escaped, so a value from outside (a run name a form gave, a host part a bucket writer forged) cannot ping a
    channel or hide a link."""
    escaped = "|replace('&', '&amp;')|replace('<', '&lt;')|replace('>', '&gt;')"
    return "{{ (" + expression + ")|string|truncate(300)" + escaped + " }}"


def save_notify_block(url: str) -> UUID:
    """The Custom Webhook block ``trainpipe-notify``, its URL a secret value; returns its document id."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.types import SecretDict

    from trainpipe.tasks.common import answered

    block = CustomWebhookNotificationBlock(
        name="trainpipe",
        url="{{url}}",  # substituted from the secret values when the server sends
        secrets=SecretDict({"url": url}),
        headers=None,
        cookies=None,
        json_data={"text": "{{subject}}\n{{body}}", "subject": "{{subject}}", "body": "{{body}}"},
    )
    return answered(block.save(NOTIFY_BLOCK, overwrite=True))


def check_notify_url(notify_url: str | None) -> None:
    """A webhook's URL or nothing: the server POSTs to it (the value is never said: it may hold a token)."""
    if notify_url and urlsplit(notify_url).scheme not in ("http", "https"):
        raise TrainpipeError(f"{NOTIFY_URL_ENV} is not an http(s) URL: give the webhook's URL")


def ensure_automations(notify_url: str | None, silent_after_s: float = SILENT_AFTER_S) -> Ensured:
    """Create or replace trainpipe's automations on the configured Prefect server (by name: run it again at will).
    ``notify_url`` None leaves the notification automations as they are."""
    from prefect.client.orchestration import get_client

    check_notify_url(notify_url)
    wanted = [silent_run_crashed(silent_after_s)]
    if notify_url:
        block_id = save_notify_block(notify_url)
        wanted += [notify_failed(block_id), notify_quiet(block_id)]
    with get_client(sync_client=True) as client:
        for automation in wanted:
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
            client.create_automation(automation)
        names = [n for n in (FAILED, QUIET, SILENT) if client.read_automations_by_name(n)]
    return Ensured(names, FAILED in names and QUIET in names)
