from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from tasks.common import retry_on_incident
from trainer.config import Profile
from trainer.errors import TrainingIncident
from trainer.incidents import incident, record_incidents
from trainer.supervisor import run_job, torchrun_command, worker_env


@task(
    name="train_model",
    task_run_name="train-{run_name}",
    retries=2,  # the flow sets train.max_retries from the profile
    retry_delay_seconds=2,
    retry_condition_fn=retry_on_incident,
    cache_policy=NO_CACHE,
)
def train_model(profile: Profile, profile_uri: str, run_name: str, dataset_uri: str, mlflow_run_id: str | None = None) -> dict[str, Any]:
    """One training attempt under torchrun; a retry is a fresh launch that resumes from the last commit."""
    logger = get_run_logger()
    attempt = task_run.run_count or 1
    logger.info("attempt %d: %d node(s) × %d process(es)", attempt, profile.cluster.nodes, profile.cluster.procs_per_node)
    with tempfile.TemporaryDirectory(prefix="trainpipe-attempt-") as tmp:
        result_path = Path(tmp) / "result.json"
        args = ["--profile", profile_uri, "--run-name", run_name, "--dataset-uri", dataset_uri, "--result", str(result_path)]
        if profile.tracking.enabled and mlflow_run_id:
            args += ["--tracking-uri", profile.tracking.tracking_uri, "--mlflow-run-id", mlflow_run_id]
        outcome = run_job(torchrun_command(profile, "trainer", args), worker_env(profile), on_line=logger.info, timeout_s=profile.train.timeout_s)
        if not outcome.ok or not result_path.exists():
            why = f"timed out after {profile.train.timeout_s:g}s" if outcome.timed_out else f"exited with code {outcome.returncode}"
            record = incident("crash", f"attempt {attempt} {why}", detected_after_s=outcome.wall_s)
            record_incidents(profile.store.root, run_name, [record], profile.store.storage_options)
            raise TrainingIncident(f"training attempt {attempt} {why}; last output: {' | '.join(outcome.tail[-3:])}", [record])
        result = json.loads(result_path.read_text())
    result["attempt"] = attempt
    result["attempt_wall_s"] = outcome.wall_s
    return result
