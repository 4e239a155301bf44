"""Rank 0's metrics to MLflow (DESIGN §7), and the step log every rank 0 prints.

``MetricLogger.log`` only enqueues; a daemon thread sends batches, so a slow
tracking store never stalls a step. The callbacks are built before the process
group starts, so mlflow's import overlaps the set-up instead of the first steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from trainer import tracking
from trainer.loop.callbacks import Callback, StepMetrics

log = logging.getLogger("trainpipe.trainer")


class MetricLogger:
    """Batches metrics to one MLflow run from a background thread."""

    def __init__(self, tracking_uri: str, run_id: str, flush_every_s: float = 2.0):
        self._uri, self._run_id, self._every = tracking_uri, run_id, flush_every_s
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.failures = 0
        self._connected = threading.Event()
        # mlflow's import and connection (~2 s of CPU) start on the sender thread at once, beside the process
        # group's start, the model build and the resume; the loop waits for them before its first step
        # (``wait_connected``), because Python work on a second thread slows every step of this rank by holding
        # the GIL: the first steps of rank 0 ran 10-20x slower and the watchdog saw a straggler.
        self._thread = threading.Thread(target=self._run, name="mlflow-logger", daemon=True)
        self._thread.start()

    def wait_connected(self, timeout_s: float = 60.0) -> None:
        """Return once the import and first connection are over (or failed), or after ``timeout_s``."""
        self._connected.wait(timeout_s)

    def log(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            self._queue.put((k, float(v), ts, step))

    def _drain(self) -> None:
        from mlflow.entities import Metric

        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for i in range(0, len(items), 1000):
            try:
                tracking.client(self._uri).log_batch(self._run_id, metrics=[Metric(*it) for it in items[i : i + 1000]])
            except Exception as exc:  # noqa: BLE001 - tracking must never kill training
                self.failures += 1
                log.warning("MLflow logging failed (%s); training continues", exc.__class__.__name__)

    def _run(self) -> None:
        try:
            tracking.client(self._uri)
            from mlflow.entities import Metric  # noqa: F401 - imported here, not during a step
        except Exception as exc:  # noqa: BLE001 - tracking must never kill training; each send retries
            log.warning("MLflow is not reachable yet (%s); metrics are kept and sent later", exc.__class__.__name__)
        finally:
            self._connected.set()
        while not self._stop.wait(self._every):
            self._drain()
        self._drain()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


class MetricsCallback(Callback):
    """train/*, perf/*, eval/loss and ckpt/* from the loop's events."""

    def __init__(self, logger: MetricLogger):
        self.logger = logger

    def on_train_start(self, start_step: int, steps: int) -> None:
        self.logger.wait_connected()  # no step runs beside mlflow's import

    def on_step_end(self, m: StepMetrics) -> None:
        self.logger.log(
            {
                "train/loss": m.loss,
                "train/lr": m.lr,
                "train/grad_norm": m.grad_norm,
                "perf/step_ms": m.step_ms,
                "perf/tokens_per_s": m.tokens_per_s,
            },
            m.step,
        )

    def on_eval(self, step: int, loss: float) -> None:
        self.logger.log({"eval/loss": loss}, step)

    def on_checkpoint_committed(self, step: int, stall_s: float, save_s: float) -> None:
        self.logger.log({"ckpt/stall_ms": stall_s * 1000, "ckpt/save_s": save_s}, step)

    def on_finish(self) -> None:
        self.logger.close()
        if self.logger.failures:
            log.warning("%d MLflow metric batch(es) could not be sent", self.logger.failures)


class StepLog(Callback):
    """About twenty progress lines a run, plus every evaluation."""

    def __init__(self) -> None:
        self.steps, self.start = 0, 0

    def on_train_start(self, start_step: int, steps: int) -> None:
        self.steps, self.start = steps, start_step

    def on_step_end(self, m: StepMetrics) -> None:
        if m.step % max(1, self.steps // 20) == 0 or m.step in (self.steps, self.start + 1):
            log.info("step %d/%d loss %.4f lr %.2e %.0f ms", m.step, self.steps, m.loss, m.lr, m.step_ms)

    def on_eval(self, step: int, loss: float) -> None:
        log.info("step %d eval loss %.4f", step, loss)
