"""Flash snapshots: a rank's state copied straight into shared-memory slots that outlive it (the memory tier).

The memory tier's DCP snapshot (trainer.checkpoint.checkpointer) costs a dozen copies' worth of CPU per save:
DCP's planning, a ``torch.save`` per tensor, the files' sha256 and the state hash (docs/architecture.md §4,
"Flash snapshots"). Where a rank holds plain tensors (DDP or one rank), this module does the least a
restorable snapshot needs: each rank copies its state's tensors into one of two slot files in the tier's folder
(``/dev/shm``, mapped: the copy is the write); a background thread takes an XXH3-64 checksum of each tensor's
bytes, compares a digest of them with the other ranks' (replicas hold the same bytes), and writes the slot's
record (step, where each tensor lies, their checksums, the state's other values and the rank's RNG streams, its
part of the proof but the state hash) atomically after the bytes; across hosts it then copies the slot to a
peer host (trainer.checkpoint.flash_peers), and each round ends with every rank's word on it. There is no
commit across ranks: at resume the ranks agree on the newest step every rank's slots hold. A slot is
overwritten only after its record is removed, so a crash while copying leaves a slot without a record, never a
record of bytes that are not there.

The folder is private to this user (``memory_tier.private_folder``); a record is still read as untrusted: a
regular file not reached through a link, followed by the sha256 of its text (a field changed by a bug or a
bit flip is no record), bounded and typed, its tensors laid out exactly as a save lays them, the pickled
values loaded with ``weights_only``; every byte is checked against its checksum before it loads, and whatever a
damaged slot raises is a ``ChecksumMismatch``, so a resume skips it as a corrupt checkpoint.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import logging
import mmap
import os
import shutil
import stat
import threading
import time
from typing import TYPE_CHECKING, Any, Literal

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainpipe.trainer.checkpoint.files import ChecksumMismatch
from trainpipe.trainer.checkpoint.memory_tier import MemoryTierUnavailable, private_folder

if TYPE_CHECKING:
    from trainpipe.trainer.checkpoint.flash_peers import FlashPeers

log = logging.getLogger("trainpipe.checkpointer")

SLOTS = 2  # the newest snapshot, and the one being written over the one before it
ALIGN = 64  # each tensor's offset in a slot: any dtype's view of the bytes is aligned
MAX_TENSORS = 1 << 20
MAX_RECORD_BYTES = 64 << 20  # a record, its pickled values included (a state's scheduler, RNG streams, numbers)

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    )
}  # fmt: skip
_TENSOR = "\0flash-tensor"  # a tensor's place in the pickled skeleton: (_TENSOR, its index)


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    dtype: Literal[tuple(DTYPES)]  # type: ignore[valid-type]
    shape: list[int] = Field(max_length=64)
    offset: int = Field(ge=0)
    checksum: int = Field(ge=0, lt=1 << 64)  # XXH3-64 of its bytes


class FlashProof(BaseModel):
    """A rank's part of a flash snapshot's proof: the RNG hash and the sample ledger, as a checkpoint's; the
    state is proved by the checksums of its bytes instead of the state hash."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rng: str = Field(pattern=r"^[0-9a-f]{64}$")
    ledger: tuple[int, int] | None
    samples: int = Field(ge=0, le=1 << 62)


