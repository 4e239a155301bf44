"""MLflow: one run per pipeline run, continued across attempts and reruns.

The orchestrator opens the run with ``tracked_run`` (found again by the tag
``trainpipe.run_name`` when a run resumes) and hands its id to the tasks and
ranks; each holds a ``TrackedRun`` for it. Per-step metrics go through a
``MetricLogger``, which the supervisor feeds from rank 0's metrics file (plain
torchrun: rank 0 itself). mlflow is imported lazily: it costs about two seconds
of CPU and the ranks never need it under a supervisor.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

from trainpipe.trainer.config import Profile, TrackingConfig
from trainpipe.trainer.errors import RunCancelled, TrackingError
from trainpipe.trainer.profile_files import trainpipe_home
from trainpipe.trainer.redact import redact_text, url_secrets, without_userinfo
from trainpipe.trainer.store import is_local
from trainpipe.trainer.store_paths import join

log = logging.getLogger("trainpipe.tracking")

RUN_NAME_TAG = "trainpipe.run_name"
# The two loss curves share the first chart section of the MLflow run page, which sorts sections by name:
# "loss" before "perf", "train" (learning rate, gradient norm) and "watchdog". A run's headline figures
# (SUMMARY_TAGS: goodput, recoveries, the validated loss, …) are tags under SUMMARY, columns of the runs table, and
# every figure (badput by bucket, incidents by kind, the memory tier) is in the run's summary.json; the two that
# runs are sorted, filtered and plotted by (RANKED) are metrics too, at the final step.
TRAIN_LOSS, EVAL_LOSS = "loss/train", "loss/eval"
SUMMARY = "summary."
SUMMARY_TAGS = ("validated_loss", "final_step", "goodput", "recoveries", "incidents", "wall_s", "published")
RANKED = ("validated_loss", "goodput")

# A run's params: the profile keys a person changes to change what it trains (the runs table's columns, the
# parallel-coordinates plot's axes), never one that differs on every run (its name) or only says how it is run
# (retries, the data stage's workers); the whole profile is the run's profile.yaml artifact.
PARAM_SECTIONS = ("data", "model", "train")
NOT_PARAMS = frozenset(
    {
        "train.run_name", "train.max_retries", "train.retry_delay_s", "train.timeout_s", "train.rollbacks",
        "data.engine", "data.workers", "data.buffer_mb", "data.piece_mb", "data.max_bad_records",
    }
)  # fmt: skip
ALSO_PARAMS = frozenset(
    {
        "cluster.nodes", "cluster.procs_per_node", "cluster.device", "checkpoint.every_steps",
        "checkpoint.memory_every_steps", "checkpoint.memory_snapshot",
    }
)  # fmt: skip


def summary_tags(figures: dict[str, Any]) -> dict[str, Any]:
    """The run's SUMMARY_TAGS of ``figures``, as a person reads them in a column: seconds to 0.1 s, other
    fractions to 4 places (the exact figures are in summary.json)."""

    def rounded(key: str, value: Any) -> Any:
        if not isinstance(value, float):
            return value
        return round(value, 1) if key.endswith("_s") else round(value, 4)

    return {f"{SUMMARY}{k}": rounded(k, figures[k]) for k in SUMMARY_TAGS if k in figures}


WATCHDOG_FIGURES = {"score": "straggler_score", "compute_ms": "compute_ms", "data_ms": "data_ms", "comm_ms": "comm_ms"}


def watchdog_metrics(window: dict[str, Any]) -> dict[str, float]:
    """One scored watchdog window (its per-rank figures: straggler score, compute, data and collective wait) as
    a few charts whatever the world size, not one per rank: each figure's maximum and median over the ranks,
    and the slowest rank's (the highest score) with that rank's number."""
    out: dict[str, float] = {}
    scores = window.get("score") or {}
    slowest = max(scores, key=lambda r: scores[r]) if scores else None
    if slowest is not None:
        out["watchdog/slowest_rank"] = float(slowest)
    for key, name in WATCHDOG_FIGURES.items():
        per_rank = window.get(key) or {}
        if not per_rank:
            continue
        values = sorted(float(v) for v in per_rank.values())
        out[f"watchdog/{name}/max"] = values[-1]
        out[f"watchdog/{name}/median"] = statistics.median(values)
        if slowest in per_rank:
            out[f"watchdog/{name}/slowest"] = float(per_rank[slowest])
    return out


def run_params(profile: Profile) -> dict[str, Any]:
    """The MLflow params of a run of ``profile`` (see PARAM_SECTIONS): about 40 of its 160 keys."""
    return {
        k: v
        for k, v in profile.flat().items()
        if k == "name" or k in ALSO_PARAMS or (k.split(".")[0] in PARAM_SECTIONS and k not in NOT_PARAMS)
    }


# Opens the experiment in the UI's machine-learning view (not "GenAI apps & agents").
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def artifact_root(profile: Profile) -> str:
    """Where new experiments keep their artifacts: beside the data in an object store, else under TRAINPIPE_HOME
    (never ``./mlruns`` of whatever folder a run was started from)."""
    if not is_local(profile.store.root):
        return join(profile.store.root, "mlflow")
    return home_artifacts()


def home_artifacts() -> str:
    return f"file://{os.path.join(trainpipe_home(), 'mlartifacts')}"


# mlflow's first import, one thread at a time: a supervisor imports it on two threads at once (the metric
# relay's sender and the system metrics' starter), and a thread can then see a partly initialised module
# ("cannot import name '_get_store' from partially initialized module 'mlflow.tracking'").
_IMPORT_LOCK = threading.Lock()


def import_mlflow() -> None:
    with _IMPORT_LOCK:
        import mlflow.entities
        import mlflow.tracking  # noqa: F401


@functools.lru_cache(maxsize=8)
def client(tracking_uri: str):
    """One client per store: building one connects and checks the schema."""
    import_mlflow()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)  # never a process-wide default


class MetricLogger:
    """Batches metrics to one MLflow run from a background thread, one point per key and step across attempts.

    MLflow's metric log is append-only, and a resumed attempt trains again the steps its failed predecessor
    trained after its last commit: a metric of a step the run already holds for that key is not sent
    (``replayed``). Resume is exact, so the values agree; a training loss that does not is counted
    (``mismatched``) and said, and the run keeps its first point (docs/architecture.md §7). After a
    loss-spike rollback the retrained steps read other data: the run's curve keeps the points of the
    attempt that rolled back, up to the last step it logged."""

    def __init__(self, tracking_uri: str, run_id: str, flush_every_s: float = 2.0):
        self._uri, self._run_id, self._every = tracking_uri, run_id, flush_every_s
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.failures = self.replayed = self.mismatched = 0
        self._held: dict[str, int] | None = None  # key -> the last step the run held when this logger started
        self._first_losses: dict[int, float] | None = None  # the run's training loss by step, read on a replay
        self._connected = threading.Event()
        # mlflow's import and connection (~2 s of CPU) start on the sender thread at once; in a rank, beside the
        # process group's start, the model build and the resume. The loop waits for them before its first step
        # (``wait_ready``), because Python work on a second thread slows every step of the rank by holding the
        # GIL: the first steps of rank 0 ran 10-20x slower and the watchdog saw a straggler.
        self._thread = threading.Thread(target=self._run, name="mlflow-logger", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Return once the import and first connection are over (or failed), or after ``timeout_s``."""
        self._connected.wait(timeout_s)

    def log(self, metrics: dict[str, float], step: int, time_ms: int | None = None) -> None:
        ts = int(time.time() * 1000) if time_ms is None else time_ms
        for k, v in metrics.items():
            self._queue.put((k, float(v), ts, step))

    def _read_held(self) -> None:
        """What the run holds: one request (the run's latest metrics carry their steps), not a history per key."""
        if self._held is None:
            try:
                self._held = last_logged_steps(self._uri, self._run_id)
            except Exception as exc:  # noqa: BLE001 - tracking must never kill training; read again next time
                log.warning("could not read the MLflow run's last steps (%s)", exc.__class__.__name__)

    def _new(self, items: list[tuple[str, float, int, int]]) -> list[tuple[str, float, int, int]]:
        """The items whose step the run does not hold yet for their key."""
        self._read_held()
        held = self._held or {}
        new = []
        for item in items:
            key, value, _, step = item
            if step > held.get(key, -1):
                new.append(item)
                continue
            self.replayed += 1
            if key == TRAIN_LOSS:
                self._compare(step, value)
        return new

    def _compare(self, step: int, value: float) -> None:
        if self._first_losses is None:  # one key's history, read once and only when an attempt trains again
            try:
                self._first_losses = {}
                for at, logged in metric_history(self._uri, self._run_id, TRAIN_LOSS):
                    self._first_losses.setdefault(at, logged)  # a run logged before this holds some steps twice
            except Exception as exc:  # noqa: BLE001 - the comparison is a report, never a reason to stop
                log.warning("could not read the run's training loss to compare (%s)", exc.__class__.__name__)
                self._first_losses = {}
        first = self._first_losses.get(step)
        if first is None or first == value or (first != first and value != value):  # NaN equals NaN here
            return
        self.mismatched += 1
        if self.mismatched <= 3:
            log.warning(
                "%s at step %d was %r and is %r in the resumed attempt (a resume that was not exact, or a "
                "rollback's other data): the run keeps its first point",
                TRAIN_LOSS,
                step,
                first,
                value,
            )

    def _drain(self) -> None:
        from mlflow.entities import Metric

        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        items = self._new(items) if items else items
        for i in range(0, len(items), 1000):
            try:
                client(self._uri).log_batch(self._run_id, metrics=[Metric(*it) for it in items[i : i + 1000]])
            except Exception as exc:  # noqa: BLE001 - tracking must never kill training
                self.failures += 1
                log.warning("MLflow logging failed (%s); training continues", exc.__class__.__name__)

    def _run(self) -> None:
        try:
            client(self._uri)
            from mlflow.entities import Metric  # noqa: F401 - imported here, not during a step

            self._read_held()
        except Exception as exc:  # noqa: BLE001 - tracking must never kill training; each send retries
            log.warning("MLflow is not reachable yet (%s); metrics are kept and sent later", exc.__class__.__name__)
        finally:
            self._connected.set()
        while not self._stop.wait(self._every):
            self._drain()
        self._drain()

    def close(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)


