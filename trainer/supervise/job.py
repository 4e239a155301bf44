"""Run one command as the leader of its own process group; always leave nothing behind."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.launcher import JobOutcome  # the contract's type: what a job's end is, here and on a cluster
from trainpipe.trainer.proc import die_with_parent, kill_group


def run_job(
    cmd: list[str],
    env: dict[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
    tail_lines: int = 80,
    watch: Callable[[], Incident | None] | None = None,
    poll_s: float = 0.5,
    before_teardown: Callable[[Incident], float | None] | None = None,
    start: Callable[[list[str], dict[str, str]], Any] | None = None,
) -> JobOutcome:
    """Run ``cmd``, streaming its output; end it on timeout, on a finding of ``watch``, or on interrupt.

    ``watch`` is polled every ``poll_s``; an incident it returns ends the job,
    after ``before_teardown(incident)`` (e.g. asking the ranks for their stacks),
    which may return seconds to let the job exit by itself first. ``start(cmd, env)`` may start the job itself
    (a warm host's fork, with what is used here of a ``Popen``); when it returns None the job starts as a process.
    """
    began = time.monotonic()
    tail: deque[str] = deque(maxlen=tail_lines)
    proc = (start(cmd, dict(os.environ) if env is None else env) if start else None) or subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent,
        text=True,
        bufsize=1,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if on_line:
                on_line(line)

    reader = threading.Thread(target=pump, name="job-output", daemon=True)
    reader.start()
    timed_out, finding = False, None
    deadline = began + timeout_s if timeout_s else None
    try:
        while proc.poll() is None:
            if deadline and time.monotonic() > deadline:
                timed_out = True
                break
            with contextlib.suppress(subprocess.TimeoutExpired):  # still running: look again
                proc.wait(timeout=poll_s)
            finding = watch() if watch and proc.poll() is None else None
            if finding is not None:
                let_exit_s = before_teardown(finding) if before_teardown else None
                if let_exit_s:  # e.g. torchrun tearing itself down after a crash, reporting its root cause
                    with contextlib.suppress(subprocess.TimeoutExpired):  # then we tear it down
                        proc.wait(timeout=let_exit_s)
                break
    finally:
        # Also on KeyboardInterrupt / cancellation: the whole group goes, workers included.
        _teardown(proc)
        reader.join(timeout=5)
    job = f"torchrun pid {proc.pid} on {socket.gethostname()}" + (", forked by a warm host" if _warm(proc) else "")
    return JobOutcome(proc.returncode, time.monotonic() - began, timed_out, list(tail), finding, job)


def _warm(proc: Any) -> bool:
    return getattr(proc, "warm", False)


def _teardown(proc: subprocess.Popen) -> None:
    # The leader of its own session, so pgid == pid; survivors of a clean exit are killed too.
    kill_group(proc.pid, grace_s=3.0, reap=proc.poll)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
