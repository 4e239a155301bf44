"""Hang, desync, straggler and NaN drills on real ranks (world size 2, gloo), faults from outside where possible."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time

import pytest

from tests.conftest import DRILL, NO_PUBLISH, TINY, run_cli
from tests.test_drills import wait_for, workers
from trainpipe.trainer import tracking
from trainpipe.trainer.checkpoint import catalog
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.protocol import BEACON_ENV, BEACON_TOKEN_ENV
from trainpipe.trainer.store_paths import RunPaths
from trainpipe.trainer.supervise.attempt import train_attempt

pytestmark = pytest.mark.drill


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def test_sigstop_a_rank_is_a_hang_naming_it_with_the_others_flight_recorder(home, tiny_profile):
    """SIGSTOP rank 0 after the first commit: a hang naming the stopped rank in seconds, well inside the allowance
    (watchdog.stopped_after_s), with where the live rank waits as torch recorded it. (Resuming after a failed
    attempt: tests/test_drills.py and the others.)"""
    hang_s = 10.0
    prof = tiny_profile(*DRILL, "tracking.enabled=false", f"watchdog.hang_timeout_s={hang_s}", "faults.factor=2")
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    first_commit = RunPaths(prof.store.root, "stop").checkpoint(10)

    def stop_rank_0():
        wait_for(lambda: catalog.inspect_checkpoint(first_commit, verify=False).committed, 120, "the first commit")
        wait_for(lambda: workers(str(home)).get(0), 10, "rank 0").send_signal(signal.SIGSTOP)

    stopper = threading.Thread(target=stop_rank_0)
    stopper.start()
    first = train_attempt(prof, "stop", dataset_uri, attempt=1)
    stopper.join()
    incident = first.incident
    assert first.result is None and incident.kind == "hang" and incident.rank == 0, incident
    assert "stopped" in incident.detail
    # stopped_after_s (1 s) plus three median steps of a tiny model, not the 10 s allowance.
    assert incident.detected_after_s < 4, incident.detected_after_s
    # Before the teardown the live rank dumped its flight recorder: torch's record of the collective it waits in.
    assert set(first.flight) == {1} and first.flight[1]["entries"]
    assert "flight recorder, last collective: rank 1 #" in incident.detail and "gloo:" in incident.detail


def test_a_rank_idle_in_its_forward_while_the_other_waits_is_a_hang_in_seconds(tiny_profile):
    """The hang drill: rank 1 sleeps in step 12's forward (alive, holding nothing) while rank 0 waits in the
    gradients' all-reduce. The watchdog names it from its process using no CPU, well inside the 30 s allowance."""
    prof = tiny_profile(
        *DRILL, "tracking.enabled=false", "watchdog.hang_timeout_s=30", "faults.kind=hang", "faults.rank=1",
        "faults.step=12",
    )  # fmt: skip
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    first = train_attempt(prof, "idle", dataset_uri, attempt=1)
    incident = first.incident
    assert first.result is None and (incident.kind, incident.rank, incident.step) == ("hang", 1, 12), incident
    assert "rank 1 sits idle at step 12 phase forward (no CPU used) while rank(s) [0] wait in collective" in (
        incident.detail
    )
    # stopped_after_s (1 s) plus three median steps, plus the poll that starts the CPU clock
    assert incident.detected_after_s < 4, incident.detected_after_s


def test_the_end_of_an_attempt_is_never_a_training_hang(tiny_profile):
    """After the final commit the ranks flush metrics, meet and leave: that has its own allowance (exit_timeout_s).

    A slow end is no hang even with a hang allowance a third of it; an end that stalls past exit_timeout_s is
    torn down and the attempt still counts, its checkpoint being committed.
    """
    prof = tiny_profile(
        "tracking.enabled=false",
        "watchdog.hang_timeout_s=2",
        "faults.kind=slow_exit",
        "faults.rank=1",
        "faults.delay_s=4.5",
    )
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    slow = train_attempt(prof, "slow-exit", dataset_uri)
    assert slow.result is not None and slow.incident is None and slow.findings == [], (slow.incident, slow.findings)
    assert slow.result.final_step == 8

    stalled_prof = tiny_profile(
        "tracking.enabled=false",
        "watchdog.hang_timeout_s=2",
        "watchdog.exit_timeout_s=2",
        "faults.kind=slow_exit",
        "faults.rank=1",
        "faults.delay_s=120",
    )
    stalled = train_attempt(stalled_prof, "stalled-exit", dataset_uri)
    assert stalled.result is not None and stalled.incident is None and stalled.job.wall_s < 90
    [unclean] = stalled.findings
    assert unclean.kind == "exit" and not unclean.fatal and "step 8 committed" in unclean.detail
    assert stalled.result.model_digest == slow.result.model_digest
    assert catalog.inspect_checkpoint(stalled.result.checkpoint_uri).valid


