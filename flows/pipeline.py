"""The trainpipe flow: shard → preflight → train (retried, resuming) → validate → report, tracked in MLflow.

Orchestration only: it orders the tasks and opens the run's MLflow run; what
each step does lives in the tasks, what a result means in
``trainer.orchestrate.policy``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff

from tasks.preflight import apply_preflight_policy, preflight_cluster
from tasks.report import report_run
from tasks.shard import shard_dataset
from tasks.train import train_model
from tasks.validate import validate_checkpoint
from trainer.config import write_resolved_profile
from trainer.orchestrate.resolve import resolve
from trainer.tracking import tracked_run


@flow(name="trainpipe", flow_run_name="{profile}", validate_parameters=True)
def training_pipeline(
    profile: str = "local", overrides: list[str] | None = None, run_name: str | None = None
) -> dict[str, Any]:
    """Run the whole pipeline on a profile (a name in profiles/ or a YAML path) with section.key=value overrides."""
    start = time.time()
    prof, name = resolve(profile, overrides, run_name)
    write_resolved_profile(prof, name)  # the record of what this run trains with
    tags = {
        "prefect.flow_run_id": str(flow_run.id),
        "prefect.flow_run_name": str(flow_run.name),
        "trainpipe.profile": prof.name,
        "trainpipe.config_hash": prof.config_hash(),
    }
    with tracked_run(prof.tracking, name, tags, params=prof.flat(), texts={"profile.yaml": prof.public_yaml()}) as run:
        dataset = shard_dataset(prof.data, prof.store, progress=sys.stderr.isatty())
        if prof.preflight.enabled:
            report = preflight_cluster(prof, run.id)
            prof = apply_preflight_policy(report, prof, name, run.id)
        retrying = train_model.with_options(
            retries=prof.train.max_retries,
            retry_delay_seconds=exponential_backoff(backoff_factor=prof.train.retry_delay_s),
        )
        trained = retrying(prof, name, dataset.uri, run.id)
        validated = validate_checkpoint(trained["checkpoint_uri"], prof)
        return report_run(prof, name, run.id, dataset.dataset_id, trained, validated, wall_s=time.time() - start)
