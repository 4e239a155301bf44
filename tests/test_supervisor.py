"""The job runner leaves nothing behind: timeouts, crashes and interrupts kill the whole process group."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import psutil

from trainpipe.trainer.supervise.job import run_job

# A leader that starts two grandchildren which ignore SIGTERM, then waits forever.
STUBBORN = textwrap.dedent("""
    import signal, subprocess, sys, time
    kids = [subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('child up', flush=True); time.sleep(600)"])
            for _ in range(2)]
    print("leader pids", *[k.pid for k in kids], flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_timeout_kills_the_whole_group_including_stubborn_children():
    outcome = run_job([sys.executable, "-c", STUBBORN], timeout_s=3)
    assert outcome.timed_out and not outcome.ok
    pids = [int(p) for line in outcome.tail if line.startswith("leader pids") for p in line.split()[2:]]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_exit_code_and_output_tail_are_reported():
    lines = []
    outcome = run_job([sys.executable, "-c", "print('one'); print('two'); raise SystemExit(7)"], on_line=lines.append)
    assert outcome.returncode == 7 and not outcome.timed_out and not outcome.ok
    assert lines == ["one", "two"] and outcome.tail == ["one", "two"]


def test_a_stopped_process_is_still_torn_down():
    code = (
        "import os, signal, time; print('pid', os.getpid(), flush=True); "
        "os.kill(os.getpid(), signal.SIGSTOP); time.sleep(60)"
    )
    outcome = run_job([sys.executable, "-c", code], timeout_s=2)
    assert outcome.timed_out
    pid = int(outcome.tail[0].split()[1])
    assert not _alive(pid)
    assert os.getpgid(os.getpid()) != pid  # it ran in its own group, not ours


# A rank as torchrun's agent forks it: named trainpipe-rN, then killed by SIGKILL once its stdin closes.
RANK_TO_KILL = textwrap.dedent("""
    import os, signal, sys
    with open("/proc/self/comm", "w") as f:
        f.write("trainpipe-r" + sys.argv[1])
    sys.stdin.read()
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_the_agent_reports_a_sigkilled_rank_even_when_it_is_reaped_milliseconds_after_it_died():
    # torchrun's close reaps the ranks it did not report a few milliseconds after they died: the SIGKILL that
    # caused the crash must be on record by then, or a survivor's lost connection is named instead.
    import subprocess

    from trainpipe.trainer.supervise.agent import ExitWatcher

    watcher = ExitWatcher(every_s=0.5)  # finds new ranks slowly: their exits must not wait for that
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_TO_KILL, str(r)], stdin=subprocess.PIPE) for r in range(4)]
    deadline = time.monotonic() + 10
    while len(watcher.ranks) < len(ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(watcher.ranks.values()) == [0, 1, 2, 3], watcher.ranks
    for proc in ranks:
        assert proc.stdin is not None
        proc.stdin.close()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped
        time.sleep(0.005)
        assert proc.wait() == -9
    failures = watcher.failures({})
    assert sorted((f["rank"], f["signal"]) for f in failures) == [(r, "SIGKILL") for r in range(4)], failures
