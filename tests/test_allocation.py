"""The standing host's loop (``trainer.supervise.allocation.serve``) without a cluster: the requests it runs, in
order, once each; a request it cannot run answered at once; one not signed with the job's token left alone; its
end when stopped or left idle."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.supervise import allocation
from trainpipe.trainer.supervise.allocation import STOP, AttemptRequest, Requests, serve

TOKEN = "job-token-0123"


def ask(
    folder: Path, attempt: int, profile: str | None = "local", key: str = TOKEN, swapped: str | None = None
) -> Path:
    """An attempt's folder beside ``folder`` with its profile, and its request, signed with ``key``, in ``folder``;
    with ``swapped``, the folder holds that text instead of the profile the request was signed for."""
    attempt_dir = folder.parent / f"attempt-{attempt}-abcdef"
    attempt_dir.mkdir(exist_ok=True)
    text = load_profile(profile or "local", ["tracking.enabled=false"]).public_yaml()
    if profile is not None:
        (attempt_dir / "profile.yaml").write_text(swapped or text)
    request = AttemptRequest.signed(key, text, attempt=attempt, folder=attempt_dir.name, dataset_uri="file:///d")
    allocation.ask(str(folder), None, request)
    return attempt_dir


class Host:
    """``serve`` on a thread, recording what it ran and wrote."""

    def __init__(self, folder: Path, idle_s: float = 30.0, settings: list[str] | None = None):
        self.ran: list[tuple[int, int, float]] = []
        self.written: dict[str, dict] = {}
        self.said: list[str] = []
        self.code: int | None = None
        self.fail: set[int] = set()  # attempts whose part raises, as a part whose beacon port is taken does

        def run_part(profile, request: AttemptRequest, attempt_dir: str, started_at: float) -> dict:
            if request.attempt in self.fail:
                raise OSError("[Errno 98] Address already in use")
            self.ran.append((request.attempt, profile.cluster.node_rank, started_at))
            return {"attempt": request.attempt, "ok": True}

        def write_part(attempt_dir: str, rank: int, record: dict) -> None:
            self.written[f"{Path(attempt_dir).name}/host-{rank}"] = record

        def main() -> None:
            requests = Requests(str(folder), None, TOKEN)
            self.code = serve(
                requests, "r", settings or [], lambda configured: 3, run_part, write_part, idle_s, self.said.append
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
    ask(folder, 2, key="another-jobs-token")  # planted by someone who does not hold this job's token
    host = Host(folder)
    host.wait_for(lambda: "attempt-1-abcdef/host-3" in host.written)
    part = host.written["attempt-1-abcdef/host-3"]
    assert part["incident"]["kind"] == "error" and "could not run attempt 1" in part["incident"]["detail"], part
    ask(folder, 3)
    host.wait_for(lambda: len(host.ran) == 1)
    assert host.ran[0][0] == 3  # the planted request 2 was left alone; 3 ran
    assert "attempt-2-abcdef/host-3" not in host.written
    ask(folder, 4, swapped=load_profile("local", ["train.steps=1"]).public_yaml())  # another one than it signed
    host.wait_for(lambda: "attempt-4-abcdef/host-3" in host.written)
    detail = host.written["attempt-4-abcdef/host-3"]["incident"]["detail"]
    assert "its profile is not the one the request names" in detail and len(host.ran) == 1, detail
    host.fail.add(5)
    ask(folder, 5)
    host.wait_for(lambda: "attempt-5-abcdef/host-3" in host.written)
    assert host.written["attempt-5-abcdef/host-3"]["incident"]["detail"].endswith("could not run attempt 5: OSError")
    ask(folder, 6)  # the host is still there for the next one
    host.wait_for(lambda: len(host.ran) == 2)
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


def test_a_stop_says_replaced_only_as_the_follower_writes_it_and_a_planted_one_never_blocks(tmp_path):
    """``stop(replaced=True)`` tells the hosts to leave their memory tiers for the next job; anything else in the
    stop's place (empty, other text, a huge file, a FIFO) is a plain stop, read without waiting or
    reading it whole. (Whoever could plant a link there could write the stop itself.)"""
    folder = tmp_path / "job"
    folder.mkdir()
    requests = Requests(str(folder), None, TOKEN)
    allocation.stop(str(folder), None, replaced=True)
    assert requests.stopped() and requests.replaced()
    allocation.stop(str(folder), None)
    assert requests.stopped() and not requests.replaced()
    stop = folder / STOP
    for plant in ("text", "huge", "fifo"):
        stop.unlink()
        if plant == "text":
            stop.write_text("replaced, and more")
        elif plant == "huge":
            stop.write_bytes(b"replaced" + b"\0" * (64 << 20))
        else:
            os.mkfifo(stop)
        began = time.monotonic()
        assert not requests.replaced() and time.monotonic() - began < 5, plant
