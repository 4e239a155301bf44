"""The torchrun command and environment of one attempt on this host.

torchrun runs with ``--max-restarts 0``: restarts have one owner, the Prefect
task's retries (docs/architecture.md §4), so each attempt is a fresh launch that resumes from
the newest committed checkpoint.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys

from trainpipe.trainer.config import ClusterConfig, Profile
from trainpipe.trainer.proc import free_port
from trainpipe.trainer.protocol import NODE_NAME_ENV, SUPERVISED_ENV

AGENT = "trainpipe.trainer.supervise.agent"  # torchrun's entry point, reporting failures as JSON


def torchrun_command(profile: Profile, module: str, args: list[str]) -> list[str]:
    c = profile.cluster
    cmd = [
        sys.executable,
        "-m",
        AGENT,
        "--nnodes",
        str(c.nodes),
        "--nproc-per-node",
        str(c.procs_per_node),
        "--max-restarts",
        "0",
        # How soon the agent sees a rank's death and stops the others: every look is a waitpid per rank, and
        # each tenth of a second here is a tenth of a second of every recovery (benchmarks/recovery_time.py).
        "--monitor-interval",
        "0.05",
    ]
    if c.nodes == 1:
        cmd += [
            # One host has no peers to rendezvous with: the static rendezvous starts the workers at once, where
            # c10d's first round waits a random 0-0.3 s to spread several hosts' joins (docs/architecture.md §4,
            # what a recovery spends).
            "--rdzv-backend",
            "static",
            "--rdzv-endpoint",
            f"127.0.0.1:{c.master_port or free_port()}",
            "--rdzv-id",
            f"trainpipe-{os.getpid()}",
            # the workers' MASTER_ADDR: else the host's name, which in a network namespace of the job's own
            # (trainer.supervise.isolation) may name an address that is not there (a pod's IP)
            "--local-addr",
            "127.0.0.1",
        ]
    elif c.simulate_nodes:
        return _local_nodes_command(cmd, c, module, args)
    else:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{c.master_addr}:{c.rendezvous_port}"]
        cmd += ["--node-rank", str(c.node_rank)]  # c10d numbers the nodes itself; this names the agent's report
        # Said on every node: node 0 hosts the store even when its name resolves elsewhere, and the others skip
        # c10d's match of the endpoint against their own host name, which dies where that name does not resolve.
        cmd += ["--rdzv-conf", f"is_host={'true' if c.node_rank == 0 else 'false'}"]
        if c.local_addr:  # what the other nodes connect to (node 0's becomes the workers' MASTER_ADDR)
            cmd += ["--local-addr", c.local_addr]
    return [*cmd, "-m", module, *args]


def _local_nodes_command(base: list[str], c: ClusterConfig, module: str, args: list[str]) -> list[str]:
    """Every node's torchrun agent on this machine (static rendezvous), under one shell that the
    supervisor owns as a process group: a local stand-in for a multi-node cluster."""
    port = c.master_port or free_port()
    agents = []
    for node in range(c.nodes):
        agent = [
            *base,
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            module,
            *args,
        ]
        name = shlex.quote(f"{socket.gethostname()}-node{node}")
        agents.append(f"{NODE_NAME_ENV}={name} {shlex.join(agent)} & p{node}=$!")
    waits = "; ".join(f"wait $p{n} || rc=1" for n in range(c.nodes))
    return ["bash", "-c", f"rc=0; {'; '.join(agents)}; {waits}; exit $rc"]


def worker_env(profile: Profile) -> dict[str, str]:
    env = dict(os.environ)
    threads = str(profile.cluster.threads_per_proc)
    env.update({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1", SUPERVISED_ENV: "1"})
    # The flight recorder: each rank's last collectives, which the watchdog asks for when it finds a hang.
    env.setdefault("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"))
    if profile.train.deterministic:  # cuBLAS is deterministic only with a fixed workspace (torch's docs)
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # The ranks import what the orchestrator's checkout holds beside trainpipe (a model factory's module there).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env
