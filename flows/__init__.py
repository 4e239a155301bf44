"""The Prefect flows and the CLI (installed as ``trainpipe.flows``): orchestration only.

``pipeline`` (training_pipeline: shard, preflight, train, validate, report) · ``parameters`` (its one
parameter model, the run form) · ``shard`` (the shard stage: pieces mapped over the engine's task runner) ·
``stages`` (one-stage flows) · ``deployments`` (on-demand and nightly) · ``automations`` (notifications,
a silent run marked Crashed) ·
``warm_start`` (served runs forked from a warm process) · ``cli`` (the ``trainpipe`` command).
"""
