"""Resuming replicated (DDP) state: rank 0 reads the checkpoint once and sends it to every rank.

Every DDP rank holds the same model and optimizer state, so reading it from the store on every rank would
multiply the bytes read by the world size. Rank 0 loads it (verifying each file as it reads it), tells the
others whether it could, and broadcasts the tensors in place, then the values that are not tensors (the
LR schedule, the counters). Each rank still reads its own extra state (RNG) itself.

The tensors travel in flat buckets of one device and dtype (at most ``BUCKET_BYTES`` each), not one by one:
a small model's state is hundreds of tensors, and one collective each cost about 0.1 s of every resume at
10 MB on gloo, a tenth of the memory tier's recovery target (docs/architecture.md §4).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from trainpipe.trainer.checkpoint.loading import load_checkpoint
from trainpipe.trainer.checkpoint.storage import ChecksumMismatch
from trainpipe.trainer.errors import CheckpointError, StoreError, StoreUnavailable, TrainpipeError

# What rank 0's failure is on every rank: the same class, so every rank takes the same way out.
_ERRORS: dict[str, type[TrainpipeError]] = {
    c.__name__: c for c in (ChecksumMismatch, CheckpointError, StoreError, StoreUnavailable)
}
# A bucket's flat copy is memory on top of the state: bounded, and large enough that a bucket's collective
# costs its bytes rather than its latency.
BUCKET_BYTES = 64 << 20


def load_replicated(
    uri: str,
    state: dict[str, Any],
    storage_options: dict[str, Any] | None,
    expected: dict[str, str],
    cpu_group: dist.ProcessGroup | None = None,
    sizes: dict[str, int] | None = None,
) -> None:
    """Load ``state`` in place on every rank from what rank 0 alone reads (collective). ``cpu_group``: a gloo
    group for the CPU tensors when the default group is NCCL; ``sizes``: the manifest's file sizes."""
    failure = None
    if dist.get_rank() == 0:
        try:
            load_checkpoint(uri, state, storage_options, expected, single=True, sizes=sizes)
        except TrainpipeError as exc:
            failure = (type(exc).__name__, str(exc))
    if failure := _from_rank0(failure):
        raise _ERRORS.get(failure[0], CheckpointError)(failure[1])
    for bucket in buckets(_tensors(state)):
        on_cpu = bucket[0].device.type == "cpu" and dist.get_backend() != "gloo"
        broadcast_bucket(bucket, cpu_group if on_cpu else None)
    _merge(state, _from_rank0(_skeleton(state) if dist.get_rank() == 0 else None))


def buckets(tensors: list[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """``tensors`` in groups of one device and dtype, each at most ``limit`` bytes (or one larger tensor), in an
    order every rank that holds the same shapes computes alike."""
    open_: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    held: dict[tuple[torch.device, torch.dtype], int] = {}
    done: list[list[torch.Tensor]] = []
    for t in tensors:
        key, size = (t.device, t.dtype), t.numel() * t.element_size()
        if open_.get(key) and held[key] + size > limit:
            done.append(open_.pop(key))
        open_.setdefault(key, []).append(t)
        held[key] = (held[key] if len(open_[key]) > 1 else 0) + size
    return done + list(open_.values())


def broadcast_bucket(bucket: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Rank 0's values of ``bucket`` into every rank's tensors, in place, as one collective."""
    if len(bucket) == 1:
        dist.broadcast(bucket[0], src=0, group=group)
        return
    flat = _flatten_dense_tensors(bucket)
    dist.broadcast(flat, src=0, group=group)
    if dist.get_rank() != 0:
        with torch.no_grad():
            for t, value in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                t.copy_(value)


def _from_rank0(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state dict, in an order every rank walks alike."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _skeleton(obj: Any) -> Any:
    """The state without its tensors (None in their place): what is left to send as an object."""
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, dict):
        return {k: _skeleton(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_skeleton(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_skeleton(v) for v in obj)
    return obj


def _merge(obj: Any, skeleton: Any) -> None:
    """Set the values that are not tensors from rank 0's skeleton into ``obj``, in place."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in list(items):
        if isinstance(value, torch.Tensor) or (isinstance(value, tuple) and _tensors(value)):
            continue  # tensors came by broadcast
        if isinstance(value, (dict, list)):
            _merge(value, skeleton[key])
        else:
            obj[key] = skeleton[key]
