"""A bucket writer's records (docs/security.md): what the store holds is read as a bounded regular file, checked by
its model, and a record that is not one is said in one line; it never hangs, exhausts or steers a run.

Each test is an attack as the role would make it: a FIFO, a link to a device or an oversized file planted where
a run reads a record, a progress file that is not one, a request that is not signed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainpipe.trainer.errors import StoreError
from trainpipe.trainer.launch.jobs import recorded
from trainpipe.trainer.orchestrate.lease import RunLease
from trainpipe.trainer.orchestrate.records import RunRecords
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store import NotARecord, read_json_uri

RUN = "r1"


def plant(path: Path, kind: str) -> None:
    """What another writer of the store leaves where a record should be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes it: an open for reading waits forever
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")  # read to its end, never ends
    elif kind == "folder":
        path.mkdir()
    else:  # a regular file larger than any record
        with open(path, "wb") as fh:
            fh.truncate(65 * 2**20)


KINDS = ["fifo", "link to /dev/zero", "folder", "oversized"]


def one_line(text: str) -> str:
    assert "\n" not in text and "Traceback" not in text, text
    return text


@pytest.fixture
def run_dir(home) -> Path:
    return home / "store" / "runs" / RUN


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_lease_is_one_line_not_a_hang(home, run_dir, cli, kind):
    plant(run_dir / "lease.json", kind)
    code, _, err = cli("run", "--run-name", RUN, "--set", "preflight.enabled=false")
    assert code == 2, err
    line = one_line(err.strip())
    assert "lease.json" in line and "move it aside" in line, line


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("record", ["incidents.json", "attempts.json"])
def test_a_planted_history_record_is_moved_aside_and_the_run_goes_on(home, run_dir, kind, record):
    plant(run_dir / record, kind)
    prof = load_profile("local", [])
    records = RunRecords(prof.store, RUN)
    assert (records.incidents if record == "incidents.json" else records.attempts)() == []
    assert not (run_dir / record).exists() and not (run_dir / record).is_symlink()
    assert [p.name.split(".corrupt-")[0] for p in run_dir.iterdir()] == [record]  # kept beside, for a person


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("record", ["excluded_nodes.json", "rollbacks.json", "jobs.json"])
def test_a_planted_record_that_steers_a_run_is_one_line(home, run_dir, kind, record):
    plant(run_dir / record, kind)
    prof = load_profile("local", [])
    records = RunRecords(prof.store, RUN)
    read = {
        "excluded_nodes.json": records.excluded_nodes,
        "rollbacks.json": records.rollbacks,
        "jobs.json": lambda: recorded(prof.store, RUN),
    }[record]
    with pytest.raises(StoreError) as exc:
        read()
    line = one_line(str(exc.value))
    assert record in line and "move it aside" in line, line


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_dataset_manifest_is_one_line(home, kind):
    from trainpipe.trainer.data.format import load_manifest

    folder = home / "store" / "datasets" / "0123456789abcdef"
    plant(folder / "manifest.json", kind)
    with pytest.raises(StoreError) as exc:
        load_manifest(str(folder))
    assert "manifest.json" in one_line(str(exc.value))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "oversized"])
def test_a_planted_shard_is_corrupt_at_once_never_read_past_its_size(home, kind):
    from trainpipe.trainer.data.format import load_manifest
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.data.tokens import TokenStream
    from trainpipe.trainer.errors import DataError

    prof = load_profile("local", ["data.max_bytes=200000", "data.shard_tokens=65536"])
    uri = shard_dataset(prof.data, prof.store).uri
    shard = load_manifest(uri)["splits"]["val"]["shards"][0]["file"]
    (Path(uri).parent / shard).unlink()
    plant(Path(uri).parent / shard, kind)
    with pytest.raises(DataError, match=r"is missing|not of the size its manifest's token count says") as exc:
        TokenStream(uri, "val")
    one_line(str(exc.value))
    stream = TokenStream(uri, "train")  # looked at before the swap: the read itself refuses it
    shard = stream.shards[0]["file"]
    (Path(uri).parent / shard).unlink()
    plant(Path(uri).parent / shard, kind)
    with pytest.raises(DataError, match="corrupt") as exc:
        stream.shard(0)
    one_line(str(exc.value))


def test_a_forged_token_count_is_refused_before_anything_is_sized_by_it(home):
    """A bucket writer raises a split's token counts (2^27 samples): the sample order would be sized by them before
    any shard is read, in every rank and in ``ckpt verify``."""
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.data.tokens import TokenStream
    from trainpipe.trainer.errors import DataError

    prof = load_profile("local", ["data.max_bytes=200000", "data.shard_tokens=65536"])
    uri = shard_dataset(prof.data, prof.store).uri
    manifest = json.loads((Path(uri) / "manifest.json").read_text())
    split = manifest["splits"]["train"]
    split["shards"][0]["tokens"] += 2**27 * 128
    split["tokens"] = sum(s["tokens"] for s in split["shards"])
    (Path(uri) / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="not of the size its manifest's token count says"):
        TokenStream(uri, "train", verify=False)


