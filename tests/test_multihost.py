"""Two hosts for real: network namespaces joined by a bridge (``tests/netns.py``), one host supervisor
(``python -m trainpipe.trainer.supervise.host``) and torchrun agent per host, c10d rendezvous over the hosts' addresses.

Node 0's supervisor runs the job's watchdog; every rank of both hosts beacons to it; the other host follows it.
Each host writes its part's outcome, and ``job_outcome`` makes the attempt's from them, as a launcher does.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import netns
from tests.conftest import DRILL, ROOT, TINY
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import CHECKPOINT_MANIFEST, RunPaths
from trainpipe.trainer.supervise.host import job_outcome
from trainpipe.trainer.tracking import client, experiment_id

WHY_NOT = netns.available()
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]

TWO_HOSTS = ["cluster.nodes=2", "cluster.procs_per_node=1", "cluster.master_port=29400", "tracking.enabled=false"]


class Job:
    """One attempt of a run on ``hosts``: each host's supervisor started in its namespace."""

    def __init__(
        self, hosts: list[netns.Host], home: Path, sets: list[str], run: str, attempt: int = 1, mlflow_run: str = ""
    ):
        self.hosts, self.home, self.run = hosts, home, run
        prof = load_profile("local", sets)
        dataset_uri = shard_dataset(prof.data, prof.store).uri
        token = secrets.token_hex(16)
        self.outcomes = [home / f"{run}-{attempt}-host{i}.json" for i in range(len(hosts))]
        self.procs = []
        for i, host in enumerate(hosts):
            env = {
                "PATH": os.environ["PATH"],
                "HOME": os.environ.get("HOME", "/root"),
                "TRAINPIPE_HOME": str(home),
                "PYTHONPATH": str(ROOT),
                "TRAINPIPE_NODE_NAME": host.name,
                "GLOO_SOCKET_IFNAME": host.interface,
                "TRAINPIPE_BEACON_TOKEN": token,
                "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1",
            }
            mine = [
                f"cluster.master_addr={hosts[0].address}",
                f"cluster.node_rank={i}",
                f"cluster.local_addr={host.address}",
            ]
            argv = [
                sys.executable,
                "-m",
                "trainpipe.trainer.supervise.host",
                "--run-name",
                run,
                "--dataset-uri",
                dataset_uri,
            ]
            argv += ["--attempt", str(attempt), "--outcome", str(self.outcomes[i])]
            argv += ["--mlflow-run-id", mlflow_run] if mlflow_run else []
            argv += [a for s in [*sets, *mine] for a in ("--set", s)]
            log = open(home / f"{run}-{attempt}-host{i}.log", "w")  # noqa: SIM115 - closed with the process
            self.procs.append(subprocess.Popen(host.command(argv, env), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))

    def wait_for_commit(self, after: int, timeout: float = 120) -> int:
        """The step of the first commit after step ``after``."""
        folder = Path(RunPaths(str(self.home / "store"), self.run).checkpoints)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = [int(p.parent.name.removeprefix("step-")) for p in folder.glob(f"step-*/{CHECKPOINT_MANIFEST}")]
            if [s for s in steps if s > after]:
                return min(s for s in steps if s > after)
            assert all(p.poll() is None for p in self.procs), self.logs()
            time.sleep(0.05)
        raise AssertionError(f"no commit after step {after}\n{self.logs()}")

    def process(self, host: int, marker: str) -> psutil.Process:
        """A process running in ``host`` whose name or command line has ``marker``."""
        pids = subprocess.run(["ip", "netns", "pids", self.hosts[host].namespace], capture_output=True, text=True)
        for pid in pids.stdout.split():
            p = psutil.Process(int(pid))
            if p.name().startswith(marker) or marker in " ".join(p.cmdline()):
                return p
        raise AssertionError(f"no {marker} in host {host}")

    def outcome(self, timeout: float = 120) -> dict:
        for p in self.procs:
            p.wait(timeout=timeout)
        return job_outcome([json.loads(o.read_text()) for o in self.outcomes])

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in sorted(self.home.glob(f"{self.run}-*.log")))


