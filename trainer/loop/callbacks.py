"""What the training loop announces, and who listens (composer's events, in small).

The loop calls one ``Callbacks`` object at fixed points; beacons, metrics, the
step log, traces and fault drills are callbacks. A callback observes: it gets
values, never the loop's state to change (a fault drill misbehaves on purpose,
through a torch hook on the model or a collective of its own). An exception
from a callback propagates from the loop (a drill that raises is a failing
rank); from a checkpoint event on the background thread it fails that save.
Checkpoint events of an async save come from that thread, of a synchronous one
from the loop's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trainpipe.trainer.incidents import Incident


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step, as every rank saw it (``loss`` is the mean over all ranks)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    step_ms: float
    tokens_per_s: float
    samples: np.ndarray  # this rank's sample ids
    mfu: float | None = None  # model FLOPs utilisation, when the device's peak is known
    # Where the step's time went on this rank (trainer.loop.step_clock): reading its data, waiting in
    # collectives, and the rest (forward, backward, optimizer).
    data_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    # Of data_s: fetching shards from the store and checking their sha256 (trainer.data.tokens.ReadTimes).
    data_fetch_s: float = 0.0
    data_verify_s: float = 0.0


class Callback:
    """Override what you need; every event is a no-op here."""

    def on_setup(self, model: torch.nn.Module) -> None:
        """The model is built (before DDP wraps it and before resume)."""

    def on_resume(self, step: int, verified: bool, tier: str = "store") -> None:
        """The attempt resumed from the checkpoint of ``step``; ``verified``: the loaded state hashed to the hash
        recorded at its save (False: a checkpoint written before checkpoints recorded one); ``tier``: ``store``,
        or ``memory`` for a snapshot in host memory (trainer.checkpoint.memory_tier)."""

    def on_train_start(self, start_step: int, steps: int) -> None:
        """Training begins after ``start_step`` steps (0: from scratch) and ends at ``steps``."""

    def on_step_start(self, step: int) -> None:
        """Step ``step`` (1-based) begins: its data is about to be read."""

    def on_phase(self, step: int, phase: str) -> None:
        """The step enters ``phase``: forward, optimizer, eval or checkpoint."""

    def on_data(self, step: int) -> None:
        """The loop reads a micro-batch of step ``step``; time spent in this call counts as waiting for data
        (the slow_data drill sleeps here)."""

    def on_data_wait(self, step: int, waited_s: float) -> None:
        """Reading a micro-batch of step ``step`` took ``waited_s``."""

    def on_collective(self, step: int, kind: str) -> None:
        """This rank is about to enter a collective (``kind``: e.g. loss, or FSDP2's all_gather, reduce_scatter)."""

    def on_collective_end(self, step: int, kind: str, waited_s: float) -> None:
        """A collective the model's sharding issues (FSDP2) returned after ``waited_s``; compute resumes."""

    def on_gradients_ready(self) -> None:
        """The last gradient bucket is ready: this rank's compute for the step is done, the all-reduce begins."""

    def on_step_end(self, metrics: StepMetrics, /) -> None:
        """The step is done on this rank."""

    def on_eval(self, step: int, loss: float) -> None:
        """Evaluation after ``step`` gave ``loss``."""

    def on_checkpoint_written(self, step: int) -> None:
        """Every file of the checkpoint of ``step`` is written; the commit comes next."""

    def on_checkpoint_committed(self, step: int, stall_s: float, save_s: float) -> None:
        """Rank 0 committed the checkpoint of ``step``; the loop was blocked ``stall_s`` of its ``save_s``."""

    def on_incident(self, incident: Incident) -> None:
        """Something went wrong on this rank that training survives (a failed checkpoint, a store outage)."""

    def on_finish(self) -> None:
        """The final checkpoint is committed: the attempt is ending (flush, tear down)."""


class Callbacks(Callback):
    """Calls each callback in order."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = callbacks

    def on_setup(self, model: torch.nn.Module) -> None:
        for c in self.callbacks:
            c.on_setup(model)

    def on_resume(self, step: int, verified: bool, tier: str = "store") -> None:
        for c in self.callbacks:
            c.on_resume(step, verified, tier)

    def on_train_start(self, start_step: int, steps: int) -> None:
        for c in self.callbacks:
            c.on_train_start(start_step, steps)

    def on_step_start(self, step: int) -> None:
        for c in self.callbacks:
            c.on_step_start(step)

    def on_phase(self, step: int, phase: str) -> None:
        for c in self.callbacks:
            c.on_phase(step, phase)

    def on_data(self, step: int) -> None:
        for c in self.callbacks:
            c.on_data(step)

    def on_data_wait(self, step: int, waited_s: float) -> None:
        for c in self.callbacks:
            c.on_data_wait(step, waited_s)

    def on_collective(self, step: int, kind: str) -> None:
        for c in self.callbacks:
            c.on_collective(step, kind)

    def on_collective_end(self, step: int, kind: str, waited_s: float) -> None:
        for c in self.callbacks:
            c.on_collective_end(step, kind, waited_s)

    def on_gradients_ready(self) -> None:
        for c in self.callbacks:
            c.on_gradients_ready()

    def on_step_end(self, metrics: StepMetrics) -> None:
        for c in self.callbacks:
            c.on_step_end(metrics)

    def on_eval(self, step: int, loss: float) -> None:
        for c in self.callbacks:
            c.on_eval(step, loss)

    def on_checkpoint_written(self, step: int) -> None:
        for c in self.callbacks:
            c.on_checkpoint_written(step)

    def on_checkpoint_committed(self, step: int, stall_s: float, save_s: float) -> None:
        for c in self.callbacks:
            c.on_checkpoint_committed(step, stall_s, save_s)

    def on_incident(self, incident: Incident) -> None:
        for c in self.callbacks:
            c.on_incident(incident)

    def on_finish(self) -> None:
        for c in self.callbacks:
            c.on_finish()
