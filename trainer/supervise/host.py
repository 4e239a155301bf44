"""``python -m trainpipe.trainer.supervise.host``: this host's part of one stage of a run, beside its torchrun agent.

    python -m trainpipe.trainer.supervise.host --profile P [--set section.key=value …] --run-name NAME
        [--stage train] --dataset-uri URI [--node-rank N] [--attempt N] [--outcome PATH | --outcome-dir DIR]
    python -m trainpipe.trainer.supervise.host --stage preflight --profile P --run-name NAME …   (the preflight probes)
    python -m trainpipe.trainer.supervise.host --profile-env NAME …   (the profile's YAML in environment variable NAME)
    python -m trainpipe.trainer.supervise.host --serve FOLDER --run-name NAME …   (every attempt of an allocation)

What a launcher (Slurm's ``srun``, a Kubernetes pod) runs once per host of a
multi-host job, and what a person can run by hand on each host. Every host
sets the same cluster settings but its own node rank (``--node-rank``, else
``cluster.node_rank``, else the launcher's ``SLURM_NODEID``), node 0 being the
host named by ``cluster.master_addr``, and shares ``TRAINPIPE_BEACON_TOKEN``
(a Kubeflow Trainer pod's ``PET_NODE_RANK`` counts as the launcher's too).
Node 0's supervisor runs the job's watchdog, which hears every rank of every
host; the others follow it and stop their ranks when node 0's part ends. Each
host writes its part's outcome (result, incident, findings) as one JSON object
to ``--outcome``, ``--outcome-dir``/host-{N}.json or stdout, and exits 0 when
its part finished. With ``--outcome-dir`` (a folder or a store URI such as
``s3://…``, written with the store's settings), node 0 also keeps the ranks'
latest progress in ``progress.json`` there while the attempt runs. With ``--serve``, the host's part lasts as
long as its allocation and runs each attempt it is asked for (``trainer.supervise.allocation``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainpipe.trainer import store_retry
from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.launcher import AttemptOutcome
from trainpipe.trainer.proc import node_name, process_started_at
from trainpipe.trainer.profile_files import load_profile, with_private_env
from trainpipe.trainer.protocol import BEACON_TOKEN_ENV
from trainpipe.trainer.store import write_json_uri
from trainpipe.trainer.store_paths import join
from trainpipe.trainer.supervise.attempt import preflight_job, train_attempt

log = logging.getLogger("trainpipe.host")
NODE_RANK_ENVS = ("SLURM_NODEID", "PET_NODE_RANK")  # where a launcher (Slurm, Kubeflow Trainer) says which node


def outcome_record(outcome: AttemptOutcome, node_rank: int, started_at: float | None = None) -> dict[str, Any]:
    """A host's part of an attempt as JSON: what a launcher collects from every host. ``started_at``: when the
    cluster let this part start (default: this supervisor's start; a standing host's: when it saw the request)."""
    return {
        "node": node_name(),
        "node_rank": node_rank,
        "attempt": outcome.attempt,
        "result": outcome.result.model_dump(mode="json") if outcome.result else outcome.report,
        "incident": outcome.incident.model_dump(mode="json") if outcome.incident else None,
        "findings": [f.model_dump(mode="json") for f in outcome.findings],
        "returncode": outcome.job.returncode,
        "agent": (outcome.job.job or "")[:300],
        "wall_s": round(outcome.job.wall_s, 3),
        "first_step": outcome.first_step,
        "first_step_at": outcome.first_step_at,
        "started_at": process_started_at() if started_at is None else started_at,  # the cluster's queue ended
        "scores": outcome.scores,
        "progress": {str(r): p for r, p in outcome.progress.items()},
    }


class Stopped(BaseException):
    """SIGTERM reached this host's supervisor: its pod was deleted or its Slurm step cancelled. A BaseException,
    so that nothing on the way mistakes it for a failure of its own; the job is torn down as it unwinds."""


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def stopped_record(node_rank: int, attempt: int, signame: str) -> dict[str, Any]:
    """A host's part that was stopped from outside before it ended: the launcher still hears from it."""
    detail = f"node {node_rank}'s part was stopped by {signame} (its pod deleted or its job step cancelled)"
    return incident_record(node_rank, Incident(kind="aborted", detail=detail, attempt=attempt, node=node_name()))


def incident_record(node_rank: int, incident: Incident) -> dict[str, Any]:
    """A host's part that ended before its attempt could, as ``incident`` says."""
    attempt = incident.attempt
    return {
        "node": node_name(),
        "node_rank": node_rank,
        "attempt": attempt,
        "result": None,
        "incident": incident.model_dump(mode="json"),
        "findings": [],
        "returncode": None,
    }


