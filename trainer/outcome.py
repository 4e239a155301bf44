"""Turn a failed attempt into an incident record (DESIGN §5) from what the supervisor saw."""

from __future__ import annotations

import re
import time
from typing import Any

from trainer.incidents import incident
from trainer.supervisor import AttemptResult

_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_SIGNAL = re.compile(r"Signal (\d+) \((\w+)\)")


def _root_cause(tail: list[str]) -> tuple[int | None, int | None, str | None]:
    """torchrun's 'Root Cause (first observed failure)' block: rank, exit code, signal name."""
    rank = code = sig = None
    for i, line in enumerate(tail):
        if "Root Cause" in line:
            for follow in tail[i:]:
                if rank is None and (m := _ROOT_RANK.match(follow)):
                    rank = int(m.group(1))
                elif code is None and (m := _ROOT_EXIT.match(follow)):
                    code = int(m.group(1))
                elif sig is None and (m := _SIGNAL.search(follow)):
                    sig = m.group(2)
            break
    return rank, code, sig


_NAN = re.compile(r"loss is (nan|inf|-inf) at step (\d+)")


def attempt_incident(run: AttemptResult, attempt: int, timeout_s: float) -> dict[str, Any]:
    o = run.outcome
    rank, code, sig = _root_cause(o.tail)
    nan = next((m for line in reversed(o.tail) if (m := _NAN.search(line))), None)
    if o.stopped_by is not None and o.stopped_by.kind != "crash":
        record = o.stopped_by.as_incident()
        return _finish(record, run, attempt)
    if o.stopped_by is not None and rank is None:  # torchrun had no time to name it: the watchdog's word
        rank = o.stopped_by.rank
    last = run.progress.get(rank, {}) if rank is not None else {}
    if nan:
        record = incident("nan", f"loss is {nan.group(1)} at step {nan.group(2)}", rank=None, step=int(nan.group(2)),
                          phase="collective", detected_after_s=0.0)
        return _finish(record, run, attempt)
    if o.timed_out:
        kind, detail = "hang", f"attempt {attempt} exceeded train.timeout_s={timeout_s:g}s"
    elif code is not None and code < 0:
        kind, detail = "crash", f"rank {rank} killed by {sig or f'signal {-code}'}"
    elif code is not None:
        kind, detail = "crash", f"rank {rank} exited with code {code}"
    else:
        kind, detail = "crash", f"attempt {attempt} exited with code {o.returncode}"
    errors = [line for line in o.tail if "Error" in line or "error" in line]
    if errors and kind == "crash" and not sig:
        detail += f": {errors[-1].strip()[:300]}"
    if o.stopped_by is not None:
        after = o.stopped_by.detected_after_s
    else:
        after = (time.time() - last["time"]) if last.get("time") else None
    record = incident(kind, detail, rank=rank, node=last.get("host"), step=last.get("step", run.last_step), phase=last.get("phase"),
                      detected_after_s=after)
    return _finish(record, run, attempt)


def _finish(record: dict[str, Any], run: AttemptResult, attempt: int) -> dict[str, Any]:
    record.update({"attempt": attempt, "time_epoch": time.time(), "last_step": run.last_step,
                   "start_step": run.first_step - 1 if run.first_step else None,
                   "first_step_at": run.first_step_at, "progress": list(run.progress.values())})
    return record
