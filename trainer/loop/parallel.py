"""How the model is spread over the ranks (``train.strategy``): DDP replicates it, FSDP2 shards it.

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
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.nn.parallel import DistributedDataParallel as DDP

from trainpipe.trainer.device import Distributed
from trainpipe.trainer.loop.callbacks import Callback
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
        weights = get_model_state_dict(module, options=options)
        return weights if dist.get_rank() == 0 else None
    inner = module.module if isinstance(module, DDP) else module
    return {k: v.detach().clone() for k, v in inner.state_dict().items()} if dist.get_rank() == 0 else None


def load_full_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Every rank's share of ``weights`` (the whole model's, the same on every rank) into ``module``."""
    set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True))


class TimedComms:
    """FSDP2's collectives, announced to the callbacks and timed: the loop's compute time leaves them out."""

    def __init__(self, callbacks: Callback, step: Callable[[], int], reduce_scatter=None):
        self.callbacks, self.step = callbacks, step
        self.all_gather = _Timed(DefaultAllGather(), "all_gather", self)
        self.reduce_scatter = _Timed(reduce_scatter or DefaultReduceScatter(), "reduce_scatter", self)


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
    return default_hooks.allreduce_hook(None, bucket)
