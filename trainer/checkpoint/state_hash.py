"""The state hash and the sample ledger of a checkpoint's proof (``proof``; docs/architecture.md §4).

The state hash is a sum, over every element of every tensor of the state (model, optimizer, scheduler, progress)
and over every other value in it and the data position, of a mix of the element's bits, its global index and its
name. A sum does not care who holds which element: each rank adds the elements it owns (its shards of a DTensor;
a tensor every rank holds whole is added by rank 0 alone), and the ranks' sums add up to the same hash at any
world size, under DDP or FSDP2. The terms are 31-bit integers summed exactly, in two lanes kept modulo the
Mersenne prime 2^61 - 1: no reduction order changes an integer sum.

The ledger is the same kind of sum over the samples the steps consumed, each term a mix of (epoch, sample id):
the digest of the multiset of samples, whoever read them, which ``trainpipe ckpt verify`` recomputes from the
sample order alone.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from trainpipe.trainer.checkpoint.proof import PRIME, Sum
from trainpipe.trainer.data.sampler import DataSkip, data_index, epoch_permutation

M31 = (1 << 31) - 1
CHUNK = 1 << 22  # elements mixed at once: the temporaries of a large tensor stay a few times this size
# A publishing process sums a whole checkpoint in one process beside a chunk it holds: its temporaries (a dozen
# int64 tensors of this many elements) are kept to tens of MB.
STORED_CHUNK = 1 << 19
PIECE = 1 << 20  # sample positions planned at once
# Odd multipliers below 2^31 (x * k < 2^62 for x < 2^31: no int64 overflow), one set per lane.
LANES = ((0x5BD1E995, 0x27D4EB2F, 0x165667B1, 0x61C88647), (0x2545F491, 0x4CF5AD43, 0x7FEB352D, 0x68E31DA5))
FLAG = (0x2F0B3A49, 0x1B873593)  # times the top bits of a value (0-3): a distinct 31-bit pattern each


def _salt(name: str) -> tuple[int, int]:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") & M31, int.from_bytes(digest[4:8], "little") & M31


def _mix(x: torch.Tensor, k: int, scratch: torch.Tensor) -> torch.Tensor:
    """x in [0, 2^31) to a 31-bit mix of it, in place: multiply, then fold the 62-bit product. In place, with one
    ``scratch`` buffer for the whole block: the hash is a dozen passes over memory per element, and a fresh
    temporary per operation made it a fifth slower (58 against 48 ms, benchmarks/state_hash_cost.py)."""
    x.mul_(k)
    torch.bitwise_right_shift(x, 31, out=scratch)
    return x.bitwise_and_(M31).bitwise_xor_(scratch)


def _terms(values: torch.Tensor, index: torch.Tensor, salt: tuple[int, int], wide: bool) -> torch.Tensor:
    """Each lane's sum over the flat ``values`` of the mix of the value's bits, its global index and the salt, as
    an int64 tensor of two, on the values' device (``wide``: the tensor has 2^31 elements or more, so an index has
    high bits to mix in too). Each term is below 2^31: exact for a block under 2^32 elements."""
    low, high, flag = _pieces(values)
    index_low, index_high = index & M31, (index >> 31) if wide else None
    scratch = torch.empty_like(low)
    sums = []
    for lane, (k1, k2, k3, k4) in enumerate(LANES):
        x = _mix(low ^ salt[lane], k1, scratch)
        x.bitwise_xor_(torch.mul(flag, FLAG[lane], out=scratch).bitwise_and_(M31))  # 0-3 times FLAG: 4 patterns
        if high is not None:
            x = _mix(x.bitwise_xor_(high), k4, scratch)
        x = _mix(x.bitwise_xor_(index_low), k2, scratch)
        if index_high is not None:
            x = _mix(x.bitwise_xor_(index_high), k3, scratch)
        sums.append(x.sum())
    return torch.stack(sums)


def _pieces(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A flat tensor's bits as int64: the low 31, the next 31 of an 8-byte value (else None), and the top ones."""
    if values.dtype == torch.bool:
        values = values.to(torch.int8)
    size = values.element_size()
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    raw = (values.view(bits) if values.dtype != bits else values).to(torch.int64)
    if size < 8:  # sign-extended: bit 31 stands for all the top bits
        return raw & M31, None, (raw >> 31) & 1
    return raw & M31, (raw >> 31) & M31, (raw >> 62) & 3


