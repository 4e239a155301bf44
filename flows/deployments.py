"""The pipeline's deployments: ``on-demand`` (run from the UI or API) and ``nightly`` (a cron schedule).

``trainpipe serve`` serves both from one long-running process, the way
``flow.serve`` does; ``trainpipe deploy --pool NAME`` creates two of their own
for a process work pool's workers (``deploy_to_pool``: what ``prefect deploy``
does, with the served run form), ``on-demand-worker`` and ``nightly-worker``:
other names, so that neither path takes the other's deployments over. Prefect
pauses a served deployment when its process stops (its schedule with it) and
resumes it when ``serve`` starts again; ``serve`` says so as it stops.

Concurrency: one training run at a time per pair. The on-demand and nightly
deployments of a pair share one concurrency slot (``share_one_slot``), which the
server enforces: a second on-demand run waits its turn (``ENQUEUE``: it shows as
"AwaitingConcurrencySlot" until the first ends, never "Late"); a nightly run that
finds one still going is cancelled (``CANCEL_NEW``), so schedules never pile up
behind a long run. The serving process sets no limit of its own: a run it held
back would sit Scheduled and turn Late, saying nothing of why it waits.
"""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

from prefect import Flow
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron
from prefect.utilities.urls import url_for

from trainpipe.flows.automations import HEARTBEATS
from trainpipe.flows.parameters import PipelineParameters, form_schema, form_values
from trainpipe.flows.pipeline import training_pipeline
from trainpipe.tasks.common import answered
from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.orchestrate.servers import tracking_uri_for
from trainpipe.trainer.redact import redact_text

ON_DEMAND = "on-demand"
NIGHTLY = "nightly"
WORKER_SUFFIX = "-worker"  # a work pool's deployments: names of their own, never the served ones'


def pipeline_deployments(
    profile: Profile, profile_name: str, flow: Flow = training_pipeline, suffix: str = ""
) -> list[RunnerDeployment]:
    """Both deployments of the pipeline ``flow`` for ``profile`` (its ``deploy`` section gives the schedule),
    named ``on-demand`` and ``nightly`` with ``suffix``; their run form is prefilled with the profile's own values
    (``form_schema``)."""
    values = form_values(profile)
    params = PipelineParameters(profile=profile_name, **values).model_dump(mode="json")
    defaults = {"params": {**params, "run_name": "", "resume": ""}}
    tags, deploy = [f"profile:{profile.name}", f"world-size:{profile.cluster.world_size}"], profile.deploy
    on_demand = answered(
        flow.to_deployment(
            ON_DEMAND + suffix,
            parameters=defaults,
            tags=tags,
            description="Train on demand: pick the profile and settings in the run form.",
            concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
            enforce_parameter_schema=True,
        )
    )
    nightly = answered(
        flow.to_deployment(
            NIGHTLY + suffix,
            parameters=defaults,
            tags=[*tags, "schedule:nightly"],
            description=f"Train {profile.name} on a schedule ({deploy.nightly_cron} {deploy.timezone}).",
            schedule=Cron(deploy.nightly_cron, timezone=deploy.timezone),
            concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
            enforce_parameter_schema=True,
        )
    )
    for d in (on_demand, nightly):
        d._parameter_openapi_schema.definitions = form_schema(
            {"definitions": d._parameter_openapi_schema.definitions}, values
        )["definitions"]
        d._parameter_openapi_schema.properties["params"]["default"] = defaults["params"]
    return [on_demand, nightly]


