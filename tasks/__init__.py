"""The Prefect tasks (installed as ``trainpipe.tasks``): thin adapters from the flow to trainer code.

``shard`` (plan_shards, tokenize_piece, assemble_dataset) · ``preflight`` (preflight_cluster,
apply_preflight_policy) · ``train`` (train_model, retried) · ``validate`` (validate_checkpoint) · ``publish``
(publish_model, retried when the registry did not answer) · ``report`` (report_run) · ``events`` (trainpipe's
Prefect events: incidents, attempt outcomes) · ``common`` (retry conditions, labels, cancellation, left-over
jobs). They import the launcher contract, never the supervisor (docs/architecture.md §1).
"""
