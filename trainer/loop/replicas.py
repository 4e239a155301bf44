"""Replica consistency: data-parallel replicas must hold bit-identical weights (docs/architecture.md §9).

A GPU with a silent fault (a flipped bit in memory or a bad ALU) corrupts its
replica's weights without an error; under DDP the gradients are averaged, so the
difference never heals and never shows in the loss. Every ``watchdog.sdc_every``
steps and before every checkpoint commit, each rank sums the exact bit patterns
of each of its parameters (an integer sum, so any single flipped bit changes it;
at a checkpoint also a position-weighted sum, so swapped values do too) and the
ranks compare them in one small all-gather. A mismatch names the ranks that
differ from the majority (with two replicas, both) and the tensors, and stops
the attempt before the checkpoint is written: the retry resumes from the newest
checkpoint, whose replicas agreed when it was saved.

Under FSDP2 no two ranks hold the same shard, so there is nothing to compare.

Resume is exact, so the first step after a resume must give the loss the
attempt that saved the checkpoint computed for that step (each manifest
records it when that step ended before the commit: ``Replay``). A difference is
an ``sdc`` incident at phase ``replay``: a device computed differently, or the
checkpoint's state is not what was saved.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.incidents import ranks_text
from trainpipe.trainer.proc import node_name

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MODULUS = 65521  # position weights cycle through 1..65521 (Fletcher's prime)
_CHUNK = 1 << 20  # elements weighted at a time: the int64 copies stay at 16 MiB whatever the tensor


class ReplicaMismatch(TrainpipeError):
    """Replicas that should hold the same weights do not."""

    def __init__(self, step: int, ranks: list[int], nodes: list[str], tensors: list[str], before_commit: bool):
        self.step, self.ranks, self.nodes, self.tensors = step, ranks, nodes, tensors
        self.before_commit = before_commit
        who = (
            f"rank {ranks[0]}'s weights differ"
            if len(ranks) == 1
            else f"ranks {ranks_text(ranks)} hold different weights"
        )
        against = " from the other replicas'" if len(ranks) == 1 else " (no majority to tell which is right)"
        shown = ", ".join(tensors[:3]) + (f" and {len(tensors) - 3} more" if len(tensors) > 3 else "")
        device = "that rank's device" if len(ranks) == 1 else "one of their devices"
        when = " before its checkpoint (not committed)" if before_commit else ""
        super().__init__(
            f"{who}{against} at step {step}{when} in {len(tensors)} tensor(s) ({shown}): silent data corruption "
            f"on {device}; the run rolls back to the newest checkpoint, whose replicas agreed"
        )


class ReplicaCheck:
    """Compares this rank's weight fingerprint with every other rank's; ``check`` raises ReplicaMismatch."""

    def __init__(self, model: torch.nn.Module):
        self.names = [n for n, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]

    def fingerprint(self, full: bool = False) -> torch.Tensor:
        """Per parameter the integer sum of its elements' bit patterns (``full``: and a position-weighted sum)."""
        sums = []
        for p in self.params:
            bits = p.detach().reshape(-1).view(_BITS[p.element_size()])
            sums.append(bits.sum(dtype=torch.int64))
            if full:  # wraps around in int64, the same way on every rank
                sums.append(_weighted_sum(bits))
        return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)

    def check(self, step: int, full: bool = False) -> str:
        """Raise ReplicaMismatch unless every rank holds the same bits; returns the agreed fingerprint's digest."""
        mine = self.fingerprint(full)
        world = dist.get_world_size()
        everyone = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
        dist.all_gather_single(everyone, mine)  # all_gather_into_tensor is deprecated in torch 2.13
        everyone = everyone.view(world, mine.numel())
        rows = [tuple(r) for r in everyone.cpu().tolist()]
        if len(set(rows)) == 1:
            return hashlib.sha256(everyone[0].cpu().numpy().tobytes()).hexdigest()[:16]
        common, count = Counter(rows).most_common(1)[0]
        majority = common if count > world // 2 else None
        ranks = [r for r, row in enumerate(rows) if row != majority]
        columns = {i for row in rows for i, v in enumerate(row) if v != rows[0][i]}
        per = 2 if full else 1
        tensors = sorted({self.names[i // per] for i in columns}, key=self.names.index)
        nodes: list[str] = [""] * world
        dist.all_gather_object(nodes, node_name())
        raise ReplicaMismatch(step, ranks, [nodes[r] for r in ranks], tensors, before_commit=full)


def _weighted_sum(bits: torch.Tensor) -> torch.Tensor:
    """The sum of each element's bit pattern times its position's weight (1..65521, cycling), chunk by chunk."""
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    cycle = _weights(bits.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        at = start % _MODULUS
        total += chunk.mul_(cycle[at : at + chunk.numel()]).sum()
    return total


@functools.cache
def _weights(device: torch.device) -> torch.Tensor:
    """Position weights from any offset in the cycle for a chunk: ``[at : at + n]`` weighs positions ``at``..
    (made once per device: making them for every chunk of every check cost as much as the sums)."""
    return torch.arange(_CHUNK + _MODULUS, device=device, dtype=torch.int64) % _MODULUS + 1


class ReplayMismatch(TrainpipeError):
    """The first step after a resume did not give the loss the saving attempt computed for it."""

    def __init__(self, step: int, resumed: int, loss: float, expected: float):
        self.step = step
        super().__init__(
            f"step {step}, the first after resuming from step {resumed}, gave loss {loss!r}; the attempt that saved "
            f"that checkpoint computed {expected!r}: resume is exact, so a device computed differently (silent data "
            "corruption) or the checkpoint's state is not what was saved"
        )


class Replay:
    """The loss a checkpoint's manifest recorded for the step after it, checked when that step is trained again."""

    def __init__(self, resumed: int, record: object, context: dict[str, Any]):
        self.resumed, self.step, self.loss = resumed, None, None
        if (  # the manifest is read from the store: typed, finite, and saved under the settings of this attempt
            isinstance(record, dict)
            and type(record.get("step")) is int
            and type(record.get("loss")) is float
            and math.isfinite(record["loss"])
            and record.get("context") == context
        ):
            self.step, self.loss = record["step"], record["loss"]

    def check(self, step: int, loss: float) -> None:
        if step == self.step and self.step == self.resumed + 1 and self.loss is not None and loss != self.loss:
            raise ReplayMismatch(step, self.resumed, loss, self.loss)