# MLflow 3's UI opens an experiment in the view its ``workflowType`` query names, else in the one the experiment's
# ``mlflow.experimentKind`` tag maps to (EXPERIMENT_KIND), else in the GenAI view; a link names the view.
ML_VIEW = "workflowType=machine_learning"


def run_page(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """A run's charts (the run page's Model metrics tab, the loss curves first) in the MLflow UI's model-training
    view. A link is shown to everyone who sees the flow run: the browser asks for a password, the link never
    holds one."""
    base = without_userinfo(tracking_uri).rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics?{ML_VIEW}"


class TrackedRun:
    """An MLflow run to log into; every call is a no-op when tracking is off (``run_id`` None)."""

    def __init__(self, tracking_uri: str, run_id: str | None):
        self.uri, self.id = tracking_uri, run_id

    @classmethod
    def of(cls, cfg: TrackingConfig, run_id: str | None) -> TrackedRun:
        return cls(cfg.tracking_uri, run_id if cfg.enabled else None)

    def web_url(self) -> str | None:
        """The run's page in the MLflow UI when the tracking URI is a server, else None."""
        if not self.id or not self.uri.startswith(("http://", "https://")):
            return None
        return run_page(self.uri, client(self.uri).get_run(self.id).info.experiment_id, self.id)

    def log_figure(self, figure, artifact_file: str) -> None:
        if self.id:
            client(self.uri).log_figure(self.id, figure, artifact_file)

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.id:
            from mlflow.entities import RunTag

            client(self.uri).log_batch(self.id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params; a resumed run keeps the values it started with (MLflow params are immutable)."""
        if not self.id:
            return
        from mlflow.entities import Param

        existing = client(self.uri).get_run(self.id).data.params
        items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items()) if k not in existing]
        for i in range(0, len(items), 100):
            client(self.uri).log_batch(self.id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.log_steps([(step, metrics)])

    def log_steps(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        """Metrics of many steps in as few requests as MLflow takes (1,000 metrics each): a tracking server
        behind basic auth checks a password hash per request, ~0.1 s of its CPU. A key's step the run already
        holds (a window a resumed attempt scored again) is not sent: one point per key and step."""
        if not self.id or not steps:
            return
        from mlflow.entities import Metric

        ts, held = int(time.time() * 1000), last_logged_steps(self.uri, self.id)
        items = [
            Metric(k, float(v), ts, step)
            for step, metrics in steps
            for k, v in metrics.items()
            if step > held.get(k, -1)
        ]
        for i in range(0, len(items), 1000):
            client(self.uri).log_batch(self.id, metrics=items[i : i + 1000])

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.id:
            client(self.uri).log_text(self.id, text, artifact_file)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        if self.id:
            client(self.uri).log_dict(self.id, obj, artifact_file)

    @contextlib.contextmanager
    def system_metrics(self, enabled: bool = True, node_id: str | None = None, every_s: float = 5.0) -> Iterator[None]:
        """MLflow's ``system/*`` metrics of this host (CPU, memory, disk, network; GPU through nvidia-ml-py where
        present) while the block runs, every ``every_s`` seconds (``tracking.system_metrics_every_s``); with
        ``node_id`` named ``system/{node_id}/*``, so that each host of a job has its own.

        The supervisor samples them, not rank 0: Python work on a second thread of a rank slows its steps by
        holding the GIL. The monitor's start (an import and a metric history read, about 1.5 s) runs on its
        own thread, so the launch does not wait for it."""
        if not (enabled and self.id):
            yield
            return
        monitors: list = []
        lock, ended = threading.Lock(), threading.Event()

        def start() -> None:
            try:
                import_mlflow()
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                class HostMetrics(SystemMetricsMonitor):
                    def monitor(self) -> None:
                        import psutil

                        # psutil measures CPU use since the same thread's previous call: without one a moment
                        # before, the first sample reads 0%.
                        psutil.cpu_percent()
                        if not self._shutdown_event.wait(min(self.sampling_interval, 1.0)):
                            super().monitor()
                        # MLflow's loop drops what it sampled since its last publication when it is stopped: an
                        # attempt shorter than the interval would have no point at all.
                        try:
                            if not any(m._metrics for m in self.monitors):
                                self.collect_metrics()
                            self.publish_metrics(self.aggregate_metrics())
                        except Exception as exc:  # noqa: BLE001 - a missing sample must never stop training
                            log.debug("last system metrics sample not logged (%s)", exc)

                monitor = HostMetrics(
                    self.id,
                    sampling_interval=every_s,  # pyright: ignore[reportArgumentType] - documented as a float
                    resume_logging=True,
                    node_id=node_id,
                    tracking_uri=self.uri,
                )
                monitor.sampling_interval = every_s  # the profile's, over MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
                with lock:  # a start that comes after the block ended never begins sampling
                    if not ended.is_set():
                        monitor.start()
                        monitors.append(monitor)
            except Exception as exc:  # noqa: BLE001 - a missing sensor must never stop training
                log.warning("system metrics are off (%s)", redact_text(str(exc)))

        starter = threading.Thread(target=start, name="system-metrics-start", daemon=True)
        starter.start()
        try:
            yield
        finally:
            # Bounded: a host's supervisor ends here on SIGTERM too, and must write its part before the grace
            # period runs out, whatever MLflow does (finish() joins the sampler and flushes with no timeout).
            starter.join(timeout=5)
            with lock:
                ended.set()
            for monitor in monitors:
                stopper = threading.Thread(target=monitor.finish, name="system-metrics-stop", daemon=True)
                stopper.start()
                stopper.join(timeout=5)


def experiment_id(tracking_uri: str, experiment: str, artifact_location: str | None = None) -> str:
    """The experiment's id, created (with ``artifact_location``) when missing; marked a model-training experiment."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        try:
            exp_id = c.create_experiment(experiment, artifact_location=artifact_location, tags=EXPERIMENT_KIND)
        except Exception:
            exp = c.get_experiment_by_name(experiment)
            if exp is None:
                raise
            exp_id = exp.experiment_id
        return exp_id
    if exp.tags.get("mlflow.experimentKind") != EXPERIMENT_KIND["mlflow.experimentKind"]:
        c.set_experiment_tag(exp.experiment_id, *next(iter(EXPERIMENT_KIND.items())))
    return exp.experiment_id


def open_run(
    tracking_uri: str,
    experiment: str,
    run_name: str,
    tags: dict[str, str] | None = None,
    artifact_location: str | None = None,
) -> tuple[str, bool]:
    """(run_id, resumed): the run tagged with ``run_name``, set RUNNING again, or a new one. A new experiment keeps
    its artifacts at ``artifact_location``, by default under TRAINPIPE_HOME: MLflow's own default is ``./mlruns``
    of whatever folder the process runs in."""
    c = client(tracking_uri)
    artifact_location = artifact_location or home_artifacts()
    exp_id = experiment_id(tracking_uri, experiment, artifact_location)
    found = c.search_runs([exp_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1)
    if found:
        run_id = found[0].info.run_id
        c.update_run(run_id, status="RUNNING")
        TrackedRun(tracking_uri, run_id).set_tags(tags or {})
        return run_id, True
    run = c.create_run(exp_id, run_name=run_name, tags={RUN_NAME_TAG: run_name, **(tags or {})})
    return run.info.run_id, False


@contextlib.contextmanager
def tracked_run(
    cfg: TrackingConfig,
    run_name: str,
    tags: dict[str, str] | None = None,
    params: dict[str, Any] | None = None,
    texts: dict[str, str] | None = None,
    artifact_location: str | None = None,
) -> Iterator[TrackedRun]:
    """The pipeline run's MLflow run, with its params and text artifacts logged on entry, ended FINISHED, FAILED
    (an error) or KILLED (interrupt, cancellation) on exit."""
    if not cfg.enabled:
        yield TrackedRun(cfg.tracking_uri, None)
        return
    try:
        run_id, _ = open_run(cfg.tracking_uri, cfg.experiment, run_name, tags, artifact_location)
    except Exception as exc:  # noqa: BLE001 - MLflow's errors name the URL it asked, password and all
        first = redact_text((str(exc).splitlines() or [""])[0][:300], url_secrets(cfg.tracking_uri))
        raise TrackingError(
            f"MLflow at {redact_text(cfg.tracking_uri)} cannot open the run ({type(exc).__name__}: {first}); "
            "start it (trainpipe up) or fix tracking.tracking_uri"
        ) from None
    run = TrackedRun(cfg.tracking_uri, run_id)
    status = "KILLED"
    try:
        run.log_params(params or {})
        for name, text in (texts or {}).items():
            run.log_text(text, name)
        yield run
        status = "FINISHED"
    except RunCancelled:
        raise  # KILLED, like an interrupt
    except Exception:
        status = "FAILED"
        raise
    finally:  # KeyboardInterrupt, SystemExit and cancellation are BaseExceptions: KILLED
        try:
            client(cfg.tracking_uri).set_terminated(run_id, status=status)
        except Exception as exc:  # noqa: BLE001 - an error in flight must not be replaced by this one
            log.warning(
                "could not end MLflow run %s as %s (%s: %s)", run_id, status, type(exc).__name__, redact_text(str(exc))
            )


def last_logged_steps(tracking_uri: str, run_id: str) -> dict[str, int]:
    """Each metric key of the run and the largest step it holds, from one ``get_run``: MLflow keeps each key's
    point at its largest step among the run's latest metrics."""
    return {m.key: m.step for m in client(tracking_uri).get_run(run_id).data.to_proto().metrics}


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client(tracking_uri).get_metric_history(run_id, key)]
