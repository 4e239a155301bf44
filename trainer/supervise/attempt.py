"""One attempt on this host: launch it under torchrun, watch it, and say how it ended, as data.

How an attempt ended comes from structured sources only, first match wins:

1. a rank's own report of an expected failure (``incident-rank{R}.json``: a
   non-finite loss, bad data, an unloadable checkpoint, a store error);
2. the watchdog's finding that ended the job (hang, desync, straggler abort,
   stalled exit);
3. torchrun's failures (``agent-node{N}.json``: rank, exit code, signal, the
   rank's exception message);
4. the watchdog's crash finding when torchrun was gone before it could report;
5. the attempt's timeout, or the job's exit code.

Rank 0's ``result.json`` exists once the final checkpoint is committed: with it
the attempt succeeded, whatever happened during the teardown after it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainpipe.trainer.checkpoint import memory_tier
from trainpipe.trainer.checkpoint.memory_tier import MEMORY_ENV
from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.launcher import AttemptOutcome, JobOutcome, stage_outcome
from trainpipe.trainer.proc import node_name
from trainpipe.trainer.profile_files import can_shrink
from trainpipe.trainer.protocol import (
    AGENT_REPORT_ENV,
    ATTEMPT_ENV,
    BEACON_ENV,
    BEACON_TOKEN_ENV,
    flight_request_path,
    metrics_path,
    result_path,
)
from trainpipe.trainer.supervise import warm_host
from trainpipe.trainer.supervise.beacons import BeaconServer, RankProgress, WatchdogLink
from trainpipe.trainer.supervise.checks.desync import desync_of
from trainpipe.trainer.supervise.gpu_use import GpuUse
from trainpipe.trainer.supervise.host_health import with_host_health
from trainpipe.trainer.supervise.isolation import ISOLATE_ENV, Forwards, probe, route, store_endpoints
from trainpipe.trainer.supervise.job import run_job
from trainpipe.trainer.supervise.launch import torchrun_command, worker_env
from trainpipe.trainer.supervise.metric_relay import MetricRelay
from trainpipe.trainer.supervise.rank_states import CpuUse, local_rank_states
from trainpipe.trainer.supervise.watchdog import Watchdog
from trainpipe.trainer.tracking import TrackedRun

log = logging.getLogger("trainpipe.supervisor")


@dataclass
class AttemptFiles:
    """What the ranks and torchrun left in the attempt's folder."""

    result: dict[str, Any] | None = None
    host_result: dict[str, Any] | None = None  # on a host without rank 0: its local rank 0's, once it finished
    rank_incidents: list[Incident] = field(default_factory=list)
    notices: list[Incident] = field(default_factory=list)  # incidents the ranks survived
    flight: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank → its flight recorder, when asked
    agent_failures: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, folder: str) -> AttemptFiles:
        files = cls()
        path = Path(folder)
        if Path(result_path(folder)).is_file():
            files.result = json.loads(Path(result_path(folder)).read_text())
        for p in sorted(path.glob("host-result-rank*.json"))[:1]:
            files.host_result = json.loads(p.read_text())
        for p in sorted(path.glob("incident-rank*.json")):
            files.rank_incidents.append(Incident.model_validate_json(p.read_text()))
        for p in sorted(path.glob("notice-rank*.json")):
            files.notices.append(Incident.model_validate_json(p.read_text()))
        for p in sorted(path.glob("flight-rank*.json")):
            with contextlib.suppress(ValueError):  # a rank's dump is a diagnosis: one that did not parse is left out
                files.flight[int(p.stem.removeprefix("flight-rank"))] = json.loads(p.read_text())
        for p in sorted(path.glob("agent-node*.json")):
            report = json.loads(p.read_text())
            files.agent_failures += [{**f, "node": report.get("node")} for f in report.get("failures", [])]
        return files


