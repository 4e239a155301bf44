"""Virtual ranks (``train.virtual_ranks: K``): the same weights, bit for bit, at any world size that divides K
(docs/architecture.md §4).

A floating-point sum depends on its order, and a plain all-reduce's order depends on the world size, so the
weights of an elastic run drift in their last bits from the uninterrupted run's. Here the global batch is split
into K fixed virtual shards (shard v: the samples ``[v * B/K, (v+1) * B/K)`` of the step, B the global batch), and
rank r of W computes the gradient of each of its K/W shards on its own, the same micro-batches in the same
order whatever W is. The K gradients are then summed in one fixed binary tree: ((g0 + g1) + (g2 + g3)) ...
Each rank owns a block of K/W consecutive leaves, a subtree when K/W is a power of two (so K must be one): it
sums its own shards' gradients as they come (``Subtree``, a binary counter holding at most log2(K/W) + 1 of
them), and one exchange sums the W subtrees in the tree's order: ``all_to_all`` sends each rank its region of
every rank's subtree, which it sums in rank order, and ``all_gather`` returns the regions. The traffic is a ring
all-reduce's whatever K is; it is not overlapped with the backward as DDP's buckets are. Gradient clipping
and the optimizer then see the same gradient bits at any W, and the step's loss rides along in the same sum.

DDP runs every backward under ``no_sync`` and ``reduce`` is its reduction. FSDP2 reduce-scatters each
virtual shard's gradient at its last micro-batch through ``VirtualReduceScatter`` (FSDP's custom comm hook,
with its division turned off): each call adds this rank's unsharded gradient of its group to the group's
subtree, and the last shard's call exchanges it and writes this rank's region of the sum, so FSDP sets the
sharded gradient itself. A one-rank FSDP2 never calls a comm, so there the loop sums each shard's gradient
(``ShardGrads``). FSDP2's gradient norm sums over shards in the world size's order, so its clipping is
``clip_by_rows``: each row's sum of squares added pairwise, gathered in the tensor's row order, and added
pairwise again, the same at any world size.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainpipe.trainer.errors import TrainpipeError


class VirtualRanksError(TrainpipeError):
    """The world size does not divide ``train.virtual_ranks`` (e.g. after a node was left out)."""


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` summed pairwise, level by level: ((p0 + p1) + (p2 + p3)) + ...; an odd last one moves up."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def check_world_size(k: int, world_size: int) -> None:
    if k % world_size or (k // world_size) & (k // world_size - 1):
        raise VirtualRanksError(
            f"train.virtual_ranks={k} needs a world size that divides it with a power of two left (1, 2, 4, ...), "
            f"not {world_size}: set train.virtual_ranks to a power of two that {world_size} divides"
        )


class Subtree:
    """The tree sum of the tensors pushed, in order, holding at most log2(n) + 1 of them: a binary counter, whose
    carries are the tree's pairs. For a power-of-two count it is ``tree_sum`` of them, bit for bit."""

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []

    def push(self, t: torch.Tensor) -> None:
        level = 0
        while self._stack and self._stack[-1][0] == level:
            t = self._stack.pop()[1] + t
            level += 1
        self._stack.append((level, t))

    def result(self) -> torch.Tensor:
        return tree_sum([t for _, t in self._stack])  # one left for a power of two


