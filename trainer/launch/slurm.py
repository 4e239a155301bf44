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
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shlex
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from fsspec.implementations.local import LocalFileSystem
from pydantic import Field, field_validator

from trainpipe.trainer import grammar
from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import LaunchError, TrainpipeError
from trainpipe.trainer.launch import held, jobs
from trainpipe.trainer.launch.jobs import LiveJob
from trainpipe.trainer.launch.outcome import PART_NAME, LiveView, forked_warm, hosts_outcome, read_host_parts
from trainpipe.trainer.launcher import (
    AttemptOutcome,
    LauncherOptions,
    LauncherSpec,
    LaunchRequest,
    Watch,
    register_launcher,
    stage_timeout,
)
from trainpipe.trainer.private import own_folder
from trainpipe.trainer.protocol import BEACON_TOKEN_ENV
from trainpipe.trainer.store_paths import RUN_NAME, RUN_PROFILE, store_tag
from trainpipe.trainer.supervise import allocation
from trainpipe.trainer.supervise.allocation import LOOK_S, AttemptRequest, request_name

log = logging.getLogger("trainpipe.slurm")


class SlurmOptions(LauncherOptions):
    """``launcher.slurm``: what the job script asks of the allocation. Each value goes into an ``#SBATCH`` line,
    checked against that place's grammar (trainer/grammar.py), so none can start a line or an option of its own."""

    kind: ClassVar[str] = "slurm"
    partition: str | None = Field(default=None, description="sbatch --partition (None: the cluster's default).")
    account: str | None = Field(default=None, description="sbatch --account.")
    sbatch_options: list[str] = Field(
        default_factory=list, description="More sbatch options, one per item (e.g. --gpus-per-node=8, --exclusive)."
    )

    @field_validator("partition", "account")
    @classmethod
    def _slurm_name(cls, value: str | None) -> str | None:
        if value is not None and not grammar.matches(grammar.SLURM_NAME, value):
            raise ValueError("not a Slurm name (letters, digits, '_', '.', '+', '-')")
        return value

    @field_validator("sbatch_options")
    @classmethod
    def _options(cls, value: list[str]) -> list[str]:
        for option in value:
            if problem := grammar.sbatch_option_problem(option):
                raise ValueError(problem)
        return value

    def check(self, profile: Profile) -> None:
        if not grammar.matches(grammar.SCRIPT_PATH, profile.launcher.shared_dir):
            raise ValueError(
                f"launcher.shared_dir={profile.launcher.shared_dir!r} goes into the job script's #SBATCH lines: use "
                "an absolute path of letters, digits and . _ / + , : @ = - (no blanks or '%')"
            )


def sbatch_script(
    profile: Profile, run_name: str, attempt: int, folder: Path, stage: str = "train", attempts: int = 1
) -> str:
    """The job script of ``stage`` submitted at ``attempt``: one task per node, each a host supervisor; node 0 is
    the first node. A train job's hosts serve the attempts asked of them in ``folder`` (the first is
    ``attempt``'s; its time limit covers ``attempts`` of them and their waits) until they are stopped; a preflight
    job's hosts probe once."""
    c, la, options = profile.cluster, profile.launcher, SlurmOptions.of(profile)
    # Every value below was checked against the grammar of a job script (SlurmOptions, trainer/grammar.py);
    # these are checked here because they do not come from the profile.
    for value, pattern in ((run_name, RUN_NAME), (str(folder), grammar.SCRIPT_PATH)):
        if not grammar.matches(pattern, value):
            raise LaunchError(f"{value!r} cannot go into a Slurm job script")
    python = la.python or sys.executable
    # Slurm's limit backs up the task's own: a train job may serve every attempt of the run (and their waits)
    limit_s = stage_timeout(profile, stage)[1]
    if stage == "train" and attempts > 1:
        limit_s = (limit_s + held.idle_s(profile)) * attempts
    minutes = math.ceil(limit_s / 60) + 1
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name(run_name, attempt, profile.store.root, stage)}",
        f"#SBATCH --nodes={c.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={c.procs_per_node * c.threads_per_proc}",
        f"#SBATCH --time={minutes}",
        f"#SBATCH --output={folder}/slurm-%j.out",
        "#SBATCH --export=ALL",
        "#SBATCH --no-requeue",  # a requeued job would start its hosts afresh beside a follower that asks no more
    ]
    lines += [f"#SBATCH --partition={options.partition}"] if options.partition else []
    lines += [f"#SBATCH --account={options.account}"] if options.account else []
    lines += [f"#SBATCH {option}" for option in options.sbatch_options]
    lines += [f"#SBATCH --exclude={','.join(la.excluded_nodes)}"] if la.excluded_nodes else []
    host = [python, "-m", "trainpipe.trainer.supervise.host", "--run-name", run_name]
    if stage == "train":  # each host's part serves the attempts asked of its job (trainer/supervise/allocation.py)
        host += ["--serve", str(folder), "--idle-s", f"{held.idle_s(profile):g}"]
    else:
        host += ["--profile", str(folder / "profile.yaml"), "--stage", stage, "--outcome-dir", str(folder)]
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


