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

DDP runs every backward under ``no_sync`` and this module is its reduction; FSDP2 is not supported yet
(its reduce-scatter sums in the world size's order, and its gradient norm over shards as well).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

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
