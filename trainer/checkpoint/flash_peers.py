"""Flash snapshots across hosts: each rank's slots copied to its peer on the next host, and fetched back.

A flash snapshot (trainer.checkpoint.flash) lies in the shared memory of the host whose rank wrote it, so a host
that is lost takes its ranks' slots with it. Across hosts each rank therefore sends every snapshot it takes, once
its record is written, to its peer: the rank with its local rank on the next host of the ring (``PeerRing``),
which keeps it as the sender's slot of the same number in its own host's folder (``rank-{source}``, beside its
own ``rank-{rank}``). The exchange runs on the snapshot's background thread, over a gloo group of its own, so it
overlaps training and never meets the training's collectives (docs/architecture.md §4, "Flash snapshots across
hosts").

Every transfer is a handshake: the sender states the slot, the record's and the bytes' sizes; the receiver
takes them only when the numbers are sane (the bytes as many as its own snapshot's: a DDP replica's layout)
and its host's shared memory holds them (``posix_fallocate``), and says so before any byte moves, so a refusal
costs neither side a hang. A rank whose own snapshot (or whose reading of it) failed still takes part, sending
nothing. Each round then ends with every rank's word (``agree``, on every host and on one host alike): a rank's
next snapshot waits for it, so no rank overwrites its older slot before every rank holds the newest step whole,
copies included, and where one does not, every rank keeps the older one (``FlashSnapshots._end_round``). What
arrives is not trusted for being a peer's: its record is read back as any record (its digest, its rank, its
layout) and its bytes are checked against their checksums when it loads, with the state proof after.

At a restore the ranks agree on the newest step each rank holds, in its own slots or in its peer's copy
(``resumable_steps``); a rank lacking it gets its copy back from its peer (``fetch_plan``, ``fetch``) into its
own slots, and every rank then loads as on one host.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainpipe.trainer.checkpoint.flash import MAX_RECORD_BYTES, SLOTS, FlashSnapshots
from trainpipe.trainer.checkpoint.peer_copy import PeerRing

log = logging.getLogger("trainpipe.checkpointer")

MAX_SLOT_BYTES = 1 << 44  # 16 TiB: no host's shared memory; a size past it is no snapshot's
NOTHING = -1  # the slot a rank sends when it has no snapshot to send
_HEADER, _VERDICT, _RECORD, _BYTES = 0, 1, 2, 3  # tags: each message kind matched in order per pair of ranks


@dataclass(frozen=True)
class FlashPeers:
    """The gloo group of the job's ranks that their snapshots' background threads use, and, across hosts, this
    rank's place in the ring of hosts (None on one host: no copies, only the ranks' word on each round)."""

    ring: PeerRing | None
    group: dist.ProcessGroup


@dataclass
class _Outgoing:
    slot: int
    record: torch.Tensor  # the record file's bytes, its digest line included
    data: torch.Tensor  # the slot's bytes (its mapped file)


def outgoing(flash: FlashSnapshots, slot: int | None) -> _Outgoing | None:
    """What ``flash`` sends of its ``slot`` (None: nothing, when there is no slot or it cannot be read)."""
    if slot is None:
        return None
    try:
        raw, size = flash.slot_record_bytes(slot)
        return _Outgoing(slot, torch.frombuffer(bytearray(raw), dtype=torch.uint8), flash.slot_bytes(slot, size))
    except Exception as exc:  # noqa: BLE001 - whatever the reason, the peer still hears from this rank: nothing
        log.warning("flash snapshot slot %d of %s cannot be sent to its peer (%s)", slot, flash.folder, exc)
        return None


def agree(group: dist.ProcessGroup, flags: list[bool]) -> list[bool]:
    """For each of ``flags``, whether every rank of ``group`` says it (an all-reduce of the minimum)."""
    every = torch.tensor([int(f) for f in flags], dtype=torch.int64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN  # pyright: ignore[reportAttributeAccessIssue] - settable; the stub says not
    group.allreduce([every], options).wait()
    return [bool(x) for x in every.tolist()]


_NONE = 1 << 62  # no value: above any digest, so it never decides the minimum of either sign


def same(group: dist.ProcessGroup, value: int | None) -> tuple[bool, bool]:
    """Whether every rank of ``group`` that has a ``value`` (a non-negative int below 2**62) has the same one, and
    whether every rank has one: one all-reduce of the minima of the value, of its negation and of "has one"."""
    vote = torch.tensor([_NONE, _NONE, 0] if value is None else [value, -value, 1], dtype=torch.int64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN  # pyright: ignore[reportAttributeAccessIssue] - settable; the stub says not
    group.allreduce([vote], options).wait()
    low, minus_high, every = vote.tolist()
    return low == _NONE or low == -minus_high, bool(every)


def exchange(
    group: dist.ProcessGroup,
    send: tuple[int, _Outgoing | None] | None,
    recv: tuple[int, FlashSnapshots] | None,
    size: int | None = None,
) -> str:
    """Send ``send`` = (rank, what) and receive from ``recv`` = (rank, the slots it goes into) at once (either may
    be None), taking only a slot of ``size`` bytes when given (a DDP replica's copy is laid out as this rank's own
    snapshot); this rank's problem with what it received ('' when none, or when the sender had nothing)."""
    header_in = torch.zeros(3, dtype=torch.int64)
    works = []
    if send is not None:
        to, out = send
        head = [NOTHING, 0, 0] if out is None else [out.slot, out.record.numel(), out.data.numel()]
        works.append(group.send([torch.tensor(head, dtype=torch.int64)], _group_rank(group, to), _HEADER))
    if recv is not None:
        works.append(group.recv([header_in], _group_rank(group, recv[0]), _HEADER))
    _wait(works)

    problem, taken = "", None
    if recv is not None:
        slot, record_len, slot_size = (int(x) for x in header_in.tolist())
        if slot != NOTHING:
            problem, taken = _take(recv[1], slot, record_len, slot_size, recv[0], size)
    verdict_in, works = torch.zeros(1, dtype=torch.int64), []
    if recv is not None:
        verdict = torch.tensor([int(taken is not None)], dtype=torch.int64)
        works.append(group.send([verdict], _group_rank(group, recv[0]), _VERDICT))
    if send is not None:
        works.append(group.recv([verdict_in], _group_rank(group, send[0]), _VERDICT))
    _wait(works)

    works = []
    if send is not None and send[1] is not None and verdict_in.item() == 1:
        out, to = send[1], _group_rank(group, send[0])
        works += [group.send([out.record], to, _RECORD), group.send([out.data], to, _BYTES)]
    record = None
    if taken is not None:
        assert recv is not None
        record = torch.empty(taken[1], dtype=torch.uint8)
        frm = _group_rank(group, recv[0])
        works += [group.recv([record], frm, _RECORD), group.recv([taken[2]], frm, _BYTES)]
    _wait(works)
    if taken is not None and record is not None:
        assert recv is not None
        try:
            recv[1].commit_received(taken[0], record.numpy().tobytes())
        except (OSError, ValueError) as exc:
            problem = f"rank {recv[0]}'s flash snapshot could not be kept ({exc})"
    return problem


