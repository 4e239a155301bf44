"""``python -m trainpipe.trainer.orchestrate.reaper PID``: when process PID ends, however it ended, end what it started.

``trainpipe run`` starts one beside itself. The torchrun job already dies with
its supervisor (a parent-death signal), but not everything the orchestrator
starts can carry one: Prefect's embedded server is a uvicorn process Prefect
starts and stops itself (at exit, which a SIGKILL skips), and it would run on
indefinitely. The reaper keeps a list of PID's descendants (``psutil.Process``
objects, which know their start time, so a reused pid is never hit) and, once
PID is gone, sends each survivor SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
GRACE_S = 5.0


def watch(pid: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> list[int]:
    """Wait for ``pid`` to end, then end its last known descendants; the pids it had to end."""
    me = os.getpid()
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    known: dict[int, psutil.Process] = {}
    while True:
        try:
            if parent.status() == psutil.STATUS_ZOMBIE:
                break
            for child in parent.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            break
        known = {p: proc for p, proc in known.items() if proc.is_running()}
        time.sleep(poll_s)
    alive = [proc for proc in known.values() if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE]
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, stubborn = psutil.wait_procs(alive, timeout=grace_s)
    for proc in stubborn:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return [proc.pid for proc in alive]


def start_reaper(pid: int | None = None) -> subprocess.Popen:
    """A reaper for ``pid`` (default: this process), in its own session so a Ctrl-C at the terminal reaches
    only the process it watches."""
    return subprocess.Popen(
        [sys.executable, "-m", "trainpipe.trainer.orchestrate.reaper", str(pid or os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ended = watch(int(sys.argv[1]))
    if ended:
        print(f"trainpipe reaper: ended {len(ended)} process(es) left by pid {sys.argv[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
