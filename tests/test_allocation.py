"""The standing host's loop (``trainer.supervise.allocation.serve``) without a cluster: the requests it runs, in
order, once each; a request it cannot run answered at once; its end when stopped or left idle."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from trainpipe.trainer.config import load_profile
from trainpipe.trainer.supervise.allocation import STOP, AttemptRequest, request_name, serve


def ask(folder: Path, attempt: int, profile: str | None = "local", **fields) -> Path:
    """An attempt's folder beside ``folder`` with its profile, and its request in ``folder``."""
    attempt_dir = folder.parent / f"attempt-{attempt}-abcdef"
    attempt_dir.mkdir(exist_ok=True)
    if profile is not None:
        (attempt_dir / "profile.yaml").write_text(load_profile(profile, ["tracking.enabled=false"]).public_yaml())
    body = {"attempt": attempt, "folder": attempt_dir.name, "dataset_uri": "file:///d", **fields}
    (folder / request_name(attempt)).write_text(json.dumps(body))
    return attempt_dir


class Host:
    """``serve`` on a thread, recording what it ran and wrote."""

    def __init__(self, folder: Path, idle_s: float = 30.0, settings: list[str] | None = None):
        self.ran: list[tuple[int, int, float]] = []
        self.written: dict[str, dict] = {}
        self.said: list[str] = []
        self.code: int | None = None

        def run_part(profile, request: AttemptRequest, attempt_dir: Path, started_at: float) -> dict:
            self.ran.append((request.attempt, profile.cluster.node_rank, started_at))
            return {"attempt": request.attempt, "ok": True}

        def write_part(attempt_dir: Path, rank: int, record: dict) -> None:
            self.written[f"{attempt_dir.name}/host-{rank}"] = record

        def main() -> None:
            self.code = serve(
                folder, "r", settings or [], lambda configured: 3, run_part, write_part, idle_s, self.said.append
            )

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()

    def wait_for(self, what, within_s: float = 10.0) -> None:
        deadline = time.monotonic() + within_s
        while not what():
            assert time.monotonic() < deadline, (self.ran, self.written, self.said)
            time.sleep(0.02)


def test_a_standing_host_runs_each_request_once_in_order_and_ends_when_stopped(home, tmp_path):
    folder = tmp_path / "attempt-1-abcdef"
    folder.mkdir()
    ask(folder, 1)
    host = Host(folder)
    host.wait_for(lambda: len(host.ran) == 1)
    asked = time.time()
    ask(folder, 2)
    host.wait_for(lambda: len(host.ran) == 2)
    assert [(a, rank) for a, rank, _ in host.ran] == [(1, 3), (2, 3)]  # the node rank the launcher says
    assert asked <= host.ran[1][2] < asked + 1  # a later attempt's queue ended when its request was seen
    assert host.ran[0][2] < asked  # the first one's when the host's process started
    assert set(host.written) == {"attempt-1-abcdef/host-3", "attempt-2-abcdef/host-3"}
    (folder / STOP).write_text("")
    host.thread.join(timeout=5)
    assert host.code == 0 and not host.thread.is_alive()
    assert len(host.ran) == 2  # nothing ran twice


def test_a_request_the_host_cannot_run_is_answered_with_an_error_part_and_the_next_one_runs(home, tmp_path):
    folder = tmp_path / "attempt-1-abcdef"
    folder.mkdir()
    ask(folder, 1, profile=None)  # its folder holds no profile
    (folder / request_name(2)).write_text('{"attempt": 2, "folder": "../../etc", "dataset_uri": "x"}')  # planted
    host = Host(folder)
    host.wait_for(lambda: "attempt-1-abcdef/host-3" in host.written)
    part = host.written["attempt-1-abcdef/host-3"]
    assert part["incident"]["kind"] == "error" and "could not start attempt 1" in part["incident"]["detail"], part
    ask(folder, 3)
    host.wait_for(lambda: len(host.ran) == 1)
    assert host.ran[0][0] == 3  # the planted request 2 was left alone; 3 ran
    (folder / STOP).write_text("")
    host.thread.join(timeout=5)


def test_a_standing_host_whose_orchestrator_went_away_ends_when_no_request_comes(home, tmp_path):
    folder = tmp_path / "attempt-1-abcdef"
    folder.mkdir()
    ask(folder, 1)
    host = Host(folder, idle_s=0.5)
    host.wait_for(lambda: len(host.ran) == 1)
    host.thread.join(timeout=5)
    assert host.code == 0 and not host.thread.is_alive()
    assert any("no attempt was asked for in 0.5s" in line for line in host.said), host.said
