"""The trainpipe flow: shard → preflight → train (retried, resuming) → validate → publish → report, in MLflow.

Orchestration only: it orders the tasks and opens the run's MLflow run; what
each step does lives in the tasks, what a result means in
``trainer.orchestrate.policy``. Its one parameter, ``PipelineParameters``, is
the Prefect UI's run form; the flow run is named after the trainpipe run.
"""

# No `from __future__ import annotations`: the flow's annotations must be objects, not names. `trainpipe serve`
# hands Prefect the flow object, which cloudpickle ships to the flow-run process by value; a string annotation
# would then name a global the shipped function no longer has ("`PipelineParameters` is not fully defined").

import contextlib
import importlib
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.client.schemas.objects import State
from prefect.context import FlowRunContext
from prefect.runtime import deployment, flow_run
from prefect.states import Cancelled
from prefect.utilities.urls import url_for

from trainpipe.flows.parameters import PipelineParameters
from trainpipe.flows.shard import shard_corpus
from trainpipe.tasks.common import (
    label_flow_run,
    link_mlflow_run,
    record_takeover,
    served_form_values,
    stop_for_lost_lease,
    stop_with_parent,
)
from trainpipe.tasks.preflight import apply_preflight_policy, preflight_cluster
from trainpipe.tasks.report import report_run
from trainpipe.tasks.train import train_model
from trainpipe.trainer.config import Profile
from trainpipe.trainer.data.shard import dataset_metrics
from trainpipe.trainer.errors import PublishError, RunCancelled, TrainpipeError
from trainpipe.trainer.launch import warm_attempts
from trainpipe.trainer.orchestrate.badput import Marks, invoked_at
from trainpipe.trainer.orchestrate.lease import RunLease
from trainpipe.trainer.orchestrate.registry import code_version
from trainpipe.trainer.orchestrate.resolve import check_form_request, new_run_name, request_key, resolve, take_over
from trainpipe.trainer.orchestrate.servers import tracking_uri_for
from trainpipe.trainer.profile_files import private_home, write_resolved_profile
from trainpipe.trainer.store_paths import RUN_NAME, RunPaths, store_tag
from trainpipe.trainer.tracking import artifact_root, run_params, tracked_run


def import_for_the_end() -> None:
    """The orchestrator's only uses of torch (validation and publishing, ~3 s of CPU to import) and matplotlib (the
    report's loss curve, ~0.6 s)."""
    for module in (
        "trainpipe.tasks.validate",
        "trainpipe.tasks.publish",
        "matplotlib.figure",
        "matplotlib.backends.backend_agg",
    ):
        importlib.import_module(module)


def name_flow_run() -> str:
    """The trainpipe run name, which the flow run takes too: the one the parameters ask for; else the Run Name
    a person gave the flow run in Prefect's form or API; else (a scheduled run, the CLI) a new one, the profile's
    name and the time. A Prefect name that is not a run name (letters, digits, . _ -) gets a new one."""
    ctx = FlowRunContext.get()
    raw = ((ctx.parameters or {}) if ctx else {}).get("params") or {}
    params = raw if isinstance(raw, PipelineParameters) else PipelineParameters.model_validate(raw)
    if params.name:
        return params.name
    run = ctx.flow_run if ctx else None
    given = run is not None and run.deployment_id is not None and not run.auto_scheduled  # not the scheduler's
    if given and run is not None and re.fullmatch(RUN_NAME, run.name):
        return run.name
    return new_run_name(Path(params.profile).stem)


@flow(name="trainpipe", flow_run_name=name_flow_run, validate_parameters=True)
def training_pipeline(params: PipelineParameters = PipelineParameters()) -> dict[str, Any] | State:  # noqa: B008 - Prefect reads the default into the form
    """Train a profile end to end: shard the data, check the cluster, train with retries that resume, validate
    the final checkpoint, and report. Reusing a run name continues that run."""
    start = time.time()
    if deployment.id is not None:  # a run form's request: its user is not the operator (docs/security.md)
        stop_with_parent()  # the serve process or worker that started this one
        private_home()  # a worker's flow run did not come through the CLI, which narrows it first
        check_form_request(params.profile, params.overrides)
        params.check_override_bounds()
    handed = take_over(request_key(params.model_dump(mode="json"))) if deployment.id is None else None
    if handed is not None:  # the CLI resolved this request a moment ago, in this process
        prof, name = handed
        start = invoked_at(start)  # the command's start: its wall time is the run's
    else:
        name, resume = params.name or str(flow_run.name), params.resume is not None
        values = params.profile_values(served=served_form_values())
        # Prefect's Run Name starts a run (Prefect fills it with a random name); a retry of this flow run continues
        fresh = params.name is None and deployment.id is not None and (flow_run.run_count or 1) <= 1
        prof, name = resolve(params.profile, params.overrides, name, resume=resume, values=values, fresh=fresh)
    prof.tracking.tracking_uri = tracking_uri_for(prof)  # a running `trainpipe up` server serves this store
    tags = [f"profile:{prof.name}", f"world-size:{prof.cluster.world_size}", f"run:{name}"]
    label_flow_run([*tags, f"store:{store_tag(prof.store.root)}"])  # which store's run: a lease checks it
    lease = RunLease(RunPaths(prof.store.root, name).dir, name, prof.store.storage_options, owner=str(flow_run.id))
    stale = lease.acquire()
    with lease.kept(on_lost=stop_for_lost_lease):
        if stale is not None:  # in the block: should a job the dead run left be unstoppable, the lease is released
            record_takeover(prof, name, stale, str(flow_run.name))
        return train_and_report(prof, name, start)


