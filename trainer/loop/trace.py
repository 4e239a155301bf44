"""Records of the loop for the attempt's result and for debugging; both are callbacks.

``Timeline``: when each step began (the attempt's median step time, benchmarks'
steady-state figures) and the seconds spent waiting for data and evaluating.
``SampleTrace``: with ``TRAINPIPE_TRACE_SAMPLES=DIR`` each
rank appends ``{"step", "ids", "loss"}`` of every step to ``DIR/rank-R.jsonl``,
to check that resumed or resharded runs consume the same samples.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time

from trainpipe.trainer.loop.callbacks import Callback, StepMetrics

TRACE_ENV = "TRAINPIPE_TRACE_SAMPLES"


class Timeline(Callback):
    """When each step began, and the seconds this rank waited for batches and spent evaluating (the attempt's
    result carries them into the run's badput)."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.step_starts_s: list[float] = []  # seconds since the attempt began, one per step
        self.data_wait_s = self.eval_s = 0.0
        self._eval_began: float | None = None

    def on_step_start(self, step: int) -> None:
        self.step_starts_s.append(time.time() - self.t0)

    def on_data_wait(self, step: int, waited_s: float) -> None:
        self.data_wait_s += waited_s

    def on_phase(self, step: int, phase: str) -> None:
        if phase == "eval":
            self._eval_began = time.perf_counter()

    def on_eval(self, step: int, loss: float) -> None:
        if self._eval_began is not None:
            self.eval_s += time.perf_counter() - self._eval_began
            self._eval_began = None

    def step_times_s(self) -> list[float]:
        """Each step's time (from its start to the next one's), the warm-up step left out."""
        return [b - a for a, b in itertools.pairwise(self.step_starts_s[1:])]

    def median_step_s(self) -> float:
        s = self.step_starts_s
        return statistics.median(b - a for a, b in itertools.pairwise(s)) if len(s) > 1 else 0.0


class SampleTrace(Callback):
    def __init__(self, folder: str, rank: int):
        self._fh = open(os.path.join(folder, f"rank-{rank}.jsonl"), "a")  # noqa: SIM115 - open for the whole attempt

    @classmethod
    def from_env(cls, rank: int) -> SampleTrace | None:
        folder = os.environ.get(TRACE_ENV)
        return cls(folder, rank) if folder else None

    def on_step_end(self, m: StepMetrics) -> None:
        self._fh.write(json.dumps({"step": m.step, "ids": [int(i) for i in m.samples], "loss": m.loss}) + "\n")
        self._fh.flush()

    def on_finish(self) -> None:
        self._fh.close()