class Allocation:
    """A train job whose hosts' parts stand as long as it does and run each attempt asked of them
    (``trainer.supervise.allocation``): a retry in it forks its agents from the hosts' warm hosts instead of
    waiting in the queue and starting cold interpreters.

    ``folder`` is the attempt's folder that submitted it: its script, its output and the requests; ``token``
    the job's secret (its beacons' token, and the key its requests are signed with)."""

    def __init__(self, job: SlurmJob, profile: Profile, run_name: str, folder: Path, token: str, live: LiveJob | None):
        self.job, self.profile, self.run_name, self.folder, self.token = job, profile, run_name, folder, token
        self.key, self.live = allocation_key(profile, run_name), live
        self.output = _Output(folder / f"slurm-{job.job_id}.out", None)

    @classmethod
    def submit(cls, profile: Profile, run_name: str, attempt: int, folder: Path) -> Allocation:
        script = folder / "job.sh"
        attempts = profile.train.max_retries + 2 - attempt if held.keeping() else 1  # the attempts it may serve
        write_new(script, sbatch_script(profile, run_name, attempt, folder, attempts=max(attempts, 1)))
        token = secrets.token_hex(16)
        job = SlurmJob.submit(script, {**os.environ, **profile.private_env(), BEACON_TOKEN_ENV: token})
        log.info("attempt-%d is slurm job %s (%s)", attempt, job.job_id, script)
        try:
            # Recorded before it is followed: should this process be killed, the run's next start stops the job.
            live = jobs.remember(profile, run_name, attempt, job_id=job.job_id)
        except BaseException:  # a job that cannot be recorded is cancelled rather than run unseen
            job.cancel()
            raise
        return cls(job, profile, run_name, folder, token, live)

    def ask(self, request: LaunchRequest, folder: Path, profile_text: str) -> None:
        """Every host of the job runs ``request``'s attempt next, with the profile written into ``folder``: the
        request names the SHA-256 of ``profile_text``, what this process wrote, never what the file holds now."""
        signed = AttemptRequest.signed(
            self.token, profile_text, attempt=request.attempt, folder=folder.name, **_inputs(request)
        )
        try:
            signed.checked(self.token)  # what the hosts would leave alone is said here, not waited for
        except ValueError as exc:
            raise LaunchError(
                f"attempt {request.attempt} cannot be asked of slurm job {self.job.job_id}: {exc}"
            ) from None
        self.output.tail = []  # this attempt's output, not the last one's
        allocation.ask(str(self.folder), None, signed)

    def answered(self, attempt: int) -> None:
        """The attempt is over: its request goes, so that no host runs it again."""
        with contextlib.suppress(OSError):
            (self.folder / request_name(attempt)).unlink()

    def end(self, replaced: bool = False) -> None:
        """Ask the hosts to end and wait until the job left the queue (scancel when it does not, soon); when
        ``replaced``, each host leaves its memory tier for the next job's host on its node."""
        with contextlib.suppress(OSError, TrainpipeError):
            allocation.stop(str(self.folder), None, replaced=replaced)
        deadline = time.monotonic() + END_WAIT_S
        with contextlib.suppress(LaunchError):
            while self.job.queued_state() is not None and time.monotonic() < deadline:
                time.sleep(0.2)
        self.close(cancel=True)

    def close(self, cancel: bool) -> None:
        try:
            gone = self.job.cancel() if cancel else True
        except LaunchError as exc:  # the record stays: the run's next start stops the job
            log.warning("slurm job %s may still run: %s", self.job.job_id, exc)
            gone = False
        self.output.pump()
        if self.live is not None and gone:  # one still in the queue stays recorded: the next attempt stops it
            jobs.forget_quietly(self.profile.store, self.run_name, self.live)
            self.live = None