def test_an_extra_collective_on_one_rank_is_reported_as_a_desync(tiny_profile):
    prof = tiny_profile(
        *DRILL,
        "tracking.enabled=false",
        "faults.kind=extra_collective",
        "faults.rank=1",
        "faults.step=5",
        "watchdog.hang_timeout_s=3",
    )
    run = train_attempt(prof, "desync", shard_dataset(prof.data, prof.store).uri)
    assert run.result is None
    incident = run.incident
    assert incident.kind == "desync", incident
    assert "rank 0 is in collective" in incident.detail and "rank 1 is in collective" in incident.detail
    assert "(loss) of step 5" in incident.detail


THROTTLE = [
    *TINY,
    "tracking.enabled=false",
    "model.n_embd=128",
    "model.n_layer=4",
    "model.n_head=4",
    "model.block_size=128",
    "train.micro_batch=4",
    "train.global_batch=16",
    "train.steps=30",
    "train.eval_every=0",
    "checkpoint.every_steps=30",
    "watchdog.straggler_window=5",
    "watchdog.straggler_patience=2",
]


def _duty_cycle(home: str, rank: int, stop: threading.Event, off_s: float = 0.1, on_s: float = 0.05) -> None:
    """Throttle a rank from outside: SIGSTOP for off_s, SIGCONT for on_s, until told to stop."""
    proc = wait_for(lambda: workers(home).get(rank), 60, "the worker")
    try:
        while not stop.is_set():
            proc.send_signal(signal.SIGSTOP)
            time.sleep(off_s)
            proc.send_signal(signal.SIGCONT)
            time.sleep(on_s)
    except Exception:  # noqa: BLE001 - the process ended
        pass


def test_a_healthy_run_has_no_straggler(drill_reference):
    """Two healthy ranks of a tiny model (steps of ~10 ms, where noise is largest): every window scored, none slow."""
    assert len(drill_reference.scores) >= 4
    assert drill_reference.findings == [], (drill_reference.findings, drill_reference.scores)


@pytest.mark.slow
def test_a_throttled_rank_is_the_only_straggler(home, tiny_profile):
    prof = tiny_profile(*THROTTLE)
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    stop = threading.Event()
    throttler = threading.Thread(target=_duty_cycle, args=(str(home), 1, stop))
    throttler.start()
    try:
        throttled = train_attempt(prof, "throttled", dataset_uri)
    finally:
        stop.set()
        throttler.join()
    assert throttled.result is not None  # policy warn: the run goes on
    assert [(f.kind, f.rank) for f in throttled.findings] == [("straggler", 1)]


