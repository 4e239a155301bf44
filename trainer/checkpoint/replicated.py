"""Resuming replicated (DDP) state: rank 0 reads the checkpoint once and sends it to every rank.

Every DDP rank holds the same model and optimizer state, so reading it from the store on every rank would
multiply the bytes read by the world size. Rank 0 loads it (verifying each file as it reads it), tells the
others whether it could, and broadcasts every tensor in place, then the values that are not tensors (the
LR schedule, the counters). Each rank still reads its own extra state (RNG) itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from trainpipe.trainer.checkpoint.loading import load_checkpoint
from trainpipe.trainer.checkpoint.storage import ChecksumMismatch
from trainpipe.trainer.errors import CheckpointError, StoreError, StoreUnavailable, TrainpipeError

# What rank 0's failure is on every rank: the same class, so every rank takes the same way out.
_ERRORS: dict[str, type[TrainpipeError]] = {
    c.__name__: c for c in (ChecksumMismatch, CheckpointError, StoreError, StoreUnavailable)
}


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
    for tensor in _tensors(state):
        on_cpu = tensor.device.type == "cpu" and dist.get_backend() != "gloo"
        dist.broadcast(tensor, src=0, group=cpu_group if on_cpu else None)
    _merge(state, _from_rank0(_skeleton(state) if dist.get_rank() == 0 else None))


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
