"""Owns one torchrun job: launch it in its own process group, stream its output, tear it down.

torchrun is started with ``--max-restarts 0``: restarts have one owner, the
Prefect task's retries (DESIGN §4), so each attempt is a fresh launch that
resumes from the newest committed checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from trainer.config import Profile
from trainer.proc import die_with_parent, free_port, kill_group


@dataclass
class JobOutcome:
    returncode: int | None
    wall_s: float
    timed_out: bool = False
    tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def torchrun_command(profile: Profile, module: str, args: list[str]) -> list[str]:
    c = profile.cluster
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(c.nodes), "--nproc-per-node", str(c.procs_per_node),
           "--max-restarts", "0", "--monitor-interval", "0.2"]
    if c.nodes == 1:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{c.master_port or free_port()}", "--rdzv-id", f"trainpipe-{os.getpid()}"]
    else:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{c.master_addr}:{c.master_port or 29500}", "--node-rank", str(c.node_rank)]
    return cmd + ["-m", module, *args]


def worker_env(profile: Profile) -> dict[str, str]:
    env = dict(os.environ)
    threads = str(profile.cluster.threads_per_proc)
    env.update({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1", "TRAINPIPE_SUPERVISED": "1"})
    # torchrun's children must import trainer even when it is not installed (plain checkout).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def run_job(
    cmd: list[str],
    env: dict[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
    tail_lines: int = 80,
) -> JobOutcome:
    """Run ``cmd`` as the leader of a new process group; always leave nothing behind."""
    start = time.monotonic()
    tail: deque[str] = deque(maxlen=tail_lines)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent,
        text=True,
        bufsize=1,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if on_line:
                on_line(line)

    reader = threading.Thread(target=pump, name="job-output", daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        # Also on KeyboardInterrupt / cancellation: the whole group goes, workers included.
        _teardown(proc)
        reader.join(timeout=5)
    return JobOutcome(proc.returncode, time.monotonic() - start, timed_out, list(tail))


def _teardown(proc: subprocess.Popen) -> None:
    # The leader of its own session, so pgid == pid; survivors of a clean exit are killed too.
    kill_group(proc.pid, grace_s=3.0, reap=proc.poll)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class AttemptResult:
    outcome: JobOutcome
    result: dict | None  # rank 0's summary of the attempt; None when it did not finish
    progress: dict[int, dict] = field(default_factory=dict)  # each rank's last beacon
    first_step_at: float | None = None  # wall clock of the first training step's first beacon
    first_step: int | None = None  # that step (1-based)

    @property
    def last_step(self) -> int | None:
        steps = [p["step"] for p in self.progress.values() if p.get("step", -1) >= 0]
        return max(steps) if steps else None


def run_module(profile: Profile, module: str, args: list[str], result_flag: str, timeout_s: float,
               on_line: Callable[[str], None] | None = None, env: dict[str, str] | None = None,
               beacons: bool = False) -> AttemptResult:
    """Run ``python -m module`` on every rank under torchrun; rank 0 writes JSON to the path given by ``result_flag``.

    The ranks get the resolved profile as a local file: each node's launcher holds
    its profile, and the store's credentials are inside it.
    """
    import json
    import tempfile
    from pathlib import Path

    from trainer.beacon import ENV as BEACON_ENV
    from trainer.beacon import BeaconServer

    server = BeaconServer() if beacons else None
    try:
        with tempfile.TemporaryDirectory(prefix="trainpipe-job-") as tmp:
            out, profile_path = Path(tmp) / "result.json", Path(tmp) / "profile.yaml"
            profile_path.write_text(profile.to_yaml())
            cmd = torchrun_command(profile, module, ["--profile", str(profile_path), *args, result_flag, str(out)])
            job_env = {**worker_env(profile), **(env or {})}
            if server:
                job_env[BEACON_ENV] = server.address
            outcome = run_job(cmd, job_env, on_line=on_line, timeout_s=timeout_s)
            result = json.loads(out.read_text()) if outcome.ok and out.exists() else None
    finally:
        if server:
            server.close()
    progress = {r: p.as_dict() for r, p in server.snapshot().items()} if server else {}
    return AttemptResult(outcome, result, progress, server.first_step_at if server else None, server.first_step if server else None)


def train_attempt(profile: Profile, run_name: str, dataset_uri: str, mlflow_run_id: str | None = None,
                  on_line: Callable[[str], None] | None = None, attempt: int = 1,
                  env: dict[str, str] | None = None) -> AttemptResult:
    """One training attempt: torchrun + ``python -m trainer``, resuming from the run's newest valid checkpoint."""
    args = ["--run-name", run_name, "--dataset-uri", dataset_uri]
    if profile.tracking.enabled and mlflow_run_id:
        args += ["--tracking-uri", profile.tracking.tracking_uri, "--mlflow-run-id", mlflow_run_id]
    return run_module(profile, "trainer", args, "--result", profile.train.timeout_s, on_line,
                      env={"TRAINPIPE_ATTEMPT": str(attempt), **(env or {})}, beacons=True)


def preflight_job(profile: Profile, on_line: Callable[[str], None] | None = None) -> AttemptResult:
    return run_module(profile, "trainer.preflight", [], "--out", profile.preflight.timeout_s, on_line)
