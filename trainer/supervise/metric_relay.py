"""Rank 0's metrics, sent to MLflow by this host's supervisor (the writer is ``trainer.loop.metrics.MetricFile``).

The supervisor already holds an MLflow client, so the rank does not import
mlflow (~2 s of CPU on its path to the first step) nor send from a thread that
competes with its steps for the GIL. The logger sends one point per key and
step across the run's attempts (``MetricLogger``): a resumed attempt's retrained
steps are not logged twice.
"""

from __future__ import annotations

import json
import threading

from trainpipe.trainer.tracking import MetricLogger


class MetricRelay:
    """Every ``every_s``, the complete lines the rank appended since the last read go to one MLflow run."""

    def __init__(self, path: str, tracking_uri: str, run_id: str, every_s: float = 2.0):
        self.path, self._every, self._offset = path, every_s, 0
        self.skipped = 0  # lines that are not a metrics record
        self._logger = MetricLogger(tracking_uri, run_id, every_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metric-relay", daemon=True)
        self._thread.start()

    @property
    def failures(self) -> int:
        return self._logger.failures

    @property
    def replayed(self) -> int:
        """Metrics of steps the run already held (a resumed attempt's retrained steps): not sent."""
        return self._logger.replayed

    @property
    def mismatched(self) -> int:
        """Of those, training losses that differ from the run's first point."""
        return self._logger.mismatched

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:  # rank 0 has not started yet
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self._offset += end
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
                metrics = {str(k): float(v) for k, v in rec["metrics"].items()}
                self._logger.log(metrics, int(rec["step"]), int(rec["time_ms"]))
            except (ValueError, TypeError, KeyError, AttributeError):
                self.skipped += 1

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._read()

    def close(self, timeout_s: float = 60.0) -> None:
        """Send what is left; returns when MLflow has it, or after ``timeout_s``."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        self._read()
        self._logger.close(timeout_s)