def _cause_rank(incident: Incident) -> int:
    """How likely an incident is the job's cause rather than a consequence on another host (lower: likelier)."""
    if incident.kind in ("error", "nan"):  # a rank's own report of what went wrong
        return 0
    if incident.kind == "crash" and incident.error not in (None, "SIGTERM"):  # killed (by a person, the kernel)
        return 1
    if incident.kind not in ("crash", "aborted"):  # node 0's job watchdog: hang, desync, straggler, timeout
        return 2
    return 3 if incident.kind == "crash" else 4  # a rank that failed when a peer went away; a host that followed


def job_outcome(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One attempt of a multi-host job from every host's part (``outcome_record``): what its launcher returns.

    It succeeded when every host's part finished; its result is then global rank 0's. Otherwise the incident is
    the likeliest cause among the hosts' incidents: a rank's own report, then a rank killed by a signal, then the
    job watchdog's finding, then a failure that follows from another host's.
    """
    incidents = [Incident.model_validate(r["incident"]) for r in records if r.get("incident")]
    results = [r["result"] for r in records if r.get("result")]
    finished = len(results) == len(records) and not incidents
    cause = min(incidents, key=lambda i: (_cause_rank(i), i.at)) if incidents else None
    return {
        "result": next((r for r in results if r.get("rank") == 0), None) if finished else None,
        "incident": cause.model_dump(mode="json") if cause else None,
        "findings": [f for r in records for f in r.get("findings", [])],
        # by node rank: two hosts may share a name (two pods on one Kubernetes node)
        "hosts": sorted(
            (r.get("node_rank", -1), r["node"], r["result"] is not None, (r.get("incident") or {}).get("kind"))
            for r in records
        ),
    }


def node_rank_from(args: argparse.Namespace, configured: int) -> int:
    if args.node_rank is not None:
        return args.node_rank
    for name in NODE_RANK_ENVS:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return configured


class ProgressFile:
    """Node 0's view of the attempt in a file, every few seconds: every rank's latest beacon and the watchdog's
    warnings so far (``{"ranks": {rank: beacon}, "findings": [incident]}``), how a launcher follows the attempt
    and says what node 0's watchdog found while it runs (``trainer.launch.outcome.LiveView``)."""

    def __init__(self, write: Callable[[Any], None], every_s: float = 2.0):
        # None: write at the next call. Not 0.0: on a host up for less than every_s, monotonic() is below it.
        self.write, self.every_s, self._last = write, every_s, None
        self.findings: list[dict[str, Any]] = []

    def finding(self, incident: Incident) -> None:
        """A warning of node 0's watchdog (a straggler under warn): written with the next progress, at once."""
        self.findings = [*self.findings[-99:], incident.model_dump(mode="json")]
        self._last = None

    def __call__(self, progress: dict[int, dict]) -> None:
        if self._last is None or time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            try:  # called from the watchdog's loop: a store that does not answer now must not stall or end the job
                with store_retry.limited(2.0):
                    self.write({"ranks": {str(r): p for r, p in progress.items()}, "findings": self.findings})
            except (OSError, TrainpipeError) as exc:
                log.warning("progress not written this time: %s", exc)


def _load(args: argparse.Namespace) -> Profile:
    if args.profile_env is None:
        return load_profile(args.profile, args.set)
    text = os.environ.get(args.profile_env)
    if not text:
        raise TrainpipeError(f"--profile-env {args.profile_env}: that environment variable is empty or not set")
    with tempfile.TemporaryDirectory() as tmp:  # a profile is loaded from a file; this one came in the environment
        path = Path(tmp, "profile.yaml")
        path.write_text(text, encoding="utf-8")
        return load_profile(str(path), args.set)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainpipe.trainer.supervise.host", description=(__doc__ or "").split("\n")[0]
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--profile", default="local", help="Profile name or path.")
    source.add_argument("--profile-env", default=None, metavar="NAME", help="Read the profile's YAML from $NAME.")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--serve", default=None, metavar="FOLDER", help="Run the attempts requested in FOLDER (or URI).")
    p.add_argument("--idle-s", type=float, default=600.0, help="--serve: end after this long without a request.")
    p.add_argument("--run-name", required=True)
    p.add_argument("--stage", choices=("train", "preflight"), default="train", help="What this host's part runs.")
    p.add_argument("--dataset-uri", default=None, help="train: the dataset the ranks read.")
    p.add_argument("--node-rank", type=int, default=None, help="This host's node rank (default: see above).")
    p.add_argument("--attempt", type=int, default=1)
    p.add_argument("--mlflow-run-id", default=None, help="The pipeline run's MLflow run: rank 0's metrics go there.")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--outcome", default=None, help="Write this host's outcome here (default: stdout).")
    out.add_argument("--outcome-dir", default=None, help="Write it to DIR/host-{node rank}.json (DIR: path or URI).")
    args = p.parse_args(argv)
    if args.stage == "train" and not args.dataset_uri and not args.serve:
        p.error("--stage train needs --dataset-uri")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    if args.serve:
        return _serve(args)
    try:
        profile = with_private_env(_load(args))
    except TrainpipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    node_rank = profile.cluster.node_rank = node_rank_from(args, profile.cluster.node_rank)
    report = _Report(args.outcome_dir, args.outcome, profile.store.storage_options)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # Kubernetes and Slurm stop a host with SIGTERM, then SIGKILL

    def say(line: str) -> None:
        print(f"[node{node_rank}] {line}", file=sys.stderr, flush=True)

    try:
        if args.stage == "preflight":  # every host probes its own GPUs and facts and joins the cross-node tests
            outcome = preflight_job(profile, on_line=say)
        else:
            progress = report.progress if args.outcome_dir else None
            outcome = train_part(
                profile, args.run_name, args.dataset_uri, args.mlflow_run_id, args.attempt, say, progress
            )
    except TrainpipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Stopped as exc:  # the job is down (torn down as the exception unwound); say so before the SIGKILL
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        report(node_rank, stopped_record(node_rank, args.attempt, str(exc)))
        return 128 + signal.SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the part ended: its outcome is written whole
    report(node_rank, outcome_record(outcome, node_rank))
    return 0 if outcome.succeeded else 1


def train_part(
    profile: Profile,
    run_name: str,
    dataset_uri: str,
    mlflow_run_id: str | None,
    attempt: int,
    say: Callable[[str], None],
    progress: Callable[[Any], None] | None,
) -> AttemptOutcome:
    """This host's part of a training attempt; node 0 keeps the ranks' progress through ``progress`` (a launcher
    follows the attempt by it)."""
    live = ProgressFile(progress) if progress is not None and profile.cluster.node_rank == 0 else None
    return train_attempt(
        profile,
        run_name,
        dataset_uri,
        mlflow_run_id,
        on_line=say,
        attempt=attempt,
        on_finding=live.finding if live else None,
        on_progress=live,
    )


def _serve(args: argparse.Namespace) -> int:
    """--serve: this host's parts of every attempt its job is asked for (``allocation.serve``)."""
    from trainpipe.trainer.supervise.allocation import AttemptRequest, Requests, serve

    node_rank = node_rank_from(args, 0)
    now: dict[str, Any] = {}  # the attempt running now: what a SIGTERM's part is written for
    signal.signal(signal.SIGTERM, _stop_on_sigterm)

    def say(line: str) -> None:
        print(f"[node{node_rank}] {line}", file=sys.stderr, flush=True)

    try:  # the store's settings, to read the job's folder when it lies in the store (Kubernetes)
        options = with_private_env(_load(args)).store.storage_options if args.profile_env else {}
        requests = Requests(args.serve, options, os.environ.get(BEACON_TOKEN_ENV, ""))
    except TrainpipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def run_part(profile: Profile, request: AttemptRequest, folder: str, started_at: float) -> dict[str, Any]:
        report = _Report(folder, None, profile.store.storage_options)
        now.update(report=report, attempt=request.attempt)
        outcome = train_part(
            profile, args.run_name, request.dataset_uri, request.mlflow_run_id, request.attempt, say, report.progress
        )
        return outcome_record(outcome, profile.cluster.node_rank, started_at)

    def write_part(folder: str, rank: int, record: dict[str, Any]) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the part ended: its outcome is written whole
        try:
            now.clear()
            _Report(folder, None, options)(rank, record)
        finally:
            signal.signal(signal.SIGTERM, _stop_on_sigterm)

    try:
        return serve(
            requests, args.run_name, args.set, lambda configured: node_rank_from(args, configured),
            run_part, write_part, args.idle_s, say,
        )  # fmt: skip
    except Stopped as exc:  # scancel, the pod's deletion: the attempt running now (torn down as this unwound) says so
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if now:
            now["report"](node_rank, stopped_record(node_rank, now["attempt"], str(exc)))
        return 128 + signal.SIGTERM


class _Report:
    """Where this host's outcome (and node 0's progress) goes: a folder or store URI, a file, or stdout."""

    def __init__(self, folder: str | None, path: str | None, storage_options: dict[str, Any]):
        self.folder, self.path, self.options = folder, path, storage_options

    def __call__(self, node_rank: int, record: dict[str, Any]) -> None:
        if self.folder:
            write_json_uri(join(self.folder, f"host-{node_rank}.json"), self.options, record)
        elif self.path:
            write_json_uri(self.path, self.options, record)
        else:
            print(json.dumps(record))

    def progress(self, progress: dict[str, Any]) -> None:
        write_json_uri(join(self.folder or "", "progress.json"), self.options, progress)


if __name__ == "__main__":
    sys.exit(main())
