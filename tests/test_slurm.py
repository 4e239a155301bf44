"""launcher.kind=slurm against a real one-node Slurm cluster (``tests/slurm_cluster.py``): submit, follow,
a rank killed inside the job and the resume, a cancelled run's scancel, a refused job."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

from tests import slurm_cluster
from tests.conftest import DRILL, TINY
from trainpipe.trainer.checkpoint.catalog import list_checkpoints
from trainpipe.trainer.config import load_profile
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.errors import LaunchError, RunCancelled
from trainpipe.trainer.launch import launch_attempt
from trainpipe.trainer.launch.slurm import SlurmJob
from trainpipe.trainer.layout import RunPaths

WHY_NOT = slurm_cluster.available()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]
SLURM = ["tracking.enabled=false", "launcher.kind=slurm", "launcher.poll_s=0.3", "preflight.enabled=false"]


def ranks_of(marker: str) -> dict[int, psutil.Process]:
    found = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        if (p.info["name"] or "").startswith("trainpipe-r") and marker in " ".join(p.info["cmdline"] or []):
            found[int(p.info["name"].removeprefix("trainpipe-r"))] = p
    return found


def test_the_preflight_runs_as_a_slurm_job_on_the_allocations_nodes(home, slurm_env):
    """The preflight stage through the launcher: one sbatch job whose srun starts a --stage preflight host part
    on every node; the report comes back through the hosts' parts and names the node Slurm ran it on."""
    from trainpipe.trainer.launch import launch
    from trainpipe.trainer.launcher import LaunchRequest, Watch

    prof = load_profile("local", [*TINY, *SLURM, "preflight.enabled=true"])
    lines: list[str] = []
    outcome = launch(LaunchRequest("preflight", prof, "pf"), Watch(on_line=lines.append))
    assert outcome.report is not None, (outcome.incident, lines[-5:])
    assert outcome.report["world_size"] == 2 and outcome.report["ok"], outcome.report["checks"]
    assert [c["status"] for c in outcome.report["checks"] if c["name"] == "compute.gemm"] == ["pass"]
    (script,) = Path(prof.launcher.shared_dir, "pf").glob("preflight-*/job.sh")
    assert "--stage preflight" in script.read_text() and "--job-name=trainpipe-pf-preflight-" in script.read_text()


# the resume across hosts to the same weights runs in the default suite in tests/test_multihost.py
@pytest.mark.parametrize("resume", [False, True])
def test_a_rank_killed_inside_the_slurm_job_is_named_and_the_next_job_resumes_to_the_same_weights(
    home, slurm_env, request, resume
):
    """A Slurm job whose rank 1 SIGKILLs itself (the fault drill; it does not change the numbers): the follower
    names it; with ``resume``, DRILL's next job resumes to the fault-free weights."""
    kill = ["faults.kind=crash", "faults.rank=1", f"faults.step={25 if resume else 5}", "faults.attempts=1"]
    prof = load_profile("local", [*(DRILL if resume else TINY), *SLURM, *kill])
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    lines: list[str] = []
    launched = time.time()
    killed = launch_attempt(prof, "job", dataset_uri, on_line=lines.append)
    assert killed.result is None and killed.incident.kind == "crash", killed.incident
    # the queue (sbatch to the host supervisor's start) ends before the first step: badput's queue bucket
    assert launched < killed.started_at < killed.first_step_at, (launched, killed.started_at, killed.first_step_at)
    assert (killed.incident.rank, killed.incident.error) == (1, "SIGKILL"), killed.incident
    assert any("[node0]" in line for line in lines)  # the job's output reached the follower's log
    (script,) = Path(prof.launcher.shared_dir, "job").glob("attempt-1-*/job.sh")
    assert "srun" in script.read_text() and "TOKEN" not in script.read_text()  # secrets only in the environment
    if not resume:
        return
    drill_digest = request.getfixturevalue("drill_digest")
    # the newest commit before the kill (the async save of step 20 may still be uploading at step 25 on a busy box)
    committed = max(i.step for i in list_checkpoints(RunPaths(prof.store.root, "job").checkpoints) if i.valid)
    resumed = launch_attempt(prof, "job", dataset_uri, attempt=2)
    assert resumed.incident is None, resumed.incident
    assert resumed.result.start_step == committed >= 10 and resumed.result.final_step == 60
    assert resumed.result.model_digest == drill_digest
    assert resumed.first_step == committed + 1 and resumed.scores  # node 0's watchdog scored the ranks in the job


def test_a_cancelled_run_cancels_its_slurm_job_and_nothing_of_it_is_left(home, slurm_env):
    prof = load_profile("local", [*TINY, *SLURM, "train.steps=2000"])
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    seen: list[dict] = []

    def follow(progress: dict[int, dict]) -> None:
        seen.append(progress)
        if max((p.get("step", -1) for p in progress.values()), default=-1) >= 3:  # training for real
            raise RunCancelled("run cancelled")

    t0 = time.monotonic()
    with pytest.raises(RunCancelled):
        launch_attempt(prof, "cancel", dataset_uri, on_progress=follow)
    assert time.monotonic() - t0 < 120 and seen
    (folder,) = Path(prof.launcher.shared_dir, "cancel").glob("attempt-1-*")
    job_id = next(folder.glob("slurm-*.out")).name.removeprefix("slurm-").removesuffix(".out")
    assert SlurmJob(job_id, dict(os.environ)).queued_state() is None  # scancel'ed and gone from the queue
    assert not ranks_of(str(home))
    # scancel's SIGTERM reached the host supervisor: it tore its ranks down and said so before Slurm's SIGKILL
    (part,) = [json.loads(p.read_text()) for p in folder.glob("host-*.json")]
    assert part["incident"]["kind"] == "aborted" and "SIGTERM" in part["incident"]["detail"], part


def test_a_job_slurm_refuses_is_one_line(home, slurm_env):
    prof = load_profile("local", [*TINY, *SLURM, "launcher.partition=nowhere"])
    with pytest.raises(LaunchError, match=r"sbatch refused the job: .*partition"):
        launch_attempt(prof, "refused", "unused")
