"""How the model is spread over the ranks (``train.strategy``, ``parallel``): DDP replicates it, FSDP2 shards
it, and a layout of several dimensions (trainer.loop.mesh) adds tensor parallelism by the model's plan under
FSDP2 (or HSDP) over the data-parallel ranks.

Both announce to the loop's callbacks what the watchdog needs: the collectives
a rank enters (so a hang names the one it stopped in) and when its backward
compute is done (so straggler scores count compute, not waiting). DDP says so
from its gradient hook. FSDP2 gathers parameters before each block's forward
and backward and reduce-scatters gradients after, so its collectives go through
``TimedComms``: each is announced, and the time spent in it is subtracted from
the rank's compute time.

FSDP2 shards every block of the model's repeated layers (the modules of each
``nn.ModuleList``, as torchtitan shards transformer blocks) and then the root,
which keeps the embeddings and the head.
"""

from __future__ import annotations

import contextlib
import fnmatch
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from trainpipe.trainer.device import Distributed
from trainpipe.trainer.factory import TensorParallelPlan
from trainpipe.trainer.loop.callbacks import Callback
from trainpipe.trainer.loop.mesh import Mesh
from trainpipe.trainer.loop.virtual_ranks import VirtualRanks, VirtualReduceScatter


def parallelize(
    model: torch.nn.Module,
    strategy: str,
    d: Distributed,
    callbacks: Callback,
    step: Callable[[], int],
    virtual: VirtualRanks | None = None,
) -> torch.nn.Module:
    """``model`` wrapped (DDP) or sharded in place (FSDP2) over every rank; ``step()``: the step being run. With
    ``virtual``, FSDP2 reduce-scatters through the virtual ranks' tree and divides nothing (the loss carries the
    mean's factor); DDP's own reduction is then never used (the loop runs its backward under ``no_sync``)."""
    if strategy == "fsdp":
        mesh = init_device_mesh(d.device.type, (d.world_size,))
        for blocks in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
            for block in blocks:
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        comms = TimedComms(callbacks, step, VirtualReduceScatter(virtual) if virtual else None)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(comms.all_gather)
                m.set_custom_reduce_scatter(comms.reduce_scatter)
                if virtual:  # sums only (the loss carries the mean's factor), every parameter in every call
                    m.set_gradient_divide_factor(1.0)
                    m.set_force_sum_reduction_for_comms(True)
                    m.set_reduce_scatter_unused_params(True)
        return model
    ddp = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    ddp.register_comm_hook(callbacks, _announce_gradients_ready)
    return ddp


def parallelize_mesh(
    model: torch.nn.Module,
    mesh: Mesh,
    plan: TensorParallelPlan | None,
    callbacks: Callback,
    step: Callable[[], int],
) -> torch.nn.Module:
    """``model`` (a pipeline stage of it under pp) split in place over ``mesh``: by its plan over the tp ranks
    (DTensor), then FSDP2 over the data-parallel ones (HSDP with replicas; a size-1 one too, so that every
    parameter is a DTensor and one optimizer and one norm take them all)."""
    if plan is not None:
        apply_tensor_parallel(model, mesh.tp_mesh(), plan)
    dp_mesh = mesh.dp_mesh()
    for blocks in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        for block in blocks:
            if any(True for _ in block.parameters()):  # another pipeline stage's block is an empty Identity
                fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    comms = TimedComms(callbacks, step)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(comms.all_gather)
            m.set_custom_reduce_scatter(comms.reduce_scatter)
    return model


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan) -> None:
    """The plan's styles on the modules this rank holds (a pipeline stage lacks the others), then its tied
    parameters tied again (each was distributed on its own)."""
    names = [name for name, _ in model.named_modules() if name]
    present = {key: style for key, style in plan.styles.items() if any(_matches(key, n) for n in names)}
    parallelize_module(model, tp_mesh, present)
    held = dict(model.named_parameters(remove_duplicate=False))
    for source, tied in plan.tied:
        if source in held and tied in held:
            owner, _, leaf = tied.rpartition(".")
            setattr(model.get_submodule(owner), leaf, held[source])