def ending_incident(
    job: JobOutcome,
    files: AttemptFiles,
    progress: dict[int, dict],
    attempt: int,
    timeout_s: float,
    timeout_key: str = "train.timeout_s",
) -> Incident:
    """Why the attempt ended, from the sources in the module's order (pure: testable on recorded inputs)."""
    reporters = sorted({r for i in files.rank_incidents for r in ([i.rank] if i.rank is not None else i.ranks)})
    # A rank killed by a signal (not torchrun's SIGTERM) without a report of its own is the cause: what the
    # others report next (a collective or a load that failed with it) follows from it.
    killed = [
        f for f in files.agent_failures if f.get("signal") not in (None, "SIGTERM") and f["rank"] not in reporters
    ]
    if files.rank_incidents and not killed:
        first = min(files.rank_incidents, key=lambda i: (i.rank is None, i.rank or 0, min(i.ranks, default=0)))
        return first.model_copy(update={"attempt": attempt, "ranks": reporters})
    # SIGKILLed between two collectives (from outside: kill -9, the OOM killer), a rank's last beacon is one
    # collective behind the others': what the watchdog took for a desync, torchrun reports as the kill it was.
    # A rank the backend aborts on mismatched collectives dies of SIGABRT: that desync stands.
    sigkilled = any(f.get("signal") == "SIGKILL" for f in killed)
    signalled_desync = job.stopped_by is not None and job.stopped_by.kind == "desync" and sigkilled
    if job.stopped_by is not None and job.stopped_by.kind != "crash" and not signalled_desync:
        return job.stopped_by.model_copy(update={"attempt": attempt})
    # A rank of another host died (its supervisor said so): this host's failures followed from it.
    if job.stopped_by is not None and _died_elsewhere(job.stopped_by, files):
        return job.stopped_by.model_copy(update={"attempt": attempt})
    if job.stopped_by is None and any(f.get("signal") == "SIGABRT" for f in killed):
        # The backend aborted on mismatched collectives before the watchdog looked: the last beacons show it.
        last = {r: RankProgress(r, p.get("step", -1), p.get("phase", "start"), extra=p) for r, p in progress.items()}
        if (desync := desync_of(last, 0.0)) is not None:
            return desync.model_copy(update={"attempt": attempt})
    if files.agent_failures:
        return _torchrun_crash(job, files, progress, attempt)
    if job.stopped_by is not None:
        return job.stopped_by.model_copy(update={"attempt": attempt})
    if job.timed_out:
        detail = f"attempt {attempt} exceeded {timeout_key}={timeout_s:g}s"
        return Incident(kind="timeout", detail=detail, attempt=attempt, node=node_name())
    code = job.returncode
    sig = signal.Signals(-code).name if code is not None and code < 0 and -code in signal.valid_signals() else None
    detail = f"attempt {attempt} exited with code {code} before any rank reported"
    return Incident(kind="crash", detail=detail, attempt=attempt, node=node_name(), error=sig)


def _died_elsewhere(found: Incident | None, files: AttemptFiles) -> bool:
    return (
        found is not None
        and found.kind == "crash"
        and found.node not in (None, node_name())
        and found.rank not in {f["rank"] for f in files.agent_failures}
    )


def flight_summary(flight: dict[int, dict[str, Any]]) -> str:
    """Each rank's last collective in its flight recorder: where every rank stands, in torch's own record."""
    parts = []
    for rank, dump in sorted(flight.items()):
        entries = [e for e in dump.get("entries", []) if isinstance(e, dict)]
        last = max(entries, key=lambda e: e.get("collective_seq_id", -1), default=None)
        if last is not None:
            parts.append(
                f"rank {rank} #{last.get('collective_seq_id')} {last.get('profiling_name')} {last.get('state')}"
            )
    return "flight recorder, last collective: " + ("; ".join(parts) or "none recorded")


def _torchrun_crash(job: JobOutcome, files: AttemptFiles, progress: dict[int, dict], attempt: int) -> Incident:
    """The crash torchrun reported, placed by the culprit's last beacon."""
    root = min(files.agent_failures, key=lambda f: _cause_order(f, job.stopped_by))
    rank, last = root["rank"], progress.get(root["rank"], {})
    code, sig = root.get("exitcode"), root.get("signal")
    detail = f"rank {rank} killed by {sig}" if sig else f"rank {rank} exited with code {code}"
    if root.get("message"):
        detail += f": {root['message']}"
    if job.stopped_by is not None:
        after = job.stopped_by.detected_after_s
    else:
        after = time.time() - last["time"] if last.get("time") else None
    step = last.get("step")
    return Incident(
        kind="crash",
        detail=detail,
        error=sig,
        rank=rank,
        node=last.get("host") or root.get("node"),
        step=step if step and step > 0 else None,
        phase=last.get("phase"),
        detected_after_s=after,
        attempt=attempt,
        ranks=sorted(f["rank"] for f in files.agent_failures),
    )


