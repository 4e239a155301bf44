"""trainpipe's own Prefect events (tasks/events.py), sent to a server that answers, one that never answers, and a
port where none listens: the event's shape, and a run that goes on in every case with one warning line. The real
Prefect server's side (automations firing on them) is tests/test_operations.py."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from trainpipe.tasks import events
from trainpipe.trainer.incidents import Incident


class _Collect(BaseHTTPRequestHandler):
    """The events a Prefect API would receive; its token endpoint answers as a server without CSRF protection."""

    received: ClassVar[list] = []

    def do_GET(self):
        body = b'{"detail": "CSRF protection is disabled."}'
        self.send_response(422 if self.path.startswith("/api/csrf-token") else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Collect.received.append((self.path, json.loads(body)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def api(monkeypatch):
    """``api(url)`` points this test's events at ``url``: PREFECT_API_URL, as a served or worker flow run has it,
    and this thread's Prefect settings (those the process read at its start may name no server)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with contextlib.ExitStack() as stack:

        def point(url: str) -> None:
            monkeypatch.setenv("PREFECT_API_URL", url)
            stack.enter_context(temporary_settings(updates={PREFECT_API_URL: url}))

        yield point


def test_an_incident_is_posted_at_once_with_the_run_as_its_resource_and_its_line_redacted(api):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Collect.received.clear()
    try:
        api(f"http://127.0.0.1:{server.server_address[1]}/api")
        incident = Incident(
            kind="straggler", detail="rank 1 slow; token s3cr3t", rank=1, step=40, node="n" * 300, fatal=False
        )
        events.emit_incident("run-7", incident, hide=lambda x: str(x).replace("s3cr3t", "***"))
    finally:
        server.shutdown()
    ((path, (body,)),) = [r for r in _Collect.received if r[0].endswith("/events")]
    assert path == "/api/events" and body["event"] == "trainpipe.incident.straggler"
    assert body["resource"]["prefect.resource.id"] == "trainpipe.run.run-7"
    assert body["resource"]["trainpipe.quiet"] == "true" and body["resource"]["trainpipe.fatal"] == "false"
    assert "s3cr3t" not in json.dumps(body) and "***" in body["payload"]["line"]
    assert body["payload"]["node"] == "n" * 64 and body["payload"]["rank"] == 1 and body["payload"]["step"] == 40


@pytest.fixture(params=["never answers", "is away"])
def unreachable(request):
    """The URL of a Prefect API that accepts connections and never answers, or of a port where none listens."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel's backlog accepts; nothing reads
        port = silent.getsockname()[1]
        if request.param == "never answers":
            yield f"http://127.0.0.1:{port}/api"
            return
    yield f"http://127.0.0.1:{port}/api"  # closed: refused (Prefect's client retries that for a while)


def test_an_unreachable_server_holds_the_run_at_most_the_send_timeout_and_is_one_line(
    unreachable, api, monkeypatch, caplog
):
    monkeypatch.setattr(events, "SEND_TIMEOUT_S", 0.5)
    api(unreachable)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainpipe.events"):
        events.emit_attempt("run-7", 2, False, "straggler on rank 1; retrying")
        waited = time.monotonic() - began
        time.sleep(1.5)  # the sending thread's own end, had it anything more to say
    assert waited < 3.0
    assert [r.getMessage() for r in caplog.records if "trainpipe.attempt.failed" in r.getMessage()] == [
        "event trainpipe.attempt.failed not sent within 0.5s; the run goes on without it"
    ]
