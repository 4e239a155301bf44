"""Checkpoints in the store (trainer/checkpoint/catalog.py, loading.py): commit, verification, resume choice, pruning.

Single process, no process group: the production Checkpointer and DCP work without one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from trainpipe.trainer.checkpoint.catalog import (
    inspect_checkpoint,
    latest_valid,
    list_checkpoints,
    prune_checkpoints,
    remove_checkpoint,
    require_valid,
)
from trainpipe.trainer.checkpoint.checkpointer import Checkpointer
from trainpipe.trainer.checkpoint.loading import load_checkpoint, load_rank_extra
from trainpipe.trainer.config import ModelConfig
from trainpipe.trainer.errors import CheckpointError
from trainpipe.trainer.model import GPT, model_digest
from trainpipe.trainer.store_paths import CHECKPOINT_MANIFEST as MANIFEST
from trainpipe.trainer.store_paths import step_uri

CFG = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)


def trained_model(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    """A tiny GPT after one AdamW step, so the optimizer has state."""
    torch.manual_seed(seed)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size + 1))
    _, loss = model(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def save(root: Path, step: int, model: GPT, optimizer: torch.optim.Optimizer) -> str:
    """A synchronous save through the production checkpointer (no pruning)."""
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    extra = {"rng": torch.get_rng_state(), "step": step}
    Checkpointer(str(root), keep_last=100, storage_options=None, use_async=False).save(
        step, state, extra, {"step": step, "model_digest": model_digest(model.state_dict())}, sync=True
    )
    return step_uri(str(root), step)


def data_files(uri: str) -> list[Path]:
    """Every file of a checkpoint except the manifest, biggest first."""
    files = [p for p in Path(uri).rglob("*") if p.is_file() and p.name != MANIFEST]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture
def ckpt(tmp_path):
    """(checkpoint root, model, optimizer) with step 1 saved."""
    root = tmp_path / "checkpoints"
    model, optimizer = trained_model()
    save(root, 1, model, optimizer)
    return root, model, optimizer


def test_manifest_lists_every_file_with_its_sha256(ckpt):
    root, model, _ = ckpt
    uri = step_uri(str(root), 1)
    manifest_path = Path(uri) / MANIFEST
    assert manifest_path.is_file()
    info = inspect_checkpoint(uri)
    files = info.manifest["files"]
    on_disk = {str(p.relative_to(uri)): hashlib.sha256(p.read_bytes()).hexdigest() for p in data_files(uri)}
    assert files == on_disk
    assert ".metadata" in files
    assert "extra/rank-00000.pt" in files
    assert info.manifest["step"] == 1
    assert info.manifest["world_size"] == 1
    assert info.manifest["model_digest"] == model_digest(model.state_dict())


def test_fresh_checkpoint_is_valid(ckpt):
    root, _, _ = ckpt
    info = inspect_checkpoint(step_uri(str(root), 1))
    assert info.committed and info.valid, info.reason
    assert info.step == 1
    assert info.size_bytes > 0
    assert require_valid(step_uri(str(root), 1)).valid


def test_load_restores_weights(ckpt):
    root, model, _ = ckpt
    fresh = GPT(CFG)
    assert model_digest(fresh.state_dict()) != model_digest(model.state_dict())
    load_checkpoint(step_uri(str(root), 1), {"model": fresh.state_dict()})
    assert model_digest(fresh.state_dict()) == model_digest(model.state_dict())
    assert fresh.head.weight is fresh.wte.weight  # still tied


def test_load_missing_checkpoint_raises(tmp_path):
    with pytest.raises(CheckpointError, match="step-00000009") as exc:
        load_checkpoint(step_uri(str(tmp_path), 9), {"model": GPT(CFG).state_dict()})
    assert "\n" not in str(exc.value)  # one line for the CLI


def test_truncated_file_invalidates_and_resume_falls_back(ckpt):
    root, model, optimizer = ckpt
    uri2 = save(root, 2, model, optimizer)
    victim = data_files(uri2)[0]
    truncate(victim)

    info = inspect_checkpoint(uri2)
    assert info.committed and not info.valid
    assert str(victim.relative_to(uri2)) in info.reason

    best, skipped = latest_valid(str(root))
    assert best is not None and best.step == 1
    assert [s.step for s in skipped] == [2]
    assert str(victim.relative_to(uri2)) in skipped[0].reason
    assert victim.exists() and (Path(uri2) / MANIFEST).exists()  # reported, not deleted

    with pytest.raises(CheckpointError, match=str(victim.relative_to(uri2))):
        require_valid(uri2)


def test_missing_file_invalidates(ckpt):
    root, _, _ = ckpt
    uri = step_uri(str(root), 1)
    os.remove(Path(uri) / "extra" / "rank-00000.pt")
    info = inspect_checkpoint(uri)
    assert not info.valid
    assert "extra/rank-00000.pt" in info.reason and "missing" in info.reason


def test_interrupted_save_is_not_committed_and_skipped(ckpt):
    root, model, optimizer = ckpt
    uri2 = save(root, 2, model, optimizer)
    (Path(uri2) / MANIFEST).unlink()  # as if the job died before rank 0 committed

    info = inspect_checkpoint(uri2)
    assert not info.committed and not info.valid
    assert "not committed" in info.reason

    best, skipped = latest_valid(str(root))
    assert best is not None and best.step == 1
    assert [(s.step, s.committed) for s in skipped] == [(2, False)]
    assert Path(uri2).is_dir()


def test_no_checkpoints(tmp_path):
    assert list_checkpoints(str(tmp_path / "none")) == []
    assert latest_valid(str(tmp_path / "none")) == (None, [])


def test_prune_keeps_newest_committed_and_leaves_uncommitted(ckpt):
    root, model, optimizer = ckpt
    for step in (2, 3, 4):
        save(root, step, model, optimizer)
    (Path(step_uri(str(root), 4)) / MANIFEST).unlink()  # step 4: interrupted save

    removed = prune_checkpoints(str(root), keep_last=2)
    assert removed == [step_uri(str(root), 1)]
    assert not Path(step_uri(str(root), 1)).exists()
    assert [(i.step, i.committed, i.valid) for i in list_checkpoints(str(root))] == [
        (2, True, True),
        (3, True, True),
        (4, False, False),
    ]
    assert prune_checkpoints(str(root), keep_last=2) == []  # idempotent


def test_prune_never_removes_the_newest_valid(ckpt):
    # Resumed from step 1 past a corrupt step 3 (kept for inspection), then saved step 2:
    # keep_last=1 must not leave only the corrupt checkpoint behind.
    root, model, optimizer = ckpt
    uri3 = save(root, 3, model, optimizer)
    truncate(data_files(uri3)[0])
    save(root, 2, model, optimizer)

    removed = prune_checkpoints(str(root), keep_last=1)
    assert removed == [step_uri(str(root), 1)]
    best, _ = latest_valid(str(root))
    assert best is not None and best.step == 2
    assert Path(uri3).is_dir()  # the invalid one is not deleted silently either


def test_require_valid_on_missing_uri(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        require_valid(step_uri(str(tmp_path), 5))


def test_model_digest():
    a, _ = trained_model(seed=0)
    b, _ = trained_model(seed=0)
    assert model_digest(a.state_dict()) == model_digest(b.state_dict())
    with torch.no_grad():
        b.blocks[0].mlp[0].weight[0, 0] += 1e-3
    assert model_digest(a.state_dict()) != model_digest(b.state_dict())


def test_load_rank_extra(tmp_path):
    model, _ = trained_model()
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    uri = step_uri(str(tmp_path), 7)
    Checkpointer(str(tmp_path), 1, None, use_async=False).save(
        7, {"model": model.state_dict()}, {"rng": rng, "step": 7}, {"step": 7}
    )
    extra = load_rank_extra(uri, 0)
    assert extra is not None and extra["step"] == 7
    assert torch.equal(extra["rng"], rng)
    assert load_rank_extra(uri, 1) is None  # no such rank


def _tamper(uri: str, change) -> None:
    path = Path(uri) / MANIFEST
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


SHA = "0" * 64


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda m: [], "the manifest is not a JSON object"),
        (lambda m: {**m, "step": "one"}, "manifest step 'one' does not match its folder (step 1)"),
        (lambda m: {**m, "step": 7}, "manifest step 7 does not match its folder (step 1)"),
        (lambda m: {**m, "world_size": 2}, "manifest lacks extra/rank-00001.pt"),
        (lambda m: {**m, "world_size": 10**12}, "fewer than a checkpoint of world size 1000000000000 has"),
        (lambda m: {**m, "files": {**m["files"], "../../../dev/zero": SHA}}, "outside its checkpoint folder"),
        (lambda m: {**m, "files": {**m["files"], "/dev/zero": SHA}}, "outside its checkpoint folder"),
        (lambda m: {**m, "files": {**m["files"], "extra/../../x": SHA}}, "outside its checkpoint folder"),
        (lambda m: {**m, "files": {k: 1 for k in m["files"]}}, "has no sha256"),
        (lambda m: {**m, "files": {k: v for k, v in m["files"].items() if k != ".metadata"}}, "lacks .metadata"),
        (lambda m: {**m, "val_loss": "low"}, "manifest field val_loss has the wrong type (str)"),
        (lambda m: {**m, "format": 99}, "manifest format 99, expected 1"),
    ],
)
def test_a_wrong_or_hostile_manifest_makes_the_checkpoint_invalid_before_a_file_is_read(ckpt, change, reason):
    root, _, _ = ckpt
    uri = step_uri(str(root), 1)
    _tamper(uri, change)
    info = inspect_checkpoint(uri)  # "/dev/zero" would be hashed forever if the manifest were trusted
    assert info.committed and not info.valid and reason in info.reason, info.reason
    assert info.as_dict()["world_size"] is None  # nothing of that manifest is used
    with pytest.raises(CheckpointError, match="is not usable"):
        require_valid(uri)


def test_ckpt_list_and_inspect_show_a_hostile_manifest_as_invalid_in_one_line(ckpt, cli):
    root, _, _ = ckpt
    uri = step_uri(str(root), 1)
    _tamper(uri, lambda m: [])
    code, out, err = cli("ckpt", "inspect", uri)
    assert code == 1 and "INVALID: the manifest is not a JSON object" in out, err
    code, out, err2 = cli("ckpt", "list", str(root))
    assert code == 0 and "INVALID (the manifest is not a JSON object)" in out
    assert "Traceback" not in err + err2


class _Touch:
    """A pickle that creates a file when it is unpickled: what a hostile writer of the bucket would plant."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _plant(uri: str, rel: str, payload: bytes) -> None:
    """Replace one file of a checkpoint and fix its sha256 and size in the manifest, as a writer of the store can."""
    (Path(uri) / rel).write_bytes(payload)
    _tamper(
        uri,
        lambda m: {
            **m,
            "files": {**m["files"], rel: hashlib.sha256(payload).hexdigest()},
            **({"sizes": {**m["sizes"], rel: len(payload)}} if "sizes" in m else {}),
        },
    )


