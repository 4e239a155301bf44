"""One training attempt on one rank: set up, resume, train, evaluate, save.

``Trainer.train`` is the whole loop; ``train_step`` is one optimizer step.
Everything that watches the loop (beacons, metrics, the step log, traces, fault
drills) is a callback, so neither method mentions them. Plain torch: no prefect
and nothing of the supervisor, so the same code runs under Slurm or Kubernetes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import posixpath
import shutil
import statistics
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from pydantic import Field, TypeAdapter, ValidationError
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainpipe.trainer.checkpoint.catalog import CheckpointInfo, list_checkpoints, read_proof
from trainpipe.trainer.checkpoint.checkpointer import Checkpointer, Committed
from trainpipe.trainer.checkpoint.flash import FlashSnapshots, drop_stale, prune, state_checksums
from trainpipe.trainer.checkpoint.loading import load_checkpoint, load_rank_extra
from trainpipe.trainer.checkpoint.memory_tier import (
    MEMORY_ENV,
    SNAPSHOTS_KEPT,
    MemoryTierUnavailable,
    private_folder,
    restore_order,
    room_free,
    room_needed,
    run_checkpoints,
)
from trainpipe.trainer.checkpoint.peer_copy import PeerRing, gather_snapshot, held_files
from trainpipe.trainer.checkpoint.peer_copy import resumable as resumable_snapshots
from trainpipe.trainer.checkpoint.replicated import load_replicated
from trainpipe.trainer.checkpoint.state_hash import data_position
from trainpipe.trainer.checkpoint.storage import ChecksumMismatch
from trainpipe.trainer.config import GPT_FACTORY, Profile
from trainpipe.trainer.data.format import require_one_block, require_vocab
from trainpipe.trainer.data.sampler import (
    DataSkip,
    data_index,
    micro_batches,
    pending_rollbacks,
    rank_samples,
    skips_after,
)
from trainpipe.trainer.data.tokens import TokenStream
from trainpipe.trainer.device import Distributed, new_group, peak_flops
from trainpipe.trainer.errors import CheckpointError, ProfileError, TrainpipeError
from trainpipe.trainer.evaluation import eval_windows, mean_loss
from trainpipe.trainer.factory import build_model, model_loss
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.loop.callbacks import Callback, Callbacks, StepMetrics
from trainpipe.trainer.loop.checkpoint_schedule import PROBE_STEPS, CheckpointSchedule
from trainpipe.trainer.loop.flash_resume import FlashResume, open_flash
from trainpipe.trainer.loop.mesh import Mesh
from trainpipe.trainer.loop.optim import build_optimizer, build_scheduler, set_kernels
from trainpipe.trainer.loop.parallel import (
    backward_done,
    clip_grad_norm,
    full_weights,
    gradient_sync,
    load_full_weights,
    parallelize,
    parallelize_mesh,
)
from trainpipe.trainer.loop.proving import ProofMismatch, Proving
from trainpipe.trainer.loop.replicas import Replay, ReplicaCheck
from trainpipe.trainer.loop.rng import rng_state, seed_everything, set_rng_state
from trainpipe.trainer.loop.state_dicts import PlainStateDicts
from trainpipe.trainer.loop.step_clock import StepClock
from trainpipe.trainer.loop.trace import Timeline
from trainpipe.trainer.loop.virtual_ranks import (
    ShardGrads,
    Subtree,
    VirtualRanks,
    clip_by_rows,
    flat_grads,
    set_grads,
)
from trainpipe.trainer.loss_health import EvalTrend, checked_by_ranks
from trainpipe.trainer.model import flops_per_token, model_digest
from trainpipe.trainer.parallel_dims import Layout
from trainpipe.trainer.proc import node_name
from trainpipe.trainer.protocol import SkippedCheckpoint, TrainResult
from trainpipe.trainer.store import filesystem, write_json
from trainpipe.trainer.store_paths import CHECKPOINT_MANIFEST, RunPaths

if TYPE_CHECKING:
    from trainpipe.trainer.loop.pipeline import Pipeline

log = logging.getLogger("trainpipe.trainer")
REPLAY_WAIT_S = 5.0  # how long a commit waits for the next step's loss (its replay record) before going ahead


class NonFiniteLoss(TrainpipeError):
    """The loss went NaN or inf; the attempt stops and the retry resumes from the last commit."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"loss is {loss} at step {step}")
        self.step, self.loss = step, loss


class UnhealthyLoss(TrainpipeError):
    """A loss spike or flatline whose policy ends the attempt (trainer.loss_health)."""

    def __init__(self, incident: Incident):
        super().__init__(incident.detail)
        self.incident = incident


