"""``python -m trainpipe.trainer.supervise.agent [torchrun arguments]``: torchrun, reporting the failures it raises.

This is torchrun's own entry point (``torch.distributed.run``): the elastic
agent launches, monitors and tears down the workers exactly as ``torchrun``
does. When workers fail, torchrun raises ``ChildFailedError`` with each failed
rank's exit code, signal and error-file message; this wrapper also writes them
to ``$TRAINPIPE_AGENT_REPORT/agent-node{N}.json``, so the supervisor reads the
root cause as data instead of parsing the log.

For trainpipe's own rank programs (``-m trainpipe.trainer``, ``-m trainpipe.trainer.preflight``) the
agent imports the program once and torchrun forks the workers from it
(``start_method="fork"``, its function entry point) instead of starting a fresh
interpreter per rank: each rank would spend seconds of CPU importing torch, and
on a small host the ranks' start-up is most of an attempt's overhead. The ranks
are still separate processes with their own pid, environment (``RANK``, …) and
exit code; each names itself ``trainpipe-r{RANK}``. Any other module runs as
torchrun runs it.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch's import (seconds): a launcher killed meanwhile takes this agent along
    from trainpipe.trainer.proc import die_with_parent
    from trainpipe.trainer.supervise.isolation import enter_from_env

    die_with_parent()
    enter_from_env()  # a network of the job's own, entered while this process has one thread (torch starts more)

import contextlib
import importlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, parse_args, run

from trainpipe.trainer.proc import die_with_parent, exit_now, name_process, node_name
from trainpipe.trainer.protocol import AGENT_REPORT_ENV, agent_report_path, write_file


def failure_record(rank: int, failure: ProcessFailure) -> dict[str, Any]:
    message = failure.message.get("message") if isinstance(failure.message, dict) else None  # the rank's exception
    return {
        "rank": rank,
        "local_rank": failure.local_rank,
        "pid": failure.pid,
        "exitcode": failure.exitcode,
        "signal": failure.signal_name() if failure.exitcode < 0 else None,
        "time": failure.timestamp,
        "message": str(message)[:500] if message else None,
    }


# -m module -> the function each rank runs: main(argv) -> exit code
RANK_PROGRAMS = {
    "trainpipe.trainer": "trainpipe.trainer.loop.main:main",
    "trainpipe.trainer.preflight": "trainpipe.trainer.preflight.probes:main",
}


def run_rank(program: str, argv: list[str]) -> None:
    """A forked worker: run the rank program; a non-zero exit code becomes the process's own."""
    # Not the agent's handlers, which turn a SIGTERM into an exception: a rank ends on SIGTERM as a fresh
    # interpreter does, without a traceback in the middle of its step.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    name_process(f"trainpipe-r{os.environ.get('RANK', '')}")
    module, func = program.split(":")
    code = getattr(importlib.import_module(module), func)(argv)
    if code:
        raise SystemExit(code)


