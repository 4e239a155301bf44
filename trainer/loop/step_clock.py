"""Where one step's time goes on this rank: waiting for data, computing, waiting in collectives.

A callback the trainer owns (like ``Timeline``), reading the loop's events by
wall clock: data is the time spent reading micro-batches; collective wait is
FSDP2's gathers and reductions, plus DDP's wait from the last gradient bucket
being ready until the gradients are synced (the exposed part of its all-reduce;
the other buckets overlap the backward), plus the loss's all-reduce; compute is
the rest (forward, backward, optimizer). On a GPU the host's clock sees kernel
launches, not kernels, so the split there is approximate until the collectives
wait (docs/architecture.md §9).
"""

from __future__ import annotations

import time

from trainpipe.trainer.loop.callbacks import Callback


class StepClock(Callback):
    def __init__(self) -> None:
        self.t0, self.data_s, self.comm_s = 0.0, 0.0, 0.0
        self.ready: float | None = None  # the last gradient bucket was ready
        self.synced: float | None = None  # the gradients were synced (the optimizer phase began)
        self.loss_at: float | None = None  # the loss's all-reduce began

    def on_step_start(self, step: int) -> None:
        self.t0, self.data_s, self.comm_s = time.perf_counter(), 0.0, 0.0
        self.ready = self.synced = self.loss_at = None

    def on_data_wait(self, step: int, waited_s: float) -> None:
        self.data_s += waited_s

    def on_collective_end(self, step: int, kind: str, waited_s: float) -> None:
        self.comm_s += waited_s

    def on_gradients_ready(self) -> None:
        self.ready = time.perf_counter()

    def on_phase(self, step: int, phase: str) -> None:
        if phase == "optimizer":
            self.synced = time.perf_counter()

    def on_collective(self, step: int, kind: str) -> None:
        if kind == "loss":
            self.loss_at = time.perf_counter()

    def split(self) -> tuple[float, float, float]:
        """(data, compute, collective wait) in seconds of the step so far."""
        now = time.perf_counter()
        comm = self.comm_s
        if self.ready is not None and self.synced is not None and self.synced > self.ready:
            comm += self.synced - self.ready
        if self.loss_at is not None:
            comm += now - self.loss_at
        compute = max(now - self.t0 - self.data_s - comm, 0.0)
        return self.data_s, compute, comm
