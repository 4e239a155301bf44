"""One orchestrator per run: a live lease refuses a second start; a dead or silent one is taken over."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from trainer.orchestrate.lease import RunBusy, RunLease


def lease(tmp_path, owner: str) -> RunLease:
    return RunLease(str(tmp_path / "runs" / "r1"), "r1", None, owner=owner)


def test_a_live_lease_refuses_a_second_orchestrator(tmp_path):
    first = lease(tmp_path, "flow-a")
    assert first.acquire() is None
    with pytest.raises(RunBusy, match="run r1 is being trained by owner flow-a"):
        lease(tmp_path, "flow-b").acquire()
    first.release()
    assert lease(tmp_path, "flow-b").acquire() is None


def test_the_same_owner_takes_its_own_lease_again(tmp_path):
    assert lease(tmp_path, "flow-a").acquire() is None
    assert lease(tmp_path, "flow-a").acquire() is None  # a Prefect retry of the same flow run


def test_a_lease_whose_process_is_gone_is_taken_over_and_named(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = lease(tmp_path, "flow-dead")
    holder.lease.pid = int(dead.stdout)  # that process has exited
    holder.acquire()
    taken = lease(tmp_path, "flow-new").acquire()
    assert taken is not None and taken.owner == "flow-dead"
    assert json.loads((tmp_path / "runs" / "r1" / "lease.json").read_text())["owner"] == "flow-new"


def test_a_lease_not_renewed_within_the_ttl_is_stale_even_on_another_host(tmp_path):
    holder = lease(tmp_path, "flow-far")
    holder.lease.host, holder.lease.renewed = "another-host", time.time() - 10
    holder._write()
    with pytest.raises(RunBusy):
        lease(tmp_path, "flow-new").acquire(ttl_s=60)
    assert lease(tmp_path, "flow-new").acquire(ttl_s=5).owner == "flow-far"


def test_kept_renews_in_the_background_and_releases_at_the_end(tmp_path):
    holder = lease(tmp_path, "flow-a")
    holder.acquire()
    first = holder.current().renewed
    with holder.kept(every_s=0.05):
        time.sleep(0.3)
        assert holder.current().renewed > first
    assert holder.current() is None


@pytest.mark.parametrize(
    "body",
    [
        "{not json",
        "[]",
        '{"run": "r1", "owner": "x", "host": "h", "pid": "12", "acquired": 1, "renewed": 1}',
        '{"run": "r1", "owner": "x", "host": "h", "pid": 12, "acquired": 1, "renewed": "yesterday"}',
        '{"run": "r1", "owner": "x", "host": "h", "pid": 12, "acquired": 1, "renewed": Infinity}',
        '{"run": "r1", "owner": "x", "extra": 1}',
    ],
)
def test_a_damaged_lease_file_protects_nothing(tmp_path, body):
    path = tmp_path / "runs" / "r1" / "lease.json"
    path.parent.mkdir(parents=True)
    path.write_text(body)
    assert lease(tmp_path, "flow-a").acquire() is None
