from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trainpipe.trainer.checkpoint.validate import validate_checkpoint as validate
from trainpipe.trainer.config import Profile


@task(name="validate_checkpoint", task_run_name="validate-{uri}", retries=0, cache_policy=NO_CACHE)
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
