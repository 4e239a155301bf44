from __future__ import annotations

import posixpath
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from trainpipe.trainer.checkpoint.validate import validate_checkpoint as validate
from trainpipe.trainer.config import Profile
from trainpipe.trainer.store_paths import check_run_name, run_of_checkpoint


def validate_run_name() -> str:
    """``validate-RUN``, as every stage's task run is named after the run: the profile's run name (the pipeline's),
    else the run folder the checkpoint lies in, else ``validate-checkpoint``. Never the URI itself: long, and a
    store's address is no name."""
    params = task_run.parameters
    profile, uri = params.get("profile"), params.get("uri")
    run = profile.train.run_name if isinstance(profile, Profile) else None
    if not run and isinstance(uri, str):
        run = posixpath.basename(run_of_checkpoint(uri))
    try:
        return f"validate-{check_run_name(run or '')}"
    except ValueError:
        return "validate-checkpoint"


@task(name="validate_checkpoint", task_run_name=validate_run_name, retries=0, cache_policy=NO_CACHE)
def validate_checkpoint(uri: str, profile: Profile) -> dict[str, Any]:
    """Checksums, load into a fresh model, finite weights, validation loss; fails with the reason."""
    report = validate(uri, profile)
    get_run_logger().info(
        "checkpoint %s is valid: step %d, %d files verified, val loss %.4f, digest %s",
        uri,
        report["step"],
        report["files_verified"],
        report["val_loss"],
        report["model_digest"][:12],
    )
    return report
