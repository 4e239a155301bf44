from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from tasks.common import retry_on_incident
from trainer import tracking
from trainer.config import Profile
from trainer.errors import TrainingFailed, TrainingIncident
from trainer.incidents import exclude_node, excluded_nodes, load_incidents, record_incidents
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
    """One training attempt under torchrun, watched; a retry is a fresh launch that resumes from the last commit."""
    logger = get_run_logger()
    attempt = task_run.run_count or 1
    store, so = profile.store.root, profile.store.storage_options
    tracked = bool(mlflow_run_id and profile.tracking.enabled)
    profile = without_excluded_nodes(profile, run_name, logger)
    logger.info("attempt %d: %d node(s) × %d process(es)", attempt, profile.cluster.nodes, profile.cluster.procs_per_node)

    def on_finding(finding) -> None:  # non-fatal findings (stragglers under 'warn') as they happen
        record = {**finding.as_incident(), "attempt": attempt}
        record_incidents(store, run_name, [record], so)
        logger.warning("incident: %s", finding.detail)

    run = train_attempt(profile, run_name, dataset_uri, mlflow_run_id, on_line=logger.info, attempt=attempt, on_finding=on_finding)
    if tracked and run.scores:
        for window in run.scores:
            tracking.log_metrics(profile.tracking.tracking_uri, mlflow_run_id, {
                **{f"health/straggler_score/rank_{r}": v for r, v in window["score"].items()},
                **{f"health/compute_ms/rank_{r}": v for r, v in window["compute_ms"].items()},
            }, window["step"])
    if run.result is None:
        record = attempt_incident(run, attempt, profile.train.timeout_s)
        previous = load_incidents(store, run_name, so)
        record_incidents(store, run_name, [record], so)
        logger.error("incident: %s on rank %s at step %s (%s), detected after %ss",
                     record["kind"], record["rank"], record["step"], record["detail"], record["detected_after_s"])
        create_table_artifact([{k: record.get(k) for k in ("kind", "rank", "node", "step", "phase", "detected_after_s", "detail")}],
                              key="training-incident", description=f"attempt {attempt} of {run_name}")
        if tracked:
            tracking.set_tags(profile.tracking.tracking_uri, mlflow_run_id, {"trainpipe.last_failure": f"{record['kind']}: {record['detail']}"})
        if record["kind"] == "straggler" and profile.watchdog.on_straggler == "exclude" and record.get("node"):
            exclude_node(store, run_name, record["node"], so)
            logger.warning("excluding node %s (straggler) from the next attempt", record["node"])
        if record["kind"] == "nan" and any(p.get("kind") == "nan" and p.get("step") == record["step"] for p in previous[-1:]):
            # The same step diverges again from the same checkpoint: retrying cannot help.
            raise TrainingFailed(f"loss went {record['detail'].split()[2]} at step {record['step']} again after resuming; "
                                 "lower train.lr or raise train.grad_clip, then rerun with the same --run-name")
        raise TrainingIncident(f"training attempt {attempt} failed: {record['kind']} on rank {record['rank']}: {record['detail']}", [record])
    figures = recovery_figures(load_incidents(store, run_name, so), run.result, run.first_step_at, attempt)
    if figures["recoveries"]:
        logger.info("recovered: %d lost step(s), %.1fs from fault to the first resumed step", figures["lost_steps"], figures["recovery_s"])
    return {**run.result, **figures, "attempt": attempt, "attempt_wall_s": run.outcome.wall_s, "first_step_at": run.first_step_at}


def without_excluded_nodes(profile: Profile, run_name: str, logger) -> Profile:
    """Shrink the cluster by the nodes an earlier attempt excluded (watchdog.on_straggler: exclude)."""
    from trainer.config import build_profile

    excluded = excluded_nodes(profile.store.root, run_name, profile.store.storage_options)
    if not excluded:
        return profile
    body = profile.model_dump(mode="json")
    body["cluster"]["nodes"] = max(profile.cluster.min_nodes, profile.cluster.nodes - len(excluded))
    logger.warning("running without excluded node(s) %s: %d node(s) left", ", ".join(excluded), body["cluster"]["nodes"])
    return build_profile(body, origin=f"exclusion of {', '.join(excluded)}")
