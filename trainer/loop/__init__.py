"""Inside the ranks: the training loop that ``python -m trainpipe.trainer`` runs under torchrun.

Imports nothing from ``trainer.supervise`` or ``trainer.orchestrate`` and never
prefect: the same command runs under plain torchrun, Slurm or Kubernetes.

``main`` (the rank program) · ``trainer`` (the loop: resume, steps, evaluation, checkpoints) ·
``checkpoint_schedule`` (which steps save: every N, or Young/Daly from measured costs) · ``parallel`` (DDP,
FSDP2, and tensor parallelism by the model's plan) · ``mesh`` (the ranks' one DeviceMesh of pp × dp_replicate
× dp_shard × tp) · ``pipeline`` (a pipeline stage under its schedule) · ``optim`` (AdamW and the schedule) ·
``rng`` (every generator, saved and restored) · ``callbacks`` (what the loop announces, and who listens) ·
``beacon`` (progress to the supervisor) · ``metrics`` (rank 0's metrics file) · ``trace`` (step times, sample
traces) · ``flight`` (the flight recorder on request) · ``step_clock`` (a step's time: data, compute,
collectives) · ``replicas`` (DDP replicas compare their weights' bits) · ``links`` (the host ring's links,
timed before the first step after a network incident) · ``virtual_ranks`` (the same bits at any world size) ·
``proving`` (each checkpoint's proof, and the check of the resumed one) · ``flash_resume`` (a resume from
flash snapshots: the steps every rank can load, a lost host's fetched from its peers, each read checked) ·
``state_dicts`` (get_state_dict's result for plain tensors, without its walk of the module tree on each call).
"""