def tensor_sum(
    name: str,
    values: torch.Tensor,
    global_shape: tuple[int, ...],
    offset: tuple[int, ...] | None = None,
    indices: list[torch.Tensor] | None = None,
    chunk: int = CHUNK,
) -> Sum:
    """The terms of the block ``values`` of a tensor of ``global_shape``, summed on the block's device and read
    once, ``chunk`` elements at a time. The block starts at ``offset``, or its positions along each dimension are
    ``indices`` (a strided shard: FSDP2 over a tensor-parallel split interleaves)."""
    salt = _salt(f"{name}|{values.dtype}|{tuple(global_shape)}")
    values = values.detach()
    if indices is not None and all(_is_range(ix) for ix in indices):
        offset, indices = tuple(int(ix[0]) if len(ix) else 0 for ix in indices), None
    offset = offset if offset is not None else (0,) * values.dim()
    if values.is_complex():  # its real and imaginary parts: one more dimension of two
        values, global_shape = torch.view_as_real(values), (*global_shape, 2)
        offset = (*offset, 0)
        indices = None if indices is None else [*indices, torch.arange(2)]
    if values.numel() == 0:
        return Sum()
    if values.dim() == 0:
        values, global_shape, offset = values.reshape(1), (1,), (0,)
    wide = math.prod(global_shape) >= 1 << 31
    strides = [math.prod(global_shape[d + 1 :]) for d in range(len(global_shape))]
    total = torch.zeros(2, dtype=torch.int64, device=values.device)
    if indices is None and tuple(values.shape[1:]) == tuple(global_shape[1:]):  # whole rows: consecutive elements
        flat, first = values.contiguous().view(-1), offset[0] * strides[0]
        for i in range(0, flat.numel(), chunk):
            part = flat[i : i + chunk]
            index = torch.arange(first + i, first + i + part.numel(), device=part.device)
            total = (total + _terms(part, index, salt, wide)) % PRIME
    else:  # another split (a column shard): each dimension's global coordinate times its stride, row by row
        if indices is None:
            indices = [torch.arange(o, o + n) for o, n in zip(offset, values.shape, strict=True)]
        indices = [ix.to(device=values.device, dtype=torch.int64) for ix in indices]
        per = max(1, chunk // max(1, values[0].numel()))
        for r0 in range(0, values.shape[0], per):
            block = values[r0 : r0 + per]
            index = torch.zeros(block.shape, dtype=torch.int64, device=block.device)
            for d in range(block.dim()):
                view = [1] * block.dim()
                view[d] = block.shape[d]
                along = indices[d][r0 : r0 + per] if d == 0 else indices[d]
                index += (along * strides[d]).view(view)
            total = (total + _terms(block.contiguous().flatten(), index.flatten(), salt, wide)) % PRIME
    a, b = total.tolist()
    return Sum(a, b)


def _is_range(ix: torch.Tensor) -> bool:
    """Whether ``ix`` holds consecutive integers (a block's positions along one dimension)."""
    return len(ix) == 0 or (int(ix[-1]) - int(ix[0]) == len(ix) - 1 and bool((ix[1:] - ix[:-1] == 1).all()))


def _rows_of(t: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int] | None:
    """A tensor every rank holds whole, shared out by rows: this rank's rows and the first's index (None: none)."""
    if t.dim() == 0:
        return (t, 0) if rank == 0 else None
    per = -(-t.shape[0] // world_size)
    first = rank * per
    return (t[first : first + per], first) if first < t.shape[0] else None


def _owned(t: DTensor) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """This rank's block of ``t`` and its positions along each dimension, or None when another rank adds it (a
    replica of it). The positions follow the placements as distribute_tensor applies them, mesh dimension by
    mesh dimension, strided shards (FSDP2 over a tensor-parallel split) included."""
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    indices = [torch.arange(n) for n in t.shape]
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            if coordinate[mesh_dim] != 0:
                return None
            continue
        if isinstance(placement, _StridedShard):
            along = _StridedShard(0, split_factor=placement.split_factor)
        elif isinstance(placement, Shard):
            along = Shard(0)
        else:
            raise ValueError(f"a {placement} tensor has no state of its own to hash")
        dim = placement.dim % t.dim()
        pieces, _ = along._split_tensor(indices[dim], t.device_mesh.size(mesh_dim), with_padding=False)
        indices[dim] = pieces[coordinate[mesh_dim]]
    local = t.to_local()
    return local[tuple(slice(0, len(ix)) for ix in indices)], indices


def _leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _leaves(obj[key], f"{path}.{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        if all(type(item) is int for item in obj):  # Python's RNG state: 625 of them, each its own leaf
            yield from ((f"{path}.{i}", item) for i, item in enumerate(obj))
            return
        for i, item in enumerate(obj):
            yield from _leaves(item, f"{path}.{i}")
    else:
        yield path, obj


def value_sum(name: str, value: Any) -> Sum:
    """A value that is not a tensor (a learning rate, a step count, a data skip): one term."""
    digest = hashlib.sha256(f"{name}={type(value).__name__}:{value!r}".encode()).digest()
    return Sum(int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little"))


def state_sum(
    state: dict[str, Any],
    rank: int,
    world_size: int = 1,
    holders: tuple[int, int] | None = None,
    copies: frozenset[str] = frozenset(),
    replicas: dict[str, int] | None = None,
    per_parameter: bool = False,
) -> Sum:
    """This rank's part of the state hash of ``state`` (a state dict: tensors, DTensors, plain values). A DTensor
    adds the block this rank owns; a plain tensor, which every rank of ``holders`` (this rank's index among the
    ranks holding the same tensors, and their number: every rank, but a pipeline stage's under pp) holds whole,
    its share of the rows (so every copy is read, and the work is shared); a plain value is rank 0's. The
    optimizer's lists of parameter names and its kernel choices are left out (the layout's, not the state's),
    and so is the state of each parameter in ``copies`` (a pipeline stage's copy of a tied parameter: the other
    end's is the same). ``replicas``: this rank's coordinates on the mesh dimensions a tensor is held alike
    across when its own mesh lacks them (FSDP2's shards on the data-parallel ranks, the same on each tp rank):
    such a block is added where those coordinates are 0. ``per_parameter``: the optimizer's state is flattened to
    an entry per parameter name (a pipeline's checkpoint), so its plain values are each stage's, added by the
    stage's first rank; else its param groups are the same on every rank, added by rank 0."""
    index, count = holders or (rank, world_size)
    total = Sum()
    for name, leaf in _leaves(state):
        if _LAYOUT_KEYS.fullmatch(name) or any(name.startswith(f"optim.{kind}.{c}.") for c in copies
                                                for kind in ("state", "param_groups")):  # fmt: skip
            continue
        if isinstance(leaf, DTensor):
            own_dims = leaf.device_mesh.mesh_dim_names or ()
            if any(c for dim, c in (replicas or {}).items() if dim not in own_dims):
                continue  # a copy of a block another rank adds
            owned = _owned(leaf)
            if owned is not None:
                total = total + tensor_sum(name, owned[0], tuple(leaf.shape), indices=owned[1])
        elif isinstance(leaf, torch.Tensor):
            if (mine := _rows_of(leaf, index, count)) is not None:
                offset = (mine[1], *[0] * (leaf.dim() - 1)) if leaf.dim() else ()
                total = total + tensor_sum(name, mine[0], tuple(leaf.shape), offset)
        elif index == 0 if per_parameter and name.startswith("optim.") else rank == 0:
            total = total + value_sum(name, leaf)
    return total


# The optimizer's lists of parameter names and its choice of kernels: how a layout runs the state, not the state.
_LAYOUT_KEYS = re.compile(r"optim\.param_groups\.(\d+\.params\.\d+|.+\.(foreach|fused|capturable|differentiable))")


def stored_sum(fqn: str, value: Any, shape: tuple[int, ...] | None = None, at: tuple[int, ...] = ()) -> Sum:
    """The state hash's terms of one record of a checkpoint as DCP stored it, read back in one process: a
    tensor's chunk at ``at`` of a tensor of ``shape`` (DCP stores each chunk once, whichever ranks held it), or a
    value (``shape`` None) and whatever it holds. The records' sums and ``position_sum`` add up to the state
    hash the ranks recorded at the save, at any world size and in any layout (``trainer.export.consolidate``)."""
    if shape is not None:
        if _LAYOUT_KEYS.fullmatch(fqn):
            return Sum()
        return tensor_sum(fqn, value, shape, at if shape else None, chunk=STORED_CHUNK)
    total = Sum()
    for name, leaf in _leaves(value, fqn):
        if _LAYOUT_KEYS.fullmatch(name):
            continue
        total = total + (
            tensor_sum(name, leaf, tuple(leaf.shape)) if isinstance(leaf, torch.Tensor) else value_sum(name, leaf)
        )
    return total


def position_sum(position: Any) -> Sum:
    """The data position's part of the state hash (the manifest's ``data_position``)."""
    total = Sum()
    for name, leaf in _leaves(position, "data_position"):
        total = total + value_sum(name, leaf)
    return total


def data_position(step: int, skips: list[DataSkip], global_batch: int, seed: int) -> dict[str, Any]:
    """Where the data stands after ``step``: the manifest's ``data_position``, and a part of the state hash."""
    return {
        "next_step": step,
        "samples_consumed": data_index(step + 1, skips) * global_batch,
        "seed": seed,
        "skips": [k.model_dump() for k in skips],
    }


def rng_digest(rng: dict[str, Any], cuda_index: int | None = None) -> str:
    """The sha256 of a rank's RNG streams (``trainer.loop.rng.rng_state``): Python's, NumPy's, torch's, and of the
    CUDA streams only its own device's (``cuda_index``): how many devices a process sees may change between
    attempts, and only its own device's stream is its."""
    h = hashlib.sha256()
    parts: list[bytes] = []  # hashed at once: the same digest as an update per part, in less time
    for name, leaf in _leaves({k: v for k, v in rng.items() if k != "cuda"}):
        parts.append(name.encode())
        if isinstance(leaf, torch.Tensor):
            parts.append(leaf.detach().cpu().contiguous().numpy().tobytes())
        else:
            parts.append(repr(leaf).encode())
    h.update(b"".join(parts))
    cuda = rng.get("cuda") or []
    if cuda_index is not None and 0 <= cuda_index < len(cuda):
        h.update(b"cuda" + cuda[cuda_index].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def ledger_sum(positions: np.ndarray, ids: np.ndarray, n_samples: int) -> Sum:
    """The ledger terms of the samples ``ids`` read at ``positions`` of the sample order: one per (epoch, id)."""
    if len(ids) == 0:
        return Sum()
    epochs = torch.from_numpy(np.asarray(positions, dtype=np.int64) // n_samples)
    a, b = _terms(torch.from_numpy(np.asarray(ids, dtype=np.int64)), epochs, _salt("ledger"), wide=True).tolist()
    return Sum(a, b)


def planned_ledger(first: int, last: int, skips: list[DataSkip], global_batch: int, seed: int, n_samples: int) -> Sum:
    """The ledger the sample order plans for steps ``first``..``last``: what the ranks must have consumed. Work and
    memory follow the samples (in pieces of PIECE), not the steps: steps between two skips read one run of
    positions, and each epoch's part of a run is one slice of that epoch's permutation."""
    total = Sum()
    cuts = sorted({k.after_step for k in skips if first <= k.after_step < last})
    bounds = [first - 1, *cuts, last]
    for lo, hi in itertools.pairwise(bounds):  # steps lo+1..hi read consecutive positions
        if hi <= lo:
            continue
        start, end = data_index(lo + 1, skips) * global_batch, (data_index(hi, skips) + 1) * global_batch
        for p0 in range(start, end, PIECE):
            p1 = min(end, p0 + PIECE)
            for epoch in range(p0 // n_samples, (p1 - 1) // n_samples + 1):
                a, b = max(p0, epoch * n_samples), min(p1, (epoch + 1) * n_samples)
                ids = epoch_permutation(seed, epoch, n_samples)[a - epoch * n_samples : b - epoch * n_samples]
                total = total + ledger_sum(np.arange(a, b), ids, n_samples)
    return total
