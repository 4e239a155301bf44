"""Beside torchrun on each host: launch one attempt, receive its beacons, watch it, tear it down, say how it ended.

``launch`` builds the torchrun command (through ``agent``, torchrun reporting its
failures as JSON), ``job`` owns the process group, ``beacons`` receives the
ranks' progress, ``watchdog`` judges it through ``checks`` (one file per fault check; ``time_split``: data
stalls and slow collectives; ``gpu_use``: each host's GPUs sampled, and idle ones named; ``rank_states``: a
rank's process alive, idle, stopped or dead), ``attempt`` ties them together into an
``AttemptOutcome`` whose incident comes from structured sources only (``host_health``: after a fault, this
host's GPUs read through NVML, so a broken one is named). ``host`` is
one host's part of a multi-host job (``python -m trainpipe.trainer.supervise.host``), ``allocation`` a host's
part that stands for its Slurm job's life and runs each attempt asked of it,
``metric_relay`` sends rank 0's metrics to MLflow while the job runs. ``warm_host`` keeps torch imported
across a run's attempts in one process that forks each attempt's agent. ``isolation`` gives a single-host job's
agent and ranks a network namespace of their own.
"""
