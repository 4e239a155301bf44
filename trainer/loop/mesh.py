"""The ranks' one DeviceMesh (``parallel``: pp × dp_replicate × dp_shard × tp) and this rank's place in it
(docs/architecture.md §10).

The mesh is built once, with every dimension (a size-1 one too), pipeline stages outermost and tensor-parallel
ranks innermost, so a tensor-parallel group is neighbouring ranks on one host. Everything else takes its part of
it: FSDP2 the data-parallel dimensions (HSDP when there are replicas), DTensor the tp one, the pipeline the pp one.
Only data-parallel ranks take different samples: the tp and pp ranks of one replica read the same batch.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainpipe.trainer.device import new_group
from trainpipe.trainer.parallel_dims import Layout


class Mesh:
    """This rank's coordinates in ``layout`` and the mesh's groups (the DeviceMesh only when the layout has
    more than one dimension; a plain DDP or FSDP2 layout needs none beyond the default group)."""

    def __init__(self, layout: Layout, rank: int, device_type: str):
        self.layout, self.rank = layout, rank
        self.coords = layout.coordinates(rank)
        self.device_mesh: DeviceMesh | None = None
        self._pp_objects: dist.ProcessGroup | None = None
        if layout.meshed:
            self.device_mesh = init_device_mesh(device_type, layout.sizes, mesh_dim_names=Layout.NAMES)
        if layout.meshed and layout.pp > 1 and device_type == "cuda":  # objects between stages: gloo, on the host
            per_stage = layout.world_size // layout.pp
            for offset in range(per_stage):  # every rank takes part in making every group
                group = new_group(list(range(offset, layout.world_size, per_stage)), backend="gloo")
                if rank % per_stage == offset:
                    self._pp_objects = group

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: which share of each step's samples it takes."""
        return self.coords["dp_replicate"] * self.layout.dp_shard + self.coords["dp_shard"]

    @property
    def stage(self) -> int:
        return self.coords["pp"]

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.layout.pp - 1

    @property
    def reads_for_replica(self) -> bool:
        """The one rank of a data-parallel replica that accounts for its samples (the ledger counts each once)."""
        return self.coords["tp"] == 0 and self.coords["pp"] == 0

    @property
    def stage_rank(self) -> tuple[int, int]:
        """(this rank's index, the number of ranks) among those that hold the same pipeline stage: a plain tensor
        of the stage is held whole by each of them."""
        size = self.layout.world_size // self.layout.pp
        return self.rank % size, size

    @property
    def replicas(self) -> dict[str, int] | None:
        """This rank's coordinates on the dimensions over which a tensor is held alike when its own mesh lacks
        them (every one but pp, whose stages hold different tensors); None without a mesh."""
        if self.device_mesh is None:
            return None
        return {name: c for name, c in self.coords.items() if name != "pp"}

    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel dimensions FSDP2 spreads over: (dp_replicate, dp_shard) for HSDP, else dp_shard."""
        assert self.device_mesh is not None
        if self.layout.dp_replicate > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp_shard"]

    def tp_mesh(self) -> DeviceMesh:
        assert self.device_mesh is not None
        return self.device_mesh["tp"]

    def pp_group(self) -> dist.ProcessGroup:
        assert self.device_mesh is not None
        return self.device_mesh["pp"].get_group()

    def pp_object_group(self) -> dist.ProcessGroup:
        """This rank's pipeline group for Python objects (a gloo one beside NCCL: pickles stay in host memory)."""
        return self._pp_objects or self.pp_group()

    def end_stages_group(self) -> dist.ProcessGroup | None:
        """This rank with its peer on the other end of the pipeline (same data-parallel and tp coordinates), for
        parameters the first and last stages both hold; None on a middle stage. Every rank takes part in making
        every such group (torch.distributed's rule), so each rank calls this once, at the same point."""
        layout, mine = self.layout, None
        per_stage = layout.world_size // layout.pp
        for offset in range(per_stage):
            pair = [offset, (layout.pp - 1) * per_stage + offset]
            group = new_group(pair)
            if self.rank in pair:
                mine = group
        return mine
