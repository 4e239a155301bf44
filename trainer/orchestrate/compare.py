"""Runs side by side: the loss-curve plot of one run, and ``trainpipe compare`` over several.

Everything comes from MLflow (``search_runs`` and metric histories), so any
two runs of an experiment compare, whoever started them and however they ended.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.orchestrate.badput import BUCKETS
from trainpipe.trainer.tracking import EVAL_LOSS, RUN_NAME_TAG, SUMMARY, TRAIN_LOSS, client

COLUMNS = ("run", "status", "validated", "best eval", "tokens/s", "goodput", "most badput", "incidents", "wall")
# The two losses measure different things, and the table says so under it.
LEGEND = (
    "validated: the validate stage's loss of the final checkpoint (32 windows spread over the validation split); "
    "best eval: the lowest in-loop evaluation (train.eval_batches micro-batches a rank); "
    "most badput: the largest share of the wall time that was not productive training (--json: every bucket)"
)


@dataclass
class RunView:
    run_id: str
    name: str
    status: str
    params: dict[str, str]
    validated_loss: float | None  # the validate stage's (the summary.validated_loss tag)
    best_eval_loss: float | None  # the lowest in-loop evaluation (loss/eval)
    tokens_per_s: float | None
    goodput: float | None
    incidents: int | None
    wall_s: float | None
    incidents_by_kind: dict[str, int] = field(default_factory=dict)
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    badput_s: dict[str, float] = field(default_factory=dict)  # seconds per bucket (trainer/orchestrate/badput.py)

    def most_badput(self) -> str:
        """The bucket that took the largest share of the wall time: ``startup 14%``."""
        if not self.badput_s or not self.wall_s:
            return "-"
        bucket, seconds = max(self.badput_s.items(), key=lambda kv: kv[1])
        return f"{bucket.replace('_', ' ')} {seconds / self.wall_s:.0%}"

    def row(self) -> dict[str, str]:
        """The table's columns, as text."""
        return {
            "run": self.name,
            "status": self.status,
            "validated": _num(self.validated_loss, "{:.4f}"),
            "best eval": _num(self.best_eval_loss, "{:.4f}"),
            "tokens/s": _num(self.tokens_per_s, "{:,.0f}"),
            "goodput": _num(self.goodput, "{:.0%}"),
            "most badput": self.most_badput(),
            "incidents": _num(self.incidents, "{:d}") + _kinds(self.incidents_by_kind),
            "wall": _num(self.wall_s, "{:.0f}s"),
        }


@dataclass
class Comparison:
    runs: list[RunView]
    differing: list[str]  # params whose values are not the same in every run

    def table(self) -> str:
        """The runs as a fixed-width table: the summary columns, then only the params that differ."""
        header = [*COLUMNS, *self.differing]
        rows = [[*r.row().values(), *(r.params.get(k, "-") for k in self.differing)] for r in self.runs]
        widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) for line in [header, *rows]]
        return "\n".join(line.rstrip() for line in lines)

    def legend(self) -> str:
        return LEGEND

    def as_dict(self) -> dict[str, Any]:
        """The comparison for a program: numbers as numbers (goodput a fraction, wall time in seconds)."""
        return {
            "differing_params": self.differing,
            "runs": [
                {
                    "run_id": r.run_id,
                    "run": r.name,
                    "status": r.status,
                    "validated_loss": r.validated_loss,
                    "best_eval_loss": r.best_eval_loss,
                    "tokens_per_s": r.tokens_per_s,
                    "goodput": r.goodput,
                    "incidents": r.incidents,
                    "incidents_by_kind": r.incidents_by_kind,
                    "wall_s": r.wall_s,
                    "badput_s": r.badput_s,
                    "params": {k: r.params.get(k) for k in self.differing},
                }
                for r in self.runs
            ],
            "legend": self.legend(),
        }


