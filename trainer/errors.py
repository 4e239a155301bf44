"""One exception class per failure a user can act on.

The CLI renders each as a single line (``error: <message>``) with a non-zero
exit code; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainpipe.trainer.incidents import Incident


class TrainpipeError(Exception):
    """Base class for expected, user-actionable failures."""

    exit_code = 2


class ProfileError(TrainpipeError):
    """The profile (YAML or --set override) is invalid."""


class DataError(TrainpipeError):
    """The data source is missing, empty or unreadable."""


class StoreError(TrainpipeError):
    """The object store cannot be reached, written or read."""


class StoreUnavailable(StoreError):
    """The store stayed unreachable (refused, reset, timed out, 5xx) through every retry: another attempt, once it
    is back, succeeds. Not raised for errors a retry cannot fix (no such bucket, access denied)."""

    reason = ""  # the last error, as ``Class: first line``


class CheckpointError(TrainpipeError):
    """A checkpoint is missing, incomplete, corrupt or not sane."""


class ExportError(TrainpipeError):
    """A validated checkpoint cannot become a stock transformers model (no equivalent architecture, a weight with
    no place in it); the checkpoint stays as it is."""


class PublishError(TrainpipeError):
    """The model registry refused or could not take the model (a name it refuses, a registry that is down, a
    name or alias this run may not touch); training's result stands and publishing alone retries."""


class TrackingError(TrainpipeError):
    """The MLflow tracking server or store cannot be reached or refuses the run (said without its credentials)."""


class LaunchError(TrainpipeError):
    """The cluster's scheduler refused the job or cannot be reached (sbatch, squeue)."""


class PreflightFailed(TrainpipeError):
    """A preflight check failed; the cluster should not be used as is."""


class TrainingIncident(TrainpipeError):
    """A training attempt failed in a way another attempt can fix (crash, hang, timeout, …); retryable."""

    def __init__(self, message: str, incidents: list[Incident] | None = None):
        super().__init__(message)
        self.incidents = incidents or []


class TrainingFailed(TrainpipeError):
    """Training cannot succeed by retrying (e.g. the loss diverges again at the same step)."""


class RunCancelled(TrainpipeError):
    """The run was cancelled (from the Prefect UI or API); committed checkpoints are kept and the same name resumes."""

    exit_code = 130
