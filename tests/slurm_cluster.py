"""A real Slurm cluster on this machine: munged, slurmctld and one slurmd per node of Debian's slurm-wlm, as root.

Its own munge key and socket, its own ports, state and logs in one folder;
``SLURM_CONF`` points Slurm's tools at it.

One node: slurmd runs here, as this machine. Several nodes (``nodes=2``): each
slurmd runs in a host of its own (``tests/netns.py``): its own network namespace
and address on a bridge that this machine (slurmctld, sbatch) joins too, its own
UTS host name (``node0``, ``node1``, …, as ``slurmd -N`` names it) and its own
mount namespace, where an ``/etc/hosts`` that names every node is bound, as a
cluster's DNS would, and the node's own ``local/`` folder is bound over the
cluster's ``local/``: a file there (a recorded NVML state) differs per node as
its GPUs do. Every job step runs inside its node's namespaces. Needs root and the packages
``slurm-wlm`` and ``munge`` (``make setup`` installs them where apt-get runs
as root; ``available()`` says why not otherwise).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests import netns

DAEMONS = ("munged", "slurmctld", "slurmd")


def available() -> str | None:
    if os.geteuid() != 0:
        return "a Slurm cluster needs root"
    missing = [d for d in (*DAEMONS, "sbatch") if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    return f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)" if missing else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(folder: Path, munge: Path, host: str, cpus: int, nodes: list[tuple[str, str | None]]) -> str:
    names = ",".join(name for name, _ in nodes)
    node_lines = "\n".join(
        f"NodeName={name}" + (f" NodeAddr={address}" if address else "") + f" CPUs={cpus} State=UNKNOWN"
        for name, address in nodes
    )
    return f"""ClusterName=trainpipe
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge}/munge.socket
CryptoType=crypto/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ReturnToService=2
MpiDefault=none
KillWait=5
MinJobAge=600
{node_lines}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


SUBNET = "10.232.0"  # the nodes' addresses: apart from tests/netns.py's default, so both can run at once
# Each node's own names and folders, then slurmd as that node; arguments come positionally, nothing is parsed.
AS_NODE = 'hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" "$4" && exec slurmd -D -N "$1" -f "$5"'


@dataclass(frozen=True)
class Cluster:
    env: dict[str, str]  # for Slurm's tools: SLURM_CONF
    pids: list[int]  # the daemons
    nodes: list[str]  # node0, node1, …
    hosts: list[netns.Host]  # each node's namespace (empty for one node, which is this machine)
    local: Path  # a folder each node sees with its own files (several nodes only): see local_of()

    def local_of(self, node: int) -> Path:
        """Where node ``node``'s own files lie; inside the node they appear under ``local``."""
        return self.local.parent / f"local-{self.nodes[node]}"


@contextlib.contextmanager
def cluster(folder: Path, nodes: int = 1) -> Iterator[Cluster]:
    """A cluster of ``nodes`` nodes; everything stopped on exit."""
    (folder / "state").mkdir(parents=True, exist_ok=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    here = socket.gethostname().split(".")[0]
    with contextlib.ExitStack() as stack:
        # munged wants every folder above its socket searchable by all (test folders are private): one in /tmp.
        munge = Path(tempfile.mkdtemp(prefix="trainpipe-munge-"))
        stack.callback(shutil.rmtree, munge, ignore_errors=True)
        munge.chmod(0o755)
        hosts = stack.enter_context(netns.hosts(nodes, SUBNET, reach_from_here=True)) if nodes > 1 else []
        names = [f"node{i}" for i in range(nodes)] if hosts else [here]
        addresses: list[str | None] = [h.address for h in hosts] or [None]
        conf = folder / "slurm.conf"
        ctl = f"{here}({SUBNET}.254)" if hosts else here
        conf.write_text(_conf(folder, munge, ctl, os.cpu_count() or 1, list(zip(names, addresses, strict=True))))
        env = {**os.environ, "SLURM_CONF": str(conf)}
        commands = [
            ["munged", "-F", f"--key-file={key}", f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
             f"--log-file={folder}/munged.log", f"--seed-file={munge}/seed"],
            ["slurmctld", "-D", "-f", str(conf)],
        ]  # fmt: skip
        if hosts:
            (folder / "hosts").write_text(
                "127.0.0.1 localhost\n" + "".join(f"{h.address} {n}\n" for h, n in zip(hosts, names, strict=True))
            )
            (folder / "local").mkdir()
            for host, name in zip(hosts, names, strict=True):
                (folder / f"local-{name}").mkdir()
                (folder / f"spool-{name}").mkdir()
                args = [name, str(folder / "hosts"), str(folder / f"local-{name}"), str(folder / "local"), str(conf)]
                commands.append(
                    # nsenter, not `ip netns exec`: that mounts a fresh /sys without the cgroup tree slurmd reads
                    ["nsenter", f"--net=/run/netns/{host.namespace}", "unshare", "--uts", "--mount", "--propagation",
                     "private", "sh", "-c", AS_NODE, "sh", *args]
                )  # fmt: skip
        else:
            (folder / f"spool-{here}").mkdir()
            commands.append(["slurmd", "-D", "-f", str(conf)])
        procs: list[subprocess.Popen] = []
        try:
            for argv in commands:
                procs.append(
                    subprocess.Popen(
                        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
                    )
                )
                time.sleep(0.3)
            deadline = time.monotonic() + 30
            while _idle(env) < nodes:
                assert time.monotonic() < deadline, (folder / "slurmctld.log").read_text()[-2000:]
                assert all(p.poll() is None for p in procs), [p.args[0] for p in procs if p.poll() is not None]
                time.sleep(0.2)
            yield Cluster(env, [p.pid for p in procs], names, hosts, folder / "local")
        finally:
            subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
            for p in reversed(procs):
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _idle(env: dict[str, str]) -> int:
    """How many nodes are idle."""
    shown = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True).stdout
    return shown.split().count("idle")
