"""A checkpoint's proof of itself (trainer/checkpoint/proof.py, state_hash.py, chain.py): the state hash is the
same whoever holds which element and changes with any element; the sample ledger is the same at any world size
and changes with a sample read twice; a resume refuses a state that does not hash to its record; ``ckpt verify``
says in one line what holds."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import BIN, ROOT, cli_env
from trainpipe.trainer.checkpoint import catalog
from trainpipe.trainer.checkpoint.chain import verify_run
from trainpipe.trainer.checkpoint.proof import Sum
from trainpipe.trainer.checkpoint.state_hash import ledger_sum, planned_ledger, state_sum, tensor_sum
from trainpipe.trainer.checkpoint.storage import HashingWriter
from trainpipe.trainer.data.sampler import DataSkip, data_index, rank_samples
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.layout import CHECKPOINT_MANIFEST, RunPaths
from trainpipe.trainer.supervise.attempt import train_attempt


def test_a_tensor_hashes_the_same_in_any_blocks_and_differently_after_any_change():
    t = torch.randn(7, 5, 3)
    whole = tensor_sum("w", t, (7, 5, 3), (0, 0, 0))
    rows = tensor_sum("w", t[:3], (7, 5, 3), (0, 0, 0)) + tensor_sum("w", t[3:], (7, 5, 3), (3, 0, 0))
    columns = tensor_sum("w", t[:, :2], (7, 5, 3), (0, 0, 0)) + tensor_sum("w", t[:, 2:], (7, 5, 3), (0, 2, 0))
    assert whole == rows == columns  # FSDP's row shards, a tensor-parallel column split
    ulp = t.clone()
    ulp[1, 1, 1] = torch.nextafter(ulp[1, 1, 1], torch.tensor(float("inf")))
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    others = [
        tensor_sum("w", ulp, (7, 5, 3), (0, 0, 0)),  # one bit of one element
        tensor_sum("w", swapped, (7, 5, 3), (0, 0, 0)),  # the same values elsewhere
        tensor_sum("v", t, (7, 5, 3), (0, 0, 0)),  # another tensor's name
        tensor_sum("w", t.double(), (7, 5, 3), (0, 0, 0)),  # another dtype
        tensor_sum("w", t.reshape(35, 3), (35, 3), (0, 0)),  # another shape
    ]
    assert len({whole, *others}) == 6


def test_a_state_hash_counts_a_replicated_tensor_once_and_every_plain_value():
    state = {"model": {"w": torch.ones(4)}, "scheduler": {"last_epoch": 3, "_last_lr": [0.1]}}
    rank0, rank1 = state_sum(state, 0), state_sum(state, 1)
    assert rank1 == Sum()  # DDP: every rank holds the same tensors; rank 0 adds them
    assert rank0 != state_sum({**state, "scheduler": {"last_epoch": 4, "_last_lr": [0.1]}}, 0)
    assert Sum.parse(rank0.hex()) == rank0


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_ledger_of_the_ranks_is_the_planned_one_at_any_world_size(world_size):
    """Each rank adds the samples it read; their sum is the plan whatever the world size. A sample read twice in
    place of another is a different ledger."""
    batch, seed, n, steps = 8, 3, 20, 7  # 56 samples: the order crosses into epoch 2
    skips = [DataSkip(after_step=2, steps=2, spike_step=4)]
    total, swapped = Sum(), Sum()
    for step in range(1, steps + 1):
        position = data_index(step, skips)
        for rank in range(world_size):
            ids = rank_samples(position, batch, seed, n, rank, world_size)
            first = position * batch + rank * len(ids)
            total = total + ledger_sum(np.arange(first, first + len(ids)), ids, n)
            if step == 5 and rank == 0:
                ids = ids.copy()
                ids[1] = ids[0]
            swapped = swapped + ledger_sum(np.arange(first, first + len(ids)), ids, n)
    assert total == planned_ledger(steps, skips, batch, seed, n)
    assert swapped != total and total != planned_ledger(steps, [], batch, seed, n)


def test_a_manifest_whose_proof_is_not_one_is_an_invalid_checkpoint():
    good = {"state": "0" * 32, "rng": ["a" * 64], "ledger": None, "samples": 0}
    assert catalog.proof_problem(good, 1) is None
    assert "RNG hashes for world size 2" in catalog.proof_problem(good, 2)
    for bad in (
        {**good, "state": "../x"},
        {**good, "extra": 1},
        {**good, "rng": "a" * 64},
        [],
        {**good, "samples": -1},
    ):
        assert catalog.proof_problem(bad, 1).startswith("manifest field proof is not a proof"), bad


def _resave(checkpoint: Path, change) -> None:
    """Rewrite a checkpoint's tensors through DCP with ``change`` applied to its state, and fix up every file's
    sha256 and size in its manifest, leaving its proof as it was: files that hash right and hold another state."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    state = _load_state_dict_from_keys(checkpoint_id=str(checkpoint))
    change(state)
    for f in checkpoint.glob("*.distcp"):
        f.unlink()
    (checkpoint / ".metadata").unlink()
    dcp.save(state, storage_writer=HashingWriter(str(checkpoint)), no_dist=True)  # as the ranks write
    manifest = json.loads((checkpoint / CHECKPOINT_MANIFEST).read_text())
    files = [p for p in checkpoint.rglob("*") if p.is_file() and p.name != CHECKPOINT_MANIFEST]
    rel = {str(p.relative_to(checkpoint)): p for p in files}
    manifest["files"] = {r: hashlib.sha256(p.read_bytes()).hexdigest() for r, p in sorted(rel.items())}
    manifest["sizes"] = {r: p.stat().st_size for r, p in sorted(rel.items())}
    (checkpoint / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest))


