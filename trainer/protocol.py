"""The contract between a host's supervisor and its ranks: environment, beacons, attempt files.

Both sides import this module and nothing of each other, so ``python -m trainpipe.trainer``
stays free of supervisor code and a rank runs the same under plain torchrun.

Beacons are JSON lines ``{"r": rank, "s": step, "p": phase, "t": wall clock, …}``
over TCP. At the end of an attempt the ranks leave files in the folder given by
``--out-dir``: rank 0's ``result.json`` after its final commit (on every other
host its local rank 0's ``host-result-rank{R}.json``), and
``incident-rank{R}.json`` from any rank that stops on an expected error,
``notice-rank{R}-{n}.json`` for each incident a rank survived, and
``flight-rank{R}.json`` (its flight recorder) when the supervisor asks. Each
torchrun agent writes ``agent-node{N}.json`` with the failures it saw.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainpipe.trainer.data.sampler import DataSkip

BEACON_ENV = "TRAINPIPE_BEACON"  # host:port of the supervisor's beacon server
BEACON_TOKEN_ENV = "TRAINPIPE_BEACON_TOKEN"  # this attempt's secret: the first line of every beacon connection
ATTEMPT_ENV = "TRAINPIPE_ATTEMPT"  # 1 for the first attempt, 2 for the first retry, …
SUPERVISED_ENV = "TRAINPIPE_SUPERVISED"  # set when a supervisor streams the ranks' output
AGENT_REPORT_ENV = "TRAINPIPE_AGENT_REPORT"  # folder where each torchrun agent reports its failures
NODE_NAME_ENV = "TRAINPIPE_NODE_NAME"  # a simulated node's name (cluster.simulate_nodes)


class SkippedCheckpoint(BaseModel):
    """A checkpoint newer than the one resumed that did not load, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    uri: str
    reason: str


class TrainResult(BaseModel):
    """What rank 0 reports once the final checkpoint is committed (its ``result.json``): the one typed result of
    a training attempt, from the rank through the supervisor, a cluster job's host parts and the train task to
    the run summary (docs/architecture.md §6)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # a host part may be forged
    run_name: str
    start_step: int = Field(ge=0, description="The step the attempt resumed from (0: from scratch).")
    final_step: int = Field(ge=0, description="The step of the final commit.")
    checkpoint_uri: str
    model_digest: str | None
    val_loss: float | None
    final_loss: float | None = Field(
        default=None, description="The final step's training loss (rank 0's, as its log's last step line says)."
    )
    resumed_from: str | None
    skipped_checkpoints: list[SkippedCheckpoint] = Field(default_factory=list)
    world_size: int = Field(ge=1)
    rank: int = Field(ge=0, description="0: the run's result; another host's local rank 0: that host's part.")
    attempt_s: float = Field(description="From the rank's start to the final commit.")
    step_s_median: float
    mfu: float | None
    step_starts_s: list[float] = Field(description="Seconds since the attempt began, one per step trained.")
    checkpoint_failures: int = 0
    checkpoint_stalls_s: list[float] = Field(default_factory=list, description="Time blocked, per save.")
    memory_every_steps: int | None = Field(
        default=None, ge=1, description="The memory tier's snapshot interval it ended with (None: no memory tier)."
    )
    memory_stalls_s: list[float] = Field(
        default_factory=list, max_length=1 << 20, description="Time blocked, per snapshot into the memory tier."
    )
    data_skips: list[DataSkip] = Field(
        default_factory=list, description="Data windows skipped by rollbacks from loss spikes (trainer.data.sampler)."
    )
    # Where the attempt's time went, for the run's badput (trainer/orchestrate/badput.py).
    started_at: float | None = Field(default=None, description="Wall clock the step times count from.")
    restore_s: float = Field(default=0.0, ge=0, description="Loading the checkpoint it resumed from.")
    data_wait_s: float = Field(default=0.0, ge=0, description="Waiting for batches, all steps.")
    eval_s: float = Field(default=0.0, ge=0, description="Evaluating, all evaluations.")
    checkpoint_every_steps: int | None = Field(default=None, ge=1, description="The checkpoint interval it ended with.")
    checkpoint_mtbf_hours: float | None = Field(default=None, gt=0, description="The MTBF its interval was chosen for.")
    resume_verified: bool | None = Field(
        default=None, description="It resumed from a checkpoint whose state hash it verified (None: it did not resume)."
    )
    resumed_tier: Literal["memory", "peer", "store"] | None = Field(
        default=None,
        description="Where that checkpoint lay: a snapshot in host memory, one whose files a host lacked and "
        "gathered from a peer host's copy, or the store (None: no resume).",
    )
    state_mb: list[Annotated[float, Field(ge=0)]] = Field(
        default_factory=list,
        max_length=1 << 16,
        description="Per rank: the MB of weights and optimizer state it holds (its shards, its pipeline stage).",
    )
    peak_device_mb: list[Annotated[float, Field(ge=0)]] = Field(
        default_factory=list, max_length=1 << 16, description="Per rank on a GPU: its peak allocated device memory."
    )


# start: launched, nothing done yet · data … optimizer: a training step · collective: waiting for the others ·
# checkpoint, eval: slow but healthy · finish: final checkpoint committed, the attempt is ending.
PHASES = ("start", "data", "forward", "backward", "collective", "optimizer", "checkpoint", "eval", "finish")


def encode_beacon(rank: int, step: int, phase: str, t: float, **extra: Any) -> bytes:
    return (json.dumps({"r": rank, "s": step, "p": phase, "t": t, **extra}, separators=(",", ":")) + "\n").encode()


# The extra fields a beacon may carry, with their types: anything else makes the beacon invalid.
# l: the previous step's loss, g: its gradient norm, dw / cp / cw: its data wait, compute, collective wait (s),
# df / dv: of its data wait, fetching shards from the store and checking their sha256 (s);
# td / te / tc: the attempt's totals so far of data wait, evaluation and checkpoint blocking (s);
# rv: 1 when the attempt resumed from a checkpoint whose state hash it verified, 0 when that checkpoint had none;
# rm: 1 when that checkpoint was a snapshot in host memory (trainer.checkpoint.memory_tier), 0 from the store;
# m: under a parallel layout, the rank's mesh coordinates as it built them, "pp.dp_replicate.dp_shard.tp".
BEACON_EXTRAS: dict[str, type] = {
    "pid": int,
    "host": str,
    "machine": str,
    "n": int,
    "c": str,
    "cs": float,
    "l": float,
    "g": float,
    "dw": float,
    "cp": float,
    "cw": float,
    "df": float,
    "dv": float,
    "td": float,
    "te": float,
    "tc": float,
    "rv": int,
    "rm": int,
    "m": str,
}
MAX_TEXT = 255


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def decode_beacon(line: bytes, world_size: int | None = None) -> tuple[int, int, str, float, dict[str, Any]] | None:
    """(rank, step, phase, time, extra) of one beacon line; None for anything malformed or out of range."""
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    if not isinstance(msg, dict):
        return None
    rank, step, phase, t = msg.pop("r", None), msg.pop("s", None), msg.pop("p", None), msg.pop("t", None)
    if not _is_int(rank) or rank < 0 or (world_size is not None and rank >= world_size):
        return None
    if not _is_int(step) or step < -1 or phase not in PHASES or not _is_number(t):
        return None
    extra: dict[str, Any] = {}
    for key, value in msg.items():
        kind = BEACON_EXTRAS.get(key)
        if key in ("l", "g") and not _is_number(value):
            continue  # a non-finite loss is the loop's to report; the beacon still counts
        if kind is int and _is_int(value) and value >= 0:
            extra[key] = value
        elif kind is float and _is_number(value) and (key == "l" or value >= 0):
            extra[key] = float(value)
        elif kind is str and isinstance(value, str) and len(value) <= MAX_TEXT:
            extra[key] = value
        else:
            return None
    return rank, step, phase, float(t), extra


def _is_rank_key(key: Any) -> bool:
    """A rank as a JSON key: ASCII digits only ("²" is a digit to str.isdigit, not to int), and short."""
    return isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10


# What another host's supervisor reports of its ranks' processes (its pids mean nothing on node 0); idle: alive,
# using no CPU since the last report.
PROCESS_STATES = ("alive", "idle", "stopped", "dead")


def encode_host_status(states: dict[int, str]) -> bytes:
    """Another host's supervisor to node 0's watchdog: the state of each of its ranks' processes."""
    return _encode_per_rank("ranks", states)