END_WAIT_S = 15.0  # how long an ended job's hosts get to leave by themselves


def allocation_key(profile: Profile, run_name: str) -> str:
    """What a held job was made from, its hosts' environment included (the store's settings, the credentials
    they were submitted with): an attempt whose key differs (another node count, an excluded node, other sbatch
    options, rotated credentials) needs a job of its own."""
    env = {**profile.private_env(), **{k: v for k, v in os.environ.items() if k in held.CREDENTIAL_ENV}}
    secrets_hash = hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()
    return sbatch_script(profile, run_name, 1, Path("/key")) + secrets_hash


def launch_slurm(request: LaunchRequest, watch: Watch) -> AttemptOutcome:
    """One attempt of the request's stage on Slurm, followed to its end; the same outcome as the local
    launcher's. Training: the attempt runs in the job held for the run (``trainer.launch.held``) when that job
    fits, else in a new sbatch job. Preflight: every node's host probes its own GPUs and facts and joins the
    cross-node tests; the report is node 0's result.

    ``watch.on_progress`` gets node 0's latest view of every rank at each look; an exception it raises (the run
    was cancelled) cancels the job and propagates. Rank 0's host sends its metrics to the MLflow run itself, so
    ``tracking.tracking_uri`` must be reachable from the nodes (an MLflow server, not a local SQLite file).
    """
    if request.stage != "train":
        return _launch_once(request, watch)
    profile, run_name, attempt = request.profile, request.run_name, request.attempt
    folder = job_folder(profile, run_name, f"attempt-{attempt}")
    profile_text = write_new(folder / RUN_PROFILE, profile.public_yaml())
    key = allocation_key(profile, run_name)
    job = held.take(
        run_name,
        profile,
        lambda j: isinstance(j, Allocation) and j.key == key and j.job.queued_state() in ("RUNNING", "PENDING"),
    )
    reused = isinstance(job, Allocation)
    slurm_job = job if isinstance(job, Allocation) else Allocation.submit(profile, run_name, attempt, folder)
    slurm_job.output.on_line = watch.on_line
    if reused:
        log.info("attempt-%d runs in slurm job %s, whose hosts stayed up", attempt, slurm_job.job.job_id)
    start, kept, timed_out, job_ended, followed = time.monotonic(), False, False, False, False
    try:
        slurm_job.ask(request, folder, profile_text)
        timed_out, job_ended = _follow(slurm_job, folder, profile, LiveView(watch), watch, start)
        read = read_host_parts(LocalFileSystem(), [str(p) for p in folder.glob("host-*.json")], profile.cluster.nodes)
        # every host answered and the job still stands: the next attempt may run in it
        kept = held.keeping() and not timed_out and not job_ended and len(read.parts) == profile.cluster.nodes
        followed = True
    finally:
        slurm_job.answered(attempt)
        if kept:
            held.put(run_name, slurm_job)
        elif job_ended:
            slurm_job.close(cancel=False)
        elif followed and not timed_out and not held.keeping():
            slurm_job.end()  # no run holds it: its hosts leave by themselves
        else:  # cancelled, timed out, a host missing, or this follower interrupted: the job must not outlive it
            slurm_job.close(cancel=True)
    name = f"slurm job {slurm_job.job.job_id}"
    if not kept:
        final, code = slurm_job.job.final()
        ended_as = f"{name} ended {final} (exit code {code})"
        returncode = int(code.split(":")[0]) if code.split(":")[0].isdigit() else None
    else:
        node0 = next((p for p in read.parts if p.get("node_rank") == 0), {})
        ended_as, returncode = f"attempt {attempt} in {name} ended", node0.get("returncode")
    if forked_warm(read.parts):
        name += ", its hosts' agents forked warm"
    names = slurm_job.job.node_names() if len(read.parts) < profile.cluster.nodes else {}
    return hosts_outcome(
        "train", profile, attempt, name, ended_as, returncode, read.parts, timed_out, time.monotonic() - start,
        slurm_job.output.tail, stage_timeout(profile, "train"), names, unreadable=read,
    )  # fmt: skip