def test_a_resume_refuses_a_state_that_does_not_hash_to_its_record(tiny_profile):
    """The same state written again loads verified; one optimizer moment changed, with the manifest's file hashes
    fixed up to match, is refused by the state hash like a corrupt file, and the run resumes from the one before."""
    prof = tiny_profile("cluster.procs_per_node=1", "checkpoint.every_steps=4", "tracking.enabled=false")
    uri = shard_dataset(prof.data, prof.store).uri
    assert train_attempt(prof, "tamper", uri).result.final_step == 8
    step8 = Path(RunPaths(prof.store.root, "tamper").checkpoint(8))

    _resave(step8, lambda state: None)
    second = train_attempt(prof, "tamper", uri, attempt=2)
    same = second.result
    assert same is not None, second.job.tail[-30:]
    assert (same.start_step, same.resume_verified, same.skipped_checkpoints) == (8, True, [])

    def nudge(state) -> None:
        moments = next(v for v in state["optim"]["state"].values() if "exp_avg" in v)
        flat = moments["exp_avg"].view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))

    _resave(step8, nudge)
    assert catalog.inspect_checkpoint(str(step8)).valid  # every file matches its manifest
    again = train_attempt(prof, "tamper", uri, attempt=3).result
    assert again.start_step == 4 and again.resume_verified is True, again
    [refused] = again.skipped_checkpoints
    assert refused.uri == str(step8) and "hashes to" in refused.reason and "recorded at its save" in refused.reason


def test_ckpt_verify_says_in_one_line_what_holds_and_what_does_not(tiny_profile, home):
    import subprocess

    prof = tiny_profile("checkpoint.every_steps=4", "tracking.enabled=false")
    uri = shard_dataset(prof.data, prof.store).uri
    assert train_attempt(prof, "proved", uri).result.final_step == 8

    def verify(*extra: str) -> tuple[int, str]:
        proc = subprocess.run(
            [str(BIN / "trainpipe"), "ckpt", "verify", "proved", *extra],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=cli_env({"TRAINPIPE_HOME": str(home)}),
            timeout=120,
        )
        return proc.returncode, proc.stdout.strip()

    code, out = verify()
    assert code == 0 and out.startswith("run proved: 2 checkpoint(s) hold (steps 4-8)"), out
    assert "the ledger of step 8 is the sample order's 64 samples" in out and "each sample of an epoch once" in out
    step8 = Path(RunPaths(prof.store.root, "proved").checkpoint(8))
    manifest = json.loads((step8 / CHECKPOINT_MANIFEST).read_text())
    forged = {**manifest, "proof": {**manifest["proof"], "ledger": "1" * 32}}
    (step8 / CHECKPOINT_MANIFEST).write_text(json.dumps(forged))
    code, out = verify()
    assert code == 1 and out == (
        "run proved: checkpoint at step 8 fails: its ledger is not the sample order's: some sample was consumed "
        "twice, or another in its place (1 of 2 fail)"
    ), out
    elsewhere = {**manifest, "dataset_uri": str(Path(prof.store.root).parent / "datasets" / "x")}
    (step8 / CHECKPOINT_MANIFEST).write_text(json.dumps(elsewhere))
    code, out = verify("--json")
    assert code == 1 and "is not one of this store's datasets" in out.splitlines()[0], out
    assert json.loads(out.splitlines()[-1])["holds"] is False
    shutil.rmtree(step8.parent)
    store = prof.store
    report = verify_run("proved", str(step8.parent), store.root, store.storage_options, [])
    assert not report.holds and report.line() == "run proved: no checkpoints to verify"
