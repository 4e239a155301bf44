"""The global sample order: a function of (seed, epoch) only.

Sample ``j`` is the token window ``[j * block_size, j * block_size + block_size + 1)``
of the train split. Epoch ``e`` visits all samples in the order of a PCG64
permutation seeded with ``(seed, e)``. Global step ``s`` consumes positions
``[s * global_batch, (s + 1) * global_batch)`` of the endless sequence
epoch 0, epoch 1, ...; rank ``r`` of ``W`` takes the ``r``-th contiguous
``global_batch / W`` of them and splits it into micro-batches. The samples of
a step are therefore the same at any world size; only who computes them changes.

A rollback from a loss spike skips the data that fed it (``DataSkip``): the
steps after the checkpoint it resumed from take their positions further on, so
step ``s`` reads position ``data_index(s, skips)``. The skips are recorded in
every later checkpoint's manifest, so a resume stays deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class DataSkip(BaseModel):
    """Steps after ``after_step`` read their data ``steps`` steps further on: the window from that checkpoint
    through a loss spike at ``spike_step``, skipped when the run rolled back from it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    after_step: int = Field(ge=0, le=10**9)  # bounded: a manifest is read from the store (docs/security.md)
    steps: int = Field(ge=1, le=10**9)
    spike_step: int = Field(ge=1, le=2 * 10**9)

    def covers(self, spike_step: int) -> bool:
        """Whether this skip already rolled back from a spike at ``spike_step``."""
        return self.after_step < spike_step <= self.spike_step


def pending_rollbacks(recorded: list[DataSkip], rollbacks: Iterable[int]) -> list[int]:
    """The loss spikes the run rolls back from that ``recorded`` skips do not cover yet, in order."""
    return sorted(s for s in set(rollbacks) if not any(k.covers(s) for k in recorded))


def skips_after(recorded: list[DataSkip], rollbacks: Iterable[int], after_step: int) -> list[DataSkip]:
    """The skips of a run resumed from the checkpoint of ``after_step`` (which recorded ``recorded``): one more
    per spike it does not cover. Each in order: a later spike, fed while an earlier skip from the same
    checkpoint was in force, was fed by a position that much further on, so the skips add up to just past it."""
    pending = [s for s in pending_rollbacks(recorded, rollbacks) if s > after_step]
    return [*recorded, *(DataSkip(after_step=after_step, steps=s - after_step, spike_step=s) for s in pending)]


def data_index(step: int, skips: Iterable[DataSkip] = ()) -> int:
    """The 0-based position in the sample order that step ``step`` (1-based) reads."""
    return step - 1 + sum(k.steps for k in skips if step > k.after_step)


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, n_samples: int) -> np.ndarray:
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n_samples)


def step_samples(step: int, global_batch: int, seed: int, n_samples: int) -> np.ndarray:
    """Sample ids consumed by global step ``step`` (all ranks together)."""
    positions = np.arange(step * global_batch, (step + 1) * global_batch)
    epochs, offsets = np.divmod(positions, n_samples)
    ids = [epoch_permutation(seed, int(e), n_samples)[o] for e, o in zip(epochs, offsets, strict=True)]
    return np.array(ids, dtype=np.int64)


def rank_samples(step: int, global_batch: int, seed: int, n_samples: int, rank: int, world_size: int) -> np.ndarray:
    ids = step_samples(step, global_batch, seed, n_samples)
    per_rank = global_batch // world_size
    return ids[rank * per_rank : (rank + 1) * per_rank]


def micro_batches(ids: np.ndarray, micro_batch: int) -> list[np.ndarray]:
    """A rank's samples of one step, in consecutive micro-batches of ``micro_batch``."""
    return [ids[i : i + micro_batch] for i in range(0, len(ids), micro_batch)]
