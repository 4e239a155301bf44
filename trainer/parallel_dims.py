"""The ranks' layout: how a world of ranks divides the work (pipeline stages, data-parallel replicas and
shards, tensor-parallel ranks), as torchtitan's ``ParallelDims``. ``ParallelConfig.layout`` (``trainer/config.py``)
resolves a profile's ``parallel`` section into one; ``loop/mesh.py`` builds the DeviceMesh from it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

MeshAxis = Literal["pp", "dp_replicate", "dp_shard", "tp"]  # the mesh's dimensions, outermost first


@dataclass(frozen=True)
class Layout:
    """How the world's ranks divide the work (``parallel``, resolved against a world size): pipeline stages
    outermost, then data-parallel replicas, data-parallel shards, and tensor-parallel ranks (neighbouring ranks,
    so on one host). Their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    fsdp: bool = False  # FSDP2 over the data-parallel dimensions (train.strategy fsdp), else DDP

    NAMES: ClassVar[tuple[MeshAxis, ...]] = ("pp", "dp_replicate", "dp_shard", "tp")

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return self.pp, self.dp_replicate, self.dp_shard, self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those that take different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def meshed(self) -> bool:
        """More than one dimension (tp, pp, or HSDP's replicas): the ranks form a DeviceMesh of them."""
        return self.fsdp and (self.tp > 1 or self.pp > 1 or self.dp_replicate > 1)

    def coordinates(self, rank: int) -> dict[MeshAxis, int]:
        """Where ``rank`` sits in the mesh (row-major, tp fastest, as init_device_mesh lays it out)."""
        out: dict[MeshAxis, int] = {}
        for name, size in reversed(list(zip(self.NAMES, self.sizes, strict=True))):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in self.NAMES}

    def place(self, rank: int) -> str:
        """``rank``'s coordinates as a beacon carries them: ``pp.dp_replicate.dp_shard.tp``."""
        return ".".join(str(c) for c in self.coordinates(rank).values())

    def describe(self) -> str:
        """E.g. ``pp 2 × dp_shard 2`` (the dimensions over one rank), or ``1 rank``."""
        parts = [f"{n} {s}" for n, s in zip(self.NAMES, self.sizes, strict=True) if s > 1]
        return " × ".join(parts) or "1 rank"


def check_virtual_ranks(k: int, deterministic: bool, global_batch: int, micro_batch: int, world_size: int) -> None:
    """``train.virtual_ranks`` K: a power of two, its shards whole micro-batches, and the world size dividing it;
    ValueError (one line, for the profile's check) otherwise."""
    if k & (k - 1):
        raise ValueError(f"train.virtual_ranks={k} is not a power of two (1, 2, 4, 8, ...)")
    if not deterministic:
        raise ValueError("train.virtual_ranks needs train.deterministic: true (the same bits need the same kernels)")
    if global_batch % (k * micro_batch):
        raise ValueError(
            f"train.global_batch={global_batch} is not divisible by train.virtual_ranks × train.micro_batch = "
            f"{k} × {micro_batch}: each virtual shard must be whole micro-batches"
        )
    if k % world_size:
        raise ValueError(
            f"the world size {world_size} does not divide train.virtual_ranks={k}; pick a power of two it divides"
        )
