"""The launchers (``launcher.kind``), registered against the contract in ``trainer/launcher.py``.

Launchers run in the orchestrator (the Prefect tasks' process) and start the
per-host supervisors, here or on a cluster's nodes: the one part of the
orchestrator that knows the supervisor's types. Modules: ``local`` (this
machine's supervisor), ``slurm`` (an sbatch job), ``kubernetes`` (a Kubeflow
Trainer TrainJob), ``outcome`` (a cluster job's outcome from its hosts'
parts), ``jobs`` (a run's live cluster jobs, stopped when their orchestrator
died), ``held`` (a run's cluster job kept across its attempts, whose hosts
fork each one warm). Importing this package registers every launcher; ``launch`` runs a
request through the one its profile names. A launcher is one module: its ``LauncherSpec`` carries its options
model, how it keeps a run's attempts warm, and how it names and stops the jobs it records.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

from trainpipe.trainer.config import Profile
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.launch import held, kubernetes, local, slurm  # noqa: F401 - each registers its LauncherSpec
from trainpipe.trainer.launcher import AttemptOutcome, LaunchRequest, Watch, check_launcher, launcher_spec
from trainpipe.trainer.protocol import TrainResult
from trainpipe.trainer.store_paths import RunPaths

__all__ = ["check_launcher", "launch", "launch_attempt", "warm_attempts"]


def warm_attempts(profile: Profile) -> AbstractContextManager[None]:
    """The block in which a run's attempts (its preflight and its training with every retry) start warm, as the
    profile's launcher keeps them (its spec's ``warm``): the local launcher forks each torchrun agent from a warm
    host on this machine; a cluster launcher keeps the run's job, whose hosts stay up between attempts."""
    return launcher_spec(profile.launcher.kind).warm(profile)


def launch(request: LaunchRequest, watch: Watch = Watch()) -> AttemptOutcome:  # noqa: B008 - a frozen default
    """Run ``request`` through the launcher of its profile's ``launcher.kind``; LaunchError (one line) when that
    launcher cannot run the request's stage. A training result must be this run's, its checkpoint one of the
    run's (a cluster's result comes back through files others may write): otherwise the attempt ends as an
    error and nothing of the result is used."""
    outcome = launcher_spec(request.profile.launcher.kind, request.stage).launch(request, watch)
    if outcome.result is not None and (why := _not_this_runs(outcome.result, request)):
        incident = Incident(kind="error", detail=f"{why}; nothing of it was used", attempt=request.attempt, rank=0)
        return replace(outcome, result=None, incident=incident)
    return outcome


def _not_this_runs(result: TrainResult, request: LaunchRequest) -> str | None:
    checkpoints = RunPaths(request.profile.store.root, request.run_name).checkpoints
    if result.run_name != request.run_name:
        return f"the attempt's result is run {result.run_name[:80]!r}'s, not {request.run_name}'s"
    if posixpath.dirname(result.checkpoint_uri.rstrip("/")) != checkpoints or ".." in result.checkpoint_uri:
        return f"the attempt's result names checkpoint {result.checkpoint_uri[:200]!r}, not one under {checkpoints}"
    return None


def launch_attempt(
    profile: Profile,
    run_name: str,
    dataset_uri: str,
    mlflow_run_id: str | None = None,
    on_line: Callable[[str], None] | None = None,
    attempt: int = 1,
    on_finding: Callable[[Incident], None] | None = None,
    on_progress: Callable[[dict[int, dict]], None] | None = None,
) -> AttemptOutcome:
    """One training attempt from its pieces (tests, benchmarks): ``launch`` of a ``train`` request."""
    request = LaunchRequest("train", profile, run_name, attempt, dataset_uri, mlflow_run_id)
    return launch(request, Watch(on_line, on_finding, on_progress))
