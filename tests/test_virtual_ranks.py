"""Virtual ranks (trainer/loop/virtual_ranks.py): the same weights, bit for bit, at 1, 2 and 4 processes under
DDP and FSDP2, and through an elastic resume from 2 to 1 and from 1 to 2; without them the world size shows in
the last bits."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.loop.virtual_ranks import VirtualRanks, VirtualRanksError, check_world_size, tree_sum
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import RunPaths
from trainpipe.trainer.supervise.attempt import train_attempt

pytestmark = pytest.mark.usefixtures("warm_module")

# One intra-op thread per rank at every world size: a BLAS kernel's own split of a sum follows its thread count.
# Two micro-batches per virtual shard (accumulated within it), dropout (each shard's own stream) and a clip that
# bites (FSDP2's norm over rows).
SAME_BITS = [
    "tracking.enabled=false",
    "cluster.threads_per_proc=1",
    "checkpoint.every_steps=4",
    "train.global_batch=16",
    "train.micro_batch=2",
    "model.dropout=0.1",
    "train.grad_clip=0.05",
]


def test_the_tree_sums_pairs_level_by_level():
    a, b, c, d = (torch.tensor([x], dtype=torch.float32) for x in (1e8, 1.0, -1e8, 1.0))
    assert tree_sum([a, b, c, d]).item() == ((a + b) + (c + d)).item() == 0.0  # a left fold gives 1.0
    assert (((a + b) + c) + d).item() == 1.0
    assert tree_sum([a, b, c]).item() == ((a + b) + c).item()


def test_a_ranks_virtual_shards_are_its_contiguous_slices():
    ids = np.arange(8)
    assert [(v, s.tolist()) for v, s in VirtualRanks(4, 1, 2, seed=0).shards(ids)] == [
        (2, [0, 1, 2, 3]),
        (3, [4, 5, 6, 7]),
    ]
    for k, w in ((4, 3), (6, 2), (4, 8)):
        with pytest.raises(VirtualRanksError, match=f"not {w}"):
            check_world_size(k, w)


@pytest.mark.parametrize(
    "sets, says",
    [
        (["train.virtual_ranks=3"], "is not a power of two"),
        (["train.virtual_ranks=8", "train.global_batch=8", "train.micro_batch=2"], "each virtual shard must be whole"),
        (["train.virtual_ranks=4", "train.deterministic=false"], "needs train.deterministic: true"),
        (["train.virtual_ranks=2", "cluster.procs_per_node=4"], "the world size 4 does not divide"),
    ],
)
def test_a_profile_whose_virtual_ranks_cannot_hold_is_one_line(home, sets, says):
    from tests.conftest import TINY

    with pytest.raises(ProfileError, match=says):
        load_profile("local", [*TINY, *sets])


class _Digests(dict):
    """(strategy, processes, virtual) → the run's final digest; ``checkpoints``: → (profile, final checkpoint)."""

    def __init__(self):
        super().__init__()
        self.checkpoints: dict[tuple[str, int, bool], tuple[object, str]] = {}


@pytest.fixture(scope="module")
def digests(tmp_path_factory):
    """The final digest of the tiny run under DDP and FSDP2 at 1, 2 and 4 processes, with and without 4 virtual
    ranks."""
    from tests.conftest import TINY

    found = _Digests()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINPIPE_HOME", str(tmp_path_factory.mktemp("virtual") / "home"))
        for strategy in ("ddp", "fsdp"):
            for procs in (1, 2, 4):
                for virtual in (True, False):
                    sets = [*TINY, *SAME_BITS, f"cluster.procs_per_node={procs}", f"train.strategy={strategy}"]
                    prof = load_profile("local", [*sets, *(["train.virtual_ranks=4"] if virtual else [])])
                    uri = shard_dataset(prof.data, prof.store).uri
                    done = train_attempt(prof, f"{strategy}-{procs}-{virtual}", uri)
                    assert done.result is not None, "\n".join(done.job.tail[-30:])
                    found[strategy, procs, virtual] = done.result.model_digest
                    found.checkpoints[strategy, procs, virtual] = (prof, done.result.checkpoint_uri)
    return found


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_of_virtual_ranks_exports_with_its_logits(digests, strategy, tmp_path):
    """Four virtual ranks on two processes: the export holds the run's weights, and transformers' logits are
    trainpipe's."""
    from tests.hf_check import exported_logits_match
    from trainpipe.trainer.export.folder import export_checkpoint

    prof, uri = digests.checkpoints[strategy, 2, True]
    report = export_checkpoint(uri, tmp_path / "m", prof, check_state=True)
    assert report.model_digest == digests[strategy, 2, True] and report.state_hash
    exported_logits_match(uri, tmp_path / "m", prof)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_four_virtual_ranks_give_the_same_weights_on_1_2_and_4_processes(digests, strategy):
    assert digests[strategy, 1, True] == digests[strategy, 2, True] == digests[strategy, 4, True]
    plain = {digests[strategy, procs, False] for procs in (1, 2, 4)}
    assert len(plain) > 1  # the drift virtual ranks remove


@pytest.mark.parametrize("strategy, before, after", [("ddp", 2, 1), ("fsdp", 2, 1), ("fsdp", 1, 2)])
def test_an_elastic_resume_keeps_the_bits(tiny_profile, digests, strategy, before, after):
    """A run that shrank from 2 processes to 1 (or grew from 1 to 2) after step 4's commit ends with the weights
    of the uninterrupted run."""

    def profile(procs: int):
        sets = [f"cluster.procs_per_node={procs}", f"train.strategy={strategy}", "train.virtual_ranks=4"]
        return tiny_profile(*SAME_BITS, *sets)

    uri = shard_dataset(profile(before).data, profile(before).store).uri
    first = train_attempt(profile(before), "elastic", uri)
    assert first.result.final_step == 8
    shutil.rmtree(RunPaths(profile(before).store.root, "elastic").checkpoint(8))  # as if it died after step 4's
    resumed = train_attempt(profile(after), "elastic", uri, attempt=2).result
    assert (resumed.start_step, resumed.world_size, resumed.resume_verified) == (4, after, True)
    assert resumed.model_digest == digests[strategy, before, True] == digests[strategy, after, True]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_eight_virtual_ranks_give_the_same_weights_on_1_and_4_processes(tiny_profile, strategy):
    """Eight shards: a rank sums eight, four or two of its own before the one exchange."""
    found = set()
    for procs in (1, 4):
        sets = [f"cluster.procs_per_node={procs}", f"train.strategy={strategy}", "train.virtual_ranks=8"]
        prof = tiny_profile(*SAME_BITS, *sets)
        done = train_attempt(prof, f"eight-{procs}", shard_dataset(prof.data, prof.store).uri)
        assert done.result is not None, "\n".join(done.job.tail[-30:])
        found.add(done.result.model_digest)
    assert len(found) == 1
