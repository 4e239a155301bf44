from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from tasks.common import retry_on_incident
from trainer.config import Profile
from trainer.errors import TrainingIncident
from trainer.incidents import incident, record_incidents
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
    logger.info("attempt %d: %d node(s) × %d process(es)", attempt, profile.cluster.nodes, profile.cluster.procs_per_node)
    run = train_attempt(profile, run_name, dataset_uri, mlflow_run_id, on_line=logger.info)
    if run.result is None:
        o = run.outcome
        why = f"timed out after {profile.train.timeout_s:g}s" if o.timed_out else f"exited with code {o.returncode}"
        record = incident("crash", f"attempt {attempt} {why}", detected_after_s=o.wall_s)
        record_incidents(profile.store.root, run_name, [record], profile.store.storage_options)
        raise TrainingIncident(f"training attempt {attempt} {why}; last output: {' | '.join(o.tail[-3:])}", [record])
    return {**run.result, "attempt": attempt, "attempt_wall_s": run.outcome.wall_s}
