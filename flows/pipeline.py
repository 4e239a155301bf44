"""The trainpipe flow: shard → preflight → train (retried, resuming) → validate, tracked in MLflow.

Orchestration only: every step is a task; policy (retries, order, what ends
the run) lives here, work lives in ``trainer``.
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from tasks.preflight import preflight_cluster
from tasks.shard import shard_dataset
from tasks.train import train_model
from tasks.validate import validate_checkpoint
from trainer import tracking
from trainer.config import Profile, load_profile, write_resolved_profile
from trainer.data import check_source
from trainer.errors import PreflightFailed
from trainer.incidents import incident, load_incidents, record_incidents
from trainer.preflight import exclusion, failure_line
from trainer.recovery import goodput
from trainer.store import check_writable


def new_run_name(profile: Profile) -> str:
    return f"{profile.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"


def resolve(profile: str, overrides: list[str] | None, run_name: str | None) -> tuple[Profile, str]:
    """Load and check everything a user can get wrong before any work starts."""
    prof = load_profile(profile, overrides or [])
    name = run_name or prof.train.run_name or new_run_name(prof)
    prof.train.run_name = name
    check_writable(prof.store.root, prof.store.storage_options)
    check_source(prof.data, prof.store)
    return prof, name


@flow(name="trainpipe", flow_run_name="{profile}", validate_parameters=True)
def training_pipeline(profile: str = "local", overrides: list[str] | None = None, run_name: str | None = None) -> dict[str, Any]:
    """Run the whole pipeline on a profile (name in profiles/ or a YAML path) with optional section.key=value overrides."""
    start = time.time()
    logger = get_run_logger()
    prof, name = resolve(profile, overrides, run_name)
    write_resolved_profile(prof, name)  # the record of what this run trained with
    t = prof.tracking
    run_id = None
    if t.enabled:
        run_id, resumed = tracking.open_run(t.tracking_uri, t.experiment, name, {
            "prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": str(flow_run.name),
            "trainpipe.profile": prof.name, "trainpipe.config_hash": prof.config_hash(),
        })
        tracking.log_params(t.tracking_uri, run_id, prof.flat())
        tracking.log_text(t.tracking_uri, run_id, prof.public_yaml(), "profile.yaml")
        logger.info("MLflow run %s (%s)", run_id, "continued" if resumed else "new")
    try:
        dataset = shard_dataset(prof.data, prof.store, progress=sys.stderr.isatty())
        if prof.preflight.enabled:
            report = preflight_cluster(prof, raise_on_fail=False)
            if run_id:
                tracking.log_dict(t.tracking_uri, run_id, report, "preflight.json")
            prof = apply_preflight_policy(report, prof, name, run_id)
        delays = [prof.train.retry_delay_s * 2**i for i in range(max(1, prof.train.max_retries))]
        trained = train_model.with_options(retries=prof.train.max_retries, retry_delay_seconds=delays)(
            prof, name, dataset.uri, run_id
        )
        validated = validate_checkpoint(trained["checkpoint_uri"], prof)
        wall_s = time.time() - start
        cost = goodput(trained["steps_this_run"], trained["step_s_median"], trained["per_incident"], wall_s)
        usd_per_s = prof.cost.gpu_hour_usd * prof.cluster.world_size / 3600 if prof.cost.gpu_hour_usd is not None else None
        wasted_at = {p["time_epoch"]: w for p, w in zip(trained["per_incident"], cost["wasted_per_incident_s"])}
        incidents = []
        for record in load_incidents(prof.store.root, name, prof.store.storage_options):
            public = _public(record)
            if record.get("time_epoch") in wasted_at:
                public["wasted_s"] = round(wasted_at[record["time_epoch"]], 3)
                if usd_per_s is not None:
                    public["wasted_usd"] = round(public["wasted_s"] * usd_per_s, 4)
            incidents.append(public)
        summary = {
            "run_name": name,
            "mlflow_run_id": run_id,
            "checkpoint_uri": validated["uri"],
            "final_step": validated["step"],
            "val_loss": validated["val_loss"],
            "model_digest": validated["model_digest"],
            "recoveries": trained["recoveries"],
            "lost_steps": trained["lost_steps"],
            "recovery_s": trained["recovery_s"],
            "incidents": incidents,
            "goodput": cost["goodput"],
            "wasted_s": cost["wasted_s"],
            "wall_s": wall_s,
            "dataset_id": dataset.dataset_id,
        }
        if usd_per_s is not None:
            summary["wasted_usd"] = round(cost["wasted_s"] * usd_per_s, 4)
        if run_id:
            tracking.log_metrics(t.tracking_uri, run_id, {
                "run/recoveries": summary["recoveries"], "run/lost_steps": summary["lost_steps"], "run/recovery_s": summary["recovery_s"],
                "run/goodput": summary["goodput"], "run/wasted_s": summary["wasted_s"], "eval/final_val_loss": summary["val_loss"],
            }, summary["final_step"])
            if summary["incidents"]:
                tracking.log_dict(t.tracking_uri, run_id, summary["incidents"], "incidents.json")
            tracking.log_dict(t.tracking_uri, run_id, _read_manifest(prof, validated["uri"]), "checkpoint/trainpipe.json")
            tracking.log_dict(t.tracking_uri, run_id, summary, "summary.json")
            tracking.end_run(t.tracking_uri, run_id, "FINISHED")
        create_markdown_artifact(_summary_markdown(summary), key="run-summary", description=f"trainpipe run {name}")
        return summary
    except BaseException:
        if run_id:
            failed_incidents = [_public(i) for i in load_incidents(prof.store.root, name, prof.store.storage_options)]
            if failed_incidents:
                tracking.log_dict(t.tracking_uri, run_id, failed_incidents, "incidents.json")
            tracking.end_run(t.tracking_uri, run_id, "FAILED")
        raise


def apply_preflight_policy(report: dict[str, Any], prof: Profile, name: str, run_id: str | None) -> Profile:
    """stop: a failing check ends the run here. exclude: continue without the failing nodes when enough remain."""
    line = failure_line(report)
    if line is None:
        return prof
    if prof.preflight.on_fail == "stop":
        raise PreflightFailed(line)
    smaller, why = exclusion(report, prof)
    if smaller is None:
        raise PreflightFailed(f"{line}; cannot exclude: {why}")
    detail = f"preflight excluded node(s) {why}; continuing on {smaller.cluster.nodes} node(s): {line}"
    record_incidents(prof.store.root, name, [incident("exclude", detail, node=why)], prof.store.storage_options)
    get_run_logger().warning(detail)
    if run_id:
        tracking.set_tags(prof.tracking.tracking_uri, run_id, {"trainpipe.excluded_nodes": why})
    write_resolved_profile(smaller, name)
    return smaller


def _public(record: dict[str, Any]) -> dict[str, Any]:
    """An incident as the summary shows it: the DESIGN §5 fields first, diagnostics after."""
    keep = ("kind", "rank", "node", "step", "phase", "detected_after_s", "detail", "attempt", "time")
    return {k: record.get(k) for k in keep}


def _read_manifest(profile: Profile, uri: str) -> dict[str, Any]:
    from trainer.checkpoint import inspect_checkpoint

    return inspect_checkpoint(uri, profile.store.storage_options, verify=False).manifest


def _summary_markdown(summary: dict[str, Any]) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items() if k != "incidents")
    return f"# trainpipe run {summary['run_name']}\n\n| field | value |\n|---|---|\n{rows}\n\nincidents: {len(summary['incidents'])}\n"
