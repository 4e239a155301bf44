from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run
from prefect.tasks import exponential_backoff

from tasks.common import retry_on_incident
from trainer.config import Profile
from trainer.errors import TrainingFailed, TrainingIncident
from trainer.incidents import Incident
from trainer.orchestrate.policy import after_attempt, without_excluded
from trainer.orchestrate.records import RunRecords
from trainer.orchestrate.summary import failed_attempts, recovery
from trainer.supervise.attempt import train_attempt
from trainer.tracking import TrackedRun

INCIDENT_COLUMNS = ("kind", "rank", "node", "step", "phase", "detected_after_s", "detail")


@task(
    name="train_model",
    task_run_name="train-{run_name}",
    retries=2,  # the flow sets train.max_retries and train.retry_delay_s from the profile
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_condition_fn=retry_on_incident,
    cache_policy=NO_CACHE,
)
def train_model(profile: Profile, run_name: str, dataset_uri: str, mlflow_run_id: str | None = None) -> dict[str, Any]:
    """One training attempt under torchrun, watched; a retry is a fresh launch that resumes from the last commit."""
    logger = get_run_logger()
    attempt = task_run.run_count or 1
    records, tracked = RunRecords(profile.store, run_name), TrackedRun.of(profile.tracking, mlflow_run_id)
    if excluded := records.excluded_nodes():
        profile = without_excluded(profile, excluded)
        logger.warning(
            "running without excluded node(s) %s: %d node(s) left", ", ".join(excluded), profile.cluster.nodes
        )
    logger.info(
        "attempt %d: %d node(s) × %d process(es)", attempt, profile.cluster.nodes, profile.cluster.procs_per_node
    )
    published: set[str] = set()

    def publish(incident: Incident) -> None:
        if incident.id in published:
            return
        published.add(incident.id)
        incident = incident.model_copy(update={"attempt": attempt})
        records.add_incidents(incident)
        tracked.log_dict([i.model_dump(mode="json") for i in records.incidents()], "incidents.json")
        (logger.error if incident.fatal else logger.warning)("incident: %s", incident.line())

    outcome = train_attempt(
        profile, run_name, dataset_uri, mlflow_run_id, on_line=logger.info, attempt=attempt, on_finding=publish
    )
    for window in outcome.scores:
        tracked.log_metrics(
            {
                **{f"health/straggler_score/rank_{r}": v for r, v in window["score"].items()},
                **{f"health/compute_ms/rank_{r}": v for r, v in window["compute_ms"].items()},
            },
            window["step"],
        )
    for finding in outcome.findings:  # those not published as they came, e.g. an unclean exit after the final commit
        publish(finding)
    history = records.incidents()
    records.add_attempt(outcome.record())
    if outcome.result is not None:
        result = outcome.result
        figures = recovery(
            failed_attempts(records.attempts(), attempt),
            outcome.record(),
            result["final_step"],
            result["step_s_median"],
        )
        if figures.recoveries:
            logger.info(
                "recovered: %d lost step(s), %.1fs from fault to the first resumed step",
                figures.lost_steps,
                figures.recovery_s,
            )
        return {**result, **figures.as_dict(), "attempt": attempt}

    incident = outcome.incident.model_copy(update={"attempt": attempt})
    publish(incident)
    create_table_artifact(
        [{k: getattr(incident, k) for k in INCIDENT_COLUMNS}],
        key="training-incident",
        description=f"attempt {attempt} of {run_name}",
    )
    tracked.set_tags({"trainpipe.last_failure": incident.line()})
    decision = after_attempt(incident, history, profile)
    if decision.exclude_node:
        records.exclude_node(decision.exclude_node)
        logger.warning("excluding node %s from the next attempt", decision.exclude_node)
    if decision.action == "stop":
        raise TrainingFailed(decision.reason)
    raise TrainingIncident(f"training attempt {attempt} failed: {decision.reason}", [incident])
