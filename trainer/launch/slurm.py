"""The slurm launcher: each training attempt is one sbatch job; its srun starts a host supervisor on every node.

The train task renders the job script (``sbatch_script``), submits it with
``sbatch --parsable``, follows it with ``squeue`` (and ``scontrol show job``
once it left the queue: ``sacct`` needs accounting storage, which many small
clusters lack), streams the job's output file into its log, and cancels the job
with ``scancel`` when the run is cancelled, the attempt runs past
``train.timeout_s`` or the follower itself is stopped. Every node's host
supervisor (``python -m trainpipe.trainer.supervise.host``) writes its part's outcome to
``launcher.shared_dir``; ``job_outcome`` makes the attempt's outcome from them,
the same ``AttemptOutcome`` the local launcher returns.

Secrets (the beacon token, the store's credentials) reach the nodes through
sbatch's environment (``--export=ALL``), never through the script or a command
line.

A job outlives its orchestrator when that is SIGKILLed: each job is recorded in
the run's records (``trainer.launch.jobs``) from its submission until it is
seen to end, and ``stop_left`` cancels one a dead orchestrator left running.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from trainpipe.trainer import grammar
from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import LaunchError
from trainpipe.trainer.launch import jobs
from trainpipe.trainer.launch.jobs import LiveJob
from trainpipe.trainer.launch.outcome import LiveView, hosts_outcome, read_host_parts
from trainpipe.trainer.launcher import (
    AttemptOutcome,
    LauncherSpec,
    LaunchRequest,
    Watch,
    register_launcher,
    stage_timeout,
)
from trainpipe.trainer.layout import RUN_NAME, store_tag
from trainpipe.trainer.protocol import BEACON_TOKEN_ENV

log = logging.getLogger("trainpipe.slurm")


def sbatch_script(
    profile: Profile,
    run_name: str,
    dataset_uri: str | None,
    attempt: int,
    folder: Path,
    mlflow_run_id: str | None = None,
    stage: str = "train",
) -> str:
    """The job script of one attempt of ``stage`` (train, or the preflight probes): one task per node, each a host
    supervisor; node 0 is the first node."""
    c, la = profile.cluster, profile.launcher
    # Every value below was checked against the grammar of a job script (trainer/config.py, trainer/grammar.py);
    # these are checked here because they do not come from the profile.
    for value, pattern in ((run_name, RUN_NAME), (str(folder), grammar.SCRIPT_PATH)):
        if not grammar.matches(pattern, value):
            raise LaunchError(f"{value!r} cannot go into a Slurm job script")
    if mlflow_run_id is not None and not grammar.matches(grammar.MLFLOW_RUN_ID, mlflow_run_id):
        raise LaunchError(f"{mlflow_run_id!r} is not an MLflow run id")
    python = la.python or sys.executable
    minutes = math.ceil(stage_timeout(profile, stage)[1] / 60) + 1  # Slurm's limit backs up the task's own
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name(run_name, attempt, profile.store.root, stage)}",
        f"#SBATCH --nodes={c.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={c.procs_per_node * c.threads_per_proc}",
        f"#SBATCH --time={minutes}",
        f"#SBATCH --output={folder}/slurm-%j.out",
        "#SBATCH --export=ALL",
    ]
    lines += [f"#SBATCH --partition={la.partition}"] if la.partition else []
    lines += [f"#SBATCH --account={la.account}"] if la.account else []
    lines += [f"#SBATCH {option}" for option in la.sbatch_options]
    lines += [f"#SBATCH --exclude={','.join(la.excluded_nodes)}"] if la.excluded_nodes else []
    host = [python, "-m", "trainpipe.trainer.supervise.host", "--profile", str(folder / "profile.yaml")]
    host += ["--run-name", run_name, "--stage", stage, "--attempt", str(attempt), "--outcome-dir", str(folder)]
    host += ["--dataset-uri", dataset_uri] if stage == "train" and dataset_uri else []
    # rank 0's host relays its metrics to the run (docs/architecture.md §7)
    if stage == "train" and profile.tracking.enabled and mlflow_run_id:
        host += ["--mlflow-run-id", mlflow_run_id]
    lines += [
        "set -eu",
        "# node 0 is the allocation's first node: it hosts the rendezvous and the job's watchdog",
        'master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'srun --ntasks-per-node=1 --kill-on-bad-exit=0 {shlex.join(host)} --set cluster.master_addr="$master"',
    ]
    return "\n".join(lines) + "\n"


def job_name(run_name: str, attempt: int, store_root: str, stage: str = "train") -> str:
    """The Slurm job name of a run's attempt (``sbatch_script``'s --job-name): how a recorded job id is confirmed
    to be this run's before it is cancelled. It ends in the attempt's digits and the store's tag, so neither two
    runs nor two stores' runs of one name share a job name."""
    return f"trainpipe-{run_name}-{attempt if stage == 'train' else stage}-{store_tag(store_root)}"


