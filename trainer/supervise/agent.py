"""``python -m trainer.supervise.agent [torchrun arguments]``: torchrun, reporting the failures it raises.

This is torchrun's own entry point (``torch.distributed.run``): the elastic
agent launches, monitors and tears down the workers exactly as ``torchrun``
does. When workers fail, torchrun raises ``ChildFailedError`` with each failed
rank's exit code, signal and error-file message; this wrapper also writes them
to ``$TRAINPIPE_AGENT_REPORT/agent-node{N}.json``, so the supervisor reads the
root cause as data instead of parsing the log.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

from trainer.proc import die_with_parent, node_name
from trainer.protocol import AGENT_REPORT_ENV, agent_report_path, write_file


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


def main(argv: list[str] | None = None) -> int:
    import os

    die_with_parent()  # under simulate_nodes its parent is a shell the supervisor owns; its workers follow it
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except SignalException as exc:  # the supervisor tears the job down (cancel, hang): torchrun stopped the workers
        print(f"torchrun agent: stopped by {signal.Signals(exc.sigval).name}; workers shut down", file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        out = os.environ.get(AGENT_REPORT_ENV)
        if out:
            write_file(
                agent_report_path(out, args.node_rank),
                {"node": node_name(), "failures": [failure_record(r, f) for r, f in sorted(exc.failures.items())]},
            )
        print(exc.format_msg(), file=sys.stderr, flush=True)  # torchrun's root-cause block, for people
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