class SlotRecord(BaseModel):
    """What a slot holds, written after its bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rank: int = Field(ge=0)  # whose snapshot: a copy kept for a peer lies in that rank's folder, and only there
    step: int = Field(ge=0)
    size: int = Field(gt=0)
    tensors: list[TensorEntry] = Field(max_length=MAX_TENSORS)
    values: str = Field(max_length=MAX_RECORD_BYTES)  # base64 of torch.save({"state": skeleton, "extra": ...})
    manifest: dict[str, Any]
    proof: FlashProof


class FlashSnapshots:
    """This rank's two slots under ``folder`` (``rank-{rank}``). ``save`` copies on the caller's thread and
    leaves the checksums and the record to one background thread; ``stalls_s``, ``taken_stalls_s`` and
    ``saves_s`` are the same figures a ``Checkpointer`` keeps, for the snapshot schedule, and ``costs_s`` what
    each snapshot took from training on a CPU: the loop's stall and the thread's CPU time (its wall time there
    also counts the waits for a core the ranks hold). A snapshot that cannot be taken (no room left in shared
    memory, a tensor it cannot hold) is a warning and leaves the previous one the newest; it never stops
    training."""

    def __init__(self, folder: str, rank: int, peers: FlashPeers | None = None) -> None:
        self.root, self.folder = folder, os.path.join(folder, f"rank-{rank}")  # made by the first save
        self.rank, self.peers = rank, peers
        # Across hosts: the copies this rank keeps of its source's snapshots (trainer.checkpoint.flash_peers).
        ring = peers.ring if peers is not None else None
        self.copies = FlashSnapshots(folder, ring.source) if ring is not None else None
        self.peer_failures = 0
        self._size: int | None = None  # the size of this rank's snapshots' layout: a peer's copy has the same
        self._group_failed = False  # the ranks' group broke (a peer gone, a timeout): alone from then on
        self._held = False  # the last round kept the older slot (_end_round)
        self._maps: dict[int, torch.Tensor] = {}
        self._views: dict[int, list[torch.Tensor]] = {}  # each slot's tensors' views, while the layout holds
        self._newest: int | None = None  # the slot of the newest snapshot this object wrote
        self._thread: threading.Thread | None = None
        self.stalls_s: list[float] = []
        self.taken_stalls_s: list[float] = []
        self.saves_s: list[float] = []
        self.costs_s: list[float] = []  # the loop's stall plus the background thread's CPU time, per snapshot
        self.failures = 0
        self.differed: int | None = None  # the last step whose snapshots differed between the ranks

    def save(
        self,
        step: int,
        state: dict[str, Any],
        extra: dict[str, Any],
        manifest: dict,
        proof: FlashProof,
        began: float | None = None,
    ) -> float:
        """Snapshot ``state`` (tensors and plain values) with ``extra`` (plain values, small tensors) and
        ``manifest`` (JSON values) as step ``step``; return the seconds the caller was blocked, from ``began``
        (``time.perf_counter()`` when the caller began the snapshot: its own work is the snapshot's cost too)."""
        t0 = time.perf_counter() if began is None else began
        self.wait()
        try:
            tensors: list[torch.Tensor] = []
            skeleton = _skeleton(state, tensors)  # before any slot changes: a state it cannot hold changes none
            blob = io.BytesIO()
            torch.save({"state": skeleton, "extra": extra}, blob)
            offsets, size = _offsets(tensors)
            self._size = size
            if self._newest is None:
                records = self.records()
                self._newest = max(records, key=lambda s: records[s].step) if records else None
            slot = next(s for s in range(SLOTS) if s != self._newest)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._record_path(slot))  # first: the bytes about to change are no one's snapshot
            buf = self._map(slot, size, create=True)
        except (TypeError, OSError, MemoryTierUnavailable) as exc:
            self._failed(step, exc)
            self.stalls_s.append(time.perf_counter() - t0)  # as many on every rank: the schedule agrees on them
            if self.peers is not None:  # the round goes on on every rank: this one sends nothing, and says so
                self._thread = threading.Thread(target=self._finish_nothing, args=(step,), daemon=True)
                self._thread.start()
            return time.perf_counter() - t0
        views = self._views.get(slot, [])
        if len(views) != len(tensors) or any(
            v.shape != t.shape or v.dtype != t.dtype for v, t in zip(views, tensors, strict=True)
        ):
            self._views[slot] = views = [
                _view(buf, at, t.dtype, t.shape) for t, at in zip(tensors, offsets, strict=True)
            ]
        for view, t in zip(views, tensors, strict=True):
            view.copy_(t.detach())
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        self.taken_stalls_s.append(stall)
        shapes = [
            (str(t.dtype).removeprefix("torch."), list(t.shape), at) for t, at in zip(tensors, offsets, strict=True)
        ]
        args = (slot, buf, step, size, shapes, blob.getvalue(), manifest, proof, t0, stall)
        self._thread = threading.Thread(target=self._finish, args=args, name=f"flash-{step}", daemon=True)
        self._thread.start()
        return stall

    def _finish(self, slot, buf, step, size, shapes, values, manifest, proof, t0, stall) -> None:
        """The checksums of the slot's tensors; with other ranks, their comparison (``_replicas_agree``); then its
        record, atomically (a reader sees a whole one or none) and followed by the sha256 of its text (so that no
        field of it changes unnoticed); across hosts, then the slot's copy to the peer; then the ranks' word on
        the round (``_end_round``: its time counts in ``saves_s``, since the next snapshot waits for it)."""
        taken, cpu, entries = None, time.thread_time(), None
        try:
            whole = memoryview(buf.numpy())
            entries = [
                TensorEntry(dtype=d, shape=s, offset=at, checksum=_checksum(whole, at, DTYPES[d], s))
                for d, s, at in shapes
            ]
        except Exception as exc:  # noqa: BLE001 - a snapshot that fails leaves the previous one the newest
            self._failed(step, exc)
        if self._replicas_agree(step, entries) and entries is not None:
            try:
                record = SlotRecord(
                    rank=self.rank,
                    step=step,
                    size=size,
                    tensors=entries,
                    values=base64.b64encode(values).decode(),
                    manifest=manifest,
                    proof=proof,
                )
                text = record.model_dump_json().encode()
                self._write_record(slot, text + b"\n" + hashlib.sha256(text).hexdigest().encode())
                self._newest = taken = slot
            except Exception as exc:  # noqa: BLE001 - a snapshot that fails leaves the previous one the newest
                self._failed(step, exc)
        if self.peers is not None:
            self._end_round(taken, step)
        if taken is not None:
            self.saves_s.append(time.perf_counter() - t0)
            self.costs_s.append(stall + time.thread_time() - cpu)

    def _finish_nothing(self, step: int) -> None:
        """A round this rank has no snapshot for: it still votes and ends the round with the others."""
        self._replicas_agree(step, None)
        self._end_round(None, step)

    @property
    def compares_replicas(self) -> bool:
        """Whether each round compares the ranks' snapshots (``_replicas_agree``): with others, while their group
        works. Where it does not, the caller compares the replicas before each snapshot."""
        return self.peers is not None and not self._group_failed

    def _replicas_agree(self, step: int, entries: list[TensorEntry] | None) -> bool:
        """Whether this rank keeps its snapshot of ``step`` (``entries``: its tensors' checksums; None: it has none).
        A flash snapshot holds a DDP replica's state or one rank's, so every rank's bytes must be the same (a
        resume proves they are): before any record is written, the ranks compare a digest of their checksums. No
        rank keeps a snapshot that was not compared with every rank's: where two differ (``differed`` then says
        at which step, for the loop to find the rank: a corrupted replica is never saved where a retry would
        resume it, docs/architecture.md §9), and where a rank has none (a step no resume could take anyway)."""
        from trainpipe.trainer.checkpoint import flash_peers  # it builds on this module

        if not self.compares_replicas:
            return entries is not None
        assert self.peers is not None
        digest = None
        if entries is not None:
            sums = hashlib.sha256(repr([e.checksum for e in entries]).encode()).digest()
            digest = int.from_bytes(sums[:7], "big")  # 56 bits: an int64 of either sign
        try:
            agreed, every = flash_peers.same(self.peers.group, digest)
        except Exception as exc:  # noqa: BLE001 - the group is gone for this attempt
            self._group_broke(step, exc)
            return False  # not compared: not kept
        if not agreed:
            self.differed = step
            if self.rank == 0:
                log.warning("flash snapshot of step %d not kept: the ranks' states differ (a replica corrupted); "
                            "the previous one stays the newest", step)  # fmt: skip
        return agreed and every and entries is not None

    def _group_broke(self, step: int, exc: BaseException) -> None:
        self._group_failed, self.peer_failures = True, self.peer_failures + 1
        log.warning("flash snapshots: the ranks' group failed at step %d (%s); this attempt's snapshots are no "
                    "longer compared or copied to a peer host", step, _line(exc))  # fmt: skip

    def _end_round(self, slot: int | None, step: int) -> None:
        """Across hosts, send ``slot`` (None: nothing) to the peer and keep the source's copy
        (trainer.checkpoint.flash_peers); then every rank's word on the round, over the ranks' group: no rank's
        next snapshot overwrites its older slot before every rank holds this step whole (its copy too), and where
        one does not, every rank keeps the older slot, the step every rank holds, and overwrites this one next."""
        from trainpipe.trainer.checkpoint import flash_peers  # it builds on this module

        assert self.peers is not None
        if self._group_failed:
            return
        copied = True
        try:
            if self.copies is not None and self.peers.ring is not None:
                ring = self.peers.ring
                out = flash_peers.outgoing(self, slot)
                problem = flash_peers.exchange(
                    self.peers.group, (ring.peer, out), (ring.source, self.copies), self._size
                )
                copied = not problem and (slot is None or out is not None)  # a snapshot not sent is no copy either
                if problem:
                    log.warning("flash snapshot of step %d: no copy kept for the previous host (%s); training "
                                "goes on", step, problem)  # fmt: skip
            whole, every_copied = flash_peers.agree(self.peers.group, [slot is not None, copied])
        except Exception as exc:  # noqa: BLE001 - the group is gone for this attempt: the snapshots stay local
            self._group_broke(step, exc)
            return
        self.peer_failures += not every_copied
        if not every_copied and self.rank == 0:
            log.warning("flash snapshot of step %d: a rank's copy on its peer host was not kept (%d round(s) so "
                        "far); a host lost now resumes from an older step", step, self.peer_failures)  # fmt: skip
        # Keep the step before this one, the newest every rank holds whole, when a rank's snapshot failed; when
        # only a copy did, for one round (a copy that keeps failing must not leave every rank one slot).
        hold = not whole or (not every_copied and not self._held)
        if hold and slot is not None:
            self._newest = 1 - slot
        self._held = hold

    def _write_record(self, slot: int, raw: bytes) -> None:
        path = self._record_path(slot)
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)

    def _failed(self, step: int, exc: BaseException) -> None:
        self.failures += 1
        line = str(exc).splitlines()[0][:200] if str(exc) else ""
        log.warning("flash snapshot of step %d not taken (%s: %s); the previous one stays the newest, training goes "
                    "on", step, exc.__class__.__name__, line)  # fmt: skip

    @property
    def busy(self) -> bool:
        """Whether the previous snapshot's round is still going (the next ``save`` waits for it)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until the snapshot in flight has its record (or failed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def records(self) -> dict[int, SlotRecord]:
        """The slots whose record reads whole, by slot: its digest, its fields, a layout of its tensors that is
        the one a save makes. Any other is no snapshot (ignored, as a half-written one)."""
        found = {}
        for slot in range(SLOTS):
            with contextlib.suppress(OSError, ValueError, ValidationError, MemoryTierUnavailable):
                found[slot] = self._record(slot)
        return found

    def _record(self, slot: int) -> SlotRecord:
        return self._read_record(slot)[1]

    def _read_record(self, slot: int) -> tuple[bytes, SlotRecord]:
        private_folder(self.folder)
        fd = os.open(self._record_path(slot), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError("not a regular file")
            raw = f.read(MAX_RECORD_BYTES + 1)
        text, _, digest = raw.rpartition(b"\n")
        if len(raw) > MAX_RECORD_BYTES or hashlib.sha256(text).hexdigest().encode() != digest:
            raise ValueError("a record that does not match its digest")
        record = SlotRecord.model_validate_json(text)
        if record.rank != self.rank:
            raise ValueError(f"rank {record.rank}'s record in rank {self.rank}'s folder")
        at = 0
        for e in record.tensors:  # exactly where a save puts them: no overlap, no gap, nothing past the end
            if e.offset != at:
                raise ValueError("a tensor out of place")
            at += _padded(_nbytes(DTYPES[e.dtype], e.shape))
        if max(at, ALIGN) != record.size:
            raise ValueError("a slot size that is not its tensors'")
        return raw, record

    def slot_of(self, step: int) -> int | None:
        """The slot whose whole record is of ``step``, or None."""
        return next((s for s, r in self.records().items() if r.step == step), None)

    def slot_record_bytes(self, slot: int) -> tuple[bytes, int]:
        """The record file of ``slot`` as it lies (read whole and checked), and the slot's size in bytes."""
        raw, record = self._read_record(slot)
        return raw, record.size

    def slot_bytes(self, slot: int, size: int) -> torch.Tensor:
        """The ``size`` bytes of ``slot`` (its mapped file: no copy)."""
        return self._map(slot, size, create=False)

    def prepare_receive(self, slot: int, size: int) -> torch.Tensor:
        """``slot`` made ready to take a snapshot from elsewhere (a peer's copy): its record removed first, its
        file sized and its pages taken (OSError when shared memory lacks them); the buffer to receive into."""
        self.wait()
        self._newest = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._record_path(slot))
        return self._map(slot, size, create=True)

    def commit_received(self, slot: int, raw: bytes) -> None:
        """Keep ``raw`` as ``slot``'s record once its bytes are in (``prepare_receive``), when it reads back as a
        whole record of this rank's of the slot's size; ValueError (and no record) otherwise."""
        self._write_record(slot, raw)
        try:
            record = self._record(slot)
            if record.size != self._maps[slot].numel():
                raise ValueError("a record of another size than the bytes received")
        except (OSError, ValueError, ValidationError, MemoryTierUnavailable) as exc:
            with contextlib.suppress(OSError):
                os.unlink(self._record_path(slot))
            raise ValueError(f"a copy whose record does not read back ({_line(exc)})") from None

    def drop_after(self, step: int) -> None:
        """Forget the snapshots past ``step`` (an earlier attempt's, which a resume from ``step`` must never take
        up again)."""
        self.wait()
        for slot, record in self.records().items():
            if record.step > step:
                with contextlib.suppress(FileNotFoundError):  # another rank of the host dropping stale folders
                    os.unlink(self._record_path(slot))
        self._newest = None
        if self.copies is not None:
            self.copies.drop_after(step)

    def read(self, step: int) -> tuple[dict[str, Any], dict[str, Any], SlotRecord]:
        """The state (its tensors copied out of the slot), the extra values and the record of this rank's snapshot
        of ``step``; ChecksumMismatch when it is not there whole, a byte differs from its checksum, or it does not
        load, whatever the reason."""
        self.wait()
        try:
            return self._read(step)
        except ChecksumMismatch:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a damaged slot raises: this snapshot does not load
            raise ChecksumMismatch(f"{self.folder}: step {step}'s snapshot does not load ({_line(exc)})") from None

    def _read(self, step: int) -> tuple[dict[str, Any], dict[str, Any], SlotRecord]:
        slot, record = next(((s, r) for s, r in self.records().items() if r.step == step), (None, None))
        if slot is None or record is None:
            raise ChecksumMismatch(f"{self.folder}: no snapshot of step {step}")
        buf = self._map(slot, record.size, create=False)
        tensors = []
        for i, e in enumerate(record.tensors):
            tensor = _view(buf, e.offset, DTYPES[e.dtype], e.shape).clone()  # checked as copied: no byte changes after
            if xxhash.xxh3_64_intdigest(_bytes(tensor).numpy().data) != e.checksum:
                raise ChecksumMismatch(f"{self.folder}: step {step}'s tensor {i} does not match its checksum")
            tensors.append(tensor)
        values = torch.load(io.BytesIO(base64.b64decode(record.values)), weights_only=True)
        if not isinstance(values, dict) or not isinstance(values.get("extra"), dict):
            raise ValueError("values that are not a snapshot's")
        return _fill(values["state"], tensors), values["extra"], record

    def _map(self, slot: int, size: int, create: bool) -> torch.Tensor:
        """The slot's file as a tensor of ``size`` bytes, mapped shared: ``create``d or resized (its pages taken
        now: a full /dev/shm is an OSError here, not a SIGBUS in the copy), or an existing one of that size."""
        buf = self._maps.get(slot)
        if buf is not None and buf.numel() == size:
            return buf
        self._maps.pop(slot, None)  # a resize that fails leaves no mapping of the old size behind
        self._views.pop(slot, None)
        if create:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
        private_folder(self.folder)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        fd = os.open(self._slot_path(slot), flags, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{self._slot_path(slot)} is not a regular file")
            if create:
                if st.st_size != size:
                    os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            elif st.st_size != size:
                raise OSError(f"the slot holds {st.st_size} bytes, not the {size} its record states")
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._maps[slot] = buf = torch.frombuffer(mapped, dtype=torch.uint8)
        self._views.pop(slot, None)
        return buf

    def _slot_path(self, slot: int) -> str:
        return os.path.join(self.folder, f"slot-{slot}.bin")

    def _record_path(self, slot: int) -> str:
        return os.path.join(self.folder, f"slot-{slot}.json")


def prune(root: str, keep: set[int]) -> list[int]:
    """Remove the rank folders under ``root`` that hold neither a rank of this host's nor the copies it keeps
    (``keep``): after a host was lost and the world shrank, the lost ranks' slots are no one's and would hold
    shared memory for the rest of the run; the ranks removed."""
    gone = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            rank = entry.name.removeprefix("rank-")
            ours = entry.name.startswith("rank-") and rank.isdigit() and entry.is_dir(follow_symlinks=False)
            if ours and int(rank) not in keep:
                shutil.rmtree(entry.path, ignore_errors=True)
                gone.append(int(rank))
    return gone


def drop_stale(root: str, step: int) -> None:
    """Forget the snapshots past ``step`` in every rank's folder under ``root``, not only the ranks' own and the
    copies they keep: after a host was lost the hosts may be numbered anew, and a folder no rank now owns must not
    keep an earlier attempt's steps."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            rank = entry.name.removeprefix("rank-")
            if entry.name.startswith("rank-") and rank.isdigit() and entry.is_dir(follow_symlinks=False):
                FlashSnapshots(root, int(rank)).drop_after(step)


def not_for(sharded: bool) -> str:
    """Why a job cannot take flash snapshots ('' when it can): they hold plain tensors (DDP's or one rank's)."""
    return "its state is sharded" if sharded else ""


def state_checksums(state: dict[str, Any]) -> list[int]:
    """The XXH3-64 checksum of each tensor of ``state``'s bytes, in the order a snapshot lays them out (a restored
    state's against its record)."""
    tensors: list[torch.Tensor] = []
    _skeleton(state, tensors)
    return [xxhash.xxh3_64_intdigest(_bytes(t).numpy().data) for t in tensors]


def _skeleton(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by its index in ``tensors`` (appended in a fixed walk order)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            raise TypeError(f"a flash snapshot holds plain tensors, not {type(obj).__name__}")
        if str(obj.dtype).removeprefix("torch.") not in DTYPES:
            raise TypeError(f"a flash snapshot holds no {obj.dtype} tensor")
        tensors.append(obj)
        return (_TENSOR, len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _skeleton(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == _TENSOR:
        return tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += _padded(t.numel() * t.element_size())
    return offsets, max(at, ALIGN)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    n = 1
    for d in shape:
        if d < 0:
            raise ValueError("a negative dimension")
        n *= d
    return n * dtype.itemsize


def _view(buf: torch.Tensor, at: int, dtype: torch.dtype, shape: Any) -> torch.Tensor:
    n = _nbytes(dtype, list(shape))
    return buf[at : at + n].view(dtype).view(tuple(shape))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{exc.__class__.__name__}: {text.splitlines()[0][:200]}" if text else exc.__class__.__name__


def _checksum(whole: memoryview, at: int, dtype: torch.dtype, shape: list[int]) -> int:
    """The XXH3-64 of a tensor's bytes in a slot (``whole``): a tenth of zlib's CRC-32's time (0.1 ms for the
    local profile's 10 MB), and 64 bits."""
    return xxhash.xxh3_64_intdigest(whole[at : at + _nbytes(dtype, shape)])
