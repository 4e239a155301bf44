"""publish_model: the validated checkpoint as a registered model (``trainer.orchestrate.publish``)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import PublishError, StoreError
from trainpipe.trainer.orchestrate.publish import Published, publish_checkpoint


def _worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """A registry or store that did not answer may answer next time; a checkpoint that does not export will not."""
    try:
        state.result()
    except (PublishError, StoreError):
        return True
    except Exception:  # noqa: BLE001 - any other failure is the same on a retry
        return False
    return False


@task(
    name="publish_model",
    task_run_name="publish-{run_name}",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=_worth_retrying,
    cache_policy=NO_CACHE,
)
def publish_model(profile: Profile, run_name: str, mlflow_run_id: str | None, validated: dict[str, Any]) -> Published:
    """Export the validated checkpoint, gate it against the champion, log it to the run and register it."""
    with tempfile.TemporaryDirectory(prefix="trainpipe-publish-") as work:  # 0700: the export and the champion
        published = publish_checkpoint(profile, run_name, mlflow_run_id, validated, Path(work))
    get_run_logger().info(
        "registered %s version %s%s (aliases: %s); gate %s",
        published.registered_model,
        published.version,
        " (already published by this run)" if published.reused else "",
        ", ".join(published.aliases) or "none",
        published.gate.line,
    )
    return published
