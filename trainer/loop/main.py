"""``python -m trainpipe.trainer``: one training attempt on this rank, under torchrun.

    torchrun … -m trainpipe.trainer --profile resolved.yaml --run-name NAME --dataset-uri URI [--out-dir DIR]
        [--tracking-uri URI --mlflow-run-id ID | --metrics-file PATH]

Without a supervisor (plain torchrun under Slurm or Kubernetes) it trains and
checkpoints the same way; beacons are off and nothing is reported but the log
and, with ``--out-dir``, the attempt files of ``trainer.protocol``.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from trainpipe.trainer import store_retry
from trainpipe.trainer.config import Profile
from trainpipe.trainer.device import init_distributed
from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.loop.beacon import Beacon, BeaconCallback
from trainpipe.trainer.loop.callbacks import Callback
from trainpipe.trainer.loop.flight import FlightRecorderDump
from trainpipe.trainer.loop.links import SlowLinks, probe_links
from trainpipe.trainer.loop.metrics import MetricFile, MetricLogger, MetricsCallback, StepLog
from trainpipe.trainer.loop.replicas import ReplayMismatch, ReplicaMismatch
from trainpipe.trainer.loop.trace import SampleTrace
from trainpipe.trainer.loop.trainer import NonFiniteLoss, Trainer, UnhealthyLoss
from trainpipe.trainer.proc import die_with_parent, node_name
from trainpipe.trainer.profile_files import load_resolved_profile
from trainpipe.trainer.protocol import (
    ATTEMPT_ENV,
    SUPERVISED_ENV,
    notice_path,
    rank_incident_path,
    result_path,
    write_file,
)
from trainpipe.trainer.store_paths import RunPaths

log = logging.getLogger("trainpipe.trainer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainpipe.trainer", description="Run one training attempt on this rank."
    )
    p.add_argument("--profile", required=True, help="Path or URI of the resolved profile YAML.")
    p.add_argument("--run-name", required=True)
    p.add_argument("--dataset-uri", required=True)
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--mlflow-run-id", default=None)
    p.add_argument(
        "--metrics-file", default=None, help="Rank 0 appends its metrics here for the supervisor to send to MLflow."
    )
    p.add_argument(
        "--out-dir", default=None, help="Local folder for the attempt files (rank 0's result, a rank's incident)."
    )
    return p.parse_args(argv)


def build_callbacks(profile: Profile, rank: int, beacon: Beacon, args: argparse.Namespace) -> list[Callback]:
    """Beacons when a supervisor listens, metrics and the step log on rank 0, traces and drills when asked for."""
    layout = profile.layout
    mesh = layout.place(rank) if layout.meshed else None
    callbacks: list[Callback] = [BeaconCallback(beacon, mesh)] if beacon.enabled else []
    if rank == 0:
        callbacks.append(StepLog())
        if args.metrics_file:
            callbacks.append(MetricsCallback(MetricFile(args.metrics_file)))
        elif profile.tracking.enabled and args.tracking_uri and args.mlflow_run_id:
            callbacks.append(
                MetricsCallback(MetricLogger(args.tracking_uri, args.mlflow_run_id, profile.tracking.flush_every_s))
            )
    if args.out_dir:
        callbacks.append(NoticeFiles(args.out_dir, rank))
    if trace := SampleTrace.from_env(rank):
        callbacks.append(trace)
    if profile.faults.kind != "none":
        from trainpipe.trainer.drills import FaultDrill

        callbacks.append(FaultDrill(profile.faults, rank, attempt=int(os.environ.get(ATTEMPT_ENV, "1"))))
    return callbacks


class NoticeFiles(Callback):
    """Each incident training survived, as a file the supervisor collects with the attempt's outcome."""

    def __init__(self, out_dir: str, rank: int):
        self.out_dir, self.rank, self.n = out_dir, rank, 0

    def on_incident(self, incident: Incident) -> None:
        self.n += 1
        try:
            write_file(notice_path(self.out_dir, self.rank, self.n), incident.model_dump(mode="json"))
        except OSError as exc:  # a full disk must not fail the save that reported it
            log.warning("could not record incident %s (%s)", incident.kind, exc)


