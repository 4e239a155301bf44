"""The ranks' one save path (trainer/checkpoint/checkpointer.py), single process: commit order, async commit,
stale folders, pruning and failure counting."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from trainpipe.trainer.checkpoint.catalog import inspect_checkpoint, latest_valid, list_checkpoints
from trainpipe.trainer.checkpoint.checkpointer import Checkpointer
from trainpipe.trainer.loop.callbacks import Callback
from trainpipe.trainer.store_paths import CHECKPOINT_MANIFEST, step_uri

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 64), value)}, "progress": {"step": int(value)}}


class Observer(Callback):
    """Records what the checkpoint events saw; ``fail_at`` makes the write-complete event raise (a failing commit)."""

    def __init__(self, root: Path, fail_at: int | None = None):
        self.root, self.fail_at = root, fail_at
        self.written: list[tuple[int, set[str], bool]] = []
        self.committed: list[tuple[int, float, float]] = []

    def on_checkpoint_written(self, step: int) -> None:
        folder = Path(step_uri(str(self.root), step))
        files = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
        self.written.append((step, files, (folder / CHECKPOINT_MANIFEST).exists()))
        if step == self.fail_at:
            raise OSError("store went away")

    def on_checkpoint_committed(self, step: int, stall_s: float, save_s: float) -> None:
        self.committed.append((step, stall_s, save_s))


def save(ck: Checkpointer, step: int, sync: bool = False) -> float:
    return ck.save(
        step, state(float(step)), {"step": step}, {"step": step, "model_digest": lambda: f"digest-{step}"}, sync=sync
    )


@pytest.mark.parametrize("use_async", [False, True])
def test_the_manifest_is_written_last_and_lists_every_file(tmp_path, use_async):
    events = Observer(tmp_path)
    ck = Checkpointer(str(tmp_path), keep_last=3, storage_options=None, use_async=use_async, events=events)
    save(ck, 1)
    ck.wait()
    [(step, files_before_commit, manifest_before_commit)] = events.written
    assert step == 1 and not manifest_before_commit
    assert {".metadata", "extra/rank-00000.pt"} <= files_before_commit
    info = inspect_checkpoint(step_uri(str(tmp_path), 1))
    assert info.valid and set(info.manifest["files"]) == files_before_commit
    assert info.manifest["model_digest"] == "digest-1"  # a deferred value, evaluated before the commit
    assert ck.committed is not None and ck.committed.step == 1 and ck.committed.digest == "digest-1"
    [(committed_step, stall_s, save_s)] = events.committed
    assert committed_step == 1 and 0 <= stall_s <= save_s


def test_async_save_returns_before_the_commit_and_wait_completes_it(tmp_path):
    events = Observer(tmp_path)
    ck = Checkpointer(str(tmp_path), keep_last=3, storage_options=None, use_async=True, events=events)
    save(ck, 1)
    save(ck, 2)  # waits for 1 first: at most one save in flight
    assert [s for s, _, _ in events.committed][:1] == [1]
    ck.wait()
    assert [i.step for i in list_checkpoints(str(tmp_path)) if i.valid] == [1, 2]
    assert len(ck.stalls_s) == 2 and ck.failures == 0


def test_a_stale_folder_at_the_step_is_replaced_with_a_warning(tmp_path, caplog):
    partial = Path(step_uri(str(tmp_path), 2))
    partial.mkdir(parents=True)
    (partial / "leftover.distcp").write_bytes(b"half a save")
    ck = Checkpointer(str(tmp_path), keep_last=3, storage_options=None, use_async=False, stale_steps={2})
    with caplog.at_level(logging.WARNING, logger="trainpipe.checkpointer"):
        save(ck, 2, sync=True)
    assert "replacing a partial save" in caplog.text
    assert not (partial / "leftover.distcp").exists()
    assert inspect_checkpoint(str(partial)).valid


def test_pruning_keeps_the_newest_and_the_protected_checkpoint(tmp_path):
    first = Checkpointer(str(tmp_path), keep_last=5, storage_options=None, use_async=False)
    save(first, 1, sync=True)
    resumed = Checkpointer(
        str(tmp_path), keep_last=1, storage_options=None, use_async=False, protect=step_uri(str(tmp_path), 1)
    )
    for step in (2, 3):
        save(resumed, step, sync=True)
    assert [i.step for i in list_checkpoints(str(tmp_path))] == [1, 3]


def test_a_failed_background_write_is_counted_and_the_previous_checkpoint_stays(tmp_path):
    ck = Checkpointer(str(tmp_path), keep_last=3, storage_options=None, use_async=True)
    save(ck, 1)
    ck.wait()
    Path(step_uri(str(tmp_path), 2), "__0_0.distcp").mkdir(parents=True)  # the write of step 2 cannot create its file
    save(ck, 2)
    ck.wait()
    assert ck.failures == 1
    assert not inspect_checkpoint(step_uri(str(tmp_path), 2)).committed
    best, _ = latest_valid(str(tmp_path))
    assert best is not None and best.step == 1
    save(ck, 3)  # training goes on, and so do its checkpoints
    ck.wait()
    assert latest_valid(str(tmp_path))[0].step == 3 and ck.failures == 1


def test_a_failed_commit_is_counted_and_leaves_the_checkpoint_uncommitted(tmp_path):
    ck = Checkpointer(
        str(tmp_path), keep_last=3, storage_options=None, use_async=True, events=Observer(tmp_path, fail_at=2)
    )
    save(ck, 1)
    save(ck, 2)
    ck.wait()
    assert ck.failures == 1 and ck.committed.step == 1
    assert inspect_checkpoint(step_uri(str(tmp_path), 1)).valid
    assert not inspect_checkpoint(step_uri(str(tmp_path), 2)).committed
