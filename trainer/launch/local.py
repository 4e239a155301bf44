"""The local launcher: this machine's supervisor runs the stage under torchrun here (simulated nodes included)."""

from __future__ import annotations

from trainpipe.trainer.launcher import AttemptOutcome, LauncherSpec, LaunchRequest, Watch, register_launcher
from trainpipe.trainer.supervise.attempt import preflight_job, train_attempt


def launch_local(request: LaunchRequest, watch: Watch) -> AttemptOutcome:
    if request.stage == "preflight":
        return preflight_job(request.profile, on_line=watch.on_line)
    return train_attempt(
        request.profile,
        request.run_name,
        request.dataset_uri or "",
        request.mlflow_run_id,
        on_line=watch.on_line,
        attempt=request.attempt,
        on_finding=watch.on_finding,
        on_progress=watch.on_progress,
    )


SPEC = register_launcher(
    LauncherSpec("local", launch_local, frozenset({"train", "preflight"}), "this machine's supervisor under torchrun")
)
