"""One orchestrator per run: a live lease refuses a second start; a dead or silent one is taken over; of two
starts in the same instant exactly one wins, on a local store and on S3."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from trainpipe.trainer.orchestrate.lease import Lease, RunBusy, RunLease


def lease(tmp_path, owner: str) -> RunLease:
    return RunLease(str(tmp_path / "runs" / "r1"), "r1", None, owner=owner)


def write_lease(tmp_path, **fields) -> None:
    path = tmp_path / "runs" / "r1" / "lease.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(Lease(**{"run": "r1", **fields}).body())


def test_a_live_lease_refuses_a_second_orchestrator(tmp_path):
    first = lease(tmp_path, "flow-a")
    assert first.acquire() is None
    with pytest.raises(RunBusy, match="run r1 is being trained by owner flow-a"):
        lease(tmp_path, "flow-b").acquire()
    first.release()
    assert lease(tmp_path, "flow-b").acquire() is None
    assert sorted(p.name for p in (tmp_path / "runs" / "r1").iterdir()) == ["lease.json"]  # no lock or temp file


def test_the_same_owner_takes_its_own_lease_again(tmp_path):
    assert lease(tmp_path, "flow-a").acquire() is None
    assert lease(tmp_path, "flow-a").acquire() is None  # a Prefect retry of the same flow run


def test_a_lease_whose_process_is_gone_is_taken_over_and_named(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_lease(tmp_path, owner="flow-dead", pid=int(dead.stdout))  # that process has exited
    taken = lease(tmp_path, "flow-new").acquire()
    assert taken is not None and taken.owner == "flow-dead"
    assert json.loads((tmp_path / "runs" / "r1" / "lease.json").read_text())["owner"] == "flow-new"


def test_a_lease_not_renewed_within_the_ttl_is_stale_even_on_another_host(tmp_path):
    write_lease(tmp_path, owner="flow-far", host="another-host", renewed=time.time() - 10)
    with pytest.raises(RunBusy):
        lease(tmp_path, "flow-new").acquire(ttl_s=60)
    assert lease(tmp_path, "flow-new").acquire(ttl_s=5).owner == "flow-far"


def test_kept_renews_in_the_background_and_releases_at_the_end(tmp_path):
    holder = lease(tmp_path, "flow-a")
    holder.acquire()
    first = holder.current().renewed
    with holder.kept(on_lost=pytest.fail, every_s=0.05):
        time.sleep(0.3)
        assert holder.current().renewed > first
    assert holder.current() is None


def test_an_orchestrator_whose_lease_was_taken_over_learns_it_at_its_next_renewal_and_deletes_nothing(tmp_path):
    """It stalled past the TTL (a suspended VM): its renewal must not overwrite the new holder's lease, and its
    release must not delete it."""
    old = lease(tmp_path, "flow-old")
    old.acquire()
    lost: list[Lease] = []
    with old.kept(on_lost=lost.append, every_s=0.2):
        time.sleep(0.05)
        assert lease(tmp_path, "flow-new").acquire(ttl_s=0.01).owner == "flow-old"  # the TTL ran out
        deadline = time.time() + 5
        while not lost and time.time() < deadline:
            time.sleep(0.05)
    assert [h.owner for h in lost] == ["flow-new"]
    assert lease(tmp_path, "x").current().owner == "flow-new"  # neither overwritten nor released by the old one


RACER = """
import json, sys, time
from trainpipe.trainer.orchestrate.lease import RunBusy, RunLease
run_dir, owner, options, start = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
contender = RunLease(run_dir, "r1", options, owner=owner)
contender.current()  # connected before the start, so that all of them write at once
time.sleep(max(0.0, start - time.time()))
try:
    contender.acquire(ttl_s=60)
    print("won", owner, flush=True)
except RunBusy as exc:
    print("busy", exc, flush=True)
