"""Records of the loop for the attempt's result and for debugging; both are callbacks.

``Timeline``: when each step began (the attempt's median step time, benchmarks'
steady-state figures). ``SampleTrace``: with ``TRAINPIPE_TRACE_SAMPLES=DIR`` each
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
    def __init__(self) -> None:
        self.t0 = time.time()
        self.step_starts_s: list[float] = []  # seconds since the attempt began, one per step

    def on_step_start(self, step: int) -> None:
        self.step_starts_s.append(time.time() - self.t0)

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
