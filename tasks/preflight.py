from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from trainer.config import Profile
from trainer.errors import PreflightFailed
from trainer.supervisor import run_job, torchrun_command, worker_env


@task(name="preflight_cluster", task_run_name="preflight-{profile.name}", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def preflight_cluster(profile: Profile, profile_uri: str) -> dict[str, Any]:
    """Probe every rank (versions, all-reduce, store round trip, disk) before training spends the cluster."""
    logger = get_run_logger()
    with tempfile.TemporaryDirectory(prefix="trainpipe-preflight-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = torchrun_command(profile, "trainer.preflight", ["--profile", profile_uri, "--out", str(out)])
        outcome = run_job(cmd, worker_env(profile), on_line=logger.debug, timeout_s=profile.preflight.timeout_s)
        if not outcome.ok or not out.exists():
            why = "timed out" if outcome.timed_out else f"exited with code {outcome.returncode}"
            tail = " | ".join(outcome.tail[-3:])
            raise PreflightFailed(f"preflight job {why}: {tail}")
        report = json.loads(out.read_text())
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
