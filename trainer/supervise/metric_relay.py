"""Rank 0's metrics, sent to MLflow by this host's supervisor (the writer is ``trainer.loop.metrics.MetricFile``).

The supervisor already holds an MLflow client, so the rank does not import
mlflow (~2 s of CPU on its path to the first step) nor send from a thread that
competes with its steps for the GIL.

A resumed attempt trains again the steps its failed predecessor trained after
its last commit, and those steps' metrics are in the run already (MLflow's
metric log is append-only): a metric of a step the run holds is not sent again,
so each series keeps one point per step. Resume is exact, so the values agree;
one of the exact series (loss, gradient norm, learning rate) that does not is counted and said
(``mismatched``), never logged twice.
"""

from __future__ import annotations

import json
import logging
import threading

from trainpipe.trainer.tracking import MetricLogger, metric_history

log = logging.getLogger("trainpipe.metrics")
EXACT = ("train/", "loss/")  # the series an exact resume reproduces bit for bit


class MetricRelay:
    """Every ``every_s``, the complete lines the rank appended since the last read go to one MLflow run."""

    def __init__(self, path: str, tracking_uri: str, run_id: str, every_s: float = 2.0):
        self.path, self._every, self._offset = path, every_s, 0
        self.skipped = 0  # lines that are not a metrics record
        self.replayed = 0  # metrics of steps the run already holds (a resumed attempt's retrained steps): not sent
        self.mismatched = 0  # of those, values that differ from the run's
        self._uri, self._run_id = tracking_uri, run_id
        self._held: dict[str, dict[int, float]] = {}  # key -> the run's points, read once per key
        self._logger = MetricLogger(tracking_uri, run_id, every_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metric-relay", daemon=True)
        self._thread.start()

    @property
    def failures(self) -> int:
        return self._logger.failures

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
                step = int(rec["step"])
                self._logger.log(self._new(metrics, step), step, int(rec["time_ms"]))
            except (ValueError, TypeError, KeyError, AttributeError):
                self.skipped += 1

    def _new(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """The metrics of ``step`` that the run does not hold yet."""
        new = {}
        for key, value in metrics.items():
            if key not in self._held:
                try:
                    self._held[key] = dict(metric_history(self._uri, self._run_id, key))
                except Exception as exc:  # noqa: BLE001 - MLflow away now: send; its history is read next time
                    log.warning("could not read %s's points (%s): sent as it is", key, type(exc).__name__)
                    new[key] = value
                    continue
            held = self._held[key]
            if step not in held:  # the rank logs a step once per attempt: only the run's earlier points are kept
                new[key] = value
                continue
            self.replayed += 1
            if not key.startswith(EXACT):  # timings and throughput differ between attempts by nature
                continue
            if held[step] != value and not (value != value and held[step] != held[step]):  # NaN equals NaN here
                self.mismatched += 1
                if self.mismatched <= 3:
                    log.warning(
                        "%s at step %d was %r and is %r after the resume: not logged again",
                        key,
                        step,
                        held[step],
                        value,
                    )
        return new

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._read()

    def close(self, timeout_s: float = 60.0) -> None:
        """Send what is left; returns when MLflow has it, or after ``timeout_s``."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        self._read()
        self._logger.close(timeout_s)
