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
from typing import Any, Callable

from trainer.config import Profile
from trainer.proc import die_with_parent, free_port, kill_group


@dataclass
class JobOutcome:
    returncode: int | None
    wall_s: float
    timed_out: bool = False
    tail: list[str] = field(default_factory=list)
    stopped_by: Any = None  # the watchdog's fatal finding, when it ended the job

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and self.stopped_by is None


def torchrun_command(profile: Profile, module: str, args: list[str]) -> list[str]:
    c = profile.cluster
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(c.nodes), "--nproc-per-node", str(c.procs_per_node),
           "--max-restarts", "0", "--monitor-interval", "0.2"]
    if c.nodes == 1:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{c.master_port or free_port()}", "--rdzv-id", f"trainpipe-{os.getpid()}"]
    elif c.simulate_nodes:
        return _local_nodes_command(cmd, c, module, args)
    else:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{c.master_addr}:{c.master_port or 29500}", "--node-rank", str(c.node_rank)]
    return cmd + ["-m", module, *args]


def _local_nodes_command(base: list[str], c, module: str, args: list[str]) -> list[str]:
    """Every node's torchrun agent on this machine (static rendezvous), under one shell that the
    supervisor owns as a process group: a local stand-in for a multi-node cluster."""
    import shlex
    import socket

    port = c.master_port or free_port()
    agents = []
    for node in range(c.nodes):
        agent = [*base, "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", module, *args]
        agents.append(f"TRAINPIPE_NODE_NAME={shlex.quote(f'{socket.gethostname()}-node{node}')} {shlex.join(agent)} & p{node}=$!")
    waits = "; ".join(f"wait $p{n} || rc=1" for n in range(c.nodes))
    return ["bash", "-c", f"rc=0; {'; '.join(agents)}; {waits}; exit $rc"]


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
    watch: Callable[[], Any] | None = None,
    poll_s: float = 0.5,
    before_teardown: Callable[[Any], float | None] | None = None,
) -> JobOutcome:
    """Run ``cmd`` as the leader of a new process group; always leave nothing behind.

    ``watch`` is polled every ``poll_s``; a fatal finding it returns ends the job
    (after ``before_teardown(finding)``, e.g. asking the ranks for their stacks).
    """
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
    timed_out, finding = False, None
    deadline = start + timeout_s if timeout_s else None
    try:
        while proc.poll() is None:
            if deadline and time.monotonic() > deadline:
                timed_out = True
                break
            try:
                proc.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
            finding = watch() if watch and proc.poll() is None else None
            if finding is not None:
                let_exit_s = before_teardown(finding) if before_teardown else None
                if let_exit_s:  # e.g. torchrun tearing itself down after a crash, printing its root cause
                    try:
                        proc.wait(timeout=let_exit_s)
                    except subprocess.TimeoutExpired:
                        pass
                break
    finally:
        # Also on KeyboardInterrupt / cancellation: the whole group goes, workers included.
        _teardown(proc)
        reader.join(timeout=5)
    return JobOutcome(proc.returncode, time.monotonic() - start, timed_out, list(tail), finding)


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
    findings: list = field(default_factory=list)  # everything the watchdog found, fatal or not
    scores: list = field(default_factory=list)  # straggler scores per window

    @property
    def last_step(self) -> int | None:
        steps = [p["step"] for p in self.progress.values() if p.get("step", -1) >= 0]
        return max(steps) if steps else None


