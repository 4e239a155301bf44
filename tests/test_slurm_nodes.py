"""trainpipe on a real two-node Slurm cluster (``tests/slurm_cluster.py``, ``nodes=2``): node0 and node1 are two
slurmd daemons, each in a host of its own (its address, host name and local files), one slurmctld and munge on this
machine. Every run below is ``trainpipe run`` with ``launcher.kind=slurm``: the preflight job and each attempt are
sbatch jobs over both nodes, one host supervisor per node, c10d rendezvous and gloo between the nodes' addresses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests import slurm_cluster
from tests.conftest import DRILL, TINY, cli_env, run_cli
from trainpipe.trainer.checkpoint import catalog
from trainpipe.trainer.launch.slurm import SlurmJob

WHY_NOT = slurm_cluster.available()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]
NVML = Path(__file__).parent / "fixtures" / "nvml"
TWO_NODES = [
    "launcher.kind=slurm",
    "launcher.poll_s=0.3",
    "cluster.nodes=2",
    "cluster.procs_per_node=1",
    "tracking.enabled=false",
]


def run(slurm_nodes, name: str, *settings: str) -> tuple[dict, str]:
    """``trainpipe run`` on the cluster: (its summary, its stderr). Each node's recorded GPUs (the NVML seam) lie
    in its own ``local/nvml.json``."""
    env = cli_env({"TRAINPIPE_NVML_STATES": str(slurm_nodes.local / "nvml.json")})
    proc = run_cli("run", *[a for s in settings for a in ("--set", s)], "--run-name", name, "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def gpus(slurm_nodes, *recorded: str) -> None:
    for node, fixture in enumerate(recorded):
        shutil.copy(NVML / f"{fixture}.json", slurm_nodes.local_of(node) / "nvml.json")


def test_preflight_names_both_nodes_and_an_ecc_fault_on_node1_trains_on_node0_alone(home, slurm_nodes):
    """node1's GPU reports uncorrected ECC errors: the preflight job (both nodes) fails node1 only, the train task
    excludes it (an ``exclude`` incident), and the attempt's job runs with ``--exclude=node1`` on node0 with the
    global batch kept."""
    gpus(slurm_nodes, "healthy", "ecc_uncorrected")
    summary, stderr = run(slurm_nodes, "ecc", *TINY, *TWO_NODES, "cluster.min_nodes=1", "preflight.on_fail=exclude")
    print("\n".join(line for line in stderr.splitlines() if "reflight" in line or "xclud" in line))
    (excluded,) = [i for i in summary["incidents"] if i["kind"] == "exclude"]
    assert excluded["node"] == "node1" and "gpu.ecc" in excluded["detail"], excluded
    final = catalog.inspect_checkpoint(summary["checkpoint_uri"])
    assert final.valid and final.manifest["world_size"] == 1
    assert final.manifest["profile"]["train"]["global_batch"] == 8  # TINY's, on half the ranks

    jobs = Path(home, "jobs", "ecc")
    (preflight,) = [json.loads(p.read_text()) for p in jobs.glob("preflight-*/host-0.json")]
    assert preflight["result"]["nodes"] == ["node0", "node1"] and preflight["result"]["failing_nodes"] == ["node1"]
    (script,) = jobs.glob("attempt-1-*/job.sh")
    assert "#SBATCH --exclude=node1" in script.read_text() and "#SBATCH --nodes=1" in script.read_text()
    (part,) = [json.loads(p.read_text()) for p in jobs.glob("attempt-1-*/host-*.json")]
    assert part["node"] == "node0" and part["result"]["final_step"] == 8


def test_a_rank_sigkilled_on_node1_is_named_and_the_retry_resumes_to_the_uninterrupted_weights(
    home, slurm_nodes, drill_digest
):
    """DRILL over node0 and node1 (one rank each), with a snapshot into host memory every step: node1's rank
    SIGKILLs itself after step 29; the crash is named by node and rank, the retry runs in the same job (the run
    holds its allocation: both nodes' hosts stayed up, fork its agents warm and kept their memory tier, each
    holding the other's snapshot files) and resumes from host memory, past the store's step 20, to the weights
    of DRILL trained without a fault on one machine."""
    gpus(slurm_nodes, "healthy", "healthy")
    # killed at step 29: nine steps past the store's 20 for a snapshot to commit on a busy box (one in flight at
    # the kill is lost with it, and one due while another is written is skipped)
    kill = ["faults.kind=crash", "faults.rank=1", "faults.step=29", "faults.attempts=1", "train.max_retries=1"]
    summary, _ = run(slurm_nodes, "kill", *DRILL, *TWO_NODES, *kill, "checkpoint.memory_every_steps=1")
    (crash,) = [i for i in summary["incidents"] if i["kind"] == "crash"]
    assert (crash["rank"], crash["node"], crash["error"]) == (1, "node1", "SIGKILL"), crash
    assert summary["recoveries"] == 1 and summary["final_step"] == 60
    assert summary["model_digest"] == drill_digest
    attempts = json.loads((home / "store" / "runs" / "kill" / "attempts.json").read_text())
    # the newest snapshot before the kill at 25 (one still being written when it came is lost with it)
    assert [(a["attempt"], a.get("resumed_tier")) for a in attempts] == [(1, None), (2, "memory")], attempts
    assert 20 < attempts[1]["start_step"] <= 29, attempts
    for attempt in (1, 2):  # each attempt over both nodes, each node's agent forked by its warm host
        parts = [json.loads(p.read_text()) for p in Path(home, "jobs", "kill").glob(f"attempt-{attempt}-*/host-*.json")]
        assert sorted(p["node"] for p in parts) == ["node0", "node1"], parts
        assert all("forked by a warm host" in p["agent"] for p in parts), [p["agent"] for p in parts]
    (script,) = Path(home, "jobs", "kill").glob("attempt-*/job.sh")  # one sbatch job for both attempts
    job_id = next(script.parent.glob("slurm-*.out")).name.removeprefix("slurm-").removesuffix(".out")
    assert SlurmJob(job_id, dict(os.environ)).queued_state() is None  # the run ended: so did its job


def test_a_node_left_out_after_two_crashes_leaves_node0_resuming_from_its_memory_in_the_new_job(home, slurm_nodes):
    """node1's rank dies at the start of step 29 in the first two attempts: the second resumes from host memory
    in the held job, and after the second crash node1 is left out. The third attempt needs a job of its own
    (one node): the held job's hosts leave their memory tiers behind, and node0's host in the new job takes up
    what it held for the run, so the shrunk world resumes from node0's own snapshot, past the store's step 20,
    instead of from the store."""
    gpus(slurm_nodes, "healthy", "healthy")
    kill = ["faults.kind=crash", "faults.rank=1", "faults.step=29", "faults.attempts=2", "train.max_retries=2"]
    summary, stderr = run(slurm_nodes, "lost", *DRILL, *TWO_NODES, *kill, "checkpoint.memory_every_steps=1")
    assert summary["recoveries"] == 2 and summary["final_step"] == 60, summary
    attempts = json.loads((home / "store" / "runs" / "lost" / "attempts.json").read_text())
    tiers = [(a["attempt"], a.get("resumed_tier")) for a in attempts]
    assert tiers == [(1, None), (2, "memory"), (3, "memory")], (tiers, stderr[-3000:])
    assert 20 < attempts[2]["start_step"] < 29, attempts
    scripts = sorted(Path(home, "jobs", "lost").glob("attempt-*/job.sh"))
    assert len(scripts) == 2 and "#SBATCH --exclude=node1" in scripts[-1].read_text(), scripts
    assert "this host's memory tier stays for it" in stderr and "kept this run's memory-tier snapshots" in stderr


def test_a_straggler_on_node1_is_reported_while_the_job_runs_and_a_prefect_cancel_leaves_nothing(home, slurm_nodes):
    """node1's rank computes 4x slower: node 0's watchdog names it a straggler, and the warning reaches the run's
    records and the task's log while the job still runs. Then the run is cancelled through Prefect's API (as the
    UI's Cancel does): the CLI's flow sees it, scancels the job and exits 130; the job left the queue, and neither
    node has a process left but slurmd."""
    from prefect.states import Cancelling

    from tests.conftest import BIN, ROOT, prefect_api, prefect_client

    gpus(slurm_nodes, "healthy", "healthy")
    settings = [*TINY, *TWO_NODES, "train.steps=100000", "train.eval_every=0", "preflight.enabled=false"]
    settings += ["faults.kind=slow", "faults.rank=1", "faults.factor=4", "faults.attempts=0"]
    env = cli_env({"TRAINPIPE_NVML_STATES": str(slurm_nodes.local / "nvml.json")})
    proc = subprocess.Popen(
        [str(BIN / "trainpipe"), "run", *[a for s in settings for a in ("--set", s)], "--run-name", "stopme"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    deadline, found = time.monotonic() + 120, []
    while not found:  # node1's rank named a straggler, from the records the train task writes as findings come
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.3)
        found = [i for i in incidents(home, "stopme") if i["kind"] == "straggler"]
    assert (found[0]["rank"], found[0]["node"], found[0]["fatal"]) == (1, "node1", False), found
    (out,) = Path(home, "jobs", "stopme").glob("attempt-1-*/slurm-*.out")
    job_id = out.name.removeprefix("slurm-").removesuffix(".out")
    assert SlurmJob(job_id, dict(os.environ)).queued_state() == "RUNNING"  # heard during the job, not after it
    with prefect_client(prefect_api()) as client:
        (flow_run,) = [r for r in client.read_flow_runs() if r.name == "stopme"]
        client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 130, stderr[-3000:]
    assert "incident: straggler on rank 1: rank 1 computes" in stderr, stderr[-3000:]
    assert SlurmJob(job_id, dict(os.environ)).queued_state() is None
    for host in slurm_nodes.hosts:
        pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout.split()
        left = [psutil.Process(int(p)) for p in pids if psutil.pid_exists(int(p))]
        assert [p.name() for p in left] == ["slurmd"], [(p.pid, p.cmdline()) for p in left]


def incidents(home: Path, run: str) -> list[dict]:
    try:
        return json.loads((home / "store" / "runs" / run / "incidents.json").read_text())
    except (OSError, ValueError):
        return []