def incident_of(exc: TrainpipeError, rank: int, step: int | None) -> Incident:
    """A rank's expected failure as the incident it reports (docs/architecture.md §5)."""
    if isinstance(exc, ReplicaMismatch):  # every rank compared the same fingerprints: each names the same culprits
        culprit = exc.ranks[0] if len(exc.ranks) == 1 else None
        return Incident(
            kind="sdc",
            detail=str(exc),
            rank=culprit,
            node=exc.nodes[0] if len(set(exc.nodes)) == 1 else None,  # one node to blame, or none
            step=exc.step,
            phase="checkpoint" if exc.before_commit else "optimizer",
            ranks=exc.ranks,
            detected_after_s=0.0,
        )
    if isinstance(exc, UnhealthyLoss):
        return exc.incident
    if isinstance(exc, SlowLinks):  # every rank measured the same times: each names the same hosts
        blamed = exc.verdict.hosts
        leaders = [exc.times.leaders[exc.times.hosts.index(h)] for h in blamed]
        return Incident(
            kind="network",
            detail=str(exc),
            rank=leaders[0] if len(leaders) == 1 else None,
            node=", ".join(blamed) or None,
            phase="probe",
            ranks=leaders,
            detected_after_s=0.0,
        )
    if isinstance(exc, ReplayMismatch):  # every rank sees the same loss: no culprit rank
        return Incident(
            kind="sdc",
            detail=str(exc),
            step=exc.step,
            phase="replay",
            detected_after_s=0.0,  # no node to blame
        )
    if isinstance(exc, NonFiniteLoss):  # every rank sees the same all-reduced loss: no culprit rank
        return Incident(
            kind="nan", detail=str(exc), step=exc.step, phase="collective", ranks=[rank], detected_after_s=0.0
        )
    return Incident(
        kind="error",
        error=exc.__class__.__name__,
        detail=str(exc),
        rank=rank,
        node=node_name(),
        step=step,
        detected_after_s=0.0,
    )


@record
def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog asks for stacks before teardown
    rank = int(os.environ.get("RANK", 0))
    # Under the supervisor every line is already timestamped by the Prefect log.
    stamp = "" if os.environ.get(SUPERVISED_ENV) else "%(asctime)s "
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] {stamp}%(levelname)s %(message)s", stream=sys.stdout)
    args = parse_args(argv)
    beacon = Beacon(rank)  # first: the supervisor learns this rank's pid before anything slow
    trainer: Trainer | None = None
    try:
        profile = load_resolved_profile(args.profile)
        store_retry.set_budget(profile.store.retry_s)
        torch.set_num_threads(profile.cluster.threads_per_proc)
        if profile.train.deterministic:
            torch.use_deterministic_algorithms(True)
        callbacks = build_callbacks(profile, rank, beacon, args)  # before the set-up: MLflow connects meanwhile
        d = init_distributed(profile)
        if profile.watchdog.probe_links and d.world_size > 1:
            probe_links(d, profile.watchdog.network_factor)
        if args.out_dir:  # the watchdog may ask for this rank's last collectives when it finds a hang
            FlightRecorderDump(args.out_dir, rank).start()
        trainer = Trainer(profile, d, RunPaths(profile.store.root, args.run_name), args.dataset_uri, callbacks)
        result = trainer.train()
    except TrainpipeError as exc:
        log.error("%s", exc)
        if args.out_dir:  # first: the supervisor must learn why even if what follows stalls
            step = trainer.at_step if trainer else None
            write_file(rank_incident_path(args.out_dir, rank), incident_of(exc, rank, step).model_dump())
        if trainer is not None and trainer.checkpointer is not None:
            trainer.end()  # no step follows: a commit waiting for the next step's loss goes ahead
            trainer.checkpointer.wait()  # a save in flight still commits: it holds work done before the failure
            if trainer.memory_tier is not None:
                trainer.memory_tier.wait()  # and a snapshot in flight, for the retry
        return 3
    if args.out_dir and (rank == 0 or d.local_rank == 0):  # global rank 0's, and each other host's own
        # before the teardown: the attempt counts from here
        write_file(result_path(args.out_dir, rank), result.model_dump(mode="json"))
    trainer.close()
    return 0
