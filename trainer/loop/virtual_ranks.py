"""Virtual ranks (``train.virtual_ranks: K``): the same weights, bit for bit, at any world size that divides K
(docs/architecture.md §4).

A floating-point sum depends on its order, and a plain all-reduce's order depends on the world size, so the
weights of an elastic run drift in their last bits from the uninterrupted run's. Here the global batch is split
into K fixed virtual shards (shard v: the samples ``[v * B/K, (v+1) * B/K)`` of the step, B the global batch), and
rank r of W computes the gradient of each of its K/W shards on its own, the same micro-batches in the same
order whatever W is. The K gradients are then summed in one fixed binary tree: ((g0 + g1) + (g2 + g3)) ...
Each rank owns a block of K/W consecutive leaves, a subtree when K/W is a power of two (so K must be one), and
the exchange keeps the tree: for each of its shards, ``all_to_all`` sends each rank its region of the gradient,
which then holds every shard's part of its region and sums them in the tree's order; ``all_gather`` returns
the sums. Bandwidth at K = W is a ring all-reduce's (one region out and one in per rank and phase); each extra
shard per rank adds a round of ``all_to_all``. Gradient clipping and the optimizer then see the same gradient
bits at any W, and the step's loss rides along in the same sum.

DDP runs every backward under ``no_sync`` and ``reduce`` is its reduction. FSDP2 reduce-scatters each
virtual shard's gradient at its last micro-batch through ``VirtualReduceScatter`` (FSDP's custom comm hook,
with its division turned off): an ``all_to_all`` keeps every rank's part of this rank's region apart, and the
last shard's call writes their tree sum, so FSDP sets the sharded gradient itself. A one-rank FSDP2 never
calls a comm, so there the loop keeps each shard's gradient (``ShardGrads``). FSDP2's gradient norm sums
over shards in the world size's order, so its clipping is ``clip_by_rows``: per-row sums of squares, gathered
in the tensor's row order and summed the same way at any world size.
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


class VirtualRanks:
    """This rank's virtual shards of each step and their deterministic sum over all ranks."""

    def __init__(self, k: int, rank: int, world_size: int, seed: int, group: dist.ProcessGroup | None = None):
        check_world_size(k, world_size)
        self.k, self.rank, self.world_size, self.seed, self.group = k, rank, world_size, seed, group
        self.per_rank = k // world_size
        self.shard, self.calls = 0, 0
        self._held: list[list[torch.Tensor]] = []  # FSDP2: per comm call of a backward, each shard's received parts

    def shards(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """This rank's samples of a step (its contiguous B/W of them) as (virtual rank, its B/K samples)."""
        size = len(ids) // self.per_rank
        first = self.rank * self.per_rank
        return [(first + j, ids[j * size : (j + 1) * size]) for j in range(self.per_rank)]

    @contextlib.contextmanager
    def rng(self, step: int, virtual_rank: int, device: torch.device) -> Iterator[None]:
        """Within it, torch's random numbers (dropout) are the virtual rank's own for this step, whoever runs it."""
        digest = hashlib.sha256(f"{self.seed}:{step}:{virtual_rank}".encode()).digest()
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            yield

    def begin_shard(self, j: int) -> None:
        """Shard ``j`` of this rank's K/W is about to run its micro-batches (FSDP2's comm counts its calls)."""
        self.shard, self.calls = j, 0

    @property
    def last_shard(self) -> bool:
        return self.shard == self.per_rank - 1

    def reduce(
        self, flats: list[torch.Tensor], waiting: Callable[[], contextlib.AbstractContextManager]
    ) -> torch.Tensor:
        """The tree sum over all K virtual ranks of the flat vectors ``flats`` (this rank's, in virtual order), on
        every rank. ``waiting()`` wraps the collectives (the watchdog's time split)."""
        if self.world_size == 1:
            return tree_sum(flats)
        n, w = flats[0].numel(), self.world_size
        chunk = -(-n // w)
        rounds = []
        with waiting():
            for flat in flats:  # round j: every rank's j-th shard, this rank's region of each
                padded = torch.nn.functional.pad(flat, (0, chunk * w - n))
                received = torch.empty_like(padded)
                dist.all_to_all_single(received, padded, group=self.group)
                rounds.append(received.view(w, chunk))
            # virtual rank v = i * K/W + j came from rank i in round j
            ordered = [rounds[j][i] for i in range(w) for j in range(self.per_rank)]
            mine = tree_sum(ordered)
            gathered = [torch.empty_like(mine) for _ in range(w)]
            dist.all_gather(gathered, mine, group=self.group)
        return torch.cat(gathered)[:n]


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Every parameter's gradient in one flat vector (zeros for one without); the gradients are then cleared."""
    parts = [
        p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device, dtype=p.dtype)
        for p in params
    ]
    flat = torch.cat(parts) if parts else torch.zeros(0)
    for p in params:
        p.grad = None
    return flat


def set_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


class VirtualReduceScatter:
    """FSDP2's reduce-scatter under virtual ranks (its ``set_custom_reduce_scatter``): each call of a shard's
    backward sends every rank its region of this rank's gradient (``all_to_all``) and keeps what it received;
    the last shard's call sums every shard's parts of this rank's region in the tree's order into the output,
    the others leave zeros (the loop clears those gradients). FSDP's calls come in the same order in every
    backward, so the n-th call of each shard is the same module's."""

    def __init__(self, virtual: VirtualRanks):
        self.virtual = virtual

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        v, w = self.virtual, group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        call = v.calls
        v.calls += 1
        if v.shard == 0:
            v._held[call:] = [[]]
        v._held[call].append(received.view(w, -1))
        if not v.last_shard:
            output_tensor.zero_()
            return None
        rounds = v._held[call]
        output_tensor.copy_(tree_sum([rounds[j][i] for i in range(w) for j in range(v.per_rank)]))
        v._held[call] = []
        return None


class ShardGrads:
    """A one-rank FSDP2 (no comm runs): each virtual shard's sharded gradients, kept, then their tree sum."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def keep(self, params: list[torch.nn.Parameter]) -> None:
        self.kept.append(flat_grads([_LocalGrad(p) for p in params]))  # type: ignore[misc]

    def set_sum(self, params: list[torch.nn.Parameter]) -> None:
        flat, offset = tree_sum(self.kept), 0
        for p in params:
            local = p.to_local() if isinstance(p, DTensor) else p
            part = flat[offset : offset + local.numel()].view_as(local).clone()
            if isinstance(p, DTensor):
                part = DTensor.from_local(part, p.device_mesh, p.placements, run_check=False)
            p.grad = part
            offset += local.numel()
        self.kept = []


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


def clip_by_rows(params: list[torch.nn.Parameter], max_norm: float, group: dist.ProcessGroup | None = None) -> float:
    """Clip sharded (FSDP2) gradients to ``max_norm`` by a norm whose bits do not depend on the world size: each
    row's sum of squares (a row lies whole on one rank), gathered in the tensor's row order, then summed as one
    vector on every rank. Returns the norm."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    locals_, rows = [], []
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g = torch.zeros_like(p.to_local() if isinstance(p, DTensor) else p) if g is None else g
        locals_.append(g)
        total = p.shape[0] if p.dim() else 1
        sizes = [len(c) for c in torch.arange(total).chunk(world)] + [0] * world
        rows.append((sizes[:world], -(-total // world)))
    mine = [(g.reshape(g.shape[0], math.prod(g.shape[1:])) if g.dim() else g.reshape(1, 1)) for g in locals_]
    mine = [rows_of.double().square().sum(dim=1) for rows_of in mine]
    pieces = []
    for part, (_, width) in zip(mine, rows, strict=True):
        pieces.append(torch.nn.functional.pad(part, (0, width - part.numel())))
    flat = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, flat, group=group)
    else:
        gathered = [flat]
    ordered, offset = [], 0
    for sizes, width in rows:
        ordered += [gathered[r][offset : offset + sizes[r]] for r in range(world)]
        offset += width
    norm = float(torch.cat(ordered).sum().sqrt()) if ordered else 0.0
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in locals_:
            g.mul_(coef)
    return norm