class VirtualRanks:
    """This rank's virtual shards of each step and their deterministic sum over all ranks.

    A rank's K/W shards are a subtree of the sum's tree, so it sums them itself as they come (``Subtree``) and
    one exchange sums the W subtrees: ``all_to_all`` gives each rank every rank's sum of its region, which it sums
    in rank order, and ``all_gather`` returns the regions. Traffic is a ring all-reduce's whatever K is."""

    def __init__(self, k: int, rank: int, world_size: int, seed: int, group: dist.ProcessGroup | None = None):
        check_world_size(k, world_size)
        self.k, self.rank, self.world_size, self.seed, self.group = k, rank, world_size, seed, group
        self.per_rank = k // world_size
        self.shard, self.calls = 0, 0
        self.signatures: list[tuple[int, torch.dtype]] = []  # FSDP2: each comm call of the first shard's backward
        self._subtrees: list[Subtree] = []  # FSDP2: per comm call, this rank's shards' gradients so far

    def shards(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """This rank's samples of a step (its contiguous B/W of them) as (virtual rank, its B/K samples)."""
        size = len(ids) // self.per_rank
        first = self.rank * self.per_rank
        return [(first + j, ids[j * size : (j + 1) * size]) for j in range(self.per_rank)]

    @contextlib.contextmanager
    def rng(self, step: int, virtual_rank: int, device: torch.device) -> Iterator[None]:
        """Within it, torch's random numbers (dropout) are the virtual rank's own for this step, whoever runs it:
        the CPU generator and this rank's own CUDA device's, each restored after."""
        seed = int.from_bytes(hashlib.sha256(f"{self.seed}:{step}:{virtual_rank}".encode()).digest()[:8], "little")
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.default_generator.manual_seed(seed >> 1)
            if device.type == "cuda":
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(seed >> 1)
            yield

    def begin_shard(self, j: int) -> None:
        """Shard ``j`` of this rank's K/W is about to run its micro-batches (FSDP2's comm counts its calls)."""
        if j > 0 and self.calls != len(self.signatures):
            raise VirtualRanksError(
                f"FSDP2 reduced {self.calls} gradient groups in a virtual shard's backward and {len(self.signatures)} "
                "in the first one: every virtual shard must give every parameter a gradient"
            )
        self.shard, self.calls = j, 0

    @property
    def last_shard(self) -> bool:
        return self.shard == self.per_rank - 1

    def reduce(self, local: torch.Tensor, announce: Callable[[], None]) -> torch.Tensor:
        """The tree sum over all K virtual ranks, on every rank, from this rank's sum of its own shards ``local``
        (a flat vector). ``announce()`` tells the watchdog the rank enters the exchange."""
        if self.world_size == 1:
            return local
        announce()
        n, w = local.numel(), self.world_size
        chunk = -(-n // w)
        padded = torch.nn.functional.pad(local, (0, chunk * w - n))
        received = torch.empty_like(padded)
        dist.all_to_all_single(received, padded, group=self.group)
        mine = tree_sum(list(received.view(w, chunk)))  # rank i's subtree, for this rank's region, in rank order
        out = torch.empty(w * chunk, dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        return out[:n]


def flat_grads(params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every parameter's gradient in one flat vector (zeros for one without), and which had one (1.0 or 0.0); the
    gradients are then cleared."""
    parts = [
        p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device, dtype=p.dtype)
        for p in params
    ]
    device = params[0].device if params else torch.device("cpu")
    had = torch.tensor([float(p.grad is not None) for p in params], device=device)
    flat = torch.cat(parts) if parts else torch.zeros(0)
    for p in params:
        p.grad = None
    return flat, had


def set_grads(params: list[torch.nn.Parameter], flat: torch.Tensor, had: torch.Tensor) -> None:
    """``flat`` back as the parameters' gradients, views of it; a parameter no shard gave one keeps None."""
    offset = 0
    for p, got in zip(params, had.tolist(), strict=True):
        p.grad = flat[offset : offset + p.numel()].view_as(p) if got > 0 else None
        offset += p.numel()


class VirtualReduceScatter:
    """FSDP2's reduce-scatter under virtual ranks (its ``set_custom_reduce_scatter``): each call of a shard's
    backward adds this rank's unsharded gradient of one group to that group's ``Subtree``; the last shard's call
    exchanges the subtree's sum like ``VirtualRanks.reduce`` and writes this rank's region of the tree sum into the
    output, the others leave zeros (the loop clears those gradients). FSDP's calls come in the same order in every
    backward; each call's size and dtype are checked against the first shard's, so a mismatch is an error, never
    a gradient added to another group's."""

    def __init__(self, virtual: VirtualRanks):
        self.virtual = virtual

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        v, w = self.virtual, group.size()
        call, signature = v.calls, (input_tensor.numel(), input_tensor.dtype)
        v.calls += 1
        if v.shard == 0:
            v.signatures[call:] = [signature]
            v._subtrees[call:] = [Subtree()]
        elif call >= len(v.signatures) or v.signatures[call] != signature:
            raise VirtualRanksError(
                f"FSDP2's gradient group {call} of a virtual shard's backward is not the first shard's "
                f"({signature} against {v.signatures[call] if call < len(v.signatures) else 'none'})"
            )
        v._subtrees[call].push(input_tensor)
        if not v.last_shard:
            output_tensor.zero_()
            return None
        local = v._subtrees[call].result()
        v._subtrees[call] = Subtree()
        received = torch.empty_like(local)
        dist.all_to_all_single(received, local, group=group)
        output_tensor.copy_(tree_sum(list(received.view(w, -1))))
        return None


class ShardGrads:
    """A one-rank FSDP2 (no comm runs): each virtual shard's sharded gradients, summed as they come."""

    def __init__(self) -> None:
        self.sum = Subtree()
        self.had: torch.Tensor | None = None

    def keep(self, params: list[torch.nn.Parameter]) -> None:
        flat, had = flat_grads([_LocalGrad(p) for p in params])  # type: ignore[misc]
        self.sum.push(flat)
        self.had = had if self.had is None else torch.maximum(self.had, had)

    def set_sum(self, params: list[torch.nn.Parameter]) -> None:
        flat, offset = self.sum.result(), 0
        for p, got in zip(params, self.had.tolist() if self.had is not None else [], strict=True):
            local = p.to_local() if isinstance(p, DTensor) else p
            part = flat[offset : offset + local.numel()].view_as(local)
            if isinstance(p, DTensor):
                part = DTensor.from_local(part, p.device_mesh, p.placements, run_check=False)
            p.grad = part if got > 0 else None
            offset += local.numel()
        self.sum, self.had = Subtree(), None


class _LocalGrad:
    """A parameter seen through its local shard, for ``flat_grads``."""

    def __init__(self, p: torch.nn.Parameter):
        self.p = p
        self.local = p.to_local() if isinstance(p, DTensor) else p

    @property
    def grad(self) -> torch.Tensor | None:
        g = self.p.grad
        return None if g is None else (g.to_local() if isinstance(g, DTensor) else g)

    @grad.setter
    def grad(self, value) -> None:
        self.p.grad = value

    def numel(self) -> int:
        return self.local.numel()

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype


def pairwise_sums(x: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` (2-D) summed pairwise over the row padded with zeros to a power of two: element-wise adds
    only, so a row's bits do not depend on how many rows ``x`` holds (a reduction kernel's split does, on CUDA and
    on more than one CPU thread)."""
    width = 1 << max(0, (x.shape[1] - 1).bit_length())
    x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
    while x.shape[1] > 1:
        x = x[:, 0::2] + x[:, 1::2]
    return x[:, 0]


def row_sums_of_squares(g: torch.Tensor) -> torch.Tensor:
    """Each row's sum of squares, in float64 (``pairwise_sums``)."""
    return pairwise_sums(
        (g.reshape(g.shape[0], math.prod(g.shape[1:])) if g.dim() else g.reshape(1, 1)).double().square()
    )


def clip_by_rows(
    params: list[torch.nn.Parameter],
    max_norm: float,
    announce: Callable[[], None] = lambda: None,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Clip sharded (FSDP2) gradients to ``max_norm`` by a norm whose bits do not depend on the world size: each
    row's sum of squares (a row lies whole on one rank), gathered in the tensor's row order, then added pairwise
    on every rank. Returns the norm; ``announce()`` before the gather."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    locals_, widths, sizes = [], [], []
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        locals_.append(g)
        rows = p.shape[0] if p.dim() else 1
        sizes.append(([len(c) for c in torch.arange(rows).chunk(world)] + [0] * world)[:world])
        widths.append(-(-rows // world))
    device = params[0].device if params else torch.device("cpu")
    pieces = []
    for p, g, width in zip(params, locals_, widths, strict=True):
        local = p.to_local() if isinstance(p, DTensor) else p
        part = row_sums_of_squares(g) if g is not None else torch.zeros(local.shape[0] if local.dim() else 1)
        pieces.append(torch.nn.functional.pad(part.to(device=device, dtype=torch.float64), (0, width - part.numel())))
    flat = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
    if world > 1:
        announce()
        gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(gathered, flat, group=group)
        by_rank = list(gathered.view(world, -1))
    else:
        by_rank = [flat]
    ordered, offset = [], 0
    for rows, width in zip(sizes, widths, strict=True):
        ordered += [by_rank[r][offset : offset + rows[r]] for r in range(world)]
        offset += width
    every = torch.cat(ordered) if ordered else torch.zeros(1, dtype=torch.float64)
    norm = float(pairwise_sums(every.reshape(1, -1))[0].sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in locals_:
            if g is not None:
                g.mul_(coef)
    return norm
