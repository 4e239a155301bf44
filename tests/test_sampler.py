"""The global sample order (trainer/data/sampler.py): a function of (seed, epoch) only. Pure logic."""

from __future__ import annotations

import numpy as np
import pytest

from trainpipe.trainer.data.sampler import epoch_permutation, rank_samples, step_samples


def test_same_args_same_ids():
    a = step_samples(3, 8, seed=1337, n_samples=100)
    epoch_permutation.cache_clear()  # not just the cached array handed back twice
    b = step_samples(3, 8, seed=1337, n_samples=100)
    assert a.dtype == np.int64
    assert np.array_equal(a, b)


def test_different_seed_different_ids():
    assert not np.array_equal(step_samples(0, 16, seed=1, n_samples=1000), step_samples(0, 16, seed=2, n_samples=1000))


def test_epochs_differ():
    assert not np.array_equal(epoch_permutation(7, 0, 1000), epoch_permutation(7, 1, 1000))


def test_epoch_covers_every_sample_once():
    ids = np.concatenate([step_samples(s, 10, seed=3, n_samples=50) for s in range(5)])
    assert len(ids) == 50
    assert sorted(ids.tolist()) == list(range(50))
    assert ids.tolist() != list(range(50))  # shuffled, not the identity


def test_crossing_an_epoch_boundary():
    n, gb, seed = 7, 4, 11
    ids = np.concatenate([step_samples(s, gb, seed, n) for s in range(4)])  # 16 positions: epochs 0, 1, 2 (part)
    assert ids[:7].tolist() == epoch_permutation(seed, 0, n).tolist()
    assert ids[7:14].tolist() == epoch_permutation(seed, 1, n).tolist()
    assert ids[14:].tolist() == epoch_permutation(seed, 2, n)[:2].tolist()
    # Step 1 straddles the boundary: three from epoch 0, one from epoch 1.
    assert step_samples(1, gb, seed, n).tolist() == [
        *epoch_permutation(seed, 0, n)[4:7],
        epoch_permutation(seed, 1, n)[0],
    ]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_same_samples_per_step_at_any_world_size(world_size):
    gb, seed, n = 8, 5, 37
    for step in range(12):  # crosses epoch boundaries too
        parts = [rank_samples(step, gb, seed, n, r, world_size) for r in range(world_size)]
        assert all(len(p) == gb // world_size for p in parts)
        assert np.array_equal(np.concatenate(parts), step_samples(step, gb, seed, n))
