"""Runs side by side: the loss-curve plot of one run, and ``trainpipe compare`` over several.

Everything comes from MLflow (``search_runs`` and metric histories), so any
two runs of an experiment compare, whoever started them and however they ended.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.tracking import RUN_NAME_TAG, client

COLUMNS = ("run", "status", "final val", "best val", "tokens/s", "goodput", "incidents", "wall")


@dataclass
class RunView:
    run_id: str
    name: str
    status: str
    params: dict[str, str]
    final_val: float | None
    best_val: float | None
    tokens_per_s: float | None
    goodput: float | None
    incidents: int | None
    wall_s: float | None
    incidents_by_kind: dict[str, int] = field(default_factory=dict)
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def row(self) -> dict[str, str]:
        return {
            "run": self.name,
            "status": self.status,
            "final val": _num(self.final_val, "{:.4f}"),
            "best val": _num(self.best_val, "{:.4f}"),
            "tokens/s": _num(self.tokens_per_s, "{:,.0f}"),
            "goodput": _num(self.goodput, "{:.0%}"),
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

    def as_dict(self) -> dict[str, Any]:
        return {
            "differing_params": self.differing,
            "runs": [
                {
                    "run_id": r.run_id,
                    **r.row(),
                    "incidents_by_kind": r.incidents_by_kind,
                    "params": {k: r.params.get(k) for k in self.differing},
                }
                for r in self.runs
            ],
        }


def _kinds(by_kind: dict[str, int]) -> str:
    """`` (crash 1, loss_spike 2)``: what the incidents were, when known."""
    return f" ({', '.join(f'{k} {n}' for k, n in sorted(by_kind.items()))})" if by_kind else ""


def incidents_by_kind(incidents: list[dict[str, Any]]) -> dict[str, int]:
    """How many incidents of each kind a summary's list holds (``run/incidents/{kind}`` in MLflow)."""
    out: dict[str, int] = {}
    for i in incidents:
        out[i["kind"]] = out.get(i["kind"], 0) + 1
    return out


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
    metrics = run.data.metrics

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, key))

    train, val = history("train/loss"), history("eval/loss")
    speed = [v for _, v in history("perf/tokens_per_s")]
    wall = metrics.get("run/wall_s")
    if wall is None and run.info.end_time:
        wall = (run.info.end_time - run.info.start_time) / 1000
    incidents = metrics.get("run/incidents")
    return RunView(
        run_id=run.info.run_id,
        name=run.data.tags.get(RUN_NAME_TAG, run.info.run_name or run.info.run_id),
        status=run.info.status,
        params=dict(run.data.params),
        final_val=metrics.get("eval/final_val_loss", val[-1][1] if val else None),
        best_val=min((v for _, v in val), default=None),
        tokens_per_s=statistics.median(speed) if speed else None,
        goodput=metrics.get("run/goodput"),
        incidents=int(incidents) if incidents is not None else None,
        wall_s=wall,
        incidents_by_kind={
            k.removeprefix("run/incidents/"): int(v) for k, v in metrics.items() if k.startswith("run/incidents/")
        },
        curves={"train": train, "val": val},
    )


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