def decode_host_status(line: bytes, world_size: int | None = None) -> dict[int, str] | None:
    """rank → process state of a host-status line; None for anything else."""
    return _decode_per_rank(line, "ranks", lambda state: state in PROCESS_STATES, world_size)


def encode_gpu_use(use: dict[int, float]) -> bytes:
    """Another host's supervisor to node 0's watchdog: its ranks' GPUs' recent utilization (%)."""
    return _encode_per_rank("gpu", {r: round(v, 1) for r, v in use.items()})


def decode_gpu_use(line: bytes, world_size: int | None = None) -> dict[int, float] | None:
    """rank → GPU utilization (%) of a GPU-use line; None for anything else."""
    use = _decode_per_rank(line, "gpu", lambda pct: _is_number(pct) and 0 <= pct <= 100, world_size)
    return None if use is None else {r: float(pct) for r, pct in use.items()}


def _encode_per_rank(field: str, values: dict[int, Any]) -> bytes:
    return (json.dumps({field: {str(r): v for r, v in values.items()}}, separators=(",", ":")) + "\n").encode()


def _decode_per_rank(
    line: bytes, field: str, valid: Callable[[Any], bool], world_size: int | None
) -> dict[int, Any] | None:
    """``{field: {rank: value}}`` and nothing else, every rank in this world and every value ``valid``."""
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    if not isinstance(msg, dict) or set(msg) != {field} or not isinstance(msg[field], dict):
        return None
    out: dict[int, Any] = {}
    for key, value in msg[field].items():
        if not (_is_rank_key(key) and valid(value)):
            return None
        rank = int(key)
        if world_size is not None and rank >= world_size:
            return None
        out[rank] = value
    return out


def flight_request_path(out_dir: str) -> str:
    """The supervisor asks every rank for its flight recorder (``trainer.loop.flight``) by creating this file."""
    return os.path.join(out_dir, "flight-recorder.request")


def flight_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"flight-rank{rank}.json")


def result_path(out_dir: str, rank: int = 0) -> str:
    """Rank 0's result (the run's), or another host's local rank 0's (that host's part finished)."""
    return os.path.join(out_dir, "result.json" if rank == 0 else f"host-result-rank{rank}.json")


def rank_incident_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"incident-rank{rank}.json")


def notice_path(out_dir: str, rank: int, n: int) -> str:
    """A rank's ``n``-th incident that training survived (a failed checkpoint, a store outage)."""
    return os.path.join(out_dir, f"notice-rank{rank}-{n:04d}.json")


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
