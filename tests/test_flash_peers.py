"""Flash snapshots across hosts (trainer.checkpoint.flash_peers), in-process: ranks as threads, each with a gloo
process group of its own over one store, and each simulated host a folder of its own."""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.test_flash import PROOF, _equal, _state
from trainpipe.trainer.checkpoint import flash_peers
from trainpipe.trainer.checkpoint.files import ChecksumMismatch
from trainpipe.trainer.checkpoint.flash import FlashSnapshots, prune
from trainpipe.trainer.checkpoint.flash_peers import FlashPeers, exchange, fetch, fetch_plan, resumable_steps
from trainpipe.trainer.checkpoint.memory_tier import room_needed
from trainpipe.trainer.checkpoint.peer_copy import PeerRing


def _together(*calls):
    """Run the calls at once, one thread each (the ranks); their results. A hang fails instead of waiting."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        return [f.result(timeout=60) for f in futures]


def _groups(n: int) -> list[dist.ProcessGroup]:
    store = dist.HashStore()
    return _together(*(lambda r=r: dist.ProcessGroupGloo(store, r, n, timedelta(seconds=30)) for r in range(n)))


def _hosts(tmp_path, hosts: int = 2, local: int = 1) -> list[FlashSnapshots]:
    """Each rank's slots in its host's folder (``host-{h}``), with its peers on a group of its own (one host: the
    group alone, no ring)."""
    n = hosts * local
    groups = _groups(n)
    folders = [str(tmp_path / f"host-{r // local}") for r in range(n)]
    for f in folders:
        os.makedirs(f, mode=0o700, exist_ok=True)
    ring = lambda r: PeerRing(r, n, local) if hosts > 1 else None  # noqa: E731
    return [FlashSnapshots(folders[r], r, FlashPeers(ring(r), groups[r])) for r in range(n)]


def _steps(flash: FlashSnapshots | None) -> list[int]:
    return sorted(r.step for r in flash.records().values()) if flash is not None else []


def _rank_s(snapshot: tuple, step: int, rank: int) -> bool:
    """Whether ``snapshot`` (state, extra, record) is ``rank``'s of ``step``: the replicas' state, its own extra."""
    state, extra, record = snapshot
    return _equal(state, _state(10 * step)) and extra == {"rank": rank} and record.rank == rank


def _save_all(ranks: list[FlashSnapshots], step: int, states: list[dict] | None = None) -> None:
    def save(r: int) -> None:
        ranks[r].save(step, states[r] if states else _state(10 * step), {"rank": r}, {"step": step}, PROOF)
        ranks[r].wait()

    _together(*(lambda r=r: save(r) for r in range(len(ranks))))


def test_each_snapshot_is_kept_on_the_next_host_and_a_lost_host_gets_it_back(tmp_path):
    """Two hosts of two ranks. Every snapshot a rank takes is kept by the rank with its local rank on the other
    host, as that rank's slots; host 1 is then lost (its folder wiped): the ranks agree on the newest step, and
    host 1's ranks get their own snapshots back from host 0's copies, bit for bit."""
    ranks = _hosts(tmp_path, hosts=2, local=2)
    for step in (1, 2, 3):
        _save_all(ranks, step)
    for r, flash in enumerate(ranks):
        kept = FlashSnapshots(str(tmp_path / f"host-{1 - r // 2}"), r)  # its copy, on the other host
        assert _steps(kept) == [2, 3] and _rank_s(kept.read(3), 3, r)
        assert _steps(flash.copies) == [2, 3] and flash.copies.rank == (r + 2) % 4
        assert flash.peer_failures == 0 and len(flash.saves_s) == 3
    shutil.rmtree(tmp_path / "host-1")  # and its ranks: their replacements start with an empty folder
    os.makedirs(tmp_path / "host-1", mode=0o700)
    ranks[2:] = [FlashSnapshots(str(tmp_path / "host-1"), r, ranks[r].peers) for r in (2, 3)]

    ring = ranks[0].peers.ring
    views = [(set(_steps(f)), set(_steps(f.copies))) for f in ranks]
    assert resumable_steps(views, ring) == [2, 3]
    assert resumable_steps(views, None) == []  # one host's view: host 1's ranks hold nothing
    plan = fetch_plan(views, 3, ring)
    assert plan == [(0, 2), (1, 3)]
    problems = _together(*(lambda f=f: fetch(plan, 3, f, f.copies, f.peers) for f in ranks))
    assert problems == [""] * 4
    for r in (2, 3):
        assert _steps(ranks[r]) == [3] and _rank_s(ranks[r].read(3), 3, r)

    _save_all(ranks, 4)  # training goes on: host 1 keeps host 0's copies again
    assert _steps(ranks[2].copies) == [4] and _steps(ranks[0].copies) == [3, 4]


def test_a_step_no_rank_holds_itself_comes_back_from_both_peers_copies(tmp_path):
    """Every rank lost its own snapshot of the newest step (a slot overwritten at the kill) and keeps its peer's:
    each gets its own back from the other, at once."""
    ranks = _hosts(tmp_path)
    for step in (1, 2, 3):
        _save_all(ranks, step)
    for flash in ranks:
        os.unlink(os.path.join(flash.folder, f"slot-{flash.slot_of(3)}.json"))
    views = [(set(_steps(f)), set(_steps(f.copies))) for f in ranks]
    assert views == [({2}, {2, 3})] * 2 and resumable_steps(views, ranks[0].peers.ring) == [2, 3]
    plan = fetch_plan(views, 3, ranks[0].peers.ring)
    assert plan == [(1, 0), (0, 1)]
    assert _together(*(lambda f=f: fetch(plan, 3, f, f.copies, f.peers) for f in ranks)) == ["", ""]
    assert [_rank_s(f.read(3), 3, r) for r, f in enumerate(ranks)] == [True, True]


def test_a_rank_whose_snapshot_failed_still_moves_the_ring_and_no_rank_keeps_that_step(tmp_path):
    """A rank that cannot take a snapshot (a tensor it cannot hold) sends nothing and no rank waits on it; the
    other rank keeps none of that step either (it was compared with no one's, and no resume could take it), so its
    peer keeps its older copy whole; the next round goes on as ever."""
    ranks = _hosts(tmp_path)
    _save_all(ranks, 1)
    bad = {"x": torch.ones(2, dtype=torch.uint16)}
    _save_all(ranks, 2, [bad, _state(20)])
    assert [f.failures for f in ranks] == [1, 0] and [_steps(f) for f in ranks] == [[1], [1]]
    assert [_steps(f.copies) for f in ranks] == [[1], [1]] and [f.differed for f in ranks] == [None, None]
    _save_all(ranks, 3)
    assert [_steps(f) for f in ranks] == [[1, 3]] * 2 and [_steps(f.copies) for f in ranks] == [[1, 3]] * 2
    assert ranks[0].peer_failures == ranks[1].peer_failures == 0


def test_no_rank_overwrites_its_older_slot_before_every_ranks_copy_of_the_newest_is_kept(tmp_path, monkeypatch):
    """Two hosts of two ranks are two lanes (0-2, 1-3). With lane 1-3's copy of step 3 held back, rank 0's next
    snapshot waits for it (the round ends with every rank's word) instead of dropping its step 2 while host 1
    could still be lost with no step every rank holds."""
    ranks = _hosts(tmp_path, hosts=2, local=2)
    for step in (1, 2):
        _save_all(ranks, step)
    gate, exchange_now = threading.Event(), flash_peers.exchange

    def slow_lane(group, send, recv, size=None):
        if send is not None and send[0] in (1, 3):  # ranks 3 and 1 send to each other: lane 1-3
            gate.wait(30)
        return exchange_now(group, send, recv, size)

    monkeypatch.setattr(flash_peers, "exchange", slow_lane)
    for r, flash in enumerate(ranks):
        flash.save(3, _state(30), {"rank": r}, {"step": 3}, PROOF)
    nxt = threading.Thread(target=ranks[0].save, args=(4, _state(40), {}, {"step": 4}, PROOF))
    nxt.start()
    nxt.join(0.5)
    assert nxt.is_alive() and _steps(ranks[0]) == [2, 3]  # still waiting: its step 2 is still there
    views = [(set(_steps(f)), set(_steps(f.copies))) for f in ranks]
    assert resumable_steps([views[0], views[1], (set(), set()), (set(), set())], ranks[0].peers.ring) == [2]
    gate.set()
    nxt.join(30)
    for r in (1, 2, 3):
        ranks[r].save(4, _state(40), {"rank": r}, {"step": 4}, PROOF)
    for flash in ranks:
        flash.wait()
    assert [_steps(f) for f in ranks] == [[3, 4]] * 4 and [_steps(f.copies) for f in ranks] == [[3, 4]] * 4


def test_when_one_ranks_snapshot_fails_every_rank_keeps_the_step_they_all_hold(tmp_path):
    """One host, two ranks: rank 0 cannot take step 3. Rank 1 copied it but keeps no record of it (no rank's to
    compare it with) and keeps step 2 (the newest both hold), so that the ranks never hold no step in common."""
    ranks = _hosts(tmp_path, hosts=1, local=2)
    assert ranks[0].copies is None and ranks[0].peers.ring is None
    for step in (1, 2):
        _save_all(ranks, step)
    _save_all(ranks, 3, [{"x": torch.ones(2, dtype=torch.uint16)}, _state(30)])
    assert _steps(ranks[0]) == [1, 2] and _steps(ranks[1]) == [2]
    _save_all(ranks, 4)
    assert _steps(ranks[0]) == [2, 4] and _steps(ranks[1]) == [2, 4]


def test_a_snapshot_that_cannot_be_sent_holds_the_older_slot_and_a_copy_that_keeps_failing_does_not(
    tmp_path, monkeypatch
):
    """Two hosts of one rank. Rank 0's step 3 is whole but cannot be read to be sent: its peer keeps no copy of
    it, so every rank keeps step 2 (what host 1 could give back for rank 0) and writes step 4 over step 3. A
    copy that then fails every round holds the older slot only every other round, so each rank still keeps two
    steps for a crash that takes no host."""
    ranks = _hosts(tmp_path)
    for step in (1, 2):
        _save_all(ranks, step)
    with monkeypatch.context() as m:
        m.setattr(ranks[0], "slot_record_bytes", lambda slot: (_ for _ in ()).throw(OSError(24, "Too many open files")))
        _save_all(ranks, 3)
    assert [_steps(f) for f in ranks] == [[2, 3]] * 2 and _steps(ranks[1].copies) == [1, 2]
    _save_all(ranks, 4)
    assert [_steps(f) for f in ranks] == [[2, 4]] * 2  # step 2 kept: a host lost in round 4 still had it

    def no_room(slot, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ranks[1].copies, "prepare_receive", no_room)
    held = []
    for step in (5, 6, 7, 8):
        _save_all(ranks, step)
        held.append([_steps(f) for f in ranks])
    assert [h[0] for h in held] == [[4, 5], [4, 6], [6, 7], [6, 8]] and all(h[0] == h[1] for h in held), held
    assert [h[0][-1] for h in held] == [5, 6, 7, 8] and [f.peer_failures for f in ranks] == [5, 5]  # 3, 5-8


def test_the_folders_of_ranks_no_longer_on_a_host_are_removed(tmp_path):
    """After the world shrank, a host keeps its own ranks' folders and the copies they keep, nothing else."""
    for rank in (0, 1, 2, 3):
        FlashSnapshots(str(tmp_path), rank).save(1, _state(rank), {}, {}, PROOF)
    (tmp_path / "rank-x").mkdir()
    assert sorted(prune(str(tmp_path), {0, 2})) == [1, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0", "rank-2", "rank-x"]


def test_a_copy_with_no_room_or_a_forged_record_is_refused_without_a_hang(tmp_path, monkeypatch):
    """The receiver says no before any byte moves when its shared memory lacks the room; a record that names
    another rank, or whose digest fails, is never kept; a changed byte arrives but never loads (its checksum)."""
    ranks = _hosts(tmp_path)
    _save_all(ranks, 1)
    sender, receiver = ranks[0], ranks[1]
    slot = sender.slot_of(1)
    raw, size = sender.slot_record_bytes(slot)

    def offer(record: bytes, data: torch.Tensor | None = None) -> list[str]:
        out = flash_peers._Outgoing(slot, torch.frombuffer(bytearray(record), dtype=torch.uint8),
                                    sender.slot_bytes(slot, size) if data is None else data)  # fmt: skip
        send = lambda: exchange(sender.peers.group, (1, out), None)  # noqa: E731
        return _together(send, lambda: exchange(receiver.peers.group, None, (0, receiver.copies)))

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    receiver.copies = FlashSnapshots(str(tmp_path / "host-1"), 0)  # a new process: its slot's pages not yet taken
    with monkeypatch.context() as m:
        m.setattr(os, "posix_fallocate", full)
        assert "no room for rank 0's flash snapshot copy" in offer(raw)[1]
        assert "no room" in offer(raw, torch.zeros(1 << 20, dtype=torch.uint8))[1]  # a resize that fails
    assert _steps(receiver.copies) == []  # the slot taken for it holds no record
    assert offer(raw) == ["", ""] and _steps(FlashSnapshots(str(tmp_path / "host-1"), 0)) == [1]  # whole again
    out = flash_peers._Outgoing(
        slot, torch.frombuffer(bytearray(raw), dtype=torch.uint8), sender.slot_bytes(slot, size)
    )
    assert _together(
        lambda: exchange(sender.peers.group, (1, out), None),
        lambda: exchange(receiver.peers.group, None, (0, receiver.copies), size + 64),
    )[1].endswith(f"of {size} bytes, not this rank's {size + 64}; refused")

    other = FlashSnapshots(str(tmp_path / "host-0"), 1).slot_record_bytes(0)[0]  # rank 1's own record
    assert "could not be kept" in offer(other)[1] and _steps(receiver.copies) == []
    assert "could not be kept" in offer(raw.replace(b'"step":1', b'"step":9'))[1]
    changed = sender.slot_bytes(slot, size).clone()
    changed[0] ^= 1
    assert offer(raw, changed) == ["", ""] and _steps(receiver.copies) == [1]
    with pytest.raises(ChecksumMismatch, match="does not match its checksum"):
        receiver.copies.read(1)
    assert offer(raw) == ["", ""] and _equal(receiver.copies.read(1)[0], _state(10))


def test_a_header_no_snapshot_has_is_refused_and_the_ring_goes_on(tmp_path):
    ranks = _hosts(tmp_path)
    group0, group1 = ranks[0].peers.group, ranks[1].peers.group

    def hostile() -> str:
        head = torch.tensor([0, 10, 1 << 50], dtype=torch.int64)  # 1 PiB of slot
        group0.send([head], 1, flash_peers._HEADER).wait()
        verdict = torch.zeros(1, dtype=torch.int64)
        group0.recv([verdict], 1, flash_peers._VERDICT).wait()
        return str(verdict.item())

    assert _together(hostile, lambda: exchange(group1, None, (0, ranks[1].copies))) == [
        "0",
        "rank 0 offered a flash snapshot copy with sizes no snapshot has; refused",
    ]
    _save_all(ranks, 1)
    assert _steps(ranks[1].copies) == [1]


def test_a_peer_that_lost_its_copy_fails_the_fetch_on_the_rank_that_needed_it(tmp_path):
    """Rank 0 lost its own snapshot and rank 1 its copy of it after they agreed on the step."""
    ranks = _hosts(tmp_path)
    _save_all(ranks, 1)
    views = [(set(), {1}), (set(), {1})]
    for flash in (ranks[0], ranks[1].copies):
        os.unlink(os.path.join(flash.folder, f"slot-{flash.slot_of(1)}.json"))
    problems = _together(
        *(lambda f=f: fetch(fetch_plan(views, 1, f.peers.ring), 1, f, f.copies, f.peers) for f in ranks)
    )
    assert problems[0].startswith("rank 1 holds no whole copy of rank 0's flash snapshot of step 1"), problems


def test_across_hosts_the_tier_counts_the_peers_copies():
    assert room_needed(100, 4, across_hosts=False, flash=True) == 800
    assert room_needed(100, 4, across_hosts=True, flash=True) == 1600
    assert room_needed(100, 4, across_hosts=True, flash=False) == 2400


@pytest.mark.parametrize("hosts,local", [(1, 2), (2, 1)])
def test_a_step_whose_replicas_differ_is_kept_by_no_rank_nor_as_a_copy(tmp_path, hosts, local):
    """DDP replicas hold the same bytes. At step 3 rank 1's differ (a corrupted replica): no rank keeps step 3,
    no peer keeps a copy of it, and every rank says at which step they differed (for the loop to find the rank);
    step 4, the same again, goes where step 3 was."""
    ranks = _hosts(tmp_path, hosts, local)
    for step in (1, 2):
        _save_all(ranks, step)
    corrupted = _state(30)
    corrupted["model"]["w"][0, 0] += 1
    _save_all(ranks, 3, [_state(30), corrupted])
    assert [_steps(f) for f in ranks] == [[2]] * 2 and [f.differed for f in ranks] == [3, 3]
    assert [f.failures for f in ranks] == [0, 0]
    if hosts > 1:
        assert [_steps(f.copies) for f in ranks] == [[1, 2]] * 2
    _save_all(ranks, 4)
    assert [_steps(f) for f in ranks] == [[2, 4]] * 2
    if hosts > 1:
        assert [_steps(f.copies) for f in ranks] == [[2, 4]] * 2


def test_a_comparison_the_group_cannot_make_keeps_no_snapshot_and_leaves_it_to_the_loop(tmp_path, monkeypatch):
    """The ranks' group fails at the comparison: that step is not kept (its replicas were never compared), and
    from then on the snapshots are taken alone and the loop compares the replicas itself (``compares_replicas``)."""
    ranks = _hosts(tmp_path, hosts=1, local=2)
    _save_all(ranks, 1)
    assert all(f.compares_replicas for f in ranks)
    with monkeypatch.context() as m:
        m.setattr(flash_peers, "same", lambda group, value: (_ for _ in ()).throw(RuntimeError("Connection closed")))
        _save_all(ranks, 2)
    assert [_steps(f) for f in ranks] == [[1]] * 2 and not any(f.compares_replicas for f in ranks)
    _save_all(ranks, 3)
    assert [_steps(f) for f in ranks] == [[1, 3]] * 2