UNREACHABLE = "UNREACHABLE"
UNREACHABLE_FOR_S = 300.0  # how long the follower waits for slurmctld to answer again before giving the job up
STOP_WAIT_S = 60.0  # how long stopping a job left running waits for it to leave the queue


class SlurmJob:
    """A submitted job, by id."""

    def __init__(self, job_id: str, env: dict[str, str]):
        self.job_id, self.env = job_id, env

    @classmethod
    def submit(cls, script: Path, env: dict[str, str]) -> SlurmJob:
        proc = _slurm(["sbatch", "--parsable", str(script)], env)
        if proc.returncode != 0:
            raise LaunchError(f"sbatch refused the job: {_first_line(proc.stderr)}")
        job_id = proc.stdout.strip().split(";")[0]
        if not grammar.matches(grammar.SLURM_JOB_ID, job_id):
            raise LaunchError(f"sbatch answered {job_id[:80]!r}, not a job id: check the job queue (squeue --me)")
        return cls(job_id, env)

    def queued_state(self) -> str | None:
        """PENDING, RUNNING, COMPLETING, …; None once the job left the queue; UNREACHABLE when squeue failed
        for another reason (slurmctld restarting, say)."""
        proc = _slurm(["squeue", "-h", "-j", self.job_id, "-o", "%T"], self.env)
        if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
            return UNREACHABLE
        return proc.stdout.strip() or None

    def queued(self) -> tuple[str, str] | None:
        """(state, job name) while the job is in the queue; None once it left. LaunchError when squeue fails."""
        proc = _slurm(["squeue", "-h", "-j", self.job_id, "-o", "%T|%j"], self.env)
        if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
            raise LaunchError(f"squeue could not say whether slurm job {self.job_id} runs: {_first_line(proc.stderr)}")
        state, _, name = proc.stdout.strip().partition("|")
        return (state, name) if state else None

    def final(self) -> tuple[str, str]:
        """(state, exit code as Slurm writes it, e.g. 0:0) of a job that left the queue."""
        proc = _slurm(["scontrol", "show", "job", "-o", self.job_id], self.env)
        state = re.search(r"JobState=(\S+)", proc.stdout)
        code = re.search(r"\bExitCode=(\S+)", proc.stdout)
        return (state.group(1) if state else "UNKNOWN", code.group(1) if code else "?")

    def node_names(self) -> dict[int, str]:
        """Each node rank's host (SLURM_NODEID counts the allocation's nodes in ``scontrol show hostnames``
        order); empty when Slurm no longer says."""
        shown = _slurm(["scontrol", "show", "job", "-o", self.job_id], self.env).stdout
        nodelist = re.search(r"\bNodeList=(\S+)", shown)
        if nodelist is None or nodelist.group(1) == "(null)":
            return {}
        hosts = _slurm(["scontrol", "show", "hostnames", nodelist.group(1)], self.env).stdout.split()
        return {i: host for i, host in enumerate(hosts) if grammar.matches(grammar.NODE_NAME, host)}

    def cancel(self, wait_s: float = 30.0) -> bool:
        """scancel, then wait until the job left the queue (its steps and every process of theirs are gone);
        whether it did."""
        _slurm(["scancel", self.job_id], self.env)
        deadline = time.monotonic() + wait_s
        while True:
            queued = self.queued_state() is not None  # UNREACHABLE too: not known to be gone
            if not queued or time.monotonic() > deadline:
                return not queued
            time.sleep(0.2)


def _slurm(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]} is not installed here: launcher.kind=slurm needs Slurm's tools") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{argv[0]} did not answer within 60s: is slurmctld up?") from None


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["(no message)"])[-1][:300]


class _Output:
    """The job's output file, line by line as it grows."""

    def __init__(self, path: Path, on_line: Callable[[str], None] | None):
        self.path, self.on_line, self.pos, self.tail = path, on_line, 0, []

    def pump(self) -> None:
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as fh:
            fh.seek(self.pos)
            data = fh.read()
            end = data.rfind(b"\n") + 1
            self.pos += end
            for line in data[:end].decode(errors="replace").splitlines():
                self.tail = [*self.tail[-79:], line]
                if self.on_line:
                    self.on_line(line)