def _cause_order(failure: dict[str, Any], watched: Incident | None) -> tuple:
    """Which of torchrun's failures caused the others: a rank killed by a signal, then one that exited by itself,
    then one torchrun stopped (it sends the survivors SIGTERM); among equals the rank the watchdog saw die first,
    the earliest (torchrun's clock has one-second steps), the lowest."""
    signal_name = failure.get("signal")
    how = 2 if signal_name == "SIGTERM" else 1 if signal_name is None else 0
    seen_first = watched is not None and watched.kind == "crash" and watched.rank == failure["rank"]
    return (how, not seen_first, failure.get("time") or 0, failure["rank"])


def conclude(
    attempt: int,
    job: JobOutcome,
    files: AttemptFiles,
    progress: dict[int, dict],
    timeout_s: float,
    findings: list[Incident],
    timeout_key: str = "train.timeout_s",
) -> tuple[dict[str, Any] | None, Incident | None, list[Incident]]:
    """(result, incident that ended a failed attempt, non-fatal findings)."""
    findings = [*findings, *sorted(files.notices, key=lambda i: i.at)]
    result = files.result if files.result is not None else files.host_result
    if result is None:
        why = ending_incident(job, files, progress, attempt, timeout_s, timeout_key)
        if why.kind in ("hang", "desync") and files.flight:
            why = why.model_copy(update={"detail": f"{why.detail}; {flight_summary(files.flight)}"})
        return None, why, findings
    if job.ok:
        return result, None, findings
    why = ending_incident(job, files, progress, attempt, timeout_s, timeout_key)
    step = result.get("final_step")
    unclean = why.model_copy(
        update={
            "kind": "exit",
            "fatal": False,
            "detail": f"training finished (step {step} committed); then {why.kind}: {why.detail}",
        }
    )
    return result, None, [*findings, unclean]


def _watchdog(
    profile: Profile, server: BeaconServer | None, local_gpu_use: Callable[[], dict[int, float]] | None
) -> Watchdog | None:
    """The attempt's watchdog over ``server``'s beacons (None without beacons or with the watchdog off): it may
    answer a fault by leaving a node out only when the profile still holds on fewer nodes."""
    if server is None or not profile.watchdog.enabled:
        return None
    size = profile.cluster.world_size
    return Watchdog(profile.watchdog, server, size, can_shrink(profile), local_gpu_use, layout=profile.layout)


