from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from tasks.common import retry_on_incident
from trainer import tracking
from trainer.config import Profile
from trainer.errors import TrainingIncident
from trainer.incidents import load_incidents, record_incidents
from trainer.outcome import attempt_incident
from trainer.recovery import recovery_figures
from trainer.supervisor import train_attempt


@task(
    name="train_model",
    task_run_name="train-{run_name}",
    retries=2,  # the flow sets train.max_retries from the profile
    retry_delay_seconds=2,
    retry_condition_fn=retry_on_incident,
    cache_policy=NO_CACHE,
)
def train_model(profile: Profile, run_name: str, dataset_uri: str, mlflow_run_id: str | None = None) -> dict[str, Any]:
    """One training attempt under torchrun; a retry is a fresh launch that resumes from the last commit."""
    logger = get_run_logger()
    attempt = task_run.run_count or 1
    store, so = profile.store.root, profile.store.storage_options
    logger.info("attempt %d: %d node(s) × %d process(es)", attempt, profile.cluster.nodes, profile.cluster.procs_per_node)
    run = train_attempt(profile, run_name, dataset_uri, mlflow_run_id, on_line=logger.info, attempt=attempt)
    if run.result is None:
        record = attempt_incident(run, attempt, profile.train.timeout_s)
        record_incidents(store, run_name, [record], so)
        logger.error("incident: %s (rank %s, step %s, phase %s)", record["detail"], record["rank"], record["step"], record["phase"])
        if mlflow_run_id and profile.tracking.enabled:
            tracking.set_tags(profile.tracking.tracking_uri, mlflow_run_id, {"trainpipe.last_failure": f"{record['kind']}: {record['detail']}"})
        raise TrainingIncident(f"training attempt {attempt} failed: {record['detail']}", [record])
    figures = recovery_figures(load_incidents(store, run_name, so), run.result, run.first_step_at, attempt)
    if figures["recoveries"]:
        logger.info("recovered: %d lost step(s), %.1fs from fault to the first resumed step", figures["lost_steps"], figures["recovery_s"])
    return {**run.result, **figures, "attempt": attempt, "attempt_wall_s": run.outcome.wall_s, "first_step_at": run.first_step_at}
