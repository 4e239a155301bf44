"""Fault drills from outside the processes: SIGKILL a rank mid-run, or while an async save is in flight."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import BIN, ROOT, TINY
from trainer import checkpoint as ckpt
from trainer.data import shard_dataset
from trainer.supervisor import train_attempt

pytestmark = pytest.mark.drill

# Long enough to be hit mid-run: rank 1 is slowed (a sleep: the numbers are unchanged).
DRILL = [*TINY, "train.steps=60", "train.eval_every=20", "checkpoint.every_steps=10", "model.n_embd=64", "model.n_layer=2",
         "faults.kind=slow", "faults.rank=1", "faults.factor=4", "faults.attempts=0",
         "preflight.enabled=false"]  # preflight would rightly fail the slowed rank's compute check


def workers(marker: str) -> dict[int, psutil.Process]:
    """rank -> the `python -m trainer` worker processes whose command line names ``marker``."""
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "trainer" in cmd and "-m" in cmd and marker in " ".join(cmd):
            try:
                found[int(p.environ()["RANK"])] = p
            except (psutil.Error, KeyError):
                pass
    return found


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def uninterrupted_digest(profile, dataset_uri: str) -> str:
    run = train_attempt(profile, "reference", dataset_uri)
    assert run.result is not None, "\n".join(run.outcome.tail)
    return run.result["model_digest"]


def signal_rank_after_first_commit(home: Path, sets: list[str], run_name: str, pick_rank, sig: int) -> tuple[int, str, str]:
    """`trainpipe run` in the background; once step 10 is committed, send ``sig`` to the rank ``pick_rank()`` returns."""
    args = [a for item in sets for a in ("--set", item)]
    proc = subprocess.Popen([str(BIN / "trainpipe"), "run", *args, "--run-name", run_name, "--json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TRAINPIPE_HOME": str(home)})
    try:
        root = ckpt.checkpoints_uri(str(home / "store"), run_name)
        wait_for(lambda: Path(ckpt.step_uri(root, 10), ckpt.MANIFEST).exists() or proc.poll() is not None, 180, "the first commit")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        rank = pick_rank()
        ranks = wait_for(lambda: workers(str(home)), 10, "the worker processes")
        ranks[rank].send_signal(sig)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def test_sigkill_a_rank_mid_run_the_flow_recovers_to_the_same_weights(home, tiny_profile):
    victim: list[int] = []

    def pick() -> int:
        time.sleep(random.uniform(0, 0.5))  # a random step after the first commit
        victim.append(random.choice([0, 1]))
        return victim[0]

    returncode, out, err = signal_rank_after_first_commit(
        home, [*DRILL, "train.max_retries=2", "train.retry_delay_s=0.5", "cost.gpu_hour_usd=2.5"], "kill", pick, signal.SIGKILL)
    victim_rank = victim[0]
    assert returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["recoveries"] == 1 and summary["final_step"] == 60
    [incident] = [i for i in summary["incidents"] if i["kind"] != "straggler"]  # rank 1 is slowed on purpose
    assert incident["kind"] == "crash" and incident["rank"] == victim_rank and "SIGKILL" in incident["detail"]
    assert incident["detected_after_s"] <= 5
    assert summary["lost_steps"] >= 1 and summary["recovery_s"] > 0
    assert incident["wasted_s"] > summary["recovery_s"] and summary["wasted_s"] == pytest.approx(incident["wasted_s"], abs=1e-2)
    assert summary["wasted_usd"] == pytest.approx(summary["wasted_s"] * 2.5 * 2 / 3600, rel=1e-2)
    prof = tiny_profile(*DRILL, "tracking.enabled=false")
    assert summary["model_digest"] == uninterrupted_digest(prof, shard_dataset(prof.data, prof.store).uri)


def test_sigkill_during_an_async_save_keeps_the_previous_checkpoint(home, tiny_profile):
    prof = tiny_profile(*DRILL, "tracking.enabled=false", "checkpoint.async=true", "faults.kind=slow_checkpoint",
                        "faults.rank=0", "faults.step=20", "faults.delay_s=60", "faults.attempts=1")
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    root = ckpt.checkpoints_uri(prof.store.root, "async")
    in_flight = Path(ckpt.step_uri(root, 20))

    def kill_when_written():
        wait_for(lambda: in_flight.is_dir() and list(in_flight.glob(".metadata")), 120, "the async write of step 20")
        time.sleep(0.3)
        assert not (in_flight / ckpt.MANIFEST).exists()  # written, not committed: the save is in flight
        workers(str(home))[1].send_signal(signal.SIGKILL)

    import threading

    killer = threading.Thread(target=kill_when_written)
    killer.start()
    first = train_attempt(prof, "async", dataset_uri, attempt=1)
    killer.join()
    assert first.result is None and first.outcome.wall_s < 60  # torn down at once, not after the held commit
    assert ckpt.inspect_checkpoint(ckpt.step_uri(root, 10)).valid

    second = train_attempt(prof, "async", dataset_uri, attempt=2)
    assert second.result is not None, "\n".join(second.outcome.tail)
    assert second.result["resumed_from"] == ckpt.step_uri(root, 10)
    skipped = {s["uri"]: s["reason"] for s in second.result["skipped_checkpoints"]}
    assert str(in_flight) in skipped  # (a rank may also have begun step 30's save while 20's commit was held)
    assert all("not committed" in reason for reason in skipped.values())
    assert second.result["model_digest"] == uninterrupted_digest(tiny_profile(*DRILL, "tracking.enabled=false"), dataset_uri)