def _matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` is one ``pattern`` names (parallelize_module's rule: fnmatch per part)."""
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatch(p, a) for p, a in zip(parts, atoms, strict=True))


def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None, copies: set[int]
) -> torch.Tensor:
    """Clip the gradients of a layout's parameters (DTensors of several meshes, a pipeline stage's) to one global
    norm: each DTensor's norm over its mesh, the stages' summed over the pipeline; ``copies``: ids of parameters
    another stage also holds (a tied head), counted there only."""
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}  # a norm takes the DTensors of one mesh (or plain ones)
    for p in params:
        if p.grad is not None and id(p) not in copies:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squared = torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
    for held in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in held if p.grad is not None], 2.0)
        squared += (norm.full_tensor() if isinstance(norm, DTensor) else norm).detach().float() ** 2
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    norm = squared.sqrt()
    for held in by_mesh.values():  # a foreach kernel takes the tensors of one mesh
        torch.nn.utils.clip_grads_with_norm_(held, max_norm, norm)
    copied = [p for p in params if p.grad is not None and id(p) in copies]
    if copied:
        torch.nn.utils.clip_grads_with_norm_(copied, max_norm, norm, foreach=False)
    return norm


def gradient_sync(module: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Within it, backward accumulates gradients locally (``enabled=False``) or also syncs them over the ranks."""
    if isinstance(module, DDP):
        return contextlib.nullcontext() if enabled else module.no_sync()
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def backward_done(module: torch.nn.Module, callbacks: Callback) -> None:
    """After the step's last backward: FSDP2's gradients are reduced (DDP announced it from its hook)."""
    if isinstance(module, FSDPModule):
        callbacks.on_gradients_ready()


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on rank 0 (collective under FSDP2); None on the other ranks."""
    if isinstance(module, FSDPModule):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(module, options=options)  # full_state_dict: plain tensors
        return cast(dict[str, torch.Tensor], weights) if dist.get_rank() == 0 else None
    inner = module.module if isinstance(module, DDP) else module
    return {k: v.detach().clone() for k, v in inner.state_dict().items()} if dist.get_rank() == 0 else None


def load_full_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Every rank's share of ``weights`` (the whole model's, the same on every rank) into ``module``."""
    state: dict[str, Any] = dict(weights)
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))


class TimedComms:
    """FSDP2's collectives, announced to the callbacks and timed: the loop's compute time leaves them out."""

    def __init__(self, callbacks: Callback, step: Callable[[], int], reduce_scatter=None):
        self.callbacks, self.step = callbacks, step
        self.all_gather = _TimedAllGather(DefaultAllGather(), "all_gather", self)
        self.reduce_scatter = _TimedReduceScatter(reduce_scatter or DefaultReduceScatter(), "reduce_scatter", self)


class _Timed:
    def __init__(self, comm, kind: str, owner: TimedComms):
        self.comm, self.kind, self.owner = comm, kind, owner

    def allocate(self, *args, **kwargs) -> torch.Tensor:
        return self.comm.allocate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        # Waited here, so the time in it is the time waited (on a GPU the wait only orders the streams: CPU
        # timing there counts launching, not the collective).
        with waiting(self.owner.callbacks, self.owner.step(), self.kind):
            work = self.comm(*args, **kwargs)
            if work is not None:
                work.wait()
        return None


class _TimedAllGather(_Timed, AllGather):
    """The all-gather FSDP2 is given (``set_custom_all_gather`` takes its interface)."""


class _TimedReduceScatter(_Timed, ReduceScatter):
    """The reduce-scatter FSDP2 is given (``set_custom_reduce_scatter`` takes its interface)."""


@contextlib.contextmanager
def waiting(callbacks: Callback, step: int, kind: str) -> Iterator[None]:
    """Within it, this rank waits in collective ``kind``: announced, and its time taken out of the compute."""
    callbacks.on_collective(step, kind)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        callbacks.on_collective_end(step, kind, time.perf_counter() - t0)


def _announce_gradients_ready(callbacks, bucket):  # no annotations: DDP checks them against its own classes
    """DDP's plain all-reduce, telling the callbacks when this rank's backward compute is done."""
    if bucket.is_last():
        callbacks.on_gradients_ready()
    return default_hooks.allreduce_hook(None, bucket)  # pyright: ignore[reportArgumentType] - None: the default group