def launch_slurm(request: LaunchRequest, watch: Watch) -> AttemptOutcome:
    """One attempt of the request's stage as a Slurm job, followed to its end; the same outcome as the local
    launcher's. Preflight: every node's host probes its own GPUs and facts and joins the cross-node tests; the
    report is node 0's result.

    ``watch.on_progress`` gets node 0's latest view of every rank at each look; an exception it raises (the run
    was cancelled) cancels the job and propagates. Rank 0's host sends its metrics to the MLflow run itself, so
    ``tracking.tracking_uri`` must be reachable from the nodes (an MLflow server, not a local SQLite file).
    """
    stage = request.stage
    profile, run_name, attempt, dataset_uri = request.profile, request.run_name, request.attempt, request.dataset_uri
    mlflow_run_id, on_line = request.mlflow_run_id, watch.on_line
    part = f"attempt-{attempt}" if stage == "train" else stage
    folder = Path(profile.launcher.shared_dir) / run_name / f"{part}-{secrets.token_hex(3)}"
    folder.mkdir(parents=True)
    (folder / "profile.yaml").write_text(profile.public_yaml())
    script = folder / "job.sh"
    script.write_text(sbatch_script(profile, run_name, dataset_uri, attempt, folder, mlflow_run_id, stage))
    timeout_key, timeout_s = stage_timeout(profile, stage)
    view = LiveView(watch)
    env = {**os.environ, **profile.private_env(), BEACON_TOKEN_ENV: secrets.token_hex(16)}
    start = time.monotonic()
    job = SlurmJob.submit(script, env)
    log.info("%s is slurm job %s (%s)", part, job.job_id, script)
    output = _Output(folder / f"slurm-{job.job_id}.out", on_line)
    timed_out, ended, unreachable_since, live, gone = False, False, None, None, False
    try:
        # Recorded before it is followed: should this process be killed, the run's next start stops the job. A
        # job that cannot be recorded is cancelled (finally) rather than run unseen.
        # (A preflight job writes nothing of the run's: it is not recorded, its --time bounds it.)
        live = jobs.remember(profile, run_name, attempt, job_id=job.job_id) if stage == "train" else None
        while (state := job.queued_state()) is not None:
            if state == UNREACHABLE:
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > UNREACHABLE_FOR_S:
                    raise LaunchError(f"squeue has not answered for {UNREACHABLE_FOR_S:g}s: is slurmctld up?")
            else:
                unreachable_since = None
            output.pump()
            if watch.on_progress is not None or watch.on_finding is not None:
                view(_progress(folder))
            if time.monotonic() - start > timeout_s:
                timed_out = True
                break
            time.sleep(profile.launcher.poll_s if state != "COMPLETING" else 0.2)
        ended = not timed_out
    finally:
        if not ended:  # cancelled, timed out, or this follower interrupted: the job must not outlive it
            gone = job.cancel()
        output.pump()
        if live is not None and (ended or gone):  # one still in the queue stays recorded: the next attempt stops it
            jobs.forget_quietly(profile.store, run_name, live)
    final, code = job.final()
    read = read_host_parts(LocalFileSystem(), [str(p) for p in folder.glob("host-*.json")], profile.cluster.nodes)
    records = read.parts
    returncode = int(code.split(":")[0]) if code.split(":")[0].isdigit() else None
    name, wall_s = f"slurm job {job.job_id}", time.monotonic() - start
    ended_as = f"{name} ended {final} (exit code {code})"
    names = job.node_names() if len(records) < profile.cluster.nodes else {}  # to name a host that never said
    timeout = (timeout_key, timeout_s)
    return hosts_outcome(
        stage, profile, attempt, name, ended_as, returncode, records, timed_out, wall_s, output.tail, timeout, names,
        unreadable=read,
    )  # fmt: skip


def stop_left(profile: Profile, run_name: str, job: LiveJob) -> tuple[bool, str] | None:
    """Cancel a recorded job of the run that its orchestrator left running, and wait until it left the queue.

    None when it no longer runs; (False, why) when the job of that id is not this run's (a stale or planted
    record: left alone); (True, what was done) when it was cancelled. LaunchError when squeue cannot say, or the
    job is still queued after ``STOP_WAIT_S``: a new attempt must not start beside it."""
    env = {**os.environ}
    found = SlurmJob(job.job_id, env).queued()  # job.job_id is digits (LiveJob checks), and no shell runs it
    if found is None:
        return None
    state, name = found
    if name != job_name(run_name, job.attempt, profile.store.root):
        return False, (
            f"slurm job {job.job_id} recorded in run {run_name}'s jobs is not one of its jobs "
            f"(it is named {name[:80]!r}): left alone"
        )
    if not SlurmJob(job.job_id, env).cancel(wait_s=STOP_WAIT_S):
        raise LaunchError(
            f"slurm job {job.job_id} of run {run_name} (attempt {job.attempt}) is still queued {STOP_WAIT_S:g}s "
            f"after scancel: cancel it by hand (scancel {job.job_id}), then start the run again"
        )
    by = f"pid {job.pid} on {job.host}" + (f", owner {job.owner}" if job.owner else "")
    return True, (
        f"cancelled slurm job {job.job_id} (attempt {job.attempt}, {state[:20]}), left running by its orchestrator "
        f"({by}): one writer per run"
    )


def _progress(folder: Path) -> object:
    """Node 0's ``progress.json`` as it reads now; nothing while it is not there or half written."""
    try:
        return json.loads((folder / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


SPEC = register_launcher(
    LauncherSpec(
        "slurm",
        launch_slurm,
        frozenset({"train", "preflight"}),
        "an sbatch job whose srun starts one host supervisor per node",
    )
)