def _take(into: FlashSnapshots, slot: int, record_len: int, size: int, frm: int, expected: int | None):
    """The slot ``into`` receives a copy in, made ready for ``size`` bytes: (problem, None) when the header is
    not a snapshot's (or not of the ``expected`` size) or the bytes do not fit."""
    if not (0 <= slot < SLOTS and 0 < record_len <= MAX_RECORD_BYTES and 0 < size <= MAX_SLOT_BYTES):
        return f"rank {frm} offered a flash snapshot copy with sizes no snapshot has; refused", None
    if expected is not None and size != expected:
        return f"rank {frm} offered a flash snapshot copy of {size} bytes, not this rank's {expected}; refused", None
    try:
        return "", (slot, record_len, into.prepare_receive(slot, size))
    except OSError as exc:
        return f"no room for rank {frm}'s flash snapshot copy ({exc.__class__.__name__}: {exc})", None
    except Exception as exc:  # noqa: BLE001 - a no, whatever the reason: the sender waits for an answer
        return f"rank {frm}'s flash snapshot copy cannot be kept ({exc.__class__.__name__}: {exc})", None


def resumable_steps(views: list[tuple[set[int], set[int]]], ring: PeerRing | None) -> list[int]:
    """The steps every rank can resume, oldest first: ``views[r]`` is rank r's (steps of its own slots, steps of
    the copies it keeps of its source's); a rank has a step in its own slots or in its peer's copy."""
    common: set[int] | None = None
    for rank, (own, _) in enumerate(views):
        has = own | (views[ring.peer_of(rank)][1] if ring is not None else set())
        common = has if common is None else common & has
    return sorted(common or set())


def fetch_plan(views: list[tuple[set[int], set[int]]], step: int, ring: PeerRing | None) -> list[tuple[int, int]]:
    """(sending rank, receiving rank): each rank that lacks ``step`` in its own slots gets it from its peer's
    copy. Pure, so every rank computes the same plan."""
    if ring is None:
        return []
    return [(ring.peer_of(rank), rank) for rank, (own, _) in enumerate(views) if step not in own]


def fetch(
    plan: list[tuple[int, int]], step: int, flash: FlashSnapshots, copies: FlashSnapshots | None, peers: FlashPeers
) -> str:
    """Carry out a ``fetch_plan`` for ``step`` (every rank walks it alike; each transfer involves its two ranks);
    this rank's problem with what it received ('' when none)."""
    problem = ""
    assert peers.ring is not None
    me = peers.ring.rank
    for src, dst in plan:
        if me == src:
            slot = copies.slot_of(step) if copies is not None else None
            exchange(peers.group, (dst, outgoing(copies, slot) if copies is not None else None), None)
        elif me == dst:
            got = exchange(peers.group, None, (src, flash))
            problem = problem or got
            if not got and step not in {r.step for r in flash.records().values()}:
                problem = f"rank {src} holds no whole copy of rank {me}'s flash snapshot of step {step}"
    return problem


def _group_rank(group: dist.ProcessGroup, rank: int) -> int:
    """``rank`` (global) in ``group``: the flash group holds every rank in order, a test's group is its own."""
    with contextlib.suppress(ValueError, RuntimeError, AttributeError):
        return dist.get_group_rank(group, rank)
    return rank


def _wait(works: list) -> None:
    for work in works:
        work.wait()
