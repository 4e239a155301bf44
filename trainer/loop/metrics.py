"""Rank 0's metrics (docs/architecture.md §7), and the step log every rank 0 prints.

Under a supervisor, rank 0 appends its metrics to a file (``MetricFile``) and the
supervisor sends them to MLflow (``trainer.supervise.metric_relay``): a step costs
one small write and the rank never imports mlflow. Under plain torchrun,
``tracking.MetricLogger`` sends them from the rank itself.
"""

from __future__ import annotations

import json
import logging
import time

from trainpipe.trainer.loop.callbacks import Callback, StepMetrics
from trainpipe.trainer.tracking import EVAL_LOSS, TRAIN_LOSS, MetricLogger

log = logging.getLogger("trainpipe.trainer")


class MetricFile:
    """Appends metrics as JSON lines, one ``{"step", "time_ms", "metrics"}`` object per call, for the supervisor."""

    def __init__(self, path: str):
        self.path, self.failures = path, 0
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole attempt; line-buffered

    def wait_ready(self) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        line = json.dumps({"step": step, "time_ms": int(time.time() * 1000), "metrics": metrics})
        try:
            self._file.write(line + "\n")
        except (OSError, ValueError):  # a full disk or a closed file must never kill training
            self.failures += 1

    def close(self) -> None:
        self._file.close()


class MetricsCallback(Callback):
    """loss/*, train/* and perf/* from the loop's events."""

    def __init__(self, logger: MetricLogger | MetricFile):
        self.logger = logger

    def on_train_start(self, start_step: int, steps: int) -> None:
        self.logger.wait_ready()  # no step runs beside mlflow's import

    def on_step_end(self, m: StepMetrics) -> None:
        self.logger.log(
            {
                TRAIN_LOSS: m.loss,
                "train/lr": m.lr,
                "train/grad_norm": m.grad_norm,
                "perf/step_ms": m.step_ms,
                "perf/tokens_per_s": m.tokens_per_s,
                **({"perf/mfu": m.mfu} if m.mfu is not None else {}),
            },
            m.step,
        )

    def on_eval(self, step: int, loss: float) -> None:
        self.logger.log({EVAL_LOSS: loss}, step)

    def on_checkpoint_committed(self, step: int, stall_s: float, save_s: float) -> None:
        self.logger.log({"perf/ckpt_stall_ms": stall_s * 1000, "perf/ckpt_save_s": save_s}, step)

    def on_finish(self) -> None:
        self.logger.close()
        if self.logger.failures:
            log.warning("%d MLflow metric batch(es) could not be sent or written", self.logger.failures)


class StepLog(Callback):
    """About twenty progress lines a run, plus every evaluation."""

    def __init__(self) -> None:
        self.steps, self.start = 0, 0

    def on_train_start(self, start_step: int, steps: int) -> None:
        self.steps, self.start = steps, start_step

    def on_step_end(self, m: StepMetrics) -> None:
        if m.step % max(1, self.steps // 20) == 0 or m.step in (self.steps, self.start + 1):
            mfu = f" MFU {m.mfu:.1%}" if m.mfu is not None else ""
            log.info("step %d/%d loss %.4f lr %.2e %.0f ms%s", m.step, self.steps, m.loss, m.lr, m.step_ms, mfu)

    def on_eval(self, step: int, loss: float) -> None:
        log.info("step %d eval loss %.4f", step, loss)
