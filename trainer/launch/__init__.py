"""Who starts a training attempt (``launcher.kind``): this machine's supervisor, a Slurm job or a TrainJob.

Launchers run in the orchestrator (the train task's process) and start the
per-host supervisors, here or on a cluster's nodes: the one part of the
orchestrator that knows the supervisor's types. Every launcher takes the same
arguments and returns the same ``AttemptOutcome``, so the train task, the retry
policy and the summary do not know which ran.
"""

from __future__ import annotations

from collections.abc import Callable

from trainer.config import Profile
from trainer.incidents import Incident
from trainer.launch import kubernetes, slurm
from trainer.supervise.attempt import AttemptOutcome, train_attempt


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
    launch = {"slurm": slurm.train_attempt, "kubernetes": kubernetes.train_attempt}.get(
        profile.launcher.kind, train_attempt
    )
    return launch(
        profile,
        run_name,
        dataset_uri,
        mlflow_run_id,
        on_line=on_line,
        attempt=attempt,
        on_finding=on_finding,
        on_progress=on_progress,
    )