def _kinds(by_kind: dict[str, int]) -> str:
    """`` (crash 1, loss_spike 2)``: what the incidents were, when known."""
    return f" ({', '.join(f'{k} {n}' for k, n in sorted(by_kind.items()))})" if by_kind else ""


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def compare_runs(tracking_uri: str, experiment: str, selectors: list[str], latest: int = 5) -> Comparison:
    """The runs named by ``selectors`` (run names or MLflow run ids), else the ``latest`` runs of the experiment."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        raise TrainpipeError(f"no MLflow experiment {experiment!r} at {tracking_uri}; pass -e EXPERIMENT")
    if selectors:
        runs = [_find(c, exp.experiment_id, s) for s in selectors]
    else:
        runs = c.search_runs([exp.experiment_id], max_results=latest, order_by=["attributes.start_time DESC"])
    if not runs:
        raise TrainpipeError(f"experiment {experiment!r} has no runs yet")
    views = [_view(c, r) for r in runs]
    keys = sorted({k for v in views for k in v.params})
    differing = [k for k in keys if len({v.params.get(k) for v in views}) > 1 and k != "train.run_name"]
    return Comparison(views, differing)


def _find(c, experiment_id: str, selector: str):
    quoted = selector.replace("\\", "\\\\").replace("'", "\\'")
    found = c.search_runs([experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{quoted}'", max_results=1)
    if found:
        return found[0]
    try:
        run = c.get_run(selector)
    except Exception:  # noqa: BLE001 - MLflow raises its own exception types for an unknown id
        run = None
    if run is None or run.info.experiment_id != experiment_id:
        raise TrainpipeError(
            f"no run named or with id {selector!r} in this experiment; `trainpipe compare` lists recent ones"
        )
    return run


def _view(c, run) -> RunView:
    def history(key: str, older: str) -> list[tuple[int, float]]:
        """A metric's points, its first of each step; runs logged before the loss curves were renamed have them
        as ``older``. A run logged before each series kept one point per step holds a retrained step twice:
        the first is kept, as the loggers keep it now (trainer.tracking.MetricLogger)."""
        points = c.get_metric_history(run.info.run_id, key) or c.get_metric_history(run.info.run_id, older)
        first: dict[int, float] = {}
        for m in sorted(points, key=lambda m: (m.step, m.timestamp)):
            first.setdefault(m.step, m.value)
        return sorted(first.items())

    def figure(name: str, older: str) -> float | None:
        return _summary(run, name, older)

    train, val = history(TRAIN_LOSS, "train/loss"), history(EVAL_LOSS, "eval/loss")
    speed = [v for _, v in history("perf/tokens_per_s", "perf/tokens_per_s")]
    wall = figure("wall_s", "run/wall_s")
    if wall is None and run.info.end_time:
        wall = (run.info.end_time - run.info.start_time) / 1000
    incidents = figure("incidents", "run/incidents")
    older = "run/incidents/"
    kinds = {k.removeprefix(older): _number(v) for k, v in run.data.metrics.items() if k.startswith(older)}
    tagged = f"{SUMMARY}incidents."
    kinds |= {k.removeprefix(tagged): _number(v) for k, v in run.data.tags.items() if k.startswith(tagged)}
    buckets = {b: _number(run.data.tags.get(f"{SUMMARY}badput.{b}_s")) for b in BUCKETS}
    if not any(v is not None for v in buckets.values()):  # a run since the summary tags were cut to a few
        kinds, buckets = _from_summary_file(c, run.info.run_id, kinds)
    return RunView(
        run_id=run.info.run_id,
        name=run.data.tags.get(RUN_NAME_TAG, run.info.run_name or run.info.run_id),
        status=run.info.status,
        params=dict(run.data.params),
        validated_loss=figure("validated_loss", "eval/final_val_loss"),
        best_eval_loss=min((v for _, v in val), default=None),
        tokens_per_s=statistics.median(speed) if speed else None,
        goodput=figure("goodput", "run/goodput"),
        incidents=int(incidents) if incidents is not None else None,
        wall_s=wall,
        incidents_by_kind={k: int(v) for k, v in kinds.items() if v is not None},
        curves={"train": train, "val": val},
        badput_s={b: s for b, s in buckets.items() if s is not None and s >= 0},
    )


def _from_summary_file(
    c, run_id: str, kinds: dict[str, float | None]
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """(incidents by kind, badput seconds by bucket) from the run's ``summary.json``; ``kinds`` and no buckets
    when it is missing or unreadable. Anyone with MLflow access may write the file: it is read only up to
    ``SUMMARY_FILE_BYTES``, and every value must be a kind's short name or a finite number."""
    summary = _summary_file(c, run_id)
    incidents = summary.get("incidents")
    if isinstance(incidents, list):
        named = [i.get("kind") for i in incidents if isinstance(i, dict)]
        counted: dict[str, float | None] = {}
        for kind in named:
            if isinstance(kind, str) and kind.isidentifier() and len(kind) <= 40:
                counted[kind] = (counted.get(kind) or 0) + 1
        kinds = counted
    raw = summary.get("badput")
    raw = raw.get("buckets") if isinstance(raw, dict) else None
    buckets = {b: _number(raw.get(b)) if isinstance(raw, dict) else None for b in BUCKETS}
    return kinds, buckets


SUMMARY_FILE_BYTES = 1 << 20  # report_run's summary.json is a few kB; a larger one is not its


def _summary_file(c, run_id: str) -> dict[str, Any]:
    """The run's ``summary.json`` as a dict, or {} (missing, too large, not a JSON object, MLflow not answering)."""
    try:
        listed = {a.path: a for a in c.list_artifacts(run_id)}
        entry = listed.get("summary.json")
        if entry is None or entry.is_dir or entry.file_size is None or entry.file_size > SUMMARY_FILE_BYTES:
            return {}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(c.download_artifacts(run_id, "summary.json", tmp))
            if not path.is_file() or path.stat().st_size > SUMMARY_FILE_BYTES:
                return {}
            data = json.loads(path.read_bytes())
    except Exception:  # noqa: BLE001 - a figure missing from the table is not worth failing the comparison
        return {}
    return data if isinstance(data, dict) else {}


def _summary(run, name: str, older: str) -> float | None:
    """A run's single figure: its ``summary.`` tag, else the one-point metric runs logged it as before."""
    raw = run.data.tags.get(f"{SUMMARY}{name}", run.data.metrics.get(older))
    return None if raw is None else _number(raw)


def _number(raw: Any) -> float | None:
    """A finite number from a tag or a metric; None for anything else (anyone with MLflow access may write
    either: a text, a NaN, an infinity)."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def loss_figure(runs: list[RunView], title: str = "loss"):
    """Train loss (line) and validation loss (markers) of each run on one set of axes."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a training host
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.subplots()
    for i, r in enumerate(runs):
        color = f"C{i % 10}"
        if r.curves.get("train"):
            steps, values = zip(*r.curves["train"], strict=True)
            ax.plot(steps, values, color=color, linewidth=1.2, label=f"{r.name} train")
        if r.curves.get("val"):
            steps, values = zip(*r.curves["val"], strict=True)
            ax.plot(steps, values, color=color, linestyle="--", marker="o", markersize=4, label=f"{r.name} val")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    if runs:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def run_view(tracking_uri: str, run_id: str) -> RunView:
    c = client(tracking_uri)
    return _view(c, c.get_run(run_id))
