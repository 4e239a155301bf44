"""The local launcher: this machine's supervisor runs the stage under torchrun here (simulated nodes included)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from trainpipe.trainer.checkpoint.memory_tier import keep_memory
from trainpipe.trainer.config import Profile
from trainpipe.trainer.launcher import AttemptOutcome, LauncherSpec, LaunchRequest, Watch, register_launcher
from trainpipe.trainer.supervise.attempt import preflight_job, train_attempt
from trainpipe.trainer.supervise.warm_host import keep_warm


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


@contextlib.contextmanager
def warm_here(profile: Profile) -> Iterator[None]:
    """A run's attempts fork their torchrun agents from a warm host on this machine (``cluster.warm_host``) and
    share the run's memory tier (``checkpoint.memory_every_steps``: trainer.checkpoint.memory_tier), removed
    when the run's attempts are over."""
    memory = profile.checkpoint.memory_every_steps != "off"
    with keep_warm(profile.cluster.warm_host), keep_memory(memory):
        yield


SPEC = register_launcher(
    LauncherSpec(
        "local",
        launch_local,
        frozenset({"train", "preflight"}),
        "this machine's supervisor under torchrun",
        warm=warm_here,
    )
)