def job_folder(profile: Profile, run_name: str, prefix: str) -> Path:
    """A new folder of this user's only (mode 0700, made here: never one that was there) for one job's files, in
    the run's folder under ``launcher.shared_dir``, which must be this user's and writable by no one else: the
    hosts read their profile and script from it, and whoever could rename entries there could swap them.
    LaunchError in one line when it is not."""
    run_dir = Path(profile.launcher.shared_dir) / run_name
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    st = os.stat(run_dir.parent)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:  # others could rename the run's folder after the check
        raise LaunchError(
            f"launcher.shared_dir {run_dir.parent} lets others rename what lies in it (writable by its group or "
            "everyone, without the sticky bit): use a folder only you may write, or one with the sticky bit (/tmp)"
        )
    if problem := own_folder(str(run_dir), follow_links=False):
        raise LaunchError(
            f"{run_dir} {problem}, not a folder of this user's: the run's job files must be out of others' reach; "
            "remove it, or set launcher.shared_dir to a folder of your own"
        )
    folder = run_dir / f"{prefix}-{secrets.token_hex(3)}"
    folder.mkdir(mode=0o700)  # fails if it exists: a folder someone else made is never used
    os.chmod(folder, 0o700)  # whatever the umask
    return folder


def write_new(path: Path, text: str) -> str:
    """Write ``text`` into a file that did not exist (owner-only, never through a link) and return it: what is
    signed or submitted is what this process wrote."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    return text


def _inputs(request: LaunchRequest) -> dict[str, str | None]:
    tracked = request.profile.tracking.enabled and request.mlflow_run_id  # rank 0's host relays its metrics
    return {"dataset_uri": request.dataset_uri, "mlflow_run_id": request.mlflow_run_id if tracked else None}


def _follow(
    job: Allocation, folder: Path, profile: Profile, view: LiveView, watch: Watch, start: float
) -> tuple[bool, bool]:
    """Follow one attempt in ``job`` until every host wrote its part into ``folder`` (or one did and
    ``held.part_wait_s`` passed), the job left the queue or ``train.timeout_s`` passed: (timed out, job ended)."""
    timeout_s, nodes, wait_s = stage_timeout(profile, "train")[1], profile.cluster.nodes, held.part_wait_s(profile)
    look_at, unreachable_since, first_part_at = 0.0, None, None
    while True:
        now = time.monotonic()
        if now >= look_at:
            state = job.job.queued_state()
            if state is None:
                return False, True
            if state == UNREACHABLE:
                unreachable_since = unreachable_since or now
                if now - unreachable_since > UNREACHABLE_FOR_S:
                    raise LaunchError(f"squeue has not answered for {UNREACHABLE_FOR_S:g}s: is slurmctld up?")
            else:
                unreachable_since = None
            job.output.pump()
            if watch.on_progress is not None or watch.on_finding is not None:
                view.look(LocalFileSystem(), str(folder / "progress.json"))
            look_at = now + (profile.launcher.poll_s if state != "COMPLETING" else 0.2)
        parts = {int(m.group(1)) for p in folder.glob("host-*.json") if (m := PART_NAME.fullmatch(p.name))}
        if len({r for r in parts if r < nodes}) >= nodes:
            return False, False
        if parts:
            first_part_at = first_part_at or now
            if now - first_part_at > wait_s:  # the attempt ended on the others; a host that says nothing is lost
                return False, False
        if now - start > timeout_s:
            return True, False
        time.sleep(LOOK_S)


def _launch_once(request: LaunchRequest, watch: Watch) -> AttemptOutcome:
    """The preflight probes as one sbatch job, followed until it left the queue."""
    profile, stage, run_name = request.profile, request.stage, request.run_name
    folder = job_folder(profile, run_name, stage)
    write_new(folder / RUN_PROFILE, profile.public_yaml())
    script = folder / "job.sh"
    write_new(script, sbatch_script(profile, run_name, request.attempt, folder, stage))
    timeout_key, timeout_s = stage_timeout(profile, stage)
    view = LiveView(watch)
    env = {**os.environ, **profile.private_env(), BEACON_TOKEN_ENV: secrets.token_hex(16)}
    start = time.monotonic()
    job = SlurmJob.submit(script, env)
    log.info("%s is slurm job %s (%s)", stage, job.job_id, script)
    output = _Output(folder / f"slurm-{job.job_id}.out", watch.on_line)
    timed_out, ended, unreachable_since = False, False, None
    try:
        while (state := job.queued_state()) is not None:
            if state == UNREACHABLE:
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > UNREACHABLE_FOR_S:
                    raise LaunchError(f"squeue has not answered for {UNREACHABLE_FOR_S:g}s: is slurmctld up?")
            else:
                unreachable_since = None
            output.pump()
            if watch.on_progress is not None or watch.on_finding is not None:
                view.look(LocalFileSystem(), str(folder / "progress.json"))
            if time.monotonic() - start > timeout_s:
                timed_out = True
                break
            time.sleep(profile.launcher.poll_s if state != "COMPLETING" else 0.2)
        ended = not timed_out
    finally:
        if not ended:  # cancelled, timed out, or this follower interrupted: the job must not outlive it
            job.cancel()
        output.pump()
    final, code = job.final()
    read = read_host_parts(LocalFileSystem(), [str(p) for p in folder.glob("host-*.json")], profile.cluster.nodes)
    returncode = int(code.split(":")[0]) if code.split(":")[0].isdigit() else None
    name, wall_s = f"slurm job {job.job_id}", time.monotonic() - start
    ended_as = f"{name} ended {final} (exit code {code})"
    names = job.node_names() if len(read.parts) < profile.cluster.nodes else {}
    timeout = (timeout_key, timeout_s)
    return hosts_outcome(
        stage, profile, request.attempt, name, ended_as, returncode, read.parts, timed_out, wall_s, output.tail,
        timeout, names, unreadable=read,
    )  # fmt: skip


def stop_left(profile: Profile, run_name: str, job: LiveJob) -> tuple[bool, str] | None:
    """Cancel a recorded job of the run that its orchestrator left running, and wait until it left the queue.

    None when it no longer runs; (False, why) when the job of that id is not this run's (a stale or planted
    record: left alone); (True, what was done) when it was cancelled. LaunchError when squeue cannot say, or the
    job is still queued after ``STOP_WAIT_S``: a new attempt must not start beside it."""
    if job.job_id is None:  # a record without an id (planted, or another version's): nothing to cancel by it
        return False, f"a record of run {run_name}'s jobs names no Slurm job: left alone"
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


def job_line(job: LiveJob) -> str:
    """A recorded Slurm job, by its id alone (digits): ValueError for any other identity."""
    if not grammar.matches(grammar.SLURM_JOB_ID, job.job_id or "") or job.namespace or job.name:
        raise ValueError("a Slurm job is named by its job id alone (digits)")
    return f"slurm job {job.job_id}"


SPEC = register_launcher(
    LauncherSpec(
        "slurm",
        launch_slurm,
        frozenset({"train", "preflight"}),
        "an sbatch job whose srun starts one host supervisor per node",
        options=SlurmOptions,
        warm=held.keep,
        job_line=job_line,
        stop_left=stop_left,
    )
)
