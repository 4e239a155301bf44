"""Flash snapshots (trainer.checkpoint.flash): a rank's state in two shared-memory slots, in-process."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import DRILL
from tests.test_drills import attempt_with_rank_1_killed
from trainpipe.trainer.checkpoint import memory_tier
from trainpipe.trainer.checkpoint.files import ChecksumMismatch
from trainpipe.trainer.checkpoint.flash import FlashProof, FlashSnapshots, SlotRecord, not_for, state_checksums
from trainpipe.trainer.checkpoint.memory_tier import run_checkpoints
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.launch import warm_attempts
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.supervise.attempt import train_attempt

pytestmark = pytest.mark.usefixtures("warm_module")  # its attempts fork their agents (conftest)

FLASH = ["checkpoint.memory_every_steps=1", "checkpoint.memory_snapshot=flash"]
PROOF = FlashProof(rng="0" * 64, ledger=(1, 2), samples=8)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(5, 3, generator=g), "h": torch.randn(7, generator=g).bfloat16()},
        "optim": {
            "state": {0: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(5, 3, generator=g)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "mask": torch.rand(4, generator=g) > 0.5,
        "ids": torch.arange(3, dtype=torch.int64) * seed,
        "empty": torch.empty(0, 2),
        "progress": {"step": seed, "tokens": seed * 10},
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_a_snapshot_restores_every_tensor_and_value_bit_for_bit(tmp_path):
    flash = FlashSnapshots(str(tmp_path), rank=1)
    state, extra = _state(3), {"rng": {"torch": torch.get_rng_state()}, "step": 3}
    flash.save(3, state, extra, {"step": 3, "data_position": {"seed": 1}}, PROOF)
    flash.wait()
    got, got_extra, record = flash.read(3)
    assert _equal(got, state) and _equal(got_extra, extra)
    assert record.manifest == {"step": 3, "data_position": {"seed": 1}} and record.proof == PROOF
    assert state_checksums(got) == [e.checksum for e in record.tensors]
    got["model"]["w"].add_(1)  # a copy: the next snapshot's bytes never reach a restored state
    assert _equal(flash.read(3)[0], state)
    assert oct(os.stat(flash.folder).st_mode & 0o777) == "0o700"


def test_two_slots_hold_the_newest_two_and_a_failed_save_leaves_the_newest(tmp_path, monkeypatch):
    flash = FlashSnapshots(str(tmp_path), rank=0)
    for step in (1, 2, 3):
        flash.save(step, _state(step), {}, {}, PROOF)
    flash.wait()
    assert sorted(r.step for r in flash.records().values()) == [2, 3]
    assert len(flash.saves_s) == 3 and len(flash.stalls_s) == 3 and len(flash.costs_s) == 3
    # A tensor it cannot hold: said, and no slot changed.
    flash.save(4, {"x": torch.ones(2, dtype=torch.uint16)}, {}, {}, PROOF)
    flash.save(4, {"x": torch.nn.Buffer(torch.ones(1)).as_subclass(_Odd)}, {}, {}, PROOF)
    assert flash.failures == 2 and sorted(r.step for r in flash.records().values()) == [2, 3]
    assert len(flash.stalls_s) == 5 and len(flash.saves_s) == 3  # every rank counts each due snapshot (auto)

    # No room left in shared memory (a full /dev/shm): the slot's pages are taken before the copy, so the save
    # fails with a warning, where a sparse file would have killed the rank with SIGBUS mid-copy.
    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    flash.save(4, {**_state(4), "more": torch.ones(100)}, {}, {}, PROOF)  # a new size: the slot is resized
    assert flash.failures == 3
    assert [r.step for r in flash.records().values()] == [3]  # step 2's slot is no one's snapshot now
    assert _equal(flash.read(3)[0], _state(3))
    flash.drop_after(2)
    assert flash.records() == {}


class _Odd(torch.Tensor):
    pass


def _rewrite(path: Path, raw: dict) -> None:
    """A record as a save writes one, its digest included: what a bug (or a forger) could leave."""
    text = json.dumps(raw).encode()
    path.write_bytes(text + b"\n" + hashlib.sha256(text).hexdigest().encode())


def _values(obj) -> str:
    blob = io.BytesIO()
    torch.save(obj, blob)
    return base64.b64encode(blob.getvalue()).decode()


def test_a_changed_byte_or_a_hostile_record_does_not_load(tmp_path):
    flash = FlashSnapshots(str(tmp_path), rank=0)
    flash.save(5, _state(5), {}, {}, PROOF)
    flash.wait()
    [(slot, record)] = flash.records().items()
    bin_path, path = Path(flash.folder, f"slot-{slot}.bin"), Path(flash.folder, f"slot-{slot}.json")
    with open(bin_path, "r+b") as f:
        f.seek(record.tensors[2].offset)
        byte = f.read(1)
        f.seek(record.tensors[2].offset)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ChecksumMismatch, match="tensor 2 does not match its checksum"):
        flash.read(5)
    with open(bin_path, "r+b") as f:  # as it was
        f.seek(record.tensors[2].offset)
        f.write(byte)
    good = json.loads(path.read_bytes().rpartition(b"\n")[0])

    text = path.read_bytes().replace(b'"step":5', b'"step":6')  # a field changed, the digest not
    path.write_bytes(text)
    assert flash.records() == {}
    no_record = []
    for hostile in (
        {"tensors": [{**good["tensors"][0], "offset": record.size}, *good["tensors"][1:]]},  # past the slot's end
        {"tensors": [good["tensors"][0]] * 200},  # overlapping entries: many clones of one region
        {"tensors": [{"dtype": "object", "shape": [1], "offset": 0, "checksum": 0}]},  # a dtype outside the list
        {"tensors": [{**good["tensors"][0], "shape": [0, 2**64]}]},
        {"size": 1 << 40},
    ):
        _rewrite(path, {**good, **hostile})
        no_record.append(flash.records())
    assert no_record == [{}] * 5
    with pytest.raises(ChecksumMismatch, match="no snapshot of step 5"):
        flash.read(5)
    for values in ({"state": os.system, "extra": {}}, {"state": {}}, [1, 2]):  # code to call; no extra; no dict
        _rewrite(path, {**good, "values": _values(values)})
        with pytest.raises(ChecksumMismatch, match="snapshot does not load"):
            flash.read(5)
    _rewrite(path, good)
    assert _equal(flash.read(5)[0], _state(5))
    bin_path.rename(Path(flash.folder, "elsewhere"))
    bin_path.symlink_to(Path(flash.folder, "elsewhere"))  # a link where the slot was: not followed
    flash._maps.clear()
    with pytest.raises(ChecksumMismatch, match="snapshot does not load"):
        flash.read(5)


def test_flash_snapshots_hold_plain_tensors_and_say_why_not():
    """A sharded state (FSDP, tensor or pipeline parallel) gets DCP snapshots; across hosts flash snapshots are
    copied to a peer (tests/test_flash_peers.py)."""
    assert not_for(sharded=False) == ""
    assert not_for(sharded=True) == "its state is sharded"


def _held(root: str, rank: int) -> set[int]:
    return {r.step for r in FlashSnapshots(root, rank).records().values()}


@pytest.mark.drill
def test_a_sigkilled_rank_resumes_from_flash_slots_and_a_changed_byte_is_refused(home, drill_digest):
    """Flash snapshots every step (two ranks, store checkpoints every 10). Once both ranks hold a snapshot past
    step 23, rank 1 is SIGKILLed. A byte of rank 0's copy of the newest step both hold is then changed: the
    retry refuses it by its checksum and resumes from the step before it where both hold that (else from the store),
    to the uninterrupted run's weights."""
    prof = load_profile("local", [*DRILL, "tracking.enabled=false", *FLASH])
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    with warm_attempts(prof):
        root = os.path.join(os.path.dirname(run_checkpoints(memory_tier.current(), prof.store.root, "flash")), "flash")

        ready = lambda: all(max(_held(root, r), default=0) >= 24 for r in (0, 1))  # noqa: E731
        attempt_with_rank_1_killed(prof, "flash", dataset_uri, ready, "snapshots past 23")
        common = sorted(_held(root, 0) & _held(root, 1))
        assert common and common[-1] >= 24, common
        flash = FlashSnapshots(root, 0)
        slot, record = next((s, r) for s, r in flash.records().items() if r.step == common[-1])
        with open(os.path.join(flash.folder, f"slot-{slot}.bin"), "r+b") as f:
            f.seek(record.tensors[0].offset)
            byte = f.read(1)
            f.seek(record.tensors[0].offset)
            f.write(bytes([byte[0] ^ 0x10]))

        second = train_attempt(prof, "flash", dataset_uri, attempt=2)
    assert second.result is not None, "\n".join(second.job.tail[-30:])
    skipped = [s for s in second.result.skipped_checkpoints if s.uri.startswith(root)]
    assert len(skipped) == 1 and "does not match its checksum" in skipped[0].reason, second.result.skipped_checkpoints
    if len(common) == 2:  # the step before it, from memory
        assert second.result.resumed_tier == "memory" and second.result.start_step == common[0], second.result
        assert second.result.resumed_from == os.path.join(root, f"step-{common[0]:08d}")
    else:  # rank 0 had taken one snapshot more than rank 1 when it died: the store's step 20
        assert second.result.resumed_tier == "store" and second.result.start_step == 20, second.result
    assert second.result.resume_verified and second.result.model_digest == drill_digest


def test_a_snapshot_whose_values_are_not_a_trainers_is_named_not_loaded():
    """Values that load but are not what Trainer.save snapshots (a section missing, progress at another step than
    the record's, no RNG streams) are a reason to skip the snapshot, checked on every rank before anything
    changes."""
    from trainpipe.trainer.loop.flash_resume import not_a_trainers_snapshot as _not_a_trainers_snapshot

    record = SlotRecord(rank=0, step=7, size=64, tensors=[], values="", manifest={}, proof=PROOF)
    state = {"model": {}, "optim": {}, "scheduler": {}, "progress": {"step": 7, "tokens": 70}}
    assert _not_a_trainers_snapshot(state, {"rng": {}}, record, 7) == ""
    assert "does not hold a model" in _not_a_trainers_snapshot({**state, "optim": [1]}, {"rng": {}}, record, 7)
    moved = {**state, "progress": {"step": 99, "tokens": 70}}
    assert "records progress" in _not_a_trainers_snapshot(moved, {"rng": {}}, record, 7)
    assert "records progress" in _not_a_trainers_snapshot(state, {"rng": {}}, record, 8)
    assert "no RNG streams" in _not_a_trainers_snapshot(state, {}, record, 7)
