"""The trainpipe engine: plain Python + torch + fsspec (+ mlflow); never imports prefect.

Grouped by where the code runs:

- inside the ranks, under torchrun: ``loop`` (``python -m trainpipe.trainer``), ``checkpoint.checkpointer``,
  ``preflight`` probes (``python -m trainpipe.trainer.preflight``), ``drills``;
- beside torchrun on each host: ``supervise`` (launch, beacons, watchdog, teardown, attempt outcome);
- in the orchestrator (called by the Prefect tasks): ``orchestrate`` (policy, run records, summary),
  ``data.shard``, ``checkpoint.validate``, ``export`` (a checkpoint as a Hugging Face folder);
- shared by all: ``launcher`` (the launcher contract), ``config`` (the profile's schema), ``profile_files``
  (profiles read from files and written back), ``parallel_dims`` (the ranks' layout), ``grammar`` (what a value may
  be where it goes), ``errors``, ``incidents``, ``store_paths`` (every store path), ``store``, ``store_retry`` (the
  object store's backoff), ``protocol`` (supervisor ↔ ranks, ``TrainResult``), ``device``, ``proc``, ``model``,
  ``factory`` (``model.factory``), ``hf`` (the transformers causal LM factory), ``evaluation``, ``tracking``,
  ``redact`` (credentials out of what is shown), ``loss_health`` (loss spikes and flatlines, judged by the ranks or
  the watchdog), ``private`` (folders only their owner may enter), ``data.tokens``, ``checkpoint.catalog``.

Installed as ``trainpipe.trainer`` (docs/architecture.md §1).
"""