def test_the_second_hosts_agent_killed_is_named_and_the_resume_matches_one_host(home, drill_digest):
    """DRILL on 2 hosts × 1 rank: host1's whole torchrun agent is SIGKILLed mid-run; the cause is host1 (not the
    rank on host0 that lost its peer), every host says how its part ended, and the next attempt resumes to the
    weights of the same run on 1 host × 2 ranks."""
    sets = [*DRILL, *TWO_HOSTS, "faults.factor=2"]  # the slowed rank leaves time to kill; the numbers are the same
    with netns.hosts(2) as hosts:
        job = Job(hosts, home, sets, "two")
        job.wait_for_commit(after=0)
        job.process(1, "trainpipe.trainer.supervise.agent").send_signal(signal.SIGKILL)
        first = job.outcome()
        why = Incident.model_validate(first["incident"])
        assert (why.kind, why.node, why.error) == ("crash", "host1", "SIGKILL"), why
        assert first["result"] is None  # and both hosts said how their part ended
        assert [h[:2] for h in first["hosts"]] == [(0, "host0"), (1, "host1")]

        done = Job(hosts, home, sets, "two", attempt=2).outcome()
    assert done["incident"] is None and done["result"]["rank"] == 0, done
    assert done["result"]["start_step"] >= 10 and done["result"]["final_step"] == 60
    assert done["result"]["model_digest"] == drill_digest


def test_a_rank_stopped_on_the_second_host_is_the_hang_named_by_host_and_rank(home):
    sets = [*TINY, *TWO_HOSTS, "train.steps=400", "train.eval_every=0", "checkpoint.every_steps=5"]
    # The allowance stays the default's (at least watchdog.hang_floor_s, 10 s): a stopped process is a hang once no
    # rank advanced for watchdog.stopped_after_s (1 s) plus three median steps, its state relayed by host1.
    sets += ["watchdog.stack_dump_s=0.3"]
    with netns.hosts(2) as hosts:
        job = Job(hosts, home, sets, "stop")
        job.wait_for_commit(after=0)
        victim = job.process(1, "trainpipe-r")
        rank = int(victim.name().removeprefix("trainpipe-r"))
        victim.suspend()
        outcome = job.outcome()
    why = Incident.model_validate(outcome["incident"])
    assert (why.kind, why.rank, why.node) == ("hang", rank, "host1"), why
    assert "stopped (SIGSTOP)" in why.detail and why.detected_after_s < 4, why
    assert outcome["hosts"] == [(0, "host0", False, "hang"), (1, "host1", False, "aborted")]  # host1 followed node 0


def test_a_link_slowed_from_outside_is_a_network_incident_and_the_probe_names_its_host(home):
    """Three hosts × 1 rank; after the first commit host2's veth is throttled to 8 Mbit/s with ``tc`` from outside
    the job (a token bucket: this kernel has no netem for a delay; a thin link slows the same hops). Every rank
    then waits in its collectives while computing as fast as before: a network incident, not a straggler. The
    retry measures the host ring first and names host2, the host both slow links share."""
    sets = [*TINY, "cluster.nodes=3", "cluster.procs_per_node=1", "cluster.master_port=29400"]
    sets += ["train.steps=2000", "train.global_batch=12", "train.eval_every=0"]
    sets += ["checkpoint.every_steps=20"]
    sets += ["watchdog.straggler_window=5", "watchdog.straggler_factor=3", "watchdog.on_network=abort"]
    tracking = load_profile("local", sets).tracking
    mlflow_run = client(tracking.tracking_uri).create_run(experiment_id(tracking.tracking_uri, "hosts")).info.run_id
    with netns.hosts(3) as hosts:
        job = Job(hosts, home, sets, "link", mlflow_run=mlflow_run)
        job.wait_for_commit(after=0)
        throttle = ["tc", "qdisc", "add", "dev", hosts[2].interface, "root", "tbf", "rate", "8mbit"]
        throttle += ["burst", "32kbit", "latency", "1s"]  # queued, not dropped: TCP's retransmits would add noise
        subprocess.run(["ip", "netns", "exec", hosts[2].namespace, *throttle], check=True)
        first = job.outcome()
        why = Incident.model_validate(first["incident"])
        assert (why.kind, why.phase) == ("network", "collective"), first
        assert "while compute and data stay flat" in why.detail

        again = Job(hosts, home, [*sets, "watchdog.probe_links=true"], "link", attempt=2).outcome()
    probed = Incident.model_validate(again["incident"])
    assert (probed.kind, probed.phase, probed.node, probed.rank) == ("network", "probe", "host2", 2), again
    assert "host2<->host0" in probed.detail and "host0<->host1" in probed.detail
    # each host's supervisor sampled its own host into the run (MLflow's node_id), rank 0's metrics beside them
    metrics = client(tracking.tracking_uri).get_run(mlflow_run).data.metrics
    assert {f"system/host{i}/cpu_utilization_percentage" for i in range(3)} <= set(metrics), sorted(metrics)
    assert "loss/train" in metrics
