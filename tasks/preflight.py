from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from trainpipe.tasks.events import emit_incident
from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import PreflightFailed
from trainpipe.trainer.launch import launch
from trainpipe.trainer.launcher import LaunchRequest, Watch
from trainpipe.trainer.orchestrate.policy import after_preflight
from trainpipe.trainer.orchestrate.records import RunRecords
from trainpipe.trainer.profile_files import write_resolved_profile
from trainpipe.trainer.tracking import TrackedRun


@task(name="preflight_cluster", task_run_name="preflight-{profile.train.run_name}", retries=0, cache_policy=NO_CACHE)
def preflight_cluster(profile: Profile) -> dict[str, Any]:
    """Probe every rank (GPU health, consistency, compute, collectives, storage) before training spends the cluster."""
    logger = get_run_logger()
    request = LaunchRequest("preflight", profile, profile.train.run_name or "preflight")
    job = launch(request, Watch(on_line=logger.debug))
    if job.report is None:
        last = " | ".join(job.job.tail[-3:])
        why = job.incident.line() if job.incident else "no report and no incident"
        raise PreflightFailed(f"the preflight job failed: {why}" + (f"; last output: {last}" if last else ""))
    report = job.report
    create_table_artifact(
        [
            {"check": c["name"], "status": c["status"], "node": c.get("node", ""), "detail": c["detail"]}
            for c in report["checks"]
        ],
        key="preflight-report",
        description=f"Preflight of {report['world_size']} ranks in {report['duration_s']:.1f}s",
    )
    for c in report["checks"]:
        (logger.info if c["status"] == "pass" else logger.warning)(
            "preflight %s: %s (%s)", c["name"], c["status"], c["detail"]
        )
    nodes = ", ".join(report.get("nodes", [])) or "this machine"
    logger.info(
        "preflight of %d rank(s) on %s took %.1fs: %s",
        report["world_size"],
        nodes,
        report["duration_s"],
        report["timings_s"],
    )
    return report


@task(name="apply_preflight_policy", task_run_name="preflight-policy-{run_name}", retries=0, cache_policy=NO_CACHE)
def apply_preflight_policy(
    report: dict[str, Any], profile: Profile, run_name: str, mlflow_run_id: str | None = None
) -> Profile:
    """Record the report in MLflow; stop on a failing check, or continue without the failing nodes
    (``preflight.on_fail: exclude``)."""
    TrackedRun.of(profile.tracking, mlflow_run_id).log_dict(report, "preflight.json")
    decision = after_preflight(report, profile)
    if decision.action == "stop":
        raise PreflightFailed(decision.reason)
    if decision.incident is not None:
        RunRecords(profile.store, run_name).add_incidents(decision.incident)
        emit_incident(run_name, decision.incident, profile.hide)
        write_resolved_profile(decision.profile, run_name)  # the record of what the run trains with
        TrackedRun.of(profile.tracking, mlflow_run_id).set_tags({"trainpipe.excluded_nodes": decision.incident.node})
        get_run_logger().warning(decision.reason)
    return decision.profile
