"""The trainpipe engine: plain Python + torch + fsspec (+ mlflow); never imports prefect.

Grouped by where the code runs:

- inside the ranks, under torchrun: ``loop`` (``python -m trainpipe.trainer``), ``checkpoint.checkpointer``,
  ``preflight`` probes (``python -m trainpipe.trainer.preflight``), ``drills``;
- beside torchrun on each host: ``supervise`` (launch, beacons, watchdog, teardown, attempt outcome);
- in the orchestrator (called by the Prefect tasks): ``orchestrate`` (policy, run records, summary),
  ``data.shard``, ``checkpoint.validate``;
- shared by all: ``config``, ``errors``, ``incidents``, ``layout``, ``store``, ``protocol``, ``device``,
  ``proc``, ``model``, ``evaluation``, ``tracking``, ``data.tokens``, ``checkpoint.catalog``.
"""
