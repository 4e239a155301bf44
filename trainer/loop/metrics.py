"""Rank 0's metrics to MLflow (DESIGN §7), and the step log every rank 0 prints.

``MetricLogger.log`` only enqueues; a daemon thread sends batches, so a slow
tracking store never stalls a step.
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
        # mlflow's import and connection (~2 s of CPU) happen on the sender thread, while the first steps run:
        # metrics queue meanwhile. In front of the first step they held every rank up.
        self._thread = threading.Thread(target=self._run, name="mlflow-logger", daemon=True)
        self._thread.start()

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
        except Exception as exc:  # noqa: BLE001 - tracking must never kill training; each send retries
            log.warning("MLflow is not reachable yet (%s); metrics are kept and sent later", exc.__class__.__name__)
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


class SystemMetrics(Callback):
    """MLflow's system metrics (``system/cpu_utilization_percentage``, memory, disk, network, and GPU through
    nvidia-ml-py where present), sampled on rank 0's host while it trains."""

    def __init__(self, tracking_uri: str, run_id: str, sampling_interval_s: float = 5.0):
        self._uri, self._run_id, self._interval = tracking_uri, run_id, sampling_interval_s
        self._monitor = None
        self._starter: threading.Thread | None = None

    def on_train_start(self, start_step: int, steps: int) -> None:
        # Its import and first MLflow call run beside training, not in front of the first step.
        self._starter = threading.Thread(target=self._start, name="system-metrics-start", daemon=True)
        self._starter.start()

    def _start(self) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(
                self._run_id, sampling_interval=self._interval, resume_logging=True, tracking_uri=self._uri
            )
            monitor.start()
            self._monitor = monitor
        except Exception as exc:  # noqa: BLE001 - a missing sensor must never stop training
            log.warning("system metrics are off (%s)", exc)

    def on_finish(self) -> None:
        if self._starter is not None:
            self._starter.join(timeout=30)
        if self._monitor is not None:
            self._monitor.finish()


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