@pytest.mark.parametrize("rel", [".metadata", "extra/rank-00000.pt"])
def test_a_poisoned_checkpoint_file_is_never_unpickled(ckpt, tmp_path, rel):
    root, model, optimizer = ckpt
    uri = step_uri(str(root), 1)
    marker = tmp_path / "pwned"
    _plant(uri, rel, pickle.dumps(_Touch(marker)))
    assert inspect_checkpoint(uri).valid  # every checksum matches: only loading can tell
    refused = r"extra state for rank 0 is invalid|DCP metadata cannot be read \(.*which no checkpoint holds"
    with pytest.raises(CheckpointError, match=refused):
        if rel == ".metadata":
            load_checkpoint(uri, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        else:
            load_rank_extra(uri, 0)
    assert not marker.exists()
    if rel == ".metadata":  # validate reads the metadata (not the ranks' extras): the whole CLI path too
        proc = run_cli("validate", uri)
        assert proc.returncode == 2 and not marker.exists()
        assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in proc.stderr


def test_rng_states_round_trip_through_the_safe_format():
    import random

    import numpy as np

    from trainpipe.trainer.loop.rng import rng_state, seed_everything, set_rng_state

    seed_everything(5)
    state = rng_state()
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    set_rng_state(torch.load(buf, weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


@pytest.mark.parametrize("where", ["local", "s3"])
def test_deleting_a_checkpoint_under_a_root_with_glob_characters_deletes_only_that_folder(tmp_path, where, request):
    """fsspec's rm expands '*', '?' and '[': a store root named like a pattern must not reach other runs."""
    from trainpipe.trainer.store import filesystem

    if where == "s3":
        bucket, options = request.getfixturevalue("s3_bucket")
        base = f"s3://{bucket}"
    else:
        base, options = str(tmp_path), None
    fs, _ = filesystem(base, options)
    mine = f"{base}/team[a]*/runs/r1/checkpoints/step-00000001"
    others = [f"{base}/teama/runs/r1/checkpoints/step-00000001", f"{base}/team[a]*x/runs/r1/checkpoints/step-00000001"]
    for folder in [mine, *others]:
        fs.makedirs(filesystem(folder, options)[1], exist_ok=True)
        for name in (MANIFEST, "__0_0.distcp"):
            fs.pipe_file(filesystem(f"{folder}/{name}", options)[1], b"x")
    remove_checkpoint(mine, options)
    assert not fs.exists(filesystem(f"{mine}/__0_0.distcp", options)[1])
    for folder in others:
        assert fs.exists(filesystem(f"{folder}/{MANIFEST}", options)[1]), folder
        assert fs.exists(filesystem(f"{folder}/__0_0.distcp", options)[1]), folder


def test_replicated_state_travels_in_buckets_of_one_dtype_under_the_limit():
    """A resume's broadcast sends one collective per bucket, not per tensor: grouped by device and dtype, in the
    same order on every rank, at most the limit each, and a tensor larger than the limit alone."""
    from trainpipe.trainer.checkpoint.replicated import buckets

    f = [torch.zeros(n) for n in (10, 20, 100, 5, 300)]
    i = [torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)]
    got = buckets([f[0], i[0], f[1], f[2], i[1], f[3], f[4]], limit=120 * 4)
    assert [[t.numel() for t in b] for b in got] == [[10, 20], [100, 5], [3, 4], [300]]
    assert all(len({(t.dtype, t.device) for t in b}) == 1 for b in got)
    assert sorted(id(t) for b in got for t in b) == sorted(id(t) for t in [*f, *i])  # each tensor once