def test_a_record_of_its_size_still_reads_and_a_missing_one_is_the_default(home, run_dir):
    run_dir.mkdir(parents=True)
    (run_dir / "rollbacks.json").write_text(json.dumps([5, 9]))
    prof = load_profile("local", [])
    assert RunRecords(prof.store, RUN).rollbacks() == [5, 9]
    assert read_json_uri(str(run_dir / "absent.json"), None, "default") == "default"
    lease = RunLease(str(run_dir), RUN, None, owner="me")
    assert lease.acquire() is None and lease.current().owner == "me"
    with pytest.raises(NotARecord):
        plant(run_dir / "big.json", "oversized")
        read_json_uri(str(run_dir / "big.json"), None, None)


# ---------------------------------------------------------------- node 0's progress, as a bucket writer plants it


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "planted, says",
    [
        ({"ranks": {"0": {"step": "9", "time": 1.0}}}, "step is not a number"),
        ({"ranks": {"0": {"step": 9, "time": "soon"}}}, "time is not a finite number"),
        ({"ranks": {"x": {"step": 9}}}, "'ranks.x"),
        ({"ranks": {"0": {"step": 9}}, "findings": [{"kind": "no such kind"}]}, "'findings.0.kind"),
        ({"ranks": {}, "command": "rm -rf /"}, "'command'"),
        ([1, 2], "the document"),
    ],
)
def test_a_planted_progress_file_is_left_out_in_one_line_and_the_follower_goes_on(tmp_path, monkeypatch, planted, says):
    from fsspec.implementations.local import LocalFileSystem

    from trainpipe.tasks import train
    from trainpipe.tasks.train import FollowAttempt
    from trainpipe.trainer.launch.outcome import LiveView
    from trainpipe.trainer.launcher import Watch

    class Quiet:
        def __getattr__(self, name):
            return lambda *a, **k: None

    monkeypatch.setattr(train, "create_progress_artifact", lambda *a, **k: None)  # no Prefect API here
    follow, lines, findings = FollowAttempt(RUN, 100, Quiet(), every_s=0), [], []
    view = LiveView(Watch(on_line=lines.append, on_progress=follow, on_finding=findings.append))
    path = tmp_path / "progress.json"
    path.write_text(json.dumps({"ranks": {"0": {"step": 3, "time": 1.0}, "1": {"step": 4, "time": 1.0}}}))
    view.look(LocalFileSystem(), str(path))
    assert follow.step == 4 and lines == []
    path.write_text(json.dumps(planted))
    for _ in range(3):  # a follower looks every few seconds: the same file is said once
        view.look(LocalFileSystem(), str(path))
    assert follow.step == 4 and findings == []  # nothing of it was used, and no one was named
    assert len(lines) == 1 and says in one_line(lines[0]) and "blamed on no one" in lines[0], lines


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
def test_a_progress_file_that_is_no_file_is_one_line_not_a_hang(tmp_path, kind):
    from fsspec.implementations.local import LocalFileSystem

    from trainpipe.trainer.launch.outcome import LiveView
    from trainpipe.trainer.launcher import Watch

    lines, seen = [], []
    plant(tmp_path / "progress.json", kind)
    view = LiveView(Watch(on_line=lines.append, on_progress=seen.append))
    view.look(LocalFileSystem(), str(tmp_path / "progress.json"))
    view.look(LocalFileSystem(), str(tmp_path / "progress.json"))
    assert seen == [{}, {}]  # nothing of it: the follower still hears each look (where it notices a cancel)
    assert len(lines) == 1 and "progress.json" in one_line(lines[0]), lines


@pytest.mark.timeout(20)
def test_json_nested_past_the_parsers_stack_is_not_a_record(home, run_dir, tmp_path):
    """``[[[[…`` two hundred thousand deep makes Python's JSON parser raise RecursionError, which no reader
    expected: it ended the follower and the run's start."""
    from fsspec.implementations.local import LocalFileSystem

    from trainpipe.trainer.launch.outcome import LiveView
    from trainpipe.trainer.launcher import Watch

    deep = "[" * 200_000
    (tmp_path / "progress.json").write_text(deep)
    lines, seen = [], []
    LiveView(Watch(on_line=lines.append, on_progress=seen.append)).look(
        LocalFileSystem(), str(tmp_path / "progress.json")
    )
    assert seen == [{}] and lines == []  # not progress: nothing of it used, the follower goes on
    run_dir.mkdir(parents=True)
    (run_dir / "incidents.json").write_text(deep)
    assert RunRecords(load_profile("local", []).store, RUN).incidents() == []  # moved aside, as a corrupt record
    assert [p.name.split(".corrupt-")[0] for p in run_dir.iterdir()] == ["incidents.json"]
