"""launcher.kind=slurm against a real one-node Slurm cluster (``tests/slurm_cluster.py``): submit, follow,
a rank killed inside the job and the resume, a cancelled run's scancel, a refused job."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import psutil
import pytest

from tests import slurm_cluster
from tests.conftest import DRILL, TINY
from trainpipe.trainer.checkpoint.catalog import list_checkpoints
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.errors import LaunchError, RunCancelled
from trainpipe.trainer.launch import launch_attempt, slurm, warm_attempts
from trainpipe.trainer.launch.jobs import recorded
from trainpipe.trainer.launch.slurm import SlurmJob
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import RunPaths

WHY_NOT = slurm_cluster.available()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]
SLURM = ["tracking.enabled=false", "launcher.kind=slurm", "launcher.poll_s=0.3", "preflight.enabled=false"]


def ranks_of(marker: str) -> dict[int, psutil.Process]:
    found = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        if (p.info["name"] or "").startswith("trainpipe-r") and marker in " ".join(p.info["cmdline"] or []):
            found[int(p.info["name"].removeprefix("trainpipe-r"))] = p
    return found


def warm_hosts_of(home: Path) -> list[psutil.Process]:
    """The warm hosts below a job started with ``home`` (sbatch passes its environment to the job's host
    supervisor; the warm host keeps a few variables): another pytest worker may run warm hosts of its own."""
    found = []
    for p in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error):
            if p.info["name"] == "trainpipe-warm" and any(
                q.environ().get("TRAINPIPE_HOME") == str(home) for q in p.parents()
            ):
                found.append(p)
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
def test_a_rank_killed_inside_the_slurm_job_is_named_and_the_next_attempt_resumes_warm_in_the_same_job(
    home, slurm_env, request, resume
):
    """A Slurm job whose rank 1 SIGKILLs itself (the fault drill; it does not change the numbers): the follower
    names it; with ``resume``, DRILL's next attempt runs in the same job (the run holds its allocation: its host
    stayed up), its agent forked from the host's warm host, and resumes to the fault-free weights. When the run's
    block ends, the job leaves the queue with nothing of it left."""
    kill = ["faults.kind=crash", "faults.rank=1", f"faults.step={25 if resume else 5}", "faults.attempts=1"]
    prof = load_profile("local", [*(DRILL if resume else TINY), *SLURM, *kill])
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    lines: list[str] = []
    launched = time.time()
    with warm_attempts(prof):
        killed = launch_attempt(prof, "job", dataset_uri, on_line=lines.append)
        assert killed.result is None and killed.incident.kind == "crash", killed.incident
        # the queue (sbatch to the host supervisor's start) ends before the first step: badput's queue bucket
        assert launched < killed.started_at < killed.first_step_at, (launched, killed.started_at, killed.first_step_at)
        assert (killed.incident.rank, killed.incident.error) == (1, "SIGKILL"), killed.incident
        assert any("[node0]" in line for line in lines)  # the job's output reached the follower's log
        (script,) = Path(prof.launcher.shared_dir, "job").glob("attempt-1-*/job.sh")
        assert "srun" in script.read_text() and "TOKEN" not in script.read_text()  # secrets only in the environment
        job_id = killed.job.job.split(",")[0].removeprefix("slurm job ")
        if resume:
            drill_digest = request.getfixturevalue("drill_digest")
            # the newest commit before the kill (the async save of step 20 may still be uploading at step 25)
            committed = max(i.step for i in list_checkpoints(RunPaths(prof.store.root, "job").checkpoints) if i.valid)
            asked = time.time()
            resumed = launch_attempt(prof, "job", dataset_uri, attempt=2)
            assert resumed.incident is None, resumed.incident
            assert resumed.result.start_step == committed >= 10 and resumed.result.final_step == 60
            assert resumed.result.model_digest == drill_digest
            assert resumed.first_step == committed + 1 and resumed.scores  # node 0's watchdog scored the ranks
            # the same job, no new queue: its host saw the request at once and forked the agent warm
            assert resumed.job.job == f"slurm job {job_id}, its hosts' agents forked warm", resumed.job.job
            assert asked < resumed.started_at < asked + 5, (asked, resumed.started_at)
            assert not list(Path(prof.launcher.shared_dir, "job").glob("attempt-2-*/job.sh"))  # no second sbatch
        assert SlurmJob(job_id, dict(os.environ)).queued_state() == "RUNNING"  # held for the run's next attempt
        assert warm_hosts_of(home)  # its host forks the next attempt's agent warm
    assert SlurmJob(job_id, dict(os.environ)).queued_state() is None  # the block ended: so did the job
    assert not ranks_of(str(home)) and not warm_hosts_of(home)
    assert recorded(prof.store, "job") == []


def test_a_standing_host_that_dies_ends_its_attempt_and_the_next_attempt_gets_a_job_of_its_own(home, slurm_env):
    """The host supervisor of a held allocation is SIGKILLed while its attempt trains: the attempt ends as a crash
    of the node that never reported, the job is not used again (the next attempt is a new sbatch job and
    trains), and nothing of either job is left."""
    prof = load_profile("local", [*TINY, *SLURM, "train.steps=100000", "train.eval_every=0"])
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    killed: list[int] = []

    def kill_host(progress: dict[int, dict]) -> None:
        if not killed and max((p.get("step", -1) for p in progress.values()), default=-1) >= 3:
            for p in psutil.process_iter(["cmdline"]):
                if "--serve" in (p.info["cmdline"] or []) and str(home) in " ".join(p.info["cmdline"]):
                    p.kill()
                    killed.append(p.pid)

    with warm_attempts(prof):
        lost = launch_attempt(prof, "lost", dataset_uri, on_progress=kill_host)
        assert killed and lost.result is None and lost.incident.kind == "crash", (killed, lost.incident)
        assert "before node(s) [0] reported" in lost.incident.detail, lost.incident.detail
        short = load_profile("local", [*TINY, *SLURM, "train.eval_every=0"])  # the same job script, fewer steps
        assert slurm.allocation_key(short, "lost") == slurm.allocation_key(prof, "lost")
        second = launch_attempt(short, "lost", dataset_uri, attempt=2)
        assert second.incident is None and second.result is not None, second.incident  # trained (or found it done)
    scripts = sorted(Path(prof.launcher.shared_dir, "lost").glob("attempt-*/job.sh"))
    assert [s.parent.name.split("-")[1] for s in scripts] == ["1", "2"]  # a job of its own for attempt 2
    assert second.job.job.split(",")[0] != lost.job.job.split(",")[0]
    assert not ranks_of(str(home)) and recorded(prof.store, "lost") == []


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
    prof = load_profile("local", [*TINY, *SLURM, "launcher.slurm.partition=nowhere"])
    with pytest.raises(LaunchError, match=r"sbatch refused the job: .*partition"):
        launch_attempt(prof, "refused", "unused")