def publish_validated(
    prof: Profile, name: str, run_id: str | None, validated: dict[str, Any]
) -> tuple[Any | None, str | None]:
    """(what publish registered, why it did not): None and None when the profile does not publish, or tracks
    nothing to publish to (the summary says which)."""
    if not prof.publish.enabled or not prof.tracking.enabled:
        return None, None
    from trainpipe.tasks.publish import publish_model

    try:
        return publish_model(prof, name, run_id, validated), None
    except TrainpipeError as exc:  # export, registry, data: said once, after the report
        return None, str(exc)


def train_and_report(prof: Profile, name: str, start: float) -> dict[str, Any] | State:
    marks = Marks(start)  # the critical path, stage by stage, for the run's badput (trainer/orchestrate/badput.py)
    write_resolved_profile(prof, name)  # the record of what this run trains with
    tags = {
        "prefect.flow_run_id": str(flow_run.id),
        "prefect.flow_run_name": str(flow_run.name),
        "prefect.deployment": str(deployment.name or ""),
        "trainpipe.profile": prof.name,
        "trainpipe.config_hash": prof.config_hash(),
        "trainpipe.code_version": code_version(),
    }
    if page := url_for("flow-run", obj_id=flow_run.id):  # the run's description: back to Prefect (a server's UI)
        tags["mlflow.note.content"] = f"trainpipe run `{name}`: its [Prefect flow run]({page})"  # a checked name
    texts = {"profile.yaml": prof.public_yaml()}
    # The attempts of this run start warm until training ends (docs/architecture.md §4): locally they fork their
    # torchrun agents from a warm host that the first one starts (the preflight job's, when there is one); under
    # Slurm they run in the sbatch job the first one submitted, whose hosts stay up between attempts.
    warm = contextlib.ExitStack()
    try:
        warm.enter_context(warm_attempts(prof))
        # The preflight job starts first: while torchrun and its ranks start up, the orchestrator opens the
        # MLflow run and shards, and is done before the probes measure.
        preflight = preflight_cluster.submit(prof) if prof.preflight.enabled else None
        with tracked_run(prof.tracking, name, tags, run_params(prof), texts, artifact_root(prof)) as run:
            link_mlflow_run(run)
            marks.close("orchestration")
            dataset = shard_corpus(
                prof.data, prof.store, sys.stderr.isatty(), prof.model.block_size, prof.model.vocab_size
            )
            run.log_metrics(dataset_metrics(dataset), step=0)
            marks.close("shard")
            if preflight is not None:
                prof = apply_preflight_policy(preflight.result(), prof, name, run.id)
                marks.close("preflight")  # the wait for its result: it ran beside the sharding
            # No delay from Prefect: the task waits itself, and only when what ended the last attempt calls for it.
            retrying = train_model.with_options(retries=prof.train.max_retries)
            # Imported on a thread while the training job starts, when torchrun's agent leaves a core idle.
            threading.Thread(target=import_for_the_end, daemon=True).start()
            marks.close("orchestration")
            trained = retrying(prof, name, dataset.uri, run.id)
            if isinstance(trained, State):  # the train task ended Cancelled: the MLflow run ends KILLED
                raise RunCancelled(trained.message or f"run {name} was cancelled")
            warm.close()
            marks.close("train")
            from trainpipe.tasks.validate import validate_checkpoint  # waits for that import if it is still running

            marks.close("orchestration")
            validated = validate_checkpoint(trained.result.checkpoint_uri, prof)
            marks.close("validate")
            published, unpublished = publish_validated(prof, name, run.id, validated)
            marks.close("publish")
            summary = report_run(
                prof, name, run.id, dataset.dataset_id, trained, validated, marks, published, unpublished
            )
            if unpublished is not None:  # training's result stands; the run says what did not happen
                raise PublishError(
                    f"training succeeded (checkpoint {validated['uri']} validated, val loss "
                    f"{validated['val_loss']:.4f}) and publishing did not: {unpublished}; the same --run-name "
                    "publishes it without training again"
                )
            return summary
    except RunCancelled as exc:
        return Cancelled(message=str(exc))
    finally:
        warm.close()
