from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from trainer.config import Profile
from trainer.errors import PreflightFailed
from trainer.supervisor import preflight_job


@task(name="preflight_cluster", task_run_name="preflight-{profile.name}", retries=0, cache_policy=NO_CACHE)
def preflight_cluster(profile: Profile) -> dict[str, Any]:
    """Probe every rank (versions, all-reduce, store round trip, disk) before training spends the cluster."""
    logger = get_run_logger()
    job = preflight_job(profile, on_line=logger.debug)
    if job.result is None:
        why = "timed out" if job.outcome.timed_out else f"exited with code {job.outcome.returncode}"
        raise PreflightFailed(f"preflight job {why}: {' | '.join(job.outcome.tail[-3:])}")
    report = job.result
    create_table_artifact(
        [{"check": c["name"], "status": c["status"], "detail": c["detail"]} for c in report["checks"]],
        key="preflight-report",
        description=f"Preflight of {report['world_size']} ranks in {report['duration_s']:.1f}s",
    )
    for c in report["checks"]:
        (logger.info if c["status"] == "pass" else logger.warning)("preflight %s: %s (%s)", c["name"], c["status"], c["detail"])
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    if failed:
        c = failed[0]
        raise PreflightFailed(f"preflight check {c['name']} failed: {c['detail']}")
    return report
