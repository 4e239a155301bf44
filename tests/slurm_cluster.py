"""A real one-node Slurm cluster on this machine: munged, slurmctld and slurmd of Debian's slurm-wlm, as root.

Its own munge key and socket, its own ports, state and logs in one folder;
``SLURM_CONF`` points Slurm's tools at it. Needs root and the packages
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
from pathlib import Path

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


def _conf(folder: Path, munge: Path, host: str, cpus: int) -> str:
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
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ReturnToService=2
MpiDefault=none
KillWait=5
MinJobAge=600
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def cluster(folder: Path) -> Iterator[tuple[dict[str, str], list[int]]]:
    """(environment for Slurm's tools, pids of the daemons); everything stopped on exit."""
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    # munged wants every folder above its socket searchable by all (test folders are private): one in /tmp.
    munge = Path(tempfile.mkdtemp(prefix="trainpipe-munge-"))
    munge.chmod(0o755)
    conf = folder / "slurm.conf"
    conf.write_text(_conf(folder, munge, socket.gethostname().split(".")[0], os.cpu_count() or 1))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    commands = [
        ["munged", "-F", f"--key-file={key}", f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
         f"--log-file={folder}/munged.log", f"--seed-file={munge}/seed"],
        ["slurmctld", "-D", "-f", str(conf)],
        ["slurmd", "-D", "-f", str(conf)],
    ]  # fmt: skip
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
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, (folder / "slurmctld.log").read_text()[-2000:]
            assert all(p.poll() is None for p in procs), [p.args[0] for p in procs if p.poll() is not None]
            time.sleep(0.2)
        yield env, [p.pid for p in procs]
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(munge, ignore_errors=True)
