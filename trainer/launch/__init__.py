"""The launchers (``launcher.kind``), registered against the contract in ``trainer/launcher.py``.

Launchers run in the orchestrator (the Prefect tasks' process) and start the
per-host supervisors, here or on a cluster's nodes: the one part of the
orchestrator that knows the supervisor's types. Modules: ``local`` (this
machine's supervisor), ``slurm`` (an sbatch job), ``kubernetes`` (a Kubeflow
Trainer TrainJob), ``outcome`` (a cluster job's outcome from its hosts'
parts), ``jobs`` (a run's live cluster jobs, stopped when their orchestrator
died). Importing this package registers every launcher; ``launch`` runs a
request through the one its profile names.
"""

from __future__ import annotations

from collections.abc import Callable

from trainpipe.trainer.config import Profile
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.launch import kubernetes, local, slurm  # noqa: F401 - each registers its LauncherSpec
from trainpipe.trainer.launcher import AttemptOutcome, LaunchRequest, Watch, launcher_spec


def launch(request: LaunchRequest, watch: Watch = Watch()) -> AttemptOutcome:  # noqa: B008 - a frozen default
    """Run ``request`` through the launcher of its profile's ``launcher.kind``; LaunchError (one line) when that
    launcher cannot run the request's stage."""
    return launcher_spec(request.profile.launcher.kind, request.stage).launch(request, watch)


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
