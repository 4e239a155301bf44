"""The memory tier (trainer.checkpoint.memory_tier): snapshots in host memory that outlive a crashed rank, resumed
from before the store's checkpoints, checked like them; its folder is private to the run's user."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import DRILL
from tests.test_drills import attempt_with_rank_1_killed
from trainpipe.trainer.checkpoint import catalog, memory_tier
from trainpipe.trainer.checkpoint.files import ChecksumMismatch
from trainpipe.trainer.checkpoint.flash import FlashSnapshots
from trainpipe.trainer.checkpoint.memory_tier import (
    MemoryTierUnavailable,
    keep_memory,
    leave_behind,
    private_folder,
    run_checkpoints,
    run_key,
)
from trainpipe.trainer.checkpoint.peer_copy import (
    PeerRing,
    accept,
    completion_plan,
    held_files,
    resumable,
    write_inside,
)
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.launch import warm_attempts
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import RunPaths
from trainpipe.trainer.supervise.attempt import train_attempt

pytestmark = pytest.mark.usefixtures("warm_module")  # its attempts fork their agents (conftest)

# DCP snapshots (flash ones: tests/test_flash.py)
MEMORY = [*DRILL, "tracking.enabled=false", "checkpoint.memory_every_steps=1", "checkpoint.memory_snapshot=dcp"]


def test_the_folder_is_private_removed_at_the_end_and_refused_when_anyone_else_may_enter(tmp_path):
    with keep_memory(base=str(tmp_path)) as folder:
        assert folder is not None and memory_tier.current() == folder
        assert (os.stat(folder).st_mode & 0o777) == 0o700 and private_folder(folder) == folder
        Path(folder, "x").write_text("snapshot")
    assert memory_tier.current() is None and not os.path.exists(folder)

    opened = tmp_path / "opened"
    opened.mkdir(mode=0o755)
    os.chmod(opened, 0o755)
    link = tmp_path / "link"
    link.symlink_to(opened)
    for path, why in ((opened, "open to other users"), (link, "is not a folder"), ("relative", "absolute")):
        with pytest.raises(MemoryTierUnavailable, match=why):
            private_folder(str(path))
    with keep_memory(base=str(tmp_path / "missing")) as none:  # said once, and the run goes on without it
        assert none is None and memory_tier.current() is None


def test_a_folder_whose_supervisor_died_is_removed_by_the_next_run_and_no_other(tmp_path):
    """tmpfs holds memory until the files are deleted: a supervisor killed inside its block leaves its folder,
    which the next ``keep_memory`` on the host removes; a live process's folder and another user's stay."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan, live = tmp_path / f"trainpipe-memory-{dead.pid}-abc", tmp_path / f"trainpipe-memory-{os.getpid()}-def"
    others = tmp_path / f"trainpipe-memory-{dead.pid}-ghi"
    for folder in (orphan, live, others):
        folder.mkdir(mode=0o700)
        (folder / "snapshot").write_text("state")
    if os.getuid() == 0:
        os.chown(others, 65534, 65534)
    # A folder whose pid this process cannot see (another pid namespace) but whose lock a live process holds.
    elsewhere = tmp_path / f"trainpipe-memory-{dead.pid}-jkl"
    elsewhere.mkdir(mode=0o700)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(elsewhere / ".lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with keep_memory(base=str(tmp_path)) as mine:
            left = sorted(p.name for p in tmp_path.iterdir())
            with keep_memory(base=str(tmp_path)) as inner:  # a block open in this very process is no orphan
                assert os.path.isdir(mine) and inner != mine
    finally:
        holder.kill()
        holder.wait()
    expected = {live.name, elsewhere.name, Path(mine).name} | ({others.name} if os.getuid() == 0 else set())
    assert set(left) == expected, left
    with keep_memory(base=str(tmp_path)):  # its holder gone, the locked folder is an orphan like the others
        assert not elsewhere.exists() and live.exists()


def test_a_replaced_jobs_host_leaves_its_tier_and_the_next_job_there_takes_up_the_runs_snapshots(tmp_path):
    """A held job replaced (a host lost, the run goes on without it) leaves each host's folder behind
    (``leave_behind``); the next job's host on the node moves the run's subfolder out of it (``adopt=``) and
    the rest goes as any orphan. Never a live job's folder, another user's, one open to others or a link."""
    key = run_key("/store", "run")
    with contextlib.ExitStack() as running:
        live = running.enter_context(keep_memory(base=str(tmp_path)))  # a job still running: no orphan
        Path(live, key).mkdir(mode=0o700)
        with keep_memory(base=str(tmp_path)) as old:
            Path(old, key, "flash", "rank-0").mkdir(parents=True, mode=0o700)
            Path(old, key, "flash", "rank-0", "slot-0.bin").write_bytes(b"state")
            Path(old, run_key("/store", "other")).mkdir(mode=0o700)
            leave_behind(old)
        assert os.path.isdir(old)  # an orphan now: its lock was released with the block
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        kinds = ("link", "open", "others") if os.getuid() == 0 else ("link", "open")  # others: a chown needs root
        hostile = {n: tmp_path / f"trainpipe-memory-{dead.pid}-{n}" for n in kinds}
        for folder in hostile.values():
            folder.mkdir(mode=0o700)
            (folder / memory_tier.LEFT).write_text(f"{time.time() + 600:.0f}")  # left for the run: still refused
        killed = tmp_path / f"trainpipe-memory-{dead.pid}-kld"  # an opener killed, not a job replaced
        expired = tmp_path / f"trainpipe-memory-{dead.pid}-exp"
        for folder in (killed, expired):
            (folder / key).mkdir(parents=True, mode=0o700)
            os.chmod(folder, 0o700)
            os.utime(folder / key, (time.time() + 120, time.time() + 120))
        (expired / memory_tier.LEFT).write_text(f"{time.time() - 1:.0f}")
        spared = tmp_path / f"trainpipe-memory-{dead.pid}-spr"  # another run's, left for its next job
        (spared / run_key("/store", "other-run")).mkdir(parents=True, mode=0o700)
        os.chmod(spared, 0o700)
        (spared / memory_tier.LEFT).write_text(f"{time.time() + 600:.0f}")
        (hostile["link"] / key).symlink_to(Path(old, key))
        (hostile["open"] / key).mkdir(mode=0o700)
        os.chmod(hostile["open"], 0o755)  # a folder others could enter: anything in it may be theirs
        if "others" in hostile:
            (hostile["others"] / key).mkdir(mode=0o700)
            os.chown(hostile["others"] / key, 65534, 65534)
        for name in kinds[1:]:  # newer than the one to take: still not taken
            os.utime(hostile[name] / key, (time.time() + 60, time.time() + 60))
        with keep_memory(base=str(tmp_path), adopt=key) as new:
            assert Path(new, key, "flash", "rank-0", "slot-0.bin").read_bytes() == b"state"
            assert not Path(new, key).is_symlink()
            assert not os.path.exists(old) and all(p.exists() for p in hostile.values())  # spared, not taken
            assert not killed.exists() and not expired.exists() and spared.exists()
            assert Path(live, key).is_dir()
        with keep_memory(base=str(tmp_path), adopt=key) as again:  # taken once: nothing left to adopt
            assert not Path(again, key).exists()


def test_two_runs_never_share_snapshots():
    a, b = run_checkpoints("/m", "/store", "run"), run_checkpoints("/m", "/store", "run2")
    assert a != b and run_checkpoints("/m", "/other-store", "run") != a and a.startswith("/m/")


@pytest.mark.parametrize("value", ["0", "-1", "often", "true"])
def test_a_cadence_that_cannot_hold_is_one_line_before_anything_starts(value):
    with pytest.raises(ProfileError, match=r"checkpoint\.memory_every_steps") as info:
        load_profile("local", [f"checkpoint.memory_every_steps={value}"])
    assert "a number of steps (1 or more), auto or off" in str(info.value)


def committed_snapshots(folder: str) -> list[int]:
    """The steps of the committed snapshots in a run's memory-tier folder."""
    return [i.step for i in catalog.list_checkpoints(folder, verify=False) if i.committed]


@pytest.mark.drill
def test_a_sigkilled_rank_resumes_from_host_memory_past_the_store_and_an_altered_snapshot_is_refused(
    home, drill_digest
):
    """Store checkpoints every 10 steps, a snapshot into host memory every step. Once a snapshot past step 23 is
    committed, rank 1 is SIGKILLed. The tier outlived the ranks: it holds at most two snapshots, both newer than
    the store's newest. The newest is then altered on purpose: the retry refuses it by its hashes and resumes from
    the other, to the uninterrupted run's weights; the snapshots never reach the store, and the tier's folder is
    gone when the run's attempts end."""
    prof = load_profile("local", MEMORY)
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    with warm_attempts(prof):
        folder = memory_tier.current()
        assert folder is not None and folder.startswith("/dev/shm/")
        snapshots = run_checkpoints(folder, prof.store.root, "memory")

        ready = lambda: any(s >= 23 for s in committed_snapshots(snapshots))  # noqa: E731
        attempt_with_rank_1_killed(prof, "memory", dataset_uri, ready, "a snapshot past step 23")
        kept = committed_snapshots(snapshots)
        store = [i.step for i in catalog.list_checkpoints(RunPaths(prof.store.root, "memory").checkpoints)]
        assert len(kept) == 2 and kept[0] > max(store), (kept, store)  # two per run, both past the store's
        newest, older = (Path(snapshots, f"step-{s:08d}") for s in (kept[1], kept[0]))
        data = max(newest.rglob("*.distcp"), key=lambda p: p.stat().st_size)
        blob = bytearray(data.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        data.write_bytes(bytes(blob))

        second = train_attempt(prof, "memory", dataset_uri, attempt=2)
        assert second.result is not None, "\n".join(second.job.tail[-30:])
        assert second.result.resumed_from == str(older) and second.result.resume_verified, (
            second.result.skipped_checkpoints,
            [x for x in second.job.tail if "memory" in x or "resum" in x],
        )
        [skipped] = second.result.skipped_checkpoints
        assert skipped.uri == str(newest) and "sha256" in skipped.reason, skipped
        assert second.result.model_digest == drill_digest
        assert second.result.resumed_tier == "memory" and second.record().resumed_tier == "memory"
        assert second.result.memory_every_steps == 1 and second.result.memory_stalls_s  # the snapshots it took
        store = [i.step for i in catalog.list_checkpoints(RunPaths(prof.store.root, "memory").checkpoints)]
        assert store and all(s % 10 == 0 for s in store), store
    assert not os.path.exists(folder)


@pytest.mark.drill
@pytest.mark.parametrize("kind,sdc_every", [("dcp", "10"), ("flash", "10"), ("flash", "null")])
def test_a_flipped_bit_is_caught_before_a_snapshot_saves_it_and_the_retry_resumes_an_earlier_one(
    home, drill_digest, kind, sdc_every
):
    """The replicas are compared at every snapshot as at every checkpoint: before a DCP one; a flash one's round
    compares the ranks' bytes and keeps none that differ, and the loop then names the rank. A bit flipped on rank
    1 after step 15 is SDC at step 15's snapshot, so no snapshot holds it, and the retry resumes from host memory
    (a step before 15, past the store's 10) to the weights of the run without the fault. Flash snapshots' rounds
    compare the replicas without the periodic check too (``sdc_every: null``)."""
    flip = ["faults.kind=bitflip", "faults.rank=1", "faults.step=15", "faults.attempts=1"]
    flip.append(f"watchdog.sdc_every={sdc_every}")
    prof = load_profile("local", [*MEMORY, *flip, f"checkpoint.memory_snapshot={kind}"])
    uri = shard_dataset(prof.data, prof.store).uri
    with warm_attempts(prof):
        snapshots = run_checkpoints(memory_tier.current(), prof.store.root, "flipped")
        first = train_attempt(prof, "flipped", uri)
        found = first.incident
        assert found is not None and (found.kind, found.step) == ("sdc", 15), first.job.tail[-20:]
        if kind == "dcp":
            kept = committed_snapshots(snapshots)
        else:  # what rank 1's slots hold
            flash = FlashSnapshots(os.path.join(os.path.dirname(snapshots), "flash"), 1)
            kept = sorted(r.step for r in flash.records().values())
        assert kept and max(kept) < 15, kept
        second = train_attempt(prof, "flipped", uri, attempt=2)
    assert second.result is not None, "\n".join(second.job.tail[-30:])
    assert second.result.resumed_tier == "memory" and 10 < second.result.start_step < 15
    assert second.result.model_digest == drill_digest


@pytest.mark.drill
def test_without_a_folder_or_room_for_the_snapshots_a_run_trains_with_the_store_alone_said_once(tmp_path, tiny_profile):
    """Asked for a memory tier the launcher did not open (train_attempt outside warm_attempts), and one whose
    host's shared memory (a 64 KiB tmpfs here) cannot hold two snapshots of every rank's state: one line each,
    and the run trains to its end with the store's checkpoints."""
    prof = tiny_profile("tracking.enabled=false", "checkpoint.memory_every_steps=1")
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    unopened = train_attempt(prof, "unopened", dataset_uri)
    assert unopened.result is not None and unopened.result.final_step == 8
    said = [x for x in unopened.job.tail if "no memory tier" in x]
    assert len(said) == 1 and "the launcher opened none" in said[0], said
    if os.getuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=1777", "tmpfs", str(small)], check=True)
    try:
        with keep_memory(base=str(small)) as folder:
            full = train_attempt(prof, "full", dataset_uri)
            left = os.listdir(folder)
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert full.result is not None and full.result.final_step == 8
    said = [x for x in full.job.tail if "no memory tier" in x]
    assert len(said) == 1 and "MB of shared memory and this host has 0 MB free" in said[0], said
    assert left == [".lock"]  # not one snapshot was begun (the lock is the opener's)


def test_another_user_cannot_read_or_plant_snapshots(tmp_path):
    """As another uid (nobody): the tier's folder can be neither listed nor written into."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")
    with keep_memory() as folder:
        assert folder is not None
        Path(folder, "snapshot").write_text("state")
        for code in (f"import os; os.listdir({folder!r})", f"open({folder!r} + '/planted', 'w')"):
            out = subprocess.run(
                [sys.executable, "-c", f"import os; os.setgid(65534); os.setuid(65534); {code}"],
                capture_output=True,
                text=True,
            )
            assert out.returncode != 0 and "PermissionError" in out.stderr, out.stderr
        assert sorted(os.listdir(folder)) == [".lock", "snapshot"]


@pytest.mark.parametrize(
    ("beacon", "tier"),
    [
        ({}, None),
        ({"rm": 1}, None),
        ({"rv": 1}, "store"),
        ({"rv": 1, "rm": 1}, "memory"),
        ({"rv": 0, "rm": True}, "store"),
        ({"rv": 1, "rm": 2}, "peer"),
        ({"rv": 1, "rm": 3}, "store"),
    ],
)
def test_an_attempt_that_died_still_names_the_tier_it_resumed_from_by_its_beacons(beacon, tier):
    from trainpipe.trainer.launcher import _resumed_tier

    assert _resumed_tier(beacon) == tier


def test_the_summary_gives_the_memory_tiers_interval_cost_and_resumes():
    from tests.conftest import train_result
    from trainpipe.trainer.incidents import AttemptRecord
    from trainpipe.trainer.orchestrate.summary import memory_tier_markdown, memory_tier_view

    attempts = [AttemptRecord(attempt=1), AttemptRecord(attempt=2, resumed_tier="memory"), AttemptRecord(attempt=3)]
    view = memory_tier_view(train_result(memory_every_steps=3, memory_stalls_s=[0.002, 0.004, 0.003]), attempts)
    assert view == {"every_steps": 3, "snapshots": 3, "save_blocking_s": 0.003, "resumes": 1, "from_peers": 0}
    assert memory_tier_markdown({"memory_tier": view}) == (
        "\n## Memory tier\n\nA snapshot every 3 steps in host memory (3 in the final attempt, each blocking 3.0 ms); "
        "1 attempt(s) resumed from one.\n"
    )
    attempts.append(AttemptRecord(attempt=4, resumed_tier="peer"))
    view = memory_tier_view(train_result(memory_every_steps=3), attempts)
    assert (view["resumes"], view["from_peers"]) == (2, 1)
    assert "2 attempt(s) resumed from one, 1 with a lost host's files gathered from its peer's copy." in (
        memory_tier_markdown({"memory_tier": view})
    )
    assert memory_tier_view(train_result(), attempts) is None and memory_tier_markdown({"memory_tier": None}) == ""


def test_a_resume_tries_the_newest_step_first_and_at_one_step_the_memory_copy_first():
    order = memory_tier.restore_order([10, 20], [15, 20], step=lambda s: s)
    assert order == [(20, "memory"), (20, "store"), (15, "memory"), (10, "store")]
    assert memory_tier.restore_order([10], [], step=lambda s: s) == [(10, "store")]


PEERS = [*MEMORY, "cluster.nodes=2", "cluster.procs_per_node=1", "cluster.simulate_nodes=true"]


@pytest.mark.drill
@pytest.mark.parametrize("kind", ["dcp", "flash"])
def test_a_lost_hosts_snapshot_comes_back_from_its_peers_copy_to_the_same_weights(home, drill_digest, kind):
    """Two simulated hosts, each with its own memory (a folder per node), a snapshot every step. Once host 0
    holds a snapshot past step 23, host 1 is lost: its rank SIGKILLed and its memory wiped. Host 0 holds host
    1's snapshots too (the peer copy: DCP's files, or flash slots), so the retry brings them back onto host 1
    and resumes from host memory, past the store's newest checkpoint, to the uninterrupted run's weights.
    Without the copy the retry would fall back to the store."""
    prof = load_profile("local", [*PEERS, f"checkpoint.memory_snapshot={kind}"])
    dataset_uri = shard_dataset(prof.data, prof.store).uri
    with warm_attempts(prof):
        folder = memory_tier.current()
        assert folder is not None
        node = [run_checkpoints(os.path.join(folder, f"node-{n}"), prof.store.root, "peers") for n in (0, 1)]
        flash = [os.path.join(os.path.dirname(n), "flash") for n in node]

        def on_host_0() -> list[int]:
            """The steps host 0 can give back for both ranks: its rank's own, and its copy of rank 1's."""
            if kind == "dcp":
                return committed_snapshots(node[0])
            own, copy = (set(_flash_steps(flash[0], r)) for r in (0, 1))
            return sorted(own & copy)

        ready = lambda: any(s >= 23 for s in on_host_0())  # noqa: E731
        lose_host_1 = lambda: shutil.rmtree(os.path.join(folder, "node-1"))  # noqa: E731
        attempt_with_rank_1_killed(prof, "peers", dataset_uri, ready, "a snapshot past step 23", lose_host_1)
        kept = on_host_0()
        if kind == "dcp":
            newest = Path(node[0], f"step-{kept[-1]:08d}")
            assert (newest / "extra" / "rank-00001.pt").is_file(), sorted(p.name for p in newest.rglob("*"))
        assert not os.path.exists(os.path.join(folder, "node-1"))

        second = train_attempt(prof, "peers", dataset_uri, attempt=2)
        assert second.result is not None, "\n".join(second.job.tail[-30:])
        store = [i.step for i in catalog.list_checkpoints(RunPaths(prof.store.root, "peers").checkpoints)]
        assert second.result.resumed_tier == "peer", [x for x in second.job.tail if "snapshot" in x or "resum" in x]
        assert second.record().resumed_tier == "peer"
        assert second.result.start_step == kept[-1] > max(s for s in store if s <= kept[-1])
        assert any("from their peers" in x for x in second.job.tail), second.job.tail[-20:]
        assert second.result.model_digest == drill_digest
        if kind == "dcp":
            assert committed_snapshots(node[1]), "host 1 holds the run's snapshots again"
        else:  # its own rank's slots, and its copy of rank 0's
            assert _flash_steps(flash[1], 1) and _flash_steps(flash[1], 0), "host 1 holds the run's snapshots again"


def _flash_steps(root: str, rank: int) -> list[int]:
    return sorted(r.step for r in FlashSnapshots(root, rank).records().values())


def ring_payload(files: dict[str, bytes], listed: list | None = None) -> torch.Tensor:
    head = json.dumps(listed if listed is not None else [[n, len(b)] for n, b in files.items()]).encode()
    return torch.frombuffer(bytearray(head + b"\n" + b"".join(files.values())), dtype=torch.uint8)


def test_a_peers_copy_that_is_altered_of_another_run_or_names_a_path_outside_is_refused(tmp_path):
    """What a peer sends is kept only under a name the snapshot lists and with its recorded size and sha256."""
    data = b"rank state"
    listed = {"extra/rank-00001.pt": (hashlib.sha256(data).hexdigest(), len(data))}
    assert accept(ring_payload({"extra/rank-00001.pt": data}), listed) == {"extra/rank-00001.pt": data}
    refusals = [
        (ring_payload({"extra/rank-00001.pt": b"rank stat3"}), "fails its size or sha256"),
        (ring_payload({"extra/rank-00001.pt": b"another run's"}), "fails its size or sha256"),
        (ring_payload({"../../escape": data}), "does not list"),
        (ring_payload({"extra/rank-00001.pt": data}, [["extra/rank-00001.pt", 3]]), "fails its size"),
        (torch.frombuffer(bytearray(b"null\n"), dtype=torch.uint8), "no readable"),
        (ring_payload({"extra/rank-00001.pt": data + b"more"}, [["extra/rank-00001.pt", len(data)]]), "more bytes"),
    ]
    for payload, says in refusals:
        with pytest.raises(ChecksumMismatch, match=says):
            accept(payload, listed)
    (tmp_path / "outside").mkdir()
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "extra").symlink_to(tmp_path / "outside")
    for name in ("../outside/x", "/etc/x", "extra/x", "a//b"):
        with pytest.raises(ChecksumMismatch):
            write_inside(str(tmp_path / "step"), name, b"x")
    assert not list((tmp_path / "outside").iterdir())
    write_inside(str(tmp_path / "step"), "sub/file.distcp", b"ok")
    assert (tmp_path / "step" / "sub" / "file.distcp").read_bytes() == b"ok"
    assert held_files(str(tmp_path / "step")) == {"sub/file.distcp"}


def test_each_host_lacking_a_file_gets_it_from_the_first_host_that_holds_it():
    ring = PeerRing(rank=0, world_size=6, local_world_size=2)  # three hosts: leaders 0, 2, 4
    assert (ring.hosts, ring.peer, ring.source, ring.leader) == (3, 2, 4, True)
    assert PeerRing(rank=3, world_size=6, local_world_size=2).peer == 5
    held = [{"a", "b"}, None, set(), None, {"b", "c"}, None]
    assert completion_plan(held, {"a", "b", "c"}, ring) == [
        (0, 2, "a"), (0, 4, "a"), (0, 2, "b"), (4, 0, "c"), (4, 2, "c")
    ]  # fmt: skip
    assert completion_plan([{"a"}, None, {"a"}, None, {"a"}, None], {"a"}, ring) == []


def test_a_snapshot_is_resumable_when_the_hosts_hold_its_files_between_them():
    def info(step: int, files: list[str]) -> catalog.CheckpointInfo:
        return catalog.CheckpointInfo(f"/h/step-{step:08d}", step, True, True, manifest={"files": dict.fromkeys(files)})

    views = [
        [(info(5, ["a", "b"]), {"a", "b"}), (info(6, ["a", "b", "c"]), {"a"})],
        None,
        [(info(6, ["a", "b", "c"]), {"b"})],
    ]
    [five] = resumable(views, "/mine")  # step 6's "c" lies nowhere
    assert five.step == 5 and five.uri == "/mine/step-00000005"
    views[2][0][1].add("c")
    assert [i.step for i in resumable(views, "/mine")] == [5, 6]
