"""MLflow tracking: one run per pipeline run, continued across attempts.

The flow opens (or re-opens, by run name) the MLflow run and hands its id to
the ranks; only rank 0 logs, from a background thread that batches metrics so
a slow tracking store never stalls the training step.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from typing import Any

log = logging.getLogger("trainpipe.tracking")

RUN_NAME_TAG = "trainpipe.run_name"


@functools.lru_cache(maxsize=8)
def _client(tracking_uri: str):
    # One client per store: building one connects and checks the schema. Imported
    # lazily: mlflow costs ~1 s to import and ranks other than 0 never need it.
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def open_run(tracking_uri: str, experiment: str, run_name: str, tags: dict[str, str] | None = None) -> tuple[str, bool]:
    """Return (run_id, resumed): the existing run tagged with ``run_name`` or a new one."""
    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    found = client.search_runs([exp_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1)
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        if tags:
            set_tags(tracking_uri, run_id, tags)
        return run_id, True
    run = client.create_run(exp_id, run_name=run_name, tags={RUN_NAME_TAG: run_name, **(tags or {})})
    return run.info.run_id, False


def set_tags(tracking_uri: str, run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    client = _client(tracking_uri)
    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_params(tracking_uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Log params; a resumed run keeps the values it started with (MLflow params are immutable)."""
    from mlflow.entities import Param

    client = _client(tracking_uri)
    existing = client.get_run(run_id).data.params
    items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items()) if k not in existing]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=items[i : i + 100])


def log_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float], step: int) -> None:
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    _client(tracking_uri).log_batch(run_id, metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()])


def log_text(tracking_uri: str, run_id: str, text: str, artifact_file: str) -> None:
    _client(tracking_uri).log_text(run_id, text, artifact_file)


def log_dict(tracking_uri: str, run_id: str, obj: Any, artifact_file: str) -> None:
    _client(tracking_uri).log_dict(run_id, obj, artifact_file)


def end_run(tracking_uri: str, run_id: str, status: str) -> None:
    _client(tracking_uri).set_terminated(run_id, status=status)


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in _client(tracking_uri).get_metric_history(run_id, key)]


class MetricLogger:
    """Rank 0's metric sink: ``log()`` only enqueues; a daemon thread sends batches."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, flush_every_s: float = 2.0):
        self.enabled = bool(tracking_uri and run_id)
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0
        if self.enabled:
            self._uri, self._run_id, self._every = tracking_uri, run_id, flush_every_s
            # Pay mlflow's import and connection (~1 s of CPU) now, not in the middle of training.
            from mlflow.entities import Metric  # noqa: F401

            _client(tracking_uri)
            self._thread = threading.Thread(target=self._run, name="mlflow-logger", daemon=True)
            self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.enabled:
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
                _client(self._uri).log_batch(self._run_id, metrics=[Metric(*it) for it in items[i : i + 1000]])
            except Exception as exc:  # noqa: BLE001 - tracking must never kill training
                self.failures += 1
                log.warning("MLflow logging failed (%s); training continues", exc.__class__.__name__)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._drain()
        self._drain()

    def close(self) -> None:
        if self._thread:
            self._stop.set()
            self._thread.join(timeout=60)
