from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from trainer.config import Profile
from trainer.errors import PreflightFailed
from trainer.preflight import failure_line
from trainer.supervisor import preflight_job


@task(name="preflight_cluster", task_run_name="preflight-{profile.name}", retries=0, cache_policy=NO_CACHE)
def preflight_cluster(profile: Profile, raise_on_fail: bool = True) -> dict[str, Any]:
    """Probe every rank (GPU health, consistency, compute, collectives, storage) before training spends the cluster."""
    logger = get_run_logger()
    job = preflight_job(profile, on_line=logger.debug)
    if job.result is None:
        why = "timed out" if job.outcome.timed_out else f"exited with code {job.outcome.returncode}"
        raise PreflightFailed(f"preflight job {why}: {' | '.join(job.outcome.tail[-3:])}")
    report = job.result
    create_table_artifact(
        [{"check": c["name"], "status": c["status"], "node": c.get("node", ""), "detail": c["detail"]} for c in report["checks"]],
        key="preflight-report",
        description=f"Preflight of {report['world_size']} ranks in {report['duration_s']:.1f}s",
    )
    for c in report["checks"]:
        (logger.info if c["status"] == "pass" else logger.warning)("preflight %s: %s (%s)", c["name"], c["status"], c["detail"])
    logger.info("preflight took %.1fs: %s", report["duration_s"], report["timings_s"])
    line = failure_line(report)
    if line and raise_on_fail:
        raise PreflightFailed(line)
    return report