def deploy_to_pool(profile: Profile, profile_name: str, pool: str) -> list[str]:
    """The two deployments a worker of the process work pool ``pool`` runs, ``on-demand-worker`` and
    ``nightly-worker``, with the served ones' run form (schema, prefilled values, bounds) and limits; created or
    updated. The flow is loaded from this checkout (``from_source``), where the worker runs it: a worker's
    machine needs the repository at the same path. Returns their names."""
    root = Path(__file__).resolve().parent.parent
    flow = answered(training_pipeline.from_source(str(root), "flows/pipeline.py:training_pipeline"))
    deployments = pipeline_deployments(profile, profile_name, flow, WORKER_SUFFIX)
    for deployment in deployments:  # heartbeats, as under serve: a dead run is marked Crashed (flows/automations.py)
        deployment.job_variables = {"env": dict(HEARTBEATS)}
    share_one_slot([answered(deployment.apply(work_pool_name=pool)) for deployment in deployments])
    return [d.name for d in deployments]


def share_one_slot(deployment_ids: list[UUID]) -> None:
    """The deployments after the first use the first one's concurrency limit (the server keeps a limit per
    deployment, ``deployment:ID``), so that a pair trains one run at a time; a deployment's own limit of that name,
    left unused, is deleted (never one an operator pointed it at). Idempotent: a deployment already sharing keeps
    it (the server leaves a limit of the same size alone when ``serve`` or ``deploy`` apply the deployment again).
    """
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        first = client.read_deployment(deployment_ids[0]).global_concurrency_limit
        if first is None:  # applied with concurrency_limit=1 a moment ago: someone cleared it meanwhile
            raise TrainpipeError("the on-demand deployment has no concurrency limit; run the command again")
        for deployment_id in deployment_ids[1:]:
            own = client.read_deployment(deployment_id).global_concurrency_limit
            if own is None or own.id == first.id:
                continue
            # Prefect's client has no field for it; the API's deployment update does (global_concurrency_limit_id)
            client.request("PATCH", "/deployments/{id}", path_params={"id": deployment_id},
                           json={"global_concurrency_limit_id": str(first.id)})  # fmt: skip
            if own.name == f"deployment:{deployment_id}":  # the one the server made for it, no one else's
                client.delete_global_concurrency_limit_by_name(own.name)


def mlflow_line(tracking_uri: str) -> str | None:
    """Where a served run's MLflow run is, for a person: a tracking server's URL, never its credentials (a URI may
    carry them as user-info); None for a store without a UI."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"its runs in MLflow: {redact_text(tracking_uri)}"


def serve_pipeline(profile: Profile, profile_name: str) -> None:
    """Serve both deployments until interrupted; their shared slot lets one flow run train at a time.

    What Prefect's ``serve(*deployments)`` does, plus one registration: the runner is told the flow object of each
    deployment (as ``flow.serve`` tells it), so it starts a run from that object rather than through
    ``python -m prefect.engine``, which imports Prefect and loads the flow from its entrypoint again for every
    run. ``flows/warm_start.py`` then forks each run from a process that has those imports done."""
    import asyncio
    import contextlib

    from prefect.exceptions import TerminationSignal
    from prefect.runner import Runner

    from trainpipe.flows.warm_start import install_warm_starter

    install_warm_starter()
    runner = Runner(pause_on_shutdown=True, limit=None)  # the shared slot holds runs back, saying so (above)
    ids = []
    for deployment in pipeline_deployments(profile, profile_name):
        ids.append(deployment_id := answered(runner.add_deployment(deployment)))
        runner._deployment_registry.register_flow(deployment_id, training_pipeline)  # Prefect's add_flow does this
        page = url_for("deployment", obj_id=deployment_id)  # None where no UI is known
        print(f"serving trainpipe/{deployment.name}" + (f": {page}" if page else ""), flush=True)
    share_one_slot(ids)
    if line := mlflow_line(tracking_uri_for(profile)):
        print(line, flush=True)
    with contextlib.suppress(KeyboardInterrupt, TerminationSignal):  # Ctrl-C or SIGTERM: the runner has stopped
        asyncio.run(runner.start())
    served = " and ".join(f"trainpipe/{d}" for d in (ON_DEMAND, NIGHTLY))
    print(f"stopped serving: Prefect paused {served}, so the nightly runs no more until `trainpipe serve` runs "
          "again (a work pool's on-demand-worker and nightly-worker go on)", flush=True)  # fmt: skip
