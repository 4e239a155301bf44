"""The global sample order: a function of (seed, epoch) only.

Sample ``j`` is the token window ``[j * block_size, j * block_size + block_size + 1)``
of the train split. Epoch ``e`` visits all samples in the order of a PCG64
permutation seeded with ``(seed, e)``. Global step ``s`` consumes positions
``[s * global_batch, (s + 1) * global_batch)`` of the endless sequence
epoch 0, epoch 1, ...; rank ``r`` of ``W`` takes the ``r``-th contiguous
``global_batch / W`` of them and splits it into micro-batches. The samples of
a step are therefore the same at any world size; only who computes them changes.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


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