def run_module(
    profile: Profile,
    module: str,
    args: list[str],
    timeout_s: float,
    on_line: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
    beacons: bool = False,
    on_finding: Callable[[Incident], None] | None = None,
    attempt: int = 1,
    timeout_key: str = "train.timeout_s",
    on_progress: Callable[[dict[int, dict]], None] | None = None,
    metrics_to: tuple[str, str] | None = None,
    stage: str = "train",
) -> AttemptOutcome:
    """Run ``python -m module`` on every rank of this host under torchrun; rank 0 leaves its result in ``--out-dir``
    (``stage`` says what it is: a training result or a preflight report).

    With ``metrics_to`` (tracking URI, MLflow run id), rank 0 writes its metrics to a file that a
    ``MetricRelay`` sends to that run while the job runs.

    ``on_progress`` gets every rank's last beacon at each watchdog poll; an exception it raises (e.g. the run
    was cancelled) tears the job down and propagates. The ranks get the resolved profile as a local file without
    credentials (``Profile.public``); the store settings reach them in the environment (``Profile.private_env``).
    """
    sample_gpus = beacons and profile.watchdog.enabled and GpuUse.wanted(profile.cluster.device)
    gpu: GpuUse | None = None

    def local_gpu_use() -> dict[int, float]:  # this host's ranks → their GPUs' recent utilization
        return gpu.by_rank(local_rank_states()) if gpu else {}

    server, link = _beacon_channel(profile, local_gpu_use, attempt) if beacons else (None, None)
    watchdog = _watchdog(profile, server, local_gpu_use if sample_gpus else None)
    # Without a watchdog the caller still hears every poll: where it sees a cancel, or a stop whose signal was lost.
    watch = (lambda: _watch(watchdog, on_finding, server, on_progress)) if watchdog or on_progress else None
    if link is not None:
        watch = lambda: _follow(link, profile)  # noqa: E731
    try:
        gpu = GpuUse(profile.cluster.procs_per_node) if sample_gpus else None
        with tempfile.TemporaryDirectory(prefix="trainpipe-job-") as out_dir:
            profile_path = Path(out_dir) / "profile.yaml"
            profile_path.write_text(profile.public_yaml())  # no credentials on disk: they travel in the env
            relay = None
            if metrics_to:
                relay = MetricRelay(metrics_path(out_dir), *metrics_to, every_s=profile.tracking.flush_every_s)
                args = [*args, "--metrics-file", relay.path]
            cmd = torchrun_command(profile, module, ["--profile", str(profile_path), *args, "--out-dir", out_dir])
            job_env = _job_env(profile, out_dir, attempt, env, server, link)
            forwards = isolated(profile, job_env, on_line)
            job = None
            try:
                job = run_job(
                    cmd,
                    job_env,
                    on_line=on_line,
                    timeout_s=timeout_s,
                    watch=watch,
                    poll_s=profile.watchdog.poll_s,
                    before_teardown=lambda f: _before_teardown(f, server, profile, on_line, out_dir),
                    start=lambda c, e: warm_host.start_agent(c, e, str(profile_path)),
                )
            finally:
                if relay:  # a cancelled attempt does not wait long for an MLflow that does not answer
                    relay.close(timeout_s=60 if job else 5)
                if forwards is not None:
                    forwards.close()
            files = AttemptFiles.read(out_dir)
    finally:
        if server:
            server.close()
        if link:
            link.close()
        if gpu:
            gpu.close()
    assert job is not None  # run_job returned (it raises otherwise)
    outcome = _outcome(stage, attempt, job, files, server, watchdog, timeout_s, timeout_key)
    if stage == "train" and outcome.incident is not None:  # a broken GPU here: the retry must not run on it
        incident = with_host_health(outcome.incident, profile.preflight, node_name())
        outcome = replace(outcome, incident=incident)
    return outcome


def _outcome(
    stage: str,
    attempt: int,
    job: JobOutcome,
    files: AttemptFiles,
    server: BeaconServer | None,
    watchdog: Watchdog | None,
    timeout_s: float,
    timeout_key: str,
) -> AttemptOutcome:
    """The attempt's outcome from what the job, the ranks' files, the beacons and the watchdog say."""
    progress = {r: p.as_dict() for r, p in server.snapshot().items()} if server else {}
    if watchdog is not None:
        watchdog.last_look()
    warnings = [f for f in watchdog.findings if not f.fatal] if watchdog else []
    raw, incident, findings = conclude(attempt, job, files, progress, timeout_s, warnings, timeout_key)
    result, report, incident = stage_outcome(stage, raw, attempt, incident)
    return AttemptOutcome(
        attempt,
        job,
        result,
        incident,
        findings,
        progress,
        server.first_step_at if server else None,
        server.first_step if server else None,
        scores=_windows(watchdog) if watchdog else [],
        flight=files.flight,
        report=report,
    )


def _windows(watchdog: Watchdog) -> list[dict[str, Any]]:
    """Each scored window's straggler scores with where its time went (data and collective wait per rank)."""
    return watchdog.windows()


def _job_env(
    profile: Profile,
    out_dir: str,
    attempt: int,
    env: dict[str, str] | None,
    server: BeaconServer | None,
    link: WatchdogLink | None,
) -> dict[str, str]:
    """The job's environment: the workers' settings, the attempt, the store's settings, the beacon channel."""
    job_env = {**worker_env(profile), AGENT_REPORT_ENV: out_dir, ATTEMPT_ENV: str(attempt), **(env or {})}
    job_env.update(profile.private_env())
    # The memory tier's folder: only the one this process opened for the run's attempts, never one inherited.
    job_env.pop(MEMORY_ENV, None)
    if (memory := memory_tier.current()) is not None:
        job_env[MEMORY_ENV] = memory
    if server:
        job_env[BEACON_ENV], job_env[BEACON_TOKEN_ENV] = server.address, server.token
    if link:
        job_env[BEACON_ENV], job_env[BEACON_TOKEN_ENV] = link.address, link.token
    return job_env


