"""In the orchestrator: what the Prefect tasks decide and record, as plain functions (no prefect import).

``policy``: one pure function per decision (after an attempt, after preflight) ·
``records``: a run's incidents, attempts and excluded nodes in the store ·
``summary``: recovery figures, goodput and the run summary (pure) ·
``badput``: where the run's wall time went, bucket by bucket (pure) ·
``resolve``: a run request checked into a profile and a run name, once · ``run_form``: what a deployment's
run form may set, and its checks · ``resume_pins``: the keys a resume must keep ·
``lease``: one orchestrator per run · ``reaper``: ends what a killed process started ·
``termination``: a SIGTERM remembered even when its exception was lost ·
``servers``: the local Prefect, MLflow and S3 servers of ``trainpipe up`` · ``mlflow_app``: the MLflow server
app they run (basic auth, opening in Model training) · ``compare``: runs side by side ·
``publish``: a validated checkpoint exported, gated, logged and registered · ``registry``: MLflow's Model
Registry as publish uses it (lineage tags, aliases).
"""
