"""This rank's progress beacons to its supervisor (the receiver is ``trainer.supervise.beacons``).

A beacon is sent only by the training loop itself at a phase boundary, never by
a background thread: a rank stuck in a collective or frozen by SIGSTOP goes
silent, which is the signal. Without a supervisor (plain torchrun, no
``TRAINPIPE_BEACON``) beacons are off.
"""

from __future__ import annotations

import math
import os
import socket
import time
from typing import Any

import torch

from trainpipe.trainer.loop.callbacks import Callback, StepMetrics
from trainpipe.trainer.proc import node_name
from trainpipe.trainer.protocol import BEACON_ENV, BEACON_TOKEN_ENV, encode_beacon


def _connect(address: str) -> socket.socket:
    """``unix:PATH`` (a single-host job's supervisor, reached from the job's own network namespace) or host:port."""
    if address.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        try:
            sock.connect(address.removeprefix("unix:"))
        except OSError:
            sock.close()
            raise
        return sock
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Beacon:
    """The sender. ``beacon(step, phase)`` costs one small send on a connected socket."""

    def __init__(self, rank: int, address: str | None = None, token: str | None = None):
        self.rank = rank
        self._sock: socket.socket | None = None
        address = address if address is not None else os.environ.get(BEACON_ENV)
        token = token if token is not None else os.environ.get(BEACON_TOKEN_ENV, "")
        if not address:
            return
        try:
            self._sock = _connect(address)
            self._sock.sendall(token.encode() + b"\n")  # the supervisor hears only this attempt's ranks
        except OSError:
            self._sock = None  # no supervisor listening: beacons are simply off
            return
        self(-1, "start", pid=os.getpid(), host=node_name(), machine=socket.gethostname())

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def __call__(self, step: int, phase: str, **extra: Any) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendall(encode_beacon(self.rank, step, phase, time.time(), **extra))
        except OSError:
            self._sock = None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class BeaconCallback(Callback):
    """Turns the loop's events into beacons: steps, phases, collectives entered, compute time.

    Compute time runs from the step's start to the moment the last gradient
    bucket is ready, less the time spent reading data and in the collectives
    that sharding issues on the way (FSDP2's gathers and reductions): what
    remains is this rank's own work; the rest is waiting for data or the others.
    Each step's first beacon also carries the previous step's loss, gradient
    norm and time split (data wait, compute, collective wait), and the attempt's
    running totals of data wait, evaluation and checkpoint blocking: what the
    run's badput tells apart in an attempt that fails before its result.
    """

    def __init__(self, beacon: Beacon, mesh: str | None = None):
        """``mesh``: under a parallel layout, this rank's coordinates (``Layout.place``), sent with its first
        step's beacon, so the watchdog can check that every rank built the mesh the job's layout describes."""
        self.beacon, self.step, self.t0, self.collectives = beacon, 0, 0.0, 0
        self.once: dict[str, str] = {"m": mesh} if mesh else {}
        self.phase, self.waited = "start", 0.0
        self.last: dict[str, float] = {}  # the previous step's figures, sent with the next step's first beacon
        self.totals = {"td": 0.0, "te": 0.0, "tc": 0.0}  # this attempt's data wait, evaluation, checkpoint blocking
        self.resumed: dict[str, int] = {}
        self._eval_began: float | None = None
        self.events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def on_setup(self, model: torch.nn.Module) -> None:
        device = next(model.parameters()).device
        if device.type == "cuda":  # kernels run after the host queued them: time them on the device
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def on_resume(self, step: int, verified: bool, tier: str = "store") -> None:
        # The supervisor's record of the attempt says whether it proved itself, and from which tier it came.
        self.resumed = {"rv": int(verified), "rm": {"memory": 1, "peer": 2}.get(tier, 0)}

    def on_train_start(self, start_step: int, steps: int) -> None:
        self.step = start_step

    def on_step_start(self, step: int) -> None:
        self.step, self.t0, self.phase, self.waited = step, time.perf_counter(), "data", 0.0
        if self.events:
            self.events[0].record()
        # The previous step's loss, gradient norm and time split ride along: the progress a person watches and
        # what the watchdog's health checks read (trainer.supervise.watchdog).
        totals = {k: round(v, 6) for k, v in self.totals.items()}
        self.beacon(step, "data", **self.last, **self.resumed, **self.once, **totals)
        self.once = {}

    def on_data_wait(self, step: int, waited_s: float) -> None:
        self.waited += waited_s  # reading data is not this rank's compute
        self.totals["td"] += waited_s

    def on_eval(self, step: int, loss: float) -> None:
        if self._eval_began is not None:
            self.totals["te"] += time.perf_counter() - self._eval_began
            self._eval_began = None

    def on_checkpoint_committed(self, step: int, stall_s: float, save_s: float) -> None:
        self.totals["tc"] += stall_s

    def on_step_end(self, metrics: StepMetrics) -> None:
        self.last = {"l": metrics.loss, "g": metrics.grad_norm}
        # The split is the step clock's (on a GPU its collective waits are CUDA events: trainer.loop.step_clock).
        if all(map(math.isfinite, (metrics.loss, metrics.grad_norm))):
            split = {"dw": metrics.data_s, "cp": metrics.compute_s, "cw": metrics.comm_s}
            if metrics.data_fetch_s or metrics.data_verify_s:  # steps that loaded a shard
                split.update(df=metrics.data_fetch_s, dv=metrics.data_verify_s)
            self.last.update({k: round(v, 6) for k, v in split.items()})
        else:
            self.last = {}

    def on_phase(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        if phase == "eval":
            self._eval_began = time.perf_counter()
        self.beacon(step, phase)

    def on_collective(self, step: int, kind: str) -> None:
        self._collective(kind)

    def on_collective_end(self, step: int, kind: str, waited_s: float) -> None:
        self.waited += waited_s
        self.beacon(self.step, self.phase)  # computing again: not waiting in the collective it left

    def on_gradients_ready(self) -> None:
        self._collective("grads", cs=round(max(self.compute_s(), 0.0), 6))

    def compute_s(self) -> float:
        """This step's compute so far. On a GPU: CUDA events around the step's kernels, read once the backward's
        are done (the last bucket's all-reduce waits for them anyway); FSDP2's gathers then count as compute."""
        if self.events:
            start, end = self.events
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000
        return time.perf_counter() - self.t0 - self.waited

    def on_finish(self) -> None:
        self.beacon(self.step, "finish")
        self.beacon.close()  # nothing follows: the supervisor's reader ends with the connection

    def _collective(self, kind: str, **extra: float) -> None:
        self.collectives += 1
        self.beacon(self.step, "collective", n=self.collectives, c=kind, **extra)
