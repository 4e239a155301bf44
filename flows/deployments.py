"""The pipeline's deployments: ``on-demand`` (run from the UI or API) and ``nightly`` (a cron schedule).

``trainpipe serve`` serves both from one long-running process, the way
``flow.serve`` does; ``prefect.yaml`` declares the same two for a process work
pool (``prefect deploy --all``).

Concurrency: one training run at a time per machine. Each deployment has a
concurrency limit of one, and the serving process runs one flow run at a time.
A second on-demand run waits its turn (``ENQUEUE``: it shows as "Awaiting
Concurrency Slot" until the first ends); a nightly run that finds one still
going is cancelled (``CANCEL_NEW``), so schedules never pile up behind a long run.
"""

from __future__ import annotations

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron
from prefect.utilities.urls import url_for

from trainpipe.flows.parameters import PipelineParameters, form_schema, form_values
from trainpipe.flows.pipeline import training_pipeline
from trainpipe.trainer.config import Profile
from trainpipe.trainer.orchestrate.servers import tracking_uri_for

ON_DEMAND = "on-demand"
NIGHTLY = "nightly"


def pipeline_deployments(profile: Profile, profile_name: str) -> list[RunnerDeployment]:
    """Both deployments of the pipeline flow for ``profile`` (its ``deploy`` section gives the schedule); their run
    form is prefilled with the profile's own values (``form_schema``)."""
    values = form_values(profile)
    params = PipelineParameters(profile=profile_name, **values).model_dump(mode="json")
    defaults = {"params": {**params, "run_name": "", "resume": ""}}
    tags = [f"profile:{profile.name}", f"world-size:{profile.cluster.world_size}"]
    on_demand = training_pipeline.to_deployment(
        ON_DEMAND,
        parameters=defaults,
        tags=tags,
        description="Train on demand: pick the profile and settings in the run form.",
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        enforce_parameter_schema=True,
    )
    nightly = training_pipeline.to_deployment(
        NIGHTLY,
        parameters=defaults,
        tags=[*tags, "schedule:nightly"],
        description=f"Train {profile.name} on a schedule ({profile.deploy.nightly_cron} {profile.deploy.timezone}).",
        schedule=Cron(profile.deploy.nightly_cron, timezone=profile.deploy.timezone),
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
        enforce_parameter_schema=True,
    )
    for d in (on_demand, nightly):
        d._parameter_openapi_schema.definitions = form_schema(
            {"definitions": d._parameter_openapi_schema.definitions}, values
        )["definitions"]
        d._parameter_openapi_schema.properties["params"]["default"] = defaults["params"]
    return [on_demand, nightly]


def serve_pipeline(profile: Profile, profile_name: str) -> None:
    """Serve both deployments until interrupted, one flow run at a time.

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
    runner = Runner(pause_on_shutdown=True, limit=1)
    for deployment in pipeline_deployments(profile, profile_name):
        deployment_id = runner.add_deployment(deployment)
        runner._deployment_registry.register_flow(deployment_id, training_pipeline)  # Prefect's add_flow does this
        page = url_for("deployment", obj_id=deployment_id)  # None where no UI is known
        print(f"serving trainpipe/{deployment.name}" + (f": {page}" if page else ""), flush=True)
    tracking = tracking_uri_for(profile)
    if tracking.startswith(("http://", "https://")):
        print(f"its runs in MLflow: {tracking}", flush=True)
    with contextlib.suppress(KeyboardInterrupt, TerminationSignal):  # Ctrl-C or SIGTERM: the runner has stopped
        asyncio.run(runner.start())
