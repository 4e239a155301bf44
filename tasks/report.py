from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from trainpipe.trainer.checkpoint.catalog import inspect_checkpoint
from trainpipe.trainer.config import Profile
from trainpipe.trainer.orchestrate.badput import Marks, account
from trainpipe.trainer.orchestrate.compare import loss_figure, run_view
from trainpipe.trainer.orchestrate.records import RunRecords
from trainpipe.trainer.orchestrate.summary import Trained, build_summary, published_view, summary_markdown
from trainpipe.trainer.tracking import RANKED, TrackedRun, summary_tags

if TYPE_CHECKING:  # the module imports torch; the flow's process imports it late (flows/pipeline.py)
    from trainpipe.trainer.orchestrate.publish import Published


@task(name="report_run", task_run_name="report-{run_name}", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def report_run(
    profile: Profile,
    run_name: str,
    mlflow_run_id: str | None,
    dataset_id: str,
    trained: Trained,
    validated: dict[str, Any],
    marks: Marks,
    published: Published | None = None,
    unpublished: str | None = None,
) -> dict[str, Any]:
    """Build the run summary and publish it: MLflow summary tags and artifacts, a Prefect markdown artifact. The
    run's wall time ends here; ``marks`` are the flow's stages until now. ``published``: the registered version;
    ``unpublished``: why the publish stage did not register one."""
    result = trained.result
    badput = account(marks, time.time(), trained.attempts, result, trained.lost_steps(), result.step_s_median)
    incidents = RunRecords(profile.store, run_name).incidents()
    summary = build_summary(
        profile,
        trained,
        validated,
        incidents,
        run_name=run_name,
        mlflow_run_id=mlflow_run_id,
        dataset_id=dataset_id,
        badput=badput,
        published=published_view(published, unpublished, profile),
    )
    tracked = TrackedRun.of(profile.tracking, mlflow_run_id)
    try:
        summary["mlflow_url"] = tracked.web_url()  # the run's charts in the MLflow UI, when a server tracks it
    except Exception:  # noqa: BLE001 - a link is not worth failing the report for
        summary["mlflow_url"] = None
    figures = {
        "validated_loss": summary["val_loss"],
        "final_step": summary["final_step"],
        "goodput": summary["goodput"],
        "recoveries": summary["recoveries"],
        "incidents": len(summary["incidents"]),
        "wall_s": summary["wall_s"],
        "published": summary["published"]["line"],
    }
    # A few single values as the runs table's columns, rounded; every figure is in summary.json, exact
    tracked.set_tags(summary_tags(figures))
    ranked = {k: figures[k] for k in RANKED if isinstance(figures[k], (int, float))}
    if ranked:  # what runs are sorted, filtered and plotted by: metrics too, exact
        tracked.log_metrics(ranked, step=summary["final_step"])
    if summary["incidents"]:
        tracked.log_dict(summary["incidents"], "incidents.json")
    manifest = inspect_checkpoint(validated["uri"], profile.store.storage_options, verify=False).manifest
    tracked.log_dict(manifest, "checkpoint/trainpipe.json")
    tracked.log_dict(summary, "summary.json")
    markdown = summary_markdown(summary)
    tracked.log_text(markdown, "summary.md")
    if tracked.id:
        tracked.log_figure(loss_figure([run_view(tracked.uri, tracked.id)], f"loss of {run_name}"), "loss_curve.png")
    create_markdown_artifact(markdown, key="run-summary", description=f"trainpipe run {run_name}")
    return summary
