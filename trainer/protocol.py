"""The contract between a host's supervisor and its ranks: environment, beacons, attempt files.

Both sides import this module and nothing of each other, so ``python -m trainer``
stays free of supervisor code and a rank runs the same under plain torchrun.

Beacons are JSON lines ``{"r": rank, "s": step, "p": phase, "t": wall clock, …}``
over TCP. At the end of an attempt the ranks leave files in the folder given by
``--out-dir``: rank 0's ``result.json`` after its final commit, and
``incident-rank{R}.json`` from any rank that stops on an expected error. Each
torchrun agent writes ``agent-node{N}.json`` with the failures it saw.
"""

from __future__ import annotations

import json
import os
from typing import Any

BEACON_ENV = "TRAINPIPE_BEACON"  # host:port of the supervisor's beacon server
ATTEMPT_ENV = "TRAINPIPE_ATTEMPT"  # 1 for the first attempt, 2 for the first retry, …
SUPERVISED_ENV = "TRAINPIPE_SUPERVISED"  # set when a supervisor streams the ranks' output
AGENT_REPORT_ENV = "TRAINPIPE_AGENT_REPORT"  # folder where each torchrun agent reports its failures
NODE_NAME_ENV = "TRAINPIPE_NODE_NAME"  # a simulated node's name (cluster.simulate_nodes)

# start: launched, nothing done yet · data … optimizer: a training step · collective: waiting for the others ·
# checkpoint, eval: slow but healthy · finish: final checkpoint committed, the attempt is ending.
PHASES = ("start", "data", "forward", "backward", "collective", "optimizer", "checkpoint", "eval", "finish")


def encode_beacon(rank: int, step: int, phase: str, t: float, **extra: Any) -> bytes:
    return (json.dumps({"r": rank, "s": step, "p": phase, "t": t, **extra}, separators=(",", ":")) + "\n").encode()


def decode_beacon(line: bytes) -> tuple[int, int, str, float, dict[str, Any]] | None:
    """(rank, step, phase, time, extra) of one beacon line; None for anything malformed."""
    try:
        msg = json.loads(line)
        rank, step, phase, t = int(msg.pop("r")), int(msg.pop("s")), str(msg.pop("p")), float(msg.pop("t"))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if phase not in PHASES or rank < 0:
        return None
    return rank, step, phase, t, msg


def result_path(out_dir: str) -> str:
    return os.path.join(out_dir, "result.json")


def rank_incident_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"incident-rank{rank}.json")


def metrics_path(out_dir: str) -> str:
    """Rank 0's metrics as JSON lines, which the supervisor sends to MLflow (``trainer.supervise.metric_relay``)."""
    return os.path.join(out_dir, "metrics.jsonl")


def agent_report_path(out_dir: str, node_rank: int) -> str:
    return os.path.join(out_dir, f"agent-node{node_rank}.json")


def write_file(path: str, obj: Any) -> None:
    """Write JSON beside ``path`` and rename it in place: the supervisor never reads half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2)
    os.replace(tmp, path)