class Trainer:
    def __init__(self, profile: Profile, d: Distributed, run: RunPaths, dataset_uri: str, callbacks: list[Callback]):
        t, so = profile.train, profile.store.storage_options
        self.profile, self.d, self.run, self.dataset_uri = profile, d, run, dataset_uri
        self.timeline, self.clock = Timeline(), StepClock()
        self.callbacks = Callbacks([self.timeline, self.clock, *callbacks])
        self.step, self.tokens_seen, self.val_loss = 0, 0, float("nan")  # step: the last one completed
        self.at_step: int | None = None  # the step being run (or evaluated, or saved after it)
        seed_everything(t.seed)  # the same init on every rank; DDP also broadcasts rank 0's weights
        self.model = build_model(profile.model).to(d.device)
        self.callbacks.on_setup(self.model)
        m = profile.model
        self.flops_per_token = flops_per_token(self.model, m.n_layer, m.n_embd, m.block_size)  # the whole model's
        self.peak_flops = peak_flops(profile.cluster, d.device)
        self.mfu: list[float] = []
        self.sharded = t.strategy == "fsdp"
        # The ranks' layout (parallel): one DeviceMesh when it has several dimensions (trainer.loop.mesh).
        self.layout = profile.layout
        self.mesh = Mesh(self.layout, d.rank, d.device.type)
        # Virtual ranks: the gradients summed in one fixed tree over fixed shards of the batch, whatever the world
        # size (trainer.loop.virtual_ranks).
        self.virtual = VirtualRanks(t.virtual_ranks, d.rank, d.world_size, t.seed) if t.virtual_ranks else None
        self.pipeline: Pipeline | None = None
        self.sharded_loss = False  # the logits leave sharded over the vocabulary: the loss under loss_parallel
        if self.layout.meshed:  # split by the model's own plan and stages, then FSDP2 over the data ranks
            self.ddp = self.split_model()
        else:  # DDP: a wrapper around self.model; FSDP2: self.model itself, its parameters now shards (DTensors)
            self.ddp = parallelize(
                self.model, t.strategy, d, self.callbacks, step=lambda: self.at_step or 0, virtual=self.virtual
            )
        # CPU tensors (the optimizer's step counts) cannot go over NCCL: a gloo group for them on GPUs.
        self._cpu_group = new_group(backend="gloo") if d.device.type == "cuda" else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # FSDP2's: their shards
        self.optimizer = build_optimizer(self.model, t, _meshes(self.params))
        self.scheduler = build_scheduler(self.optimizer, t)
        self.train_data, self.val_data = TokenStream(dataset_uri, "train", so), TokenStream(dataset_uri, "val", so)
        self.block = profile.model.block_size
        require_one_block(self.train_data.manifest, self.block)  # a rank's own error: not retried
        require_vocab(self.train_data.manifest, profile.model.vocab_size)
        if self.pipeline and self.val_data.windows(self.block) < t.global_batch:  # one whole schedule to evaluate
            raise ProfileError(
                f"the validation split holds {self.val_data.windows(self.block)} samples, fewer than one pipeline "
                f"pass of train.global_batch={t.global_batch}: raise data.val_fraction or lower train.global_batch"
            )
        self.skipped: list[CheckpointInfo] = []
        self.found: list[CheckpointInfo] = []  # the run's checkpoints when the attempt began, as rank 0 read them
        self.checkpointer: Checkpointer | None = None
        # The memory tier (trainer.checkpoint.memory_tier): this run's snapshots in host memory, and a checkpointer
        # of its own writing them; None where it is off or unusable (said once).
        self.memory_dir = self._memory_dir()
        # Across hosts, each host's snapshot files are copied to the next host (trainer.checkpoint.peer_copy).
        self.ring = PeerRing.of_job(d.rank, d.world_size) if self.memory_dir else None
        # Plain tensors: snapshots copied into slots, and across hosts to a peer host (§4, trainer.loop.flash_resume).
        sharded = any(isinstance(p, DTensor) for p in self.params) or self.pipeline is not None
        self.flash = open_flash(profile, d, self.memory_dir, self.ring, sharded)
        self.plain_state = None if sharded else PlainStateDicts()
        self.flash_resume = FlashResume(self.flash, self.ring, d, self._cpu_group) if self.flash else None
        self._memory_held: list[dict[int, set[str]] | None] = []  # per rank: what its host held (leaders only)
        self._gathered_step: int | None = None  # the snapshot whose files some host gathered from a peer's copy
        self.memory_found: list[CheckpointInfo] = []  # the tier's snapshots when the attempt began (rank 0's)
        self.memory_tier: Checkpointer | FlashSnapshots | None = None
        self.memory_schedule: CheckpointSchedule | None = None
        self.skips: list[DataSkip] = []  # data windows skipped by rollbacks from loss spikes, oldest first
        replicated = t.strategy == "ddp" and d.world_size > 1 and profile.watchdog.sdc_every is not None  # §9
        self.replicas = ReplicaCheck(self.model) if replicated else None  # only DDP has replicas to compare
        self.replica_digest: str | None = None
        self.health = checked_by_ranks(profile.watchdog)
        self.eval_trend = EvalTrend(profile.watchdog)
        self.replay: Replay | None = None  # the resumed checkpoint's record of the step after it
        self.losses: dict[int, float] = {}  # the last steps' losses, for the manifests' replay records
        self.restore_s = 0.0  # finding and loading the checkpoint this attempt resumed from
        self.schedule: CheckpointSchedule | None = None  # which steps save (trainer.loop.checkpoint_schedule)
        self._stepped = threading.Condition()  # a step ended (or the loop did): a commit may be waiting for it
        self._ended = False
        # Each checkpoint's proof of itself and the check of the resumed one (trainer.loop.proving).
        cuda_index = d.device.index if d.device.type == "cuda" else None
        self.proving = Proving(
            d.rank, d.world_size, cuda_index, self._cpu_group, self.mesh.stage_rank, self.mesh.replicas
        )
        self.proving.copies = self.pipeline.whole_names if self.pipeline else frozenset()
        self.proving.per_parameter = self.layout.pp > 1  # what this attempt's saves hash

    def split_model(self) -> torch.nn.Module:
        """This rank's part of the model under a layout of several dimensions: its pipeline stage (the model's
        ``pipeline_stage``), split over the tp ranks by the model's plan, under FSDP2 over the data ranks
        (trainer.loop.mesh, pipeline; docs/architecture.md §10)."""
        layout, p, mesh = self.layout, self.profile.parallel, self.mesh
        plug_in: Any = self.model  # its split methods are the factory protocol's (trainer/factory.py), not Module's
        try:
            split = plug_in.pipeline_stage(mesh.stage, layout.pp) if layout.pp > 1 else None
            plan = plug_in.tensor_parallel_plan(layout.tp, p.loss_parallel) if layout.tp > 1 else None
        except (AttributeError, ValueError) as exc:  # checked before the job, unless the plug-in changed since
            raise ProfileError(f"model.factory {self.profile.model.factory}: {exc}".splitlines()[0]) from None
        self.sharded_loss = bool(plan and plan.loss_parallel)
        model = parallelize_mesh(self.model, mesh, plan, self.callbacks, step=lambda: self.at_step or 0)
        if split is not None:
            # Imported here alone: torch.distributed.pipelining pulls in torch._dynamo, 0.6 s of CPU at every
            # rank's start that a run without pipeline stages never uses (docs/architecture.md §10).
            from trainpipe.trainer.loop.pipeline import Pipeline

            self.pipeline = Pipeline(
                model, mesh, self.d.device, p.pp_schedule, self.profile.grad_accum, self.sharded_loss, split.tied
            )
        return model

    def train(self) -> TrainResult:
        """Resume, run the steps left, evaluate and checkpoint on schedule; return the attempt's result."""
        t, c = self.profile.train, self.profile.checkpoint
        began = time.perf_counter()
        resumed = self.resume()
        self.restore_s = time.perf_counter() - began
        self.checkpointer = self.build_checkpointer(resumed)
        self.schedule = CheckpointSchedule(c.every_steps, c.mtbf_hours * 3600, self.step, self._agree_max)
        self.memory_tier = self.build_memory_tier()
        if self.memory_tier is not None:
            self.memory_schedule = CheckpointSchedule(
                c.memory_every_steps, c.mtbf_hours * 3600, self.step, self._agree_max
            )
        self.callbacks.on_train_start(self.step, t.steps)
        for step in range(self.step + 1, t.steps + 1):
            metrics = self.train_step(step)
            self.callbacks.on_step_end(metrics)
            self.check_step(metrics)
            evaluated = step == t.steps or bool(t.eval_every and step % t.eval_every == 0)
            if evaluated:
                self.val_loss = self.evaluate(step)
            if step == t.steps or self.schedule.due(step):
                self.save(step, final=step == t.steps)  # the final checkpoint is synchronous
            elif self.memory_schedule is not None and self.memory_schedule.due(step):
                self.save(step, final=False, to_memory=True)
            times = self.timeline.step_times_s()
            self.schedule.observe(step, times, self.checkpointer.stalls_s, durations_s=self.checkpointer.saves_s)
            if self.memory_schedule is not None and self.memory_tier is not None:
                # On a CPU the snapshot's writing and hashing take their cores from training: its whole time
                # (a flash snapshot's CPU time) is what it costs, not only the copy the loop waits for.
                tier = self.memory_tier
                cpu_cost = tier.costs_s if isinstance(tier, FlashSnapshots) else tier.saves_s
                costs = cpu_cost if self.d.device.type == "cpu" else tier.taken_stalls_s
                self.memory_schedule.observe(step, times, tier.stalls_s, costs, durations_s=tier.saves_s)
            if evaluated:  # after the save: a flatline under stop keeps this step's work
                self.check_eval(step, self.val_loss)
        self.end()
        self.checkpointer.wait()
        if self.memory_tier is not None:
            self.memory_tier.wait()
        return self.result(resumed)

    def _agree_max(self, values: list[float]) -> list[float]:
        """Every rank's maximum of each value (the checkpoint schedule's figures: all ranks save at one step)."""
        agreed = torch.tensor(values, dtype=torch.float64)
        if self.d.world_size > 1:  # on CPU: gloo's default group, or the gloo group beside NCCL
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._cpu_group)
        return agreed.tolist()

    def check_eval(self, step: int, loss: float) -> None:
        """The eval loss's trend (trainer.loss_health.EvalTrend): a flatline under stop ends the attempt on every
        rank; under warn rank 0 reports it."""
        if found := self.eval_trend.observe(step, loss, node_name()):
            if found.fatal:
                raise UnhealthyLoss(found)
            if self.d.rank == 0:
                self.callbacks.on_incident(found)

    def check_step(self, m: StepMetrics) -> None:
        """The quiet faults the ranks check themselves after each step (docs/architecture.md §9). Every rank
        sees the same loss and compares the same fingerprints, so every rank raises alike."""
        with self._stepped:
            interval = (self.schedule.every_steps if self.schedule else None) or PROBE_STEPS  # auto: not decided yet
            keep = m.step - 4 * interval
            self.losses = {s: v for s, v in self.losses.items() if s > keep}
            self.losses[m.step] = m.loss
            self._stepped.notify_all()
        if self.replay is not None:
            self.replay.check(m.step, m.loss)
        if self.health and (found := self.health.observe(m.step, m.loss, m.grad_norm, node_name())):
            raise UnhealthyLoss(found)
        sdc_every = self.profile.watchdog.sdc_every
        if self.replicas and sdc_every and m.step % sdc_every == 0:
            self.replicas.check(m.step)

    def replay_context(self) -> dict[str, Any]:
        """What a step's loss bits depend on besides the state: a resume under other settings is not replayed."""
        t = self.profile.train
        return {  # with virtual ranks the bits are the same at any world size that divides them
            "world_size": None if t.virtual_ranks else self.d.world_size,
            **({"layout": self.layout_record()} if self.layout.meshed else {}),
            "virtual_ranks": t.virtual_ranks,
            "micro_batch": t.micro_batch,
            "precision": t.precision,
            "strategy": t.strategy,
            "deterministic": t.deterministic,
            "device": torch.cuda.get_device_name(self.d.device) if self.d.device.type == "cuda" else "cpu",
            "threads": self.profile.cluster.threads_per_proc,
            "torch": torch.__version__,
        }

    def _replay_record(self, step: int) -> dict[str, Any] | None:
        """On the commit's thread: the loss of the step after ``step``, waiting for it a moment (the commit then
        lands one step later), so that a resume from this checkpoint can replay it."""
        with self._stepped:
            self._stepped.wait_for(lambda: step + 1 in self.losses or self._ended, timeout=REPLAY_WAIT_S)
            loss = self.losses.get(step + 1)
        return None if loss is None else {"step": step + 1, "loss": loss, "context": self.replay_context()}

    def end(self) -> None:
        """No step follows (the loop ended or failed): a commit waiting for one goes ahead without it."""
        with self._stepped:
            self._ended = True
            self._stepped.notify_all()

    def train_step(self, step: int) -> StepMetrics:
        """Optimizer step ``step`` (1-based) over train.global_batch samples, split over ranks and micro-batches."""
        t, d = self.profile.train, self.d
        t0, self.at_step, read_before = time.perf_counter(), step, self.train_data.times
        self.callbacks.on_step_start(step)
        position = data_index(step, self.skips)
        n_samples = self.train_data.windows(self.block)
        dp_rank, dp = self.mesh.dp_rank, self.layout.dp  # only data-parallel ranks take different samples
        ids = rank_samples(position, t.global_batch, t.seed, n_samples, dp_rank, dp)
        if self.mesh.reads_for_replica:  # one rank of a replica's tp and pp ranks accounts for its samples
            self.proving.account(position * t.global_batch + dp_rank * len(ids), ids, n_samples)
        self.callbacks.on_phase(step, "forward")
        if self.virtual:
            loss = self.virtual_backward(step, ids)
        else:
            loss = self.pipeline_backward(step, ids) if self.pipeline else self.backward(step, ids)
        self.callbacks.on_phase(step, "optimizer")
        if self.virtual and self.sharded:  # a norm over shards whose bits do not follow the world size
            announce = lambda: self.callbacks.on_collective(step, "clip_norm")  # noqa: E731
            grad_norm = clip_by_rows(self.params, t.grad_clip or float("inf"), announce)
        elif self.layout.meshed:  # DTensors of several meshes; a stage's norm summed over the pipeline
            pp_group = self.mesh.pp_group() if self.pipeline else None
            copies = self.pipeline.copies if self.pipeline else set()
            grad_norm = clip_grad_norm(self.params, t.grad_clip or float("inf"), pp_group, copies)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or float("inf"))
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.virtual:  # the step's mean loss came with the gradients' sum
            mean = loss.item()
        else:  # under pp only the last stage's ranks hold a loss (the others add zero)
            self.callbacks.on_collective(step, "loss")
            dist.all_reduce(loss)
            mean = loss.item() / (d.world_size // self.layout.pp)
        if not math.isfinite(mean):
            raise NonFiniteLoss(step, mean)
        tokens = t.global_batch * self.block
        self.step, self.tokens_seen = step, self.tokens_seen + tokens
        step_ms = (time.perf_counter() - t0) * 1000
        tokens_per_s = tokens / (step_ms / 1000)
        mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * d.world_size) if self.peak_flops else None
        if mfu is not None:
            self.mfu.append(mfu)
        data_s, compute_s, comm_s = self.clock.split()
        read = self.train_data.times - read_before  # the shards this step loaded
        return StepMetrics(
            step, mean, lr, float(grad_norm), step_ms, tokens_per_s, ids, mfu, data_s, compute_s, comm_s,
            data_fetch_s=read.fetch_s, data_verify_s=read.verify_s,
        )  # fmt: skip

    def backward(self, step: int, ids: np.ndarray) -> torch.Tensor:
        """This rank's forward and backward over its samples, in micro-batches; the gradients synced over the ranks
        in the last backward. Returns this rank's mean loss."""
        micro = micro_batches(ids, self.profile.train.micro_batch)
        loss = torch.zeros((), device=self.d.device)
        for i, sample_ids in enumerate(micro):
            x, y = self.read_batch(step, sample_ids)
            # gradients sync in the last backward; loss parallelism around the forward and its backward
            with gradient_sync(self.ddp, enabled=i == len(micro) - 1), self.loss_context():
                with self.autocast():
                    micro_loss = model_loss(self.ddp(x, y), self.profile.model.factory)
                (micro_loss / len(micro)).backward()
            loss += micro_loss.detach() / len(micro)
        backward_done(self.ddp, self.callbacks)
        return loss

    def pipeline_backward(self, step: int, ids: np.ndarray) -> torch.Tensor:
        """This replica's samples through the pipeline (trainer.loop.pipeline), its micro-batches as the schedule
        orders them; the gradients reduced over the data ranks at the last backward. Returns the mean loss on the
        last stage's ranks, zero on the others."""
        assert self.pipeline is not None  # called under pipeline stages only
        x, y = self.read_batch(step, ids)
        with self.autocast():
            loss = self.pipeline.step(x, y)
        self.pipeline.sum_tied()
        backward_done(self.ddp, self.callbacks)
        return loss

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Loss parallelism around a forward and its backward when the logits leave sharded over the vocabulary."""
        return loss_parallel() if self.sharded_loss else contextlib.nullcontext()

    def virtual_backward(self, step: int, ids: np.ndarray) -> torch.Tensor:
        """Each of this rank's virtual shards' gradient on its own, summed over all ranks in the fixed tree
        (trainer.loop.virtual_ranks): DDP's here after the backward, FSDP2's by its reduce-scatter at each shard's
        last micro-batch. Returns the step's mean loss, summed alike."""
        t, v = self.profile.train, self.virtual
        assert v is not None  # called with virtual ranks only
        share = t.micro_batch / t.global_batch  # one micro-batch's part of the step's mean
        losses, mine = Subtree(), Subtree()  # this rank's shards' losses, and (DDP) gradients, summed as they come
        one_rank = ShardGrads() if self.sharded and self.d.world_size == 1 else None  # FSDP2 runs no comm then
        for j, (virtual_rank, shard) in enumerate(v.shards(ids)):
            v.begin_shard(j)
            micro = micro_batches(shard, t.micro_batch)
            loss = torch.zeros((), device=self.d.device)
            with v.rng(step, virtual_rank, self.d.device):
                for i, sample_ids in enumerate(micro):
                    x, y = self.read_batch(step, sample_ids)
                    with gradient_sync(self.ddp, enabled=self.sharded and i == len(micro) - 1):
                        with self.autocast():
                            micro_loss = model_loss(self.ddp(x, y), self.profile.model.factory) * share
                        micro_loss.backward()
                    loss += micro_loss.detach()
            losses.push(loss.reshape(1).to(torch.float32))
            if not self.sharded:
                flat, had = flat_grads(self.params)
                mine.push(torch.cat([flat, had.to(flat.dtype)]))
            elif one_rank is not None:
                one_rank.keep(self.params)
            elif not v.last_shard:  # the comm left zeros; the last shard's call writes the sum
                for p in self.params:
                    p.grad = None
        v.begin_shard(0)  # checks the last shard's reduce-scatters against the first's
        self.callbacks.on_gradients_ready()
        if not self.sharded:
            announce = lambda: self.callbacks.on_collective(step, "all_to_all")  # noqa: E731
            n = sum(p.numel() for p in self.params)
            total = v.reduce(torch.cat([mine.result(), losses.result().to(self.params[0].dtype)]), announce)
            set_grads(self.params, total[:n], total[n:-1])
            return total[-1]
        if one_rank is not None:
            one_rank.set_sum(self.params)
        return v.reduce(losses.result(), lambda: self.callbacks.on_collective(step, "loss"))[0]

    def read_batch(self, step: int, sample_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch of step ``step``; the time it took is announced as this rank's wait for data."""
        t0 = time.perf_counter()
        self.callbacks.on_data(step)
        batch = self.train_data.batch(sample_ids, self.block, self.d.device)
        self.callbacks.on_data_wait(step, time.perf_counter() - t0)
        return batch

    def autocast(self) -> torch.autocast:
        """bf16 autocast for the forward pass and the loss when train.precision is bf16 (a no-op otherwise)."""
        bf16 = self.profile.train.precision == "bf16"
        return torch.autocast(self.d.device.type, dtype=torch.bfloat16, enabled=bf16)

    def evaluate(self, step: int) -> float:
        """Validation loss over the same windows at every evaluation, shared among the ranks."""
        t, d = self.profile.train, self.d
        self.callbacks.on_phase(step, "eval")
        dp, per_pass = self.layout.dp, t.micro_batch * (self.profile.grad_accum if self.pipeline else 1)
        # as many windows whatever the layout over this world size (so layouts compare), whole passes under pp
        count = max(t.eval_batches * t.micro_batch * d.world_size, per_pass * dp)
        ids = eval_windows(self.val_data, self.block, count)
        if self.sharded:  # every rank runs as many forwards (each gathers the weights): drop the remainder
            ids = ids[: len(ids) - len(ids) % (dp * (per_pass if self.pipeline else 1))]
        ids = ids[self.mesh.dp_rank :: dp]
        with self.autocast():
            if self.pipeline:  # which enters loss parallelism itself
                loss = self.pipeline_eval(ids, per_pass)
            else:
                with self.loss_context():
                    loss = mean_loss(self.ddp, self.val_data, ids, self.block, t.micro_batch, d.device, all_ranks=True)
        self.callbacks.on_eval(step, loss)
        return loss

    @torch.no_grad()
    def pipeline_eval(self, ids: np.ndarray, per_pass: int) -> float:
        """The mean validation loss of every replica's ``ids`` through the pipeline, forward only, a whole
        schedule's micro-batches at a time (the shapes the stages agreed on)."""
        assert self.pipeline is not None  # called under pipeline stages only
        sums = torch.zeros(2, dtype=torch.float64, device=self.d.device)  # loss × samples, samples (last stage)
        self.ddp.eval()
        for i in range(0, len(ids) - per_pass + 1, per_pass):
            x, y = self.val_data.batch(ids[i : i + per_pass], self.block, self.d.device)
            loss = self.pipeline.step(x, y, train=False)
            if self.mesh.last_stage:
                sums += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64, device=self.d.device)
        self.ddp.train()
        dist.all_reduce(sums)
        return (sums[0] / sums[1]).item()

    def save(self, step: int, final: bool, to_memory: bool = False) -> None:
        """Checkpoint everything needed to continue bit-for-bit (docs/architecture.md §4), to the store or, with
        ``to_memory``, as a snapshot into the memory tier: the same state, manifest and proof, after the same
        comparison of the replicas (a corrupted replica is never saved where a retry would resume it), without
        the whole-model digest (a gather of the weights on the loop's thread: the store's checkpoints keep it)."""
        t, began = self.profile.train, time.perf_counter()
        if not to_memory:
            self.callbacks.on_phase(step, "checkpoint")
        flash = self.memory_tier if to_memory and isinstance(self.memory_tier, FlashSnapshots) else None
        if flash is not None:
            self._flash_replicas(step, flash)
        elif self.replicas:  # a corrupted replica is never committed (docs/architecture.md §9)
            self.replica_digest = self.replicas.check(step, full=True)
        position = data_position(step, self.skips, t.global_batch, t.seed)
        manifest = {
            "step": step,
            "tokens_seen": self.tokens_seen,
            "data_position": position,
            "replica_fingerprint": self.replica_digest if self.replicas else None,
            # The next step's loss, when it ended before the commit: a resume from here replays it.
            # (Not a snapshot's: its commit would wait for the next step, and the one after it would be skipped.)
            "replay": (lambda: self._replay_record(step))
            if self.profile.checkpoint.async_save and not final and not to_memory
            else None,
            # Hashed by the background thread: only copying the weights blocks the loop.
            "model_digest": None if to_memory else _deferred_digest(self.full_weights()),
            "layout": self.layout_record(),
            "optimizer_state": "flat" if self.layout.pp > 1 else None,  # one entry per parameter (state_dict)
            "config_hash": self.profile.config_hash(),
            "profile": self.profile.public(),
            "dataset_uri": self.dataset_uri,
            "run_name": self.run.name,
            "val_loss": None if math.isnan(self.val_loss) else self.val_loss,
        }
        if to_memory:  # a manifest's digest is a string or absent
            del manifest["model_digest"]
        extra = {"rng": rng_state(), "step": step, "world_size": self.d.world_size}
        state = self.state_dict()
        proof = self.proving.part(position, extra["rng"])
        checkpointer = self.memory_tier if to_memory else self.checkpointer
        if isinstance(checkpointer, FlashSnapshots):  # what a resume reads; a snapshot is never published
            del manifest["profile"], manifest["replica_fingerprint"]
            manifest["world_size"] = self.d.world_size
            checkpointer.save(step, state, extra, manifest, self.proving.flash_part(extra["rng"]), began)
            return
        assert checkpointer is not None
        checkpointer.save(step, state, extra, manifest, sync=final, proof=proof)

    def _flash_replicas(self, step: int, flash: FlashSnapshots) -> None:
        """Before a flash snapshot, on every rank alike (docs/architecture.md §9): the previous round ended (waiting
        for it is checkpointing). A round compares the ranks' bytes itself and keeps none that differ; where the
        last one's differed, the loop compares the replicas' weights, whatever ``sdc_every``, to name the rank
        (ReplicaMismatch at the step the bytes differed). Where the rounds cannot compare (their group failed),
        the loop compares the replicas before each snapshot, as before a checkpoint."""
        if flash.busy:
            self.callbacks.on_phase(step, "checkpoint")
            flash.wait()
        if flash.differed is not None:
            differed, flash.differed = flash.differed, None
            (self.replicas or ReplicaCheck(self.model)).check(differed, full=True)
            if self.d.rank == 0:
                log.warning("flash snapshot of step %d was not kept: the ranks' bytes differed, though their weights "
                            "agree at step %d (the optimizer's state or a copy differed)", differed, step)  # fmt: skip
        elif self.replicas and not flash.compares_replicas:
            self.replica_digest = self.replicas.check(step, full=True)

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0, None elsewhere; under pp each stage's gathered there too."""
        if not self.pipeline:
            return full_weights(self.ddp)
        leader = self.mesh.stage_rank[0] == 0  # a stage's first rank sends it; rank 0 is stage 0's
        mine = {}
        for name, t in self.ddp.state_dict().items():  # a tensor at a time: each DTensor gathered over its mesh
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            if leader:
                mine[name] = whole.detach().cpu()
            del whole
        if not leader:
            return None
        stages: list[Any] | None = [None] * self.layout.pp if self.d.rank == 0 else None  # rank 0 receives
        dist.gather_object(mine, stages, dst=0, group=self.mesh.pp_object_group())
        return {k: v for stage in stages for k, v in stage.items()} if stages is not None else None

    def layout_record(self) -> dict[str, int] | None:
        """The layout for the manifest (None for a plain DDP or FSDP2 one, which the world size says)."""
        return dict(zip(Layout.NAMES, self.layout.sizes, strict=True)) if self.layout.meshed else None

    def same_layout(self, manifest: dict[str, Any]) -> bool:
        """Whether the checkpoint of ``manifest`` was saved under this attempt's layout."""
        return manifest.get("world_size") == self.d.world_size and manifest.get("layout") == self.layout_record()

    def state_dict(self, flat: bool | None = None) -> dict[str, Any]:
        """What a checkpoint holds. Under pp (``flat``'s default) the optimizer's state is flattened to one entry
        per parameter name: a stage's param groups list only its own parameters, and a checkpoint keeps one
        rank's lists. A pipeline stage's copy of a tied parameter goes under the name the whole model gives it,
        so a checkpoint of any layout holds the same names."""
        flat = self.layout.pp > 1 if flat is None else flat
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        if self.plain_state is not None and not flat:  # get_state_dict's, without its walk (§4)
            model_sd, optim_sd = self.plain_state.get(self.ddp, self.optimizer)
        else:
            model_sd, optim_sd = get_state_dict(self.ddp, self.optimizer, options=options)
        if self.pipeline:
            optim_sd = self.pipeline.whole_model_names(optim_sd)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "progress": {"step": self.step, "tokens": self.tokens_seen},
        }

    def resume(self) -> CheckpointInfo | None:
        """Load the run's newest checkpoint that loads (newer invalid ones are reported, not deleted).

        Rank 0 alone reads the commit manifests and sends every rank the same list; each rank then reads only
        the files it loads, verifying each against its manifest as it reads it. A file that fails fails every
        rank alike (DCP shares each rank's read errors), and all fall back to the next older checkpoint.
        """
        so, d = self.profile.store.storage_options, self.d
        self.found = _broadcast(list_checkpoints(self.run.checkpoints, so, verify=False) if d.rank == 0 else None)
        snapshots = self._memory_snapshots()
        candidates = restore_order(self.found, snapshots, lambda i: i.step)
        self.skipped, loaded, tried, refused = [], None, False, []
        fresh_rng = rng_state()  # a refused checkpoint's RNG streams must not outlive it
        for info, tier in candidates:
            if info.valid and (past := self._past_a_rollback(info)):
                info = replace(info, valid=False, reason=past)
            if info.valid:
                tried = True
                try:
                    if tier == "memory" and self.ring is not None:
                        if self.flash_resume is None:
                            self._gather_snapshot(info)
                        elif self.flash_resume.fetch(info):
                            self._gathered_step = info.step
                    self._load(info)
                    loaded = info
                    break
                except ChecksumMismatch as exc:
                    set_rng_state(fresh_rng)
                    info = replace(info, valid=False, reason=str(exc).split(f"{info.uri}: ", 1)[-1])
                    if isinstance(exc, ProofMismatch):
                        refused.append(info)
            self.skipped.append(info)
        if loaded is None and refused:  # no silent restart from step 0 when every proof failed
            raise CheckpointError(
                f"no checkpoint of run {self.run.name} loads: {len(refused)} refused by their state hash "
                f"(step {refused[0].step}: {refused[0].reason}); if an upgrade changed the layout of the "
                "optimizer's or scheduler's state, resume unverified with --set checkpoint.verify_state=false"
            )
        for bad in self.skipped if d.rank == 0 else []:
            log.warning("skipping checkpoint %s: %s", bad.uri, bad.reason)
        self.skips = self._skips_from(loaded)
        # Replayed only where the step after the checkpoint reads the same data on as many ranks as it did.
        replay = None
        if loaded is not None and self.profile.watchdog.replay:
            same_world = self.same_layout(loaded.manifest) or self.virtual is not None
            if same_world and self.skips == _recorded_skips(loaded):
                replay = loaded.manifest.get("replay")
        self.replay = Replay(loaded.step, replay, self.replay_context()) if loaded is not None and replay else None
        if d.rank == 0 and self.skips and (not loaded or self.skips != _recorded_skips(loaded)):
            k = self.skips[-1]
            log.warning(
                "rolling back from the loss spike at step %d: steps %d-%d read the data after step %d's",
                k.spike_step,
                k.after_step + 1,
                k.spike_step,
                k.spike_step,
            )
        if loaded is None:
            if tried:  # a failed load may have changed some weights: start again from the same fresh state
                self._fresh_start()
            if d.rank == 0:
                log.info(
                    "starting from scratch: %d params, world size %d, grad accumulation %d",
                    sum(p.numel() for p in self.model.parameters()),
                    d.world_size,
                    self.profile.grad_accum,
                )
            return None
        if d.rank == 0:
            log.info("resumed from %s%s at step %d%s", "the memory tier: " if self._in_memory(loaded) else "",
                     loaded.uri, self.step, "" if self.proving.verified else " (not verified: see above)")  # fmt: skip
        self.callbacks.on_resume(loaded.step, bool(self.proving.verified), self._tier(loaded))
        return loaded

    def _load(self, info: CheckpointInfo) -> None:
        """Every rank loads checkpoint ``info`` (read once, by rank 0); ChecksumMismatch on every rank when a file
        fails."""
        d = self.d
        flat = info.manifest.get("optimizer_state") == "flat"  # a pipeline's (Trainer.state_dict)
        record = None
        if self._in_flash(info) and self.flash_resume is not None:
            state, extra, record = self.flash_resume.read(info)
        else:
            state, extra = self._read_stored(info, flat)
        optim_sd = self.pipeline.stage_names(state["optim"]) if self.pipeline else state["optim"]
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        set_state_dict(self.ddp, self.optimizer, model_state_dict=state["model"], optim_state_dict=optim_sd,
                       options=options)  # fmt: skip
        set_kernels(self.optimizer, _meshes(self.params))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.tokens_seen = int(state["progress"]["step"]), int(state["progress"]["tokens"])
        same_world = self.same_layout(info.manifest)
        if extra is not None and same_world:
            set_rng_state(extra["rng"])  # another world size draws differently anyway (docs/architecture.md §4)
        saved = info.manifest.get("data_position")
        seed = saved.get("seed") if isinstance(saved, dict) else None
        t = self.profile.train
        position = data_position(
            self.step, _recorded_skips(info), t.global_batch, seed if type(seed) is int else t.seed
        )
        restored = rng_state() if extra is not None and same_world else None
        try:
            if record is not None:  # a flash snapshot's state is proved by its bytes
                sums = state_checksums(self.state_dict(flat))
                held = sums == [e.checksum for e in record.tensors]
                self.proving.check_flash(info, held, sums, restored, self.step * t.global_batch, record.proof)
            else:
                live = {**self.state_dict(flat), "data_position": position}
                self.proving.check(info, live, restored, self.step * t.global_batch, flat)
        except ProofMismatch as exc:
            if self.profile.checkpoint.verify_state:
                raise
            self.proving.unverified()
            if d.rank == 0:
                log.warning("resuming unverified (checkpoint.verify_state=false): %s", exc)
        if d.rank == 0 and self.proving.verified is False and read_proof(info.manifest) is None:
            log.warning(
                "resuming from %s unverified: it was written before checkpoints recorded a state hash", info.uri
            )

    def _read_stored(self, info: CheckpointInfo, flat: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The state and this rank's extra values of checkpoint or DCP snapshot ``info``, read by every rank
        (once, by rank 0, for DDP's replicas); ChecksumMismatch on every rank when a file fails."""
        so = {} if self._in_memory(info) else self.profile.store.storage_options
        d, files = self.d, info.manifest["files"]
        sizes = info.manifest.get("sizes")  # checked by latest_valid; every read stops there too
        problem = ""
        try:  # this rank's RNG states first: a bad one is found before any weight changes
            extra = load_rank_extra(info.uri, d.rank, so, expected=files, sizes=sizes)
        except ChecksumMismatch as exc:
            extra, problem = None, str(exc)
        problems: list[str] = [""] * d.world_size
        dist.all_gather_object(problems, problem)
        if any(problems):
            raise ChecksumMismatch(next(p for p in problems if p))
        state = self.state_dict(flat)
        try:
            if d.world_size == 1 or self.sharded:  # FSDP: each rank reads the shards it holds
                load_checkpoint(info.uri, state, so, expected=files, sizes=sizes)
            else:  # DDP: every rank holds the same state, so it is read once
                load_replicated(info.uri, state, so, files, self._cpu_group, sizes=sizes)
        except CheckpointError as exc:
            if self.profile.model.factory == GPT_FACTORY and ".attn.q." in str(exc):
                raise CheckpointError(
                    f"{exc}: it was written before the built-in GPT kept q, k and v apart (one fused qkv matrix "
                    "then); resume it with the trainpipe that wrote it, or start a new run"
                ) from None
            raise
        return state, extra

    def _past_a_rollback(self, info: CheckpointInfo) -> str:
        """Why checkpoint ``info`` cannot be resumed under the run's rollbacks ('' when it can): it was saved at or
        after a loss spike the run rolls back from, without having rolled back."""
        try:
            recorded = _recorded_skips(info)
        except ValueError:
            return "its manifest's data skips are not a list of skips"
        past = [s for s in pending_rollbacks(recorded, self.profile.train.rollbacks) if info.step >= s]
        return f"trained through the loss spike at step {past[0]} that the run rolls back from" if past else ""

    def _skips_from(self, loaded: CheckpointInfo | None) -> list[DataSkip]:
        """The data skips from here on: those the resumed checkpoint recorded, and one from it through each loss
        spike the run rolls back from (docs/architecture.md §9)."""
        recorded = _recorded_skips(loaded) if loaded else []
        return skips_after(recorded, self.profile.train.rollbacks, loaded.step if loaded else 0)

    def _fresh_start(self) -> None:
        """The state of a run that never resumed: the same seeded weights, a new optimizer and schedule."""
        t = self.profile.train
        seed_everything(t.seed)
        held = self.model.state_dict().keys()  # a pipeline stage holds its own part
        load_full_weights(
            self.ddp, {k: v for k, v in build_model(self.profile.model).state_dict().items() if k in held}
        )
        self.optimizer = build_optimizer(self.model, t, _meshes(self.params))
        self.scheduler = build_scheduler(self.optimizer, t)
        self.step, self.tokens_seen = 0, 0

    def build_checkpointer(self, resumed: CheckpointInfo | None) -> Checkpointer:
        c, so = self.profile.checkpoint, self.profile.store.storage_options
        stale = {i.step for i in self.found if i.step > self.step}
        return Checkpointer(
            self.run.checkpoints,
            c.keep_last,
            so,
            use_async=c.async_save,
            hash_staged=self.d.device.type == "cpu",  # on a GPU the live state hashes faster than a CPU copy
            protect=resumed.uri if resumed else None,
            stale_steps=stale,
            events=self.callbacks,
        )

    def _memory_dir(self) -> str | None:
        """This run's folder in the memory tier the supervisor opened (``MEMORY_ENV``), when
        ``checkpoint.memory_every_steps`` asks for one and every rank may use it; else None, said once by rank 0
        (a collective: every rank calls it)."""
        if self.profile.checkpoint.memory_every_steps == "off":
            return None
        folder = os.environ.get(MEMORY_ENV, "")
        opened_by = "the local launcher's attempts and a held cluster job's hosts have one"
        problem = "" if folder else f"the launcher opened none ({opened_by})"
        if folder:
            try:
                folder = private_folder(folder)
                if self.profile.cluster.simulate_nodes:  # a simulated node's memory: a folder of its own
                    folder = os.path.join(folder, f"node-{int(os.environ.get('GROUP_RANK', '0'))}")
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(folder, 0o700)
                    private_folder(folder)
            except MemoryTierUnavailable as exc:
                problem = str(exc)
        problems: list[str] = [""] * self.d.world_size
        dist.all_gather_object(problems, problem)
        if any(problems):
            if self.d.rank == 0:
                rank, why = next((r, p) for r, p in enumerate(problems) if p)
                log.warning("no memory tier (rank %d): %s; checkpoints go to the store alone", rank, why)
            return None
        return run_checkpoints(folder, self.profile.store.root, self.run.name)

    def _in_memory(self, info: CheckpointInfo) -> bool:
        in_folder = self.memory_dir is not None and info.uri.startswith(self.memory_dir + os.sep)
        return in_folder or self._in_flash(info)

    def _in_flash(self, info: CheckpointInfo) -> bool:
        return self.flash is not None and info.uri.startswith(self.flash.root + os.sep)

    def _tier(self, info: CheckpointInfo) -> Literal["memory", "peer", "store"]:
        if not self._in_memory(info):
            return "store"
        return "peer" if info.step == self._gathered_step else "memory"

    def _memory_snapshots(self) -> list[CheckpointInfo]:
        """The memory tier's committed snapshots that every rank's host holds, as rank 0 read them (a collective):
        a snapshot lies in its host's memory, so one that another rank's host lacks cannot be resumed."""
        if self.memory_dir is None:
            return []
        if self.flash_resume is not None:
            self.memory_found = self.flash_resume.held()
            return self.memory_found
        if self.ring is not None:
            return self._snapshots_across_hosts(self.ring)
        here = list_checkpoints(self.memory_dir, {}, verify=False)
        every: list[Any] = [None] * self.d.world_size
        dist.all_gather_object(every, {i.step for i in here if i.valid})
        common = set.intersection(*every)
        self.memory_found = _broadcast(here if self.d.rank == 0 else None)
        return [i for i in self.memory_found if i.step in common]

    def _snapshots_across_hosts(self, ring: PeerRing) -> list[CheckpointInfo]:
        """The committed snapshots whose files the job's hosts hold between them (a collective): each host's
        leader reports its folder, and a snapshot is resumable when every file it lists lies on some host
        (its own host's, or the peer's copy of a lost host's). Each rank's copy points into its own host's folder."""
        view = None
        if ring.leader:
            found = list_checkpoints(self.memory_dir, {}, verify=False)  # type: ignore[arg-type]
            view = [(i, held_files(i.uri)) for i in found if i.valid and i.manifest.get("sizes")]
        views: list[Any] = [None] * self.d.world_size
        dist.all_gather_object(views, view)
        self._memory_held = [None if v is None else {i.step: held for i, held in v} for v in views]
        self.memory_found = resumable_snapshots(views, self.memory_dir)  # type: ignore[arg-type]
        return self.memory_found

    def _gather_snapshot(self, info: CheckpointInfo) -> None:
        """Every host's folder made to hold the whole snapshot ``info`` before it loads (a collective): the files
        a host lacks come from a host that holds them, each checked against the manifest. ChecksumMismatch on
        every rank when one arrived altered."""
        assert self.ring is not None
        held = [None if h is None else h.get(info.step, set()) for h in self._memory_held]
        plan, problem = gather_snapshot(info.uri, info.manifest, held, self.ring, self._cpu_group)
        receiving = any(dst == self.d.rank for _, dst, _ in plan)
        problems: list[str] = [""] * self.d.world_size
        dist.all_gather_object(problems, problem)
        if any(problems):
            raise ChecksumMismatch(next(p for p in problems if p))
        if receiving:  # the host now holds a whole, committed snapshot, as its peers do
            fs, base = filesystem(info.uri, {})
            write_json(fs, posixpath.join(base, CHECKPOINT_MANIFEST), info.manifest)
        if plan:
            self._gathered_step = info.step
        if self.d.rank == 0 and plan:
            hosts = sorted({self.ring.host_of(dst) for _, dst, _ in plan})
            log.info("gathered %d file(s) of the snapshot of step %d onto host(s) %s from their peers",
                     len(plan), info.step, ", ".join(map(str, hosts)))  # fmt: skip

    def build_memory_tier(self) -> Checkpointer | FlashSnapshots | None:
        """The memory tier's checkpointer, when the tier is on and this host's shared memory holds what it keeps
        (every local rank's state, twice, plus one being written, plus the copy each stages); else None, said
        once. The earlier attempt's snapshots past the resumed step, and any it left half written, are removed
        first: none of them is resumed again, and the newest two would otherwise keep their places."""
        if self.memory_dir is None:
            return None
        if self.flash is not None:
            self.flash.drop_after(self.step)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one rank per host clears its host's folder
            if self.flash is not None and self.flash_resume is not None:
                prune(self.flash.root, self.flash_resume.folders())
                drop_stale(self.flash.root, self.step)
            for info in list_checkpoints(self.memory_dir, {}, verify=False):
                if info.step > self.step or not info.committed:
                    shutil.rmtree(info.uri, ignore_errors=True)
        dist.barrier(group=self._cpu_group)
        size = lambda t: (t.to_local() if isinstance(t, DTensor) else t).nbytes  # noqa: E731
        params = sum(size(p) for p in self.params)
        held = params + sum(size(v) for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
        per_rank = max(held, 3 * params)  # before the first step AdamW holds no moments yet
        simulated = self.profile.cluster.simulate_nodes  # every node's ranks on this host
        local = self.d.world_size if simulated else int(os.environ.get("LOCAL_WORLD_SIZE", self.d.world_size))
        flash = self.flash is not None
        need = room_needed(per_rank, local, self.ring is not None, flash)
        free = room_free(os.path.dirname(os.path.dirname(self.memory_dir)), 0 if flash else per_rank, local)
        [short] = self._agree_max([float(need > free)])  # every rank turns the tier off alike
        if short:
            if self.d.rank == 0:
                log.warning(
                    "no memory tier: its snapshots need %.0f MB of shared memory and this host has %.0f MB free; "
                    "checkpoints go to the store alone", need / 2**20, free / 2**20
                )  # fmt: skip
            return None
        if self.flash is not None:
            return self.flash
        return Checkpointer(
            self.memory_dir,
            SNAPSHOTS_KEPT,
            {},
            use_async=True,
            hash_staged=self.d.device.type == "cpu",
            grace_s=0.0,  # a snapshot still being written is skipped at once: the loop never waits for the tier
            tier="memory",
            peers=self.ring,
        )

    def memory(self) -> tuple[list[float], list[float]]:
        """Every rank's MB of weights and optimizer state (its own blocks), and on a GPU its peak allocated device
        memory (a collective: every rank calls it)."""
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        tensors = [local(p) for p in self.params]
        tensors += [local(v) for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        held = sum(t.numel() * t.element_size() for t in tensors) / 2**20
        peak = torch.cuda.max_memory_allocated(self.d.device) / 2**20 if self.d.device.type == "cuda" else None
        every: list[Any] = [None] * self.d.world_size
        dist.all_gather_object(every, (held, peak), group=self._cpu_group)
        return [round(h, 3) for h, _ in every], [round(p, 1) for _, p in every if p is not None]

    def result(self, resumed: CheckpointInfo | None) -> TrainResult:
        """What rank 0 reports to the supervisor once the final checkpoint is committed."""
        assert self.checkpointer is not None  # built by train() before any step
        state_mb, peak_device_mb = self.memory()
        start_step = resumed.step if resumed else 0
        if start_step >= self.profile.train.steps and resumed is not None:  # a retry after the final commit
            self.val_loss = resumed.manifest.get("val_loss") or self.evaluate(self.step)
        final = self.checkpointer.committed
        if final is None:  # nothing committed by this attempt: the final step was the checkpoint it resumed
            if resumed is None:
                raise CheckpointError(f"run {self.run.name} ended without a committed checkpoint")
            final = Committed(start_step, resumed.uri, resumed.manifest.get("model_digest"), time.time())
        return TrainResult(
            run_name=self.run.name,
            start_step=start_step,
            final_step=final.step,
            checkpoint_uri=final.uri,
            model_digest=final.digest,
            val_loss=None if math.isnan(self.val_loss) else self.val_loss,
            final_loss=loss if (loss := self.losses.get(final.step)) is not None and math.isfinite(loss) else None,
            resumed_from=resumed.uri if resumed else None,
            skipped_checkpoints=[SkippedCheckpoint(uri=s.uri, reason=s.reason) for s in self.skipped],
            world_size=self.d.world_size,
            rank=self.d.rank,
            attempt_s=time.time() - self.timeline.t0,
            step_s_median=self.timeline.median_step_s(),
            mfu=statistics.median(self.mfu) if self.mfu else None,
            step_starts_s=self.timeline.step_starts_s,
            checkpoint_failures=self.checkpointer.failures,
            checkpoint_stalls_s=self.checkpointer.stalls_s,
            data_skips=self.skips,
            started_at=self.timeline.t0,
            restore_s=self.restore_s,
            data_wait_s=self.timeline.data_wait_s,
            eval_s=self.timeline.eval_s,
            checkpoint_every_steps=self.schedule.every_steps if self.schedule else None,
            memory_every_steps=self.memory_schedule.every_steps if self.memory_schedule else None,
            memory_stalls_s=[round(s, 6) for s in self.memory_tier.stalls_s] if self.memory_tier else [],
            checkpoint_mtbf_hours=self.profile.checkpoint.mtbf_hours,
            resume_verified=self.proving.verified,
            resumed_tier=self._tier(resumed) if resumed else None,
            state_mb=state_mb,
            peak_device_mb=peak_device_mb,
        )

    def close(self) -> None:
        """End the attempt: announce it (metrics flush, …), wait for every rank, leave the process group."""
        self.callbacks.on_finish()
        dist.barrier()
        dist.destroy_process_group()


_SKIPS = TypeAdapter(Annotated[list[DataSkip], Field(max_length=64)])


def _recorded_skips(info: CheckpointInfo) -> list[DataSkip]:
    """The data skips a checkpoint's manifest records (ValueError when they are not skips: the store is not
    trusted)."""
    position = info.manifest.get("data_position")
    raw = position.get("skips", []) if isinstance(position, dict) else []
    try:
        return _SKIPS.validate_python(raw)
    except ValidationError as exc:
        raise ValueError(str(exc).splitlines()[0]) from None


def _meshes(params: list[torch.nn.Parameter]) -> int:
    """How many meshes ``params`` are DTensors of (plain tensors count as one more)."""
    return len({p.device_mesh if isinstance(p, DTensor) else None for p in params})


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _deferred_digest(weights: dict[str, torch.Tensor] | None):
    """The digest of ``weights`` (copied already), computed when the commit asks: rank 0's, None elsewhere."""
    return (lambda: model_digest(weights)) if weights is not None else None