def isolated(profile: Profile, job_env: dict[str, str], on_line: Callable[[str], None] | None) -> Forwards | None:
    """A single-host job in a network namespace of its own (``cluster.isolate``, trainer.supervise.isolation):
    the forwards its ranks need out of it, with the request in ``job_env``; None when it runs on the host's
    network (multi-host, simulated nodes, false, or auto where the host or the store does not allow it: said
    once). ProfileError under true when it cannot be."""
    c = profile.cluster
    if c.isolate is True and c.nodes > 1:
        raise ProfileError(
            "cluster.isolate=true is for single-host jobs: a job across hosts runs on their network (docs/security.md)"
        )
    if c.isolate is False or c.nodes > 1:
        return None
    endpoints = store_endpoints(profile.store.root, profile.store.storage_options, job_env)
    way = route(endpoints) if endpoints is not None else None
    why = probe()
    if why is None and way is None:
        why = f"its store {profile.store.root} is reached neither on this host's loopback nor over https"
    if why is not None:
        line = (
            f"this job's rendezvous and process-group stores are reachable by other local users: no network "
            f"namespace of its own ({why}); see docs/security.md"
        )
        if c.isolate is True:
            raise ProfileError(f"cluster.isolate=true: {line}")
        if line not in _SAID:
            _SAID.add(line)
            log.warning("%s", line)
            if on_line is not None:
                on_line(f"warning: {line}")
        return None
    assert way is not None
    forwards = Forwards(list(way.forwards), list(way.egress))
    job_env[ISOLATE_ENV] = forwards.spec()
    job_env.update(forwards.proxy_env())
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):  # a cluster's eth0 is not in the namespace
        if name in job_env:
            job_env[name] = "lo"
    return forwards


_SAID: set[str] = set()


def _beacon_channel(
    profile: Profile, local_gpu_use: Callable[[], dict[int, float]], attempt: int
) -> tuple[BeaconServer | None, WatchdogLink | None]:
    """Where this host's ranks send their beacons: this supervisor's server (one host; node 0 of a multi-host
    job, where the job's watchdog runs) or node 0's (every other host, which follows it through a link)."""
    c = profile.cluster
    if not c.multi_host:  # a Unix socket: reached from the job's own network namespace, by no other user
        return BeaconServer(world_size=c.world_size, unix=True), None
    host, port = c.watchdog_address.rsplit(":", 1)
    if c.node_rank == 0:
        try:
            return BeaconServer(host, c.world_size, _shared_token(attempt), port=int(port)), None
        except OSError as exc:
            raise ProfileError(
                f"node 0 cannot serve the job watchdog on {c.watchdog_address} ({exc.strerror}): cluster.master_addr "
                "must be this host's address and cluster.beacon_port free"
            ) from None
    timeout = profile.watchdog.startup_timeout_s
    states = functools.partial(local_rank_states, CpuUse())  # idle: a rank node 0 may name before the allowance
    link = WatchdogLink(c.watchdog_address, _shared_token(attempt), timeout, states, local_gpu_use)
    return None, link


def _shared_token(attempt: int) -> str:
    """The beacons' token of this attempt of a job across hosts: derived from the job's secret and the attempt, so
    that a rank left over from an earlier attempt of a job whose hosts stay up is not heard in this one."""
    token = os.environ.get(BEACON_TOKEN_ENV, "")
    if len(token) < 16:
        raise ProfileError(
            f"a job across hosts needs {BEACON_TOKEN_ENV}: the same secret (16+ characters) in every host's "
            "environment, so that node 0's watchdog hears only this job's ranks"
        )
    return hmac.new(token.encode("utf-8"), f"attempt-{attempt}".encode(), hashlib.sha256).hexdigest()