class ExitWatcher:
    """Every forked rank's exit status as the kernel reports it, read without reaping the process.

    torchrun's multiprocessing context reports one failed rank, the lowest-numbered
    it finds dead, and reaps the others as it closes; after a SIGKILL that is often a
    survivor that died of the lost connection a few milliseconds later. One thread
    per rank blocks in ``waitid(WNOWAIT)`` on it, so its status is read the moment it
    dies (a poll every few milliseconds lost that race on a loaded host), and the
    agent can report every rank that failed and how.
    """

    def __init__(self, every_s: float = 0.02):
        self.exits: dict[int, tuple[int, float]] = {}  # pid -> (exit code, negative for a signal; when seen)
        self.ranks: dict[int, int] = {}  # pid -> rank, from the name each rank gives itself
        self._every = every_s  # how often new ranks are looked for: they fork at the start, long before a fault
        self._stop = threading.Event()
        self._children = f"/proc/self/task/{threading.get_native_id()}/children"  # forked by this thread
        self._thread = threading.Thread(target=self._run, name="rank-exits", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                with open(self._children) as f:
                    pids = [int(p) for p in f.read().split()]
            except OSError:
                return
            for pid in pids:
                if pid in self.ranks:
                    continue
                with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/comm") as f:
                    self.ranks[pid] = int(f.read().strip().removeprefix("trainpipe-r"))
                    threading.Thread(target=self._wait, args=(pid,), name=f"rank-exit-{pid}", daemon=True).start()

    def _wait(self, pid: int) -> None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped already
            return
        if info is not None:
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            self.exits.setdefault(pid, (code, time.time()))

    def failures(self, reported: dict[int, ProcessFailure]) -> list[dict[str, Any]]:
        """The failures torchrun reported, plus every other rank seen ending with an error or a signal."""
        self._stop.set()
        self._thread.join(timeout=1)
        out = [failure_record(r, f) for r, f in sorted(reported.items())]
        known = {f.pid for f in reported.values()}
        for pid, (code, when) in sorted(dict(self.exits).items(), key=lambda e: e[1][1]):
            if code != 0 and pid not in known and pid in self.ranks:
                sig = signal.Signals(-code).name if code < 0 and -code in signal.valid_signals() else None
                out.append(
                    {
                        "rank": self.ranks[pid],
                        "local_rank": None,
                        "pid": pid,
                        "exitcode": code,
                        "signal": sig,
                        "time": when,
                        "message": None,
                    }
                )
        return out


def import_model_factory(rank_args: list[str]) -> None:
    """Build the profile's model once on the meta device, so the ranks fork with everything it imports (a
    transformers model imports its modeling code: seconds of CPU per rank otherwise). Best effort: a factory
    that fails is the ranks' error to report."""
    if "--profile" not in rank_args or rank_args.index("--profile") + 1 >= len(rank_args):
        return
    with contextlib.suppress(Exception):
        import torch

        from trainpipe.trainer.factory import build_model
        from trainpipe.trainer.profile_files import load_resolved_profile

        profile = load_resolved_profile(rank_args[rank_args.index("--profile") + 1])
        importlib.import_module(profile.model.factory.partition(":")[0])
        if profile.cluster.device == "cpu":  # a factory may touch CUDA, which a forked rank could not use then
            with torch.device("meta"):
                build_model(profile.model)


def launch(args: Any) -> None:
    program = RANK_PROGRAMS.get(args.training_script) if args.module else None
    if program is None:
        run(args)
        return
    importlib.import_module(program.split(":")[0])  # once, here: the forked ranks start with it imported
    import_model_factory(list(args.training_script_args))
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config, run_rank)(program, list(args.training_script_args))


def torchelastic_logs() -> str:
    """A new folder for torchrun's logs and the workers' error files: inside the attempt's job folder when the
    supervisor names one (``AGENT_REPORT_ENV``), which it removes after the attempt even when this agent was
    killed before its own cleanup; else in the temporary folder."""
    job = os.environ.get(AGENT_REPORT_ENV)
    return tempfile.mkdtemp(prefix="trainpipe-torchelastic-", dir=job if job and os.path.isdir(job) else None)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # (again, for a caller that imports this module) its workers follow it
    args = parse_args(sys.argv[1:] if argv is None else argv)
    watcher = ExitWatcher() if args.module and args.training_script in RANK_PROGRAMS else None
    # torchrun's own default is a fresh /tmp/torchelastic_* per launch that nothing removes: one folder left per
    # attempt. The workers' error files live there until the report below has read them.
    logs = None if args.log_dir else torchelastic_logs()
    args.log_dir = args.log_dir or logs
    try:
        return _launch_and_report(args, watcher)
    finally:
        if logs:
            shutil.rmtree(logs, ignore_errors=True)


def _launch_and_report(args: Any, watcher: ExitWatcher | None) -> int:
    try:
        launch(args)
    except SignalException as exc:  # the supervisor tears the job down (cancel, hang): torchrun stopped the workers
        print(f"torchrun agent: stopped by {signal.Signals(exc.sigval).name}; workers shut down", file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        out = os.environ.get(AGENT_REPORT_ENV)
        if out:
            write_file(
                agent_report_path(out, args.node_rank),
                {
                    "node": node_name(),
                    "failures": watcher.failures(exc.failures)
                    if watcher
                    else [failure_record(r, f) for r, f in sorted(exc.failures.items())],
                },
            )
        print(exc.format_msg(), file=sys.stderr, flush=True)  # torchrun's root-cause block, for people
        return 1
    return 0


if __name__ == "__main__":
    # Everything is reported and the workers are gone: skip the interpreter's teardown of torch (half a second
    # and more that every attempt would wait for).
    exit_now(main())