sys.stdin.read()  # alive until every contender has tried: a holder whose process is gone is taken over
"""


def race(run_dir: str, storage_options: dict | None, contenders: int = 6) -> list[tuple[str, str]]:
    start = time.time() + 2  # every contender is started and waiting when the clock strikes
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, run_dir, f"flow-{i}", json.dumps(storage_options), str(start)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(contenders)
    ]
    results = [tuple(p.stdout.readline().strip().split(" ", 1)) for p in procs]  # a line each: every one tried
    for p in procs:
        p.communicate(timeout=60)
    return results


def stale_lease() -> bytes:
    return Lease("r1", "flow-dead", host="another-host", renewed=time.time() - 3600).body()


@pytest.mark.parametrize("stale", [False, True], ids=["fresh-run", "stale-lease"])
def test_of_concurrent_starts_exactly_one_wins_on_a_local_store(tmp_path, stale):
    if stale:  # every contender sees a lease to take over: the takeover is the race
        (tmp_path / "runs" / "r1").mkdir(parents=True)
        (tmp_path / "runs" / "r1" / "lease.json").write_bytes(stale_lease())
    results = race(str(tmp_path / "runs" / "r1"), None)
    winners = [who for what, who in results if what == "won"]
    assert len(winners) == 1, results
    assert all("being trained by owner " + winners[0] in text for what, text in results if what == "busy"), results
    assert lease(tmp_path, "x").current().owner == winners[0]


@pytest.mark.parametrize("stale", [False, True], ids=["fresh-run", "stale-lease"])
def test_of_concurrent_starts_exactly_one_wins_on_s3(s3_bucket, stale):
    """Conditional writes (If-None-Match, If-Match) on a real S3 API."""
    bucket, options = s3_bucket
    run_dir = f"s3://{bucket}/runs/r1"
    if stale:
        assert RunLease(run_dir, "r1", options).file.create(stale_lease())
    results = race(run_dir, options)
    winners = [who for what, who in results if what == "won"]
    assert len(winners) == 1, results
    assert all("being trained by owner " + winners[0] in text for what, text in results if what == "busy"), results
    assert RunLease(run_dir, "r1", options).current().owner == winners[0]


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
    assert lease(tmp_path, "x").current().owner == "flow-a"


# A planted lease: anyone who can write the bucket can write runs/R/lease.json naming any flow run id.


def flow_run_view(**fields):
    from trainpipe.trainer.orchestrate.lease import FlowRunView

    return FlowRunView(**{"id": "dead", "name": "r1", "flow_id": "flow-1", "deployment_id": None, **fields})


@pytest.mark.parametrize(
    ("lease_run", "theirs", "says"),
    [
        ("r1", {}, None),  # this run's earlier flow run: it may be marked Crashed
        ("r1", {"name": "r1-retry", "tags": ("run:r1", "profile:local")}, None),  # named otherwise, tagged for r1
        ("r1", {"final": True}, None),  # this run's, already ended: nothing to mark, nothing to warn of
        ("other-run", {}, "the lease is for run 'other-run', not 'r1'"),
        ("r1", None, "no such flow run"),
        ("r1", {"id": "ours"}, "it is this flow run"),
        ("r1", {"flow_id": "flow-2"}, "another flow"),
        ("r1", {"deployment_id": "nightly"}, "another deployment"),
        ("r1", {"name": "their-run", "tags": ("run:their-run",)}, "flow run 'their-run', of another run"),
        ("r1", {"tags": ("run:r1", "store:0b0b0b0b")}, "a run of that name in another store"),
        ("r1", {"tags": ("run:r1", "store:aaaa1111")}, None),  # the same store's
    ],
)
def test_a_lease_names_only_its_own_runs_flow_runs(lease_run, theirs, says):
    from trainpipe.trainer.orchestrate.lease import foreign_flow_run

    stale = Lease(lease_run, "dead", host="far", renewed=0.0)
    ours = flow_run_view(id="ours", tags=("run:r1", "store:aaaa1111"))
    why = foreign_flow_run(stale, "r1", ours, None if theirs is None else flow_run_view(**theirs))
    assert why is None if says is None else says in why, why
    assert foreign_flow_run(stale, "r1", None, flow_run_view()) is not None  # outside Prefect nothing is marked


def test_a_planted_lease_says_nothing_of_its_own_in_a_log_line():
    planted = Lease("r1", "x\nERROR fake line", host="h\r\x1b[2Jost", renewed=time.time())
    assert "\n" not in planted.line() and "\r" not in planted.line() and "\x1b" not in planted.line()


@pytest.mark.integration
def test_a_planted_lease_naming_another_teams_flow_run_leaves_it_running(home, tiny_profile):
    """The attack end to end against a real Prefect server: a stale lease planted for run r1 names a live flow run
    of another flow, and one of this flow but another run. The takeover records its incident and a warning, and
    leaves both Running; the run's own dead flow run (same flow, named r1) is still marked Crashed."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings
    from prefect.states import Running

    from tests.conftest import prefect_api
    from trainpipe.tasks.common import record_takeover

    prof = tiny_profile("tracking.enabled=false")

    @flow(name="trainpipe-lease-test", flow_run_name="r1")
    def takeover(owner: str) -> None:  # this flow run takes run r1 over from the lease naming ``owner``
        record_takeover(prof, "r1", Lease("r1", owner, host="far-away", renewed=0.0), "r1")

    @flow(name="another-teams-flow")
    def theirs() -> None:
        pass

    # logs stay here: sent to the API, they would be flushed at exit, after the session's server has stopped
    settings = {PREFECT_API_URL: prefect_api(), PREFECT_LOGGING_TO_API_ENABLED: False}
    with temporary_settings(settings), get_client(sync_client=True) as client:
        victims = [
            client.create_flow_run(theirs, name="r1", tags=["run:r1"], state=Running()),  # another flow
            client.create_flow_run(takeover, name="their-run", tags=["run:their-run"], state=Running()),  # another run
        ]
        own_dead = client.create_flow_run(takeover, name="r1", tags=["run:r1"], state=Running())
        for victim in victims:
            takeover(str(victim.id))
        takeover(str(own_dead.id))
        states = [client.read_flow_run(r.id).state for r in [*victims, own_dead]]
    assert [s.type.value for s in states] == ["RUNNING", "RUNNING", "CRASHED"], states
    assert "took over run r1" in states[-1].message
    incidents = json.loads((home / "store" / "runs" / "r1" / "incidents.json").read_text())
    assert [i["kind"] for i in incidents] == ["takeover"] * 3  # each takeover is recorded, whoever the lease named
    said = [i["detail"].partition("; ")[2] for i in incidents]
    assert "not this run's (it is a run of another flow): left as it is" in said[0], said
    assert "not this run's (it is flow run 'their-run', of another run): left as it is" in said[1], said
    assert said[2] == "", said