def _follow(link: WatchdogLink, profile: Profile, grace_s: float = 2.0) -> Incident | None:
    """On a host other than node 0: end this host's part once node 0's has ended (or never began)."""
    if link.never_connected:
        detail = (
            f"node 0's job watchdog at {link.address} did not answer within watchdog.startup_timeout_s="
            f"{profile.watchdog.startup_timeout_s:g}s; check that node 0 runs and cluster.master_addr"
        )
        return Incident(kind="hang", detail=detail, node=node_name(), detected_after_s=0.0)
    if link.ended_at is not None and time.monotonic() - link.ended_at > grace_s:
        detail = "node 0's part of the attempt ended (its watchdog's link closed); this host's ranks were stopped"
        return Incident(kind="aborted", detail=detail, node=node_name(), detected_after_s=0.0)
    return None


def _watch(
    watchdog: Watchdog | None,
    on_finding: Callable[[Incident], None] | None,
    server: BeaconServer | None = None,
    on_progress: Callable[[dict[int, dict]], None] | None = None,
) -> Incident | None:
    """Poll the watchdog; report non-fatal findings (stragglers under 'warn') and progress as they come."""
    if on_progress is not None:
        on_progress({r: p.as_dict() for r, p in server.snapshot().items()} if server is not None else {})
    if watchdog is None:
        return None
    reported = len(watchdog.findings)
    try:
        found = watchdog.check()
    except Exception:  # a watchdog bug must not end a healthy attempt: the next poll looks again
        log.exception("the watchdog's check failed; the attempt goes on")
        return None
    for f in watchdog.findings[reported:]:
        if on_finding and not f.fatal:
            try:
                on_finding(f)
            except Exception:  # reporting a warning must never stop the watching
                log.exception("reporting %s failed; the attempt goes on", f.line())
    return found if found is not None and found.fatal else None


def _before_teardown(
    found: Incident,
    server: BeaconServer | None,
    profile: Profile,
    on_line: Callable[[str], None] | None,
    out_dir: str | None = None,
) -> float | None:
    """Name the finding, ask live ranks for their Python stacks (faulthandler on SIGUSR1) and, for a hang or a
    desync, their flight recorders; give them a moment."""
    if on_line:
        on_line(f"watchdog: {found.line()}")
    if found.kind == "crash":
        return 2.0  # torchrun is already tearing down; let it report its failures (exit code, signal)
    if found.kind == "exit" or server is None:
        return None
    if out_dir and found.kind in ("hang", "desync"):
        Path(flight_request_path(out_dir)).touch()
    for p in server.snapshot().values():
        pid = p.extra.get("pid")
        if pid:  # a stopped rank just keeps the signal pending
            with contextlib.suppress(OSError, TypeError, ValueError):  # gone, not ours, or not a pid
                os.kill(int(pid), signal.SIGUSR1)
    time.sleep(profile.watchdog.stack_dump_s)
    return None


def train_attempt(
    profile: Profile,
    run_name: str,
    dataset_uri: str,
    mlflow_run_id: str | None = None,
    on_line: Callable[[str], None] | None = None,
    attempt: int = 1,
    env: dict[str, str] | None = None,
    on_finding: Callable[[Incident], None] | None = None,
    on_progress: Callable[[dict[int, dict]], None] | None = None,
) -> AttemptOutcome:
    """One training attempt: torchrun + ``python -m trainpipe.trainer``, resuming from the run's newest valid
    checkpoint."""
    args = ["--run-name", run_name, "--dataset-uri", dataset_uri]
    tracked = profile.tracking.enabled and mlflow_run_id
    # Every host's supervisor samples its own host: system/{node}/* in the run, one series per host.
    monitor = TrackedRun.of(profile.tracking, mlflow_run_id).system_metrics(
        profile.tracking.system_metrics, node_name(), profile.tracking.system_metrics_every_s
    )
    with monitor:
        return run_module(
            profile,
            "trainpipe.trainer",
            args,
            profile.train.timeout_s,
            on_line,
            env=env,
            beacons=True,
            on_finding=on_finding,
            attempt=attempt,
            on_progress=on_progress,
            metrics_to=(profile.tracking.tracking_uri, mlflow_run_id) if tracked and mlflow_run_id else None,
        )


def preflight_job(profile: Profile, on_line: Callable[[str], None] | None = None) -> AttemptOutcome:
    return run_module(
        profile,
        "trainpipe.trainer.preflight",
        [],
        profile.preflight.timeout_s,
        on_line,
        timeout_key="preflight.timeout_s",
        stage="preflight",
    )
