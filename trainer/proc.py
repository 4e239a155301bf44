"""Process hygiene shared by the supervisor and the workers: no orphans, ever."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

from trainpipe.trainer.protocol import NODE_NAME_ENV

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to kill this process when its parent dies (torchrun or the supervisor)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def name_process(name: str) -> None:
    """Name this process in ps, top and /proc/PID/comm (Linux keeps 15 characters)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def kill_group(pgid: int, grace_s: float = 5.0, reap: Callable[[], object] | None = None) -> None:
    """SIGCONT + SIGTERM a process group, then SIGKILL whatever is left after ``grace_s``.

    ``reap`` (e.g. ``Popen.poll``) collects our own child, whose zombie would
    otherwise keep the group looking alive.
    """
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        try:
            os.killpg(pgid, sig)
            if sig == signal.SIGTERM:
                os.killpg(pgid, signal.SIGCONT)  # a SIGSTOPped process cannot act on SIGTERM
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if reap:
                reap()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_name() -> str:
    """This node's name: the host name, or the simulated node's (``TRAINPIPE_NODE_NAME``)."""
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


def exit_now(code: int) -> None:
    """End a rank at once, after its work is committed, reported and closed: the interpreter's own teardown of
    torch, gloo and their threads adds over a second to every job, which waits for its slowest rank."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def process_started_at() -> float | None:
    """When this process started, on the wall clock, to the kernel's tick (10 ms): its start in ticks since boot,
    against the boot-time clock now. (psutil's ``create_time`` adds the boot time, which Linux gives in whole
    seconds: up to a second off.) None where there is no ``/proc``."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, the 22nd field: the 20th after the command's closing parenthesis
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