def run_module(profile: Profile, module: str, args: list[str], result_flag: str, timeout_s: float,
               on_line: Callable[[str], None] | None = None, env: dict[str, str] | None = None,
               beacons: bool = False, on_finding: Callable[[Any], None] | None = None) -> AttemptResult:
    """Run ``python -m module`` on every rank under torchrun; rank 0 writes JSON to the path given by ``result_flag``.

    The ranks get the resolved profile as a local file: each node's launcher holds
    its profile, and the store's credentials are inside it.
    """
    import json
    import tempfile
    from pathlib import Path

    from trainer.beacon import ENV as BEACON_ENV
    from trainer.beacon import BeaconServer

    from trainer.watchdog import Watchdog

    server = BeaconServer() if beacons else None
    can_shrink = profile.cluster.nodes > profile.cluster.min_nodes
    watchdog = Watchdog(profile.watchdog, server, profile.cluster.world_size, can_shrink) if server and profile.watchdog.enabled else None
    try:
        with tempfile.TemporaryDirectory(prefix="trainpipe-job-") as tmp:
            out, profile_path = Path(tmp) / "result.json", Path(tmp) / "profile.yaml"
            profile_path.write_text(profile.to_yaml())
            cmd = torchrun_command(profile, module, ["--profile", str(profile_path), *args, result_flag, str(out)])
            job_env = {**worker_env(profile), **(env or {})}
            if server:
                job_env[BEACON_ENV] = server.address
            outcome = run_job(cmd, job_env, on_line=on_line, timeout_s=timeout_s,
                              watch=(lambda: _watch(watchdog, on_finding)) if watchdog else None, poll_s=profile.watchdog.poll_s,
                              before_teardown=lambda f: _before_teardown(f, server, profile, on_line))
            result = json.loads(out.read_text()) if outcome.ok and out.exists() else None
    finally:
        if server:
            server.close()
    progress = {r: p.as_dict() for r, p in server.snapshot().items()} if server else {}
    return AttemptResult(outcome, result, progress, server.first_step_at if server else None, server.first_step if server else None,
                         findings=list(watchdog.findings) if watchdog else [], scores=list(watchdog.scores) if watchdog else [])


def _watch(watchdog, on_finding: Callable[[Any], None] | None):
    """Poll the watchdog; report non-fatal findings (stragglers under 'warn') as they come."""
    reported = len(watchdog.findings)
    finding = watchdog.check()
    for f in watchdog.findings[reported:]:
        if on_finding and not f.fatal:
            on_finding(f)
    return finding if finding is not None and finding.fatal else None


def _before_teardown(finding, server, profile: Profile, on_line: Callable[[str], None] | None) -> float | None:
    """Name the finding, ask live ranks for their Python stacks (faulthandler on SIGUSR1), give them a moment."""
    import signal as _signal

    if on_line:
        on_line(f"watchdog: {finding.kind} on rank {finding.rank}: {finding.detail}")
    if finding.kind == "crash":
        return 2.0  # torchrun is already tearing down; let it print its root cause (exit code, signal)
    for p in server.snapshot().values():
        pid = p.extra.get("pid")
        if pid:  # a stopped rank just keeps the signal pending
            try:
                os.kill(int(pid), _signal.SIGUSR1)
            except (ProcessLookupError, TypeError, ValueError):
                pass
    time.sleep(profile.watchdog.stack_dump_s)
    return None


def train_attempt(profile: Profile, run_name: str, dataset_uri: str, mlflow_run_id: str | None = None,
                  on_line: Callable[[str], None] | None = None, attempt: int = 1,
                  env: dict[str, str] | None = None, on_finding: Callable[[Any], None] | None = None) -> AttemptResult:
    """One training attempt: torchrun + ``python -m trainer``, resuming from the run's newest valid checkpoint."""
    args = ["--run-name", run_name, "--dataset-uri", dataset_uri]
    if profile.tracking.enabled and mlflow_run_id:
        args += ["--tracking-uri", profile.tracking.tracking_uri, "--mlflow-run-id", mlflow_run_id]
    return run_module(profile, "trainer", args, "--result", profile.train.timeout_s, on_line,
                      env={"TRAINPIPE_ATTEMPT": str(attempt), **(env or {})}, beacons=True, on_finding=on_finding)


def preflight_job(profile: Profile, on_line: Callable[[str], None] | None = None) -> AttemptResult:
    return run_module(profile, "trainer.preflight", [], "--out", profile.preflight.timeout_s, on_line)