def test_a_nan_that_recurs_after_resume_stops_the_pipeline_with_one_line(home):
    """Also: a record that is not one (here a folder stands where the attempts file goes) is moved aside and the
    attempts are recorded; the user still sees the run's own error, and the MLflow run ends FAILED."""
    (home / "store" / "runs" / "nan" / "attempts.json").mkdir(parents=True)
    proc = run_cli(
        "run",
        *sets(
            *TINY,
            "faults.kind=nan",
            "faults.rank=1",
            "faults.step=6",
            "faults.attempts=0",
            "train.max_retries=2",
            "train.retry_delay_s=0",
            "preflight.enabled=false",
        ),
        "--run-name",
        "nan",
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "again after resuming" in errors[0] and "step 6" in errors[0], proc.stderr[-3000:]
    run_dir = home / "store" / "runs" / "nan"
    assert [p.is_dir() for p in run_dir.glob("attempts.json.corrupt-*")] == [True]  # kept beside, for a person
    assert len(json.loads((run_dir / "attempts.json").read_text())) == 2  # both attempts, the folder out of the way
    uri = f"sqlite:///{home}/mlflow.db"
    (tracked,) = tracking.client(uri).search_runs(
        [tracking.experiment_id(uri, "trainpipe-local")], "tags.`trainpipe.run_name` = 'nan'"
    )
    assert tracked.info.status == "FAILED"
    incidents = json.loads((home / "store" / "runs" / "nan" / "incidents.json").read_text())
    assert [(i["kind"], i["step"]) for i in incidents] == [("nan", 6), ("nan", 6)]
    assert catalog.inspect_checkpoint(RunPaths(str(home / "store"), "nan").checkpoint(4)).valid


def test_exclude_policy_relaunches_without_the_straggling_node(home):
    """Two local nodes; node 1's rank computes 4x slower; the watchdog aborts and the retry runs on node 0 alone."""
    extra = [
        "cluster.nodes=2",
        "cluster.procs_per_node=1",
        "cluster.simulate_nodes=true",
        "cluster.min_nodes=1",
        "watchdog.on_straggler=exclude",
        "watchdog.straggler_window=5",
        "watchdog.straggler_patience=2",
        "faults.kind=slow",
        "faults.rank=1",
        "faults.factor=4",
        "faults.attempts=0",
        "preflight.enabled=false",
        "train.steps=60",
        "train.eval_every=20",
        "checkpoint.every_steps=10",
        "model.n_embd=64",
        "model.n_layer=2",
        "train.max_retries=2",
        "train.retry_delay_s=0",
        NO_PUBLISH,
    ]
    proc = run_cli("run", *sets(*TINY, *extra), "--run-name", "strag", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    stragglers = [i for i in summary["incidents"] if i["kind"] == "straggler"]
    assert len(stragglers) == 1, (summary["incidents"], proc.stderr[-4000:])
    [straggler] = stragglers
    assert straggler["rank"] == 1 and straggler["node"].endswith("-node1"), (straggler, proc.stderr[-4000:])
    assert summary["recoveries"] == 1 and summary["final_step"] == 60, {
        k: summary[k] for k in ("recoveries", "incidents", "lost_steps")
    }
    assert json.loads((home / "store" / "runs" / "strag" / "excluded_nodes.json").read_text()) == [straggler["node"]]
    final = catalog.inspect_checkpoint(summary["checkpoint_uri"])
    assert final.valid and final.manifest["world_size"] == 1


def test_forged_beacons_during_a_real_run_change_nothing(home, drill_digest, caplog):
    """Another local process, even one that read the attempt's token from the job's environment, sends beacons
    with bad types, a pid that is not the job's, a rank that is taken, an endless line and a pile of connections:
    the run finishes with the weights of the undisturbed reference and nothing is reported."""
    import os
    import socket

    import psutil

    from trainpipe.trainer.profile_files import load_profile

    # A loaded 2-core host makes one of two 10 ms ranks 1.4x slower for a few windows now and then, and its
    # collectives up to 4x (another test's job beside this one); the forged straggler below is 1000x and its
    # collectives near 800x their baseline, so factors of 3 and 20 still catch them were they believed.
    settings = [
        "tracking.enabled=false",
        "faults.kind=none",
        "watchdog.straggler_factor=3",
        "watchdog.network_factor=20",
    ]
    prof = load_profile("local", [*DRILL, *settings])
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    done = threading.Event()

    def forge() -> None:
        agent = wait_for(
            lambda: [
                p
                for p in psutil.process_iter(["cmdline"])
                # this run's: another pytest worker may run a job of its own
                if "trainpipe.trainer.supervise.agent" in (p.info["cmdline"] or [])
                and str(home) in " ".join(p.info["cmdline"])
            ],
            60,
            "the torchrun agent",
        )[0]
        env = agent.environ()
        token, address = env[BEACON_TOKEN_ENV], env[BEACON_ENV]

        def connect() -> socket.socket:  # a single-host job's server is a Unix socket, a multi-host one TCP
            if address.startswith("unix:"):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(address.removeprefix("unix:"))
                return s
            host, port = address.rsplit(":", 1)
            return socket.create_connection((host, int(port)))

        wait_for(lambda: workers(str(home)), 60, "the ranks")
        time.sleep(1.0)  # the ranks have connected and claimed their ranks
        gone = subprocess.Popen(["true"])
        gone.wait()
        now = time.time()
        forged = [
            {"r": 1, "s": 10**6, "p": "data", "t": now},  # rank 1 is taken: refused
            {"r": 0, "s": "1", "p": "data", "t": now},
            {"r": 7, "s": 1, "p": "data", "t": now},
            {"r": 1, "s": 1, "p": "data", "t": now, "pid": os.getppid(), "cs": "slow"},
            {"r": 1, "s": -1, "p": "start", "t": now, "pid": gone.pid},  # a dead rank 1, were it believed
        ]
        slow_rank_0 = [  # rank 0 ten seconds a step: a straggler, were it believed
            {"r": 0, "s": s, "p": "collective", "t": now, "n": s, "c": "grads", "cs": 10.0} for s in range(1, 61)
        ]
        socks = []
        for batch in [*([m] for m in forged), slow_rank_0]:
            s = connect()
            with contextlib.suppress(OSError):  # refused connections are closed on us
                s.sendall(token.encode() + b"\n" + b"".join(json.dumps(m).encode() + b"\n" for m in batch))
            socks.append(s)
        flood = connect()
        flood.sendall(token.encode() + b"\n")
        try:
            while not done.is_set():
                flood.sendall(b"x" * 65536)  # an endless line
        except OSError:
            pass
        for _ in range(40):
            with contextlib.suppress(OSError):
                socks.append(connect())
        done.wait(120)
        for s in socks:
            s.close()

    failed: list[BaseException] = []

    def forge_or_record() -> None:
        try:
            forge()
        except BaseException as e:  # noqa: BLE001 - the test asserts below that the forgery happened
            failed.append(e)

    forger = threading.Thread(target=forge_or_record, daemon=True)
    forger.start()
    try:
        out = train_attempt(prof, "forged", dataset_uri)
    finally:
        done.set()
        forger.join(timeout=10)
    assert not failed, f"the forger never reached the run: {failed[0]!r}"
    dropped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("beacon server: dropped")]
    assert len(dropped) >= 5, dropped  # the forgeries reached the server, which refused them
    assert out.result is not None, "\n".join(out.job.tail[-20:])
    assert out.incident is None and not out.findings, [f.line() for f in out.findings]
    assert out.result.model_digest == drill_digest
