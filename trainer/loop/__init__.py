"""Inside the ranks: the training loop that ``python -m trainpipe.trainer`` runs under torchrun.

Imports nothing from ``trainer.supervise`` or ``trainer.orchestrate`` and never
prefect: the same command runs under plain torchrun, Slurm or Kubernetes.
"""
