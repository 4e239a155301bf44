"""Fault drills from outside the processes: SIGKILL a rank mid-run, or while an async save is in flight."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import BIN, DRILL, ROOT, cli_env
from trainpipe.trainer import tracking
from trainpipe.trainer.checkpoint import catalog
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.orchestrate.policy import after_attempt
from trainpipe.trainer.preflight.gpu_health import STATES_ENV
from trainpipe.trainer.store_paths import CHECKPOINT_MANIFEST, RunPaths
from trainpipe.trainer.supervise.attempt import train_attempt

pytestmark = [pytest.mark.drill, pytest.mark.usefixtures("warm_module")]  # attempts fork warm (conftest)


def workers(marker: str) -> dict[int, psutil.Process]:
    """rank -> the rank processes (named ``trainpipe-r{RANK}`` by the agent that forks them) of a torchrun
    whose command line names ``marker``."""
    found = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        name = p.info["name"] or ""
        if name.startswith("trainpipe-r") and marker in " ".join(p.info["cmdline"] or []):
            with contextlib.suppress(ValueError):
                found[int(name.removeprefix("trainpipe-r"))] = p
    return found


def ranks_under(pid: int) -> dict[int, psutil.Process]:
    """rank -> the rank processes below process ``pid`` (a `trainpipe run`): forked by a warm host, a rank carries
    that host's command line, not the job's."""
    found = {}
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error, ValueError):
                if p.name().startswith("trainpipe-r"):
                    found[int(p.name().removeprefix("trainpipe-r"))] = p
    return found


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def attempt_with_rank_1_killed(prof, run_name: str, dataset_uri: str, ready, what: str, then=None):
    """Attempt 1 of ``run_name``, its rank 1 SIGKILLed once ``ready()`` (``what``: said on a timeout), then
    ``then()`` (a host's memory wiped, …); the attempt, checked to have ended on that crash."""
    import threading

    def kill() -> None:
        wait_for(ready, 180, what)
        wait_for(lambda: ranks_under(os.getpid()).get(1), 10, "rank 1").send_signal(signal.SIGKILL)
        if then is not None:
            then()

    killer = threading.Thread(target=kill)
    killer.start()
    first = train_attempt(prof, run_name, dataset_uri, attempt=1)
    killer.join()
    assert first.result is None and first.incident.kind == "crash" and first.incident.rank == 1, first.incident
    return first


def signal_rank_after_first_commit(
    home: Path, sets: list[str], run_name: str, pick_rank, sig: int
) -> tuple[int, str, str]:
    """`trainpipe run` in the background; once step 10 is committed, send ``sig`` to rank ``pick_rank()``."""
    args = [a for item in sets for a in ("--set", item)]
    proc = subprocess.Popen(
        [str(BIN / "trainpipe"), "run", *args, "--run-name", run_name, "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env({"TRAINPIPE_HOME": str(home)}),
    )
    try:
        first_commit = Path(RunPaths(str(home / "store"), run_name).checkpoint(10), CHECKPOINT_MANIFEST)
        wait_for(lambda: first_commit.exists() or proc.poll() is not None, 180, "the first commit")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        rank = pick_rank()
        ranks = wait_for(lambda: ranks_under(proc.pid), 10, "the worker processes")
        ranks[rank].send_signal(sig)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def test_sigkill_a_rank_mid_run_the_flow_recovers_to_the_same_weights(home, drill_digest):
    victim: list[int] = []

    def pick() -> int:
        time.sleep(random.uniform(0, 0.5))  # a random step after the first commit
        victim.append(random.choice([0, 1]))
        return victim[0]

    returncode, out, err = signal_rank_after_first_commit(
        home,
        [*DRILL, "train.max_retries=2", "train.retry_delay_s=0.5", "cost.gpu_hour_usd=2.5"],
        "kill",
        pick,
        signal.SIGKILL,
    )
    victim_rank = victim[0]
    assert returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["recoveries"] == 1 and summary["final_step"] == 60
    # Warnings only besides the kill: rank 1 is slowed on purpose (a straggler), the other pytest worker's job may
    # slow the collectives for a few windows (a network warning), and a kill that lands during an async save
    # fails that save (the resume uses the commit before it).
    warned = {i["kind"] for i in summary["incidents"] if not i["fatal"]}
    assert warned <= {"straggler", "network", "checkpoint_failed"}, summary
    [incident] = [i for i in summary["incidents"] if i["fatal"]]
    assert incident["kind"] == "crash" and incident["rank"] == victim_rank and "SIGKILL" in incident["detail"]
    assert incident["detected_after_s"] <= 5
    assert summary["lost_steps"] >= 1 and summary["recovery_s"] > 0
    assert incident["wasted_s"] > summary["recovery_s"] and summary["wasted_s"] == pytest.approx(
        incident["wasted_s"], abs=1e-2
    )
    # rounded to 4 decimals: since a crash is retried at once, a few seconds wasted are well under a cent
    assert summary["wasted_usd"] == pytest.approx(summary["wasted_s"] * 2.5 * 2 / 3600, abs=5e-5)
    assert summary["model_digest"] == drill_digest
    b = summary["badput"]  # the failed attempt: its startup, the steps trained again, detection and teardown
    failed, final = b["attempts"]
    assert failed["wasted_progress"] > 0 and failed["detection"] >= 0 and failed["teardown"] > 0, failed
    assert failed["data_wait"] > 0, failed  # from rank 0's running totals in its beacons
    assert b["buckets"]["wasted_progress"] == pytest.approx(failed["wasted_progress"], abs=1e-2)
    assert final["restore"] > 0 and failed["startup"] > 0 and final["startup"] > 0
    assert b["productive_s"] + sum(b["buckets"].values()) == pytest.approx(summary["wall_s"], rel=0.01)
    assert b["buckets"]["other"] < 0.05 * summary["wall_s"], b
    [chain] = summary["incident_chains"]  # fault, detection, decision, first resumed step
    assert chain["kind"] == "crash" and chain["decision"] == "retry" and chain["job"].startswith("torchrun pid ")
    assert chain["task_run_id"] and chain["lost_steps"] == summary["lost_steps"] and chain["lost_usd"] > 0
    assert chain["fault_at"] <= chain["detected_at"] <= chain["decided_at"] <= chain["resumed_at"], chain
    assert chain["fault_to_resume_s"] == pytest.approx(chain["resumed_at"] - chain["fault_at"], abs=1e-2)
    assert chain["resume"] == "verified" and summary["resumes_verified"] == "1/1"  # the loaded state's hash
    assert chain["resumed_tier"] == "store"
    # One curve: the lost steps the retry trained again are not a second point of any series in MLflow.
    uri, run_id = f"sqlite:///{home}/mlflow.db", summary["mlflow_run_id"]
    for key in ("loss/train", "train/lr", "perf/step_ms"):
        assert sorted(step for step, _ in tracking.metric_history(uri, run_id, key)) == list(range(1, 61)), key
    for key in tracking.last_logged_steps(uri, run_id):
        steps = [step for step, _ in tracking.metric_history(uri, run_id, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps))


def test_sigkill_during_an_async_save_keeps_the_previous_checkpoint(home, tiny_profile, drill_digest):
    prof = tiny_profile(
        *DRILL,
        "tracking.enabled=false",
        "checkpoint.async=true",
        "faults.kind=slow_checkpoint",
        "faults.rank=0",
        "faults.step=20",
        "faults.delay_s=60",
        "faults.attempts=1",
    )
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    run = RunPaths(prof.store.root, "async")
    in_flight = Path(run.checkpoint(20))

    def kill_when_written():
        wait_for(lambda: in_flight.is_dir() and list(in_flight.glob(".metadata")), 120, "the async write of step 20")
        time.sleep(0.3)
        assert not (in_flight / CHECKPOINT_MANIFEST).exists()  # written, not committed: the save is in flight
        ranks_under(os.getpid())[1].send_signal(signal.SIGKILL)  # forked by the module's warm host

    import threading

    killer = threading.Thread(target=kill_when_written)
    killer.start()
    first = train_attempt(prof, "async", dataset_uri, attempt=1)
    killer.join()
    assert first.result is None and first.job.wall_s < 60  # torn down at once, not after the held commit
    assert first.incident.kind == "crash" and first.incident.rank == 1 and "SIGKILL" in first.incident.detail
    assert catalog.inspect_checkpoint(run.checkpoint(10)).valid

    second = train_attempt(prof, "async", dataset_uri, attempt=2)
    assert second.result is not None, "\n".join(second.job.tail)
    assert second.result.resumed_from == run.checkpoint(10)
    skipped = {s.uri: s.reason for s in second.result.skipped_checkpoints}
    assert str(in_flight) in skipped  # (a rank may also have begun step 30's save while 20's commit was held)
    assert all("not committed" in reason for reason in skipped.values())
    assert second.result.model_digest == drill_digest


def test_a_rank_that_dies_is_named_even_when_a_lower_rank_dies_of_it_first_in_torchruns_eyes(home, tiny_profile):
    # torchrun's multiprocessing context reports the lowest-numbered dead rank it finds: rank 0, which exits a few
    # milliseconds after rank 1's SIGKILL on the lost connection. The agent's own record of exits names rank 1.
    prof = tiny_profile(*DRILL, "tracking.enabled=false", "faults.kind=crash", "faults.rank=1", "faults.step=3")
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    out = train_attempt(prof, "selfkill", dataset_uri, attempt=1)
    assert out.result is None
    assert out.incident.kind == "crash" and out.incident.rank == 1 and "SIGKILL" in out.incident.detail


def test_a_crash_on_a_host_whose_gpu_then_fails_its_health_check_stops_instead_of_retrying_on_it(
    home, tiny_profile, monkeypatch
):
    """NVML through its seam (recorded states: GPU 0 with uncorrected ECC errors): the supervisor reads this host's
    GPUs after the crash, the incident names the failing GPU, and on one node the policy stops with what to do
    rather than spend a retry on a GPU that fails again."""
    monkeypatch.setenv(STATES_ENV, str(ROOT / "tests" / "fixtures" / "nvml" / "ecc_uncorrected.json"))
    prof = tiny_profile(*DRILL, "tracking.enabled=false", "faults.kind=crash", "faults.rank=1", "faults.step=3")
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    out = train_attempt(prof, "broken-gpu", dataset_uri, attempt=1)
    assert out.incident.kind == "crash" and out.incident.rank == 1
    assert out.incident.host_health.startswith("GPU 0 (NVIDIA H100 80GB HBM3, 00000000:18:00.0)")
    decision = after_attempt(out.incident, [], prof)
    assert decision.action == "stop" and "it is the job's only node: drain or repair it" in decision.reason


def test_two_sigkills_at_random_steps_leave_a_ledger_of_each_sample_once(home, drill_digest):
    """A random rank SIGKILLed after the commit of step 10 and again after that of step 30, each at a random moment:
    both resumes verify their state hash, ``trainpipe ckpt verify`` finds every checkpoint's ledger to be the
    sample order's (the samples of the lost steps were read twice, and counted once), and the weights are the
    uninterrupted run's."""
    sets = [*DRILL, "train.max_retries=3", "train.retry_delay_s=0"]
    args = [a for item in sets for a in ("--set", item)]
    proc = subprocess.Popen(
        [str(BIN / "trainpipe"), "run", *args, "--run-name", "twice", "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env({"TRAINPIPE_HOME": str(home)}),
    )
    run = RunPaths(str(home / "store"), "twice")
    killed: list[int] = []
    try:
        for step in (10, 30):
            commit = Path(run.checkpoint(step), CHECKPOINT_MANIFEST)
            wait_for(lambda c=commit: c.exists() or proc.poll() is not None, 180, f"the commit of step {step}")
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            ranks = wait_for(
                lambda: {r: p for r, p in ranks_under(proc.pid).items() if p.pid not in killed}, 30, "ranks"
            )
            time.sleep(random.uniform(0, 0.5))
            victim = ranks[random.choice(sorted(ranks))]
            killed.append(victim.pid)
            victim.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["recoveries"] == 2 and summary["resumes_verified"] == "2/2", summary["incident_chains"]
    assert summary["model_digest"] == drill_digest
    verify = subprocess.run(
        [str(BIN / "trainpipe"), "ckpt", "verify", "twice", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=cli_env({"TRAINPIPE_HOME": str(home)}),
        timeout=120,
    )
    report = json.loads(verify.stdout.strip().splitlines()[-1])
    assert verify.returncode == 0 and report["holds"], verify.stdout
    assert report["resumes_verified"] == report["resumes"] == 2 and report["checkpoints"][-1]["step"] == 60
    assert report["checkpoints"][-1]["samples"] == 60 * 8, report
