"""Where one step's time goes on this rank: waiting for data, computing, waiting in collectives.

A callback the trainer owns (like ``Timeline``). Data is the time the host spent
reading micro-batches. Collective wait is FSDP2's gathers and reductions, plus
DDP's wait from the last gradient bucket being ready until the gradients are
synced (the exposed part of its all-reduce; the other buckets overlap the
backward), plus the loss's all-reduce. Compute is the rest of the step (forward,
backward, optimizer).

The marks are stamps of one clock (docs/architecture.md §9): the host's on a
CPU; on a GPU, CUDA events on the compute stream, where the host only queues
kernels and a collective's wait happens on the device. There FSDP2's gathers and
reductions run on FSDP's own streams, overlapping compute, so they are not
timed as waits (their exposed part counts as compute), and a micro-batch read
while the device still works on the one before is not a wait either: only a read
the device finished its queued work during counts. The step ends with the
loss's ``.item()``, which waits for the device, so the step's total is the
host's and the events are complete when ``split`` reads them.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from trainpipe.trainer.loop.callbacks import Callback


class HostStamps:
    """The host's clock: on a CPU an operation takes its time where the host runs it."""

    device = False

    def reset(self) -> None:
        pass

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return end - start

    def idle_since(self, stamp: Any) -> bool:
        return True  # the host did the work itself: nothing ran beside it


class CudaStamps:
    """CUDA events recorded on one stream (the compute stream, whichever thread records), reused step to step."""

    device = True

    def __init__(self, stream: Any = None, event=None):
        self.stream = stream
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))  # a seam for the arithmetic's test
        self.pool: list[Any] = []
        self.used = 0

    def reset(self) -> None:
        self.used = 0

    def stamp(self) -> Any:
        if self.used == len(self.pool):
            self.pool.append(self.event())
        event = self.pool[self.used]
        self.used += 1
        event.record(self.stream)
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000

    def idle_since(self, stamp: Any) -> bool:
        """Whether the device has done everything queued before ``stamp`` (without waiting for it)."""
        return stamp.query()


class StepClock(Callback):
    def __init__(self, stamps: HostStamps | CudaStamps | None = None) -> None:
        self.stamps = stamps or HostStamps()
        self.t0, self.data_s, self.reads = 0.0, 0.0, 0
        self.read_at: Any = None  # what the device had queued when the current read began
        self.spans: list[tuple[Any, Any]] = []  # (entered, left) of each collective the host waited in
        self.entered: Any = None  # the collective being waited in
        self.ready: Any = None  # the last gradient bucket was ready
        self.synced: Any = None  # the gradients were synced (the optimizer phase began)
        self.loss_at: Any = None  # the loss's all-reduce began

    def on_setup(self, model: torch.nn.Module) -> None:
        if next(model.parameters()).device.type == "cuda" and not self.stamps.device:
            self.stamps = CudaStamps(torch.cuda.current_stream())

    def on_step_start(self, step: int) -> None:
        self.t0, self.data_s, self.reads = time.perf_counter(), 0.0, 0
        self.stamps.reset()
        self.read_at, self.spans, self.entered, self.ready, self.synced, self.loss_at = None, [], None, None, None, None

    def on_data(self, step: int) -> None:
        self.read_at = self.stamps.stamp() if self.stamps.device and self.reads else None

    def on_data_wait(self, step: int, waited_s: float) -> None:
        # The step's first read has the device idle (the last step ended waiting for it); a later one counts
        # only if the device ran out of queued work while the host read.
        if self.read_at is None or self.stamps.idle_since(self.read_at):
            self.data_s += waited_s
        self.reads += 1

    def on_collective(self, step: int, kind: str) -> None:
        if kind == "loss":
            self.loss_at = self.stamps.stamp()
        elif not self.stamps.device:  # on a GPU, FSDP2's collectives run on its own streams (see above)
            self.entered = self.stamps.stamp()

    def on_collective_end(self, step: int, kind: str, waited_s: float) -> None:
        if self.entered is not None:
            self.spans.append((self.entered, self.stamps.stamp()))
            self.entered = None

    def on_gradients_ready(self) -> None:
        self.ready = self.stamps.stamp()

    def on_phase(self, step: int, phase: str) -> None:
        if phase == "optimizer":
            self.synced = self.stamps.stamp()

    def split(self) -> tuple[float, float, float]:
        """(data, compute, collective wait) in seconds of the step so far (after its loss is read)."""
        end, total = self.stamps.stamp(), time.perf_counter() - self.t0
        seconds = self.stamps.seconds
        comm = sum(seconds(a, b) for a, b in self.spans)
        if self.ready is not None and self.synced is not None:
            comm += max(seconds(self.ready, self.synced), 0.0)
        if self.loss_at is not None:
            comm += seconds(self.loss_at, end)
        compute = max(total - self.data_s - comm, 0.0)
        return self.data_s, compute, comm
