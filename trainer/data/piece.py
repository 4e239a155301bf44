"""One piece of the shard stage, on whichever worker runs it: its segments read once, tokenized (or their tokens
copied from an earlier piece when their bytes are unchanged), and written as the piece's own shards.

    {datasets}/pieces/{key}/train-000000.bin …   the piece's train tokens, in files of data.shard_tokens at most
    {datasets}/pieces/{key}/val-000000.bin …
    {datasets}/pieces/{key}/piece.json           written last: its units, their spans in the shards, checksums

A piece's key hashes its units' keys, and a unit's key hashes what decides its tokens: the segment's bytes, its
file's name and range, the tokenizer and the settings. So equal work lands in one folder, which a second run
finds and reuses whole, and the dataset's bytes do not depend on which worker ran which piece
(docs/architecture.md §3). Torch-free and Prefect-free: the task in tasks/shard.py calls ``tokenize_piece``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainpipe.trainer import store as st
from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data.format import DTYPES, SPLITS
from trainpipe.trainer.data.plan import PieceSpec, planned_bytes
from trainpipe.trainer.data.sources import BadRecords, Part, Segment, SegmentRead, record_limit, source_filesystem
from trainpipe.trainer.data.tokenizer import TokenDtype, TokenizerSpec, token_dtype
from trainpipe.trainer.errors import DataError, StoreError
from trainpipe.trainer.store_paths import PIECE_RECORD, join, piece_folder

UNIT_FORMAT = 1  # bump when what a unit's tokens depend on changes (the reader's cuts, the routing)
MAX_COUNT = 1 << 48
FIRST_BAD = 3  # bad records named per unit (all are counted)
_COPY_TOKENS = 1 << 22  # tokens copied from an earlier piece at once

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
ShardFile = Annotated[str, Field(pattern=r"^pieces/[0-9a-f]{32}/(train|val)-\d{6}\.bin$")]


class _Record(BaseModel):
    # Read back from a store others may write (docs/security.md): strict, bounded, nothing unexpected.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Span(_Record):
    start: Count
    tokens: Count


class Unit(_Record):
    """One segment's outcome: what decided its tokens (``slot``: name, range, tokenizer, settings; ``content``:
    its bytes' sha256), where its tokens lie in the piece's split streams, its documents and bad records."""

    slot: Sha256
    content: Sha256
    name: Annotated[str, Field(max_length=4096)]
    bytes: Count
    train: Span
    val: Span
    train_documents: Count
    val_documents: Count
    bad: Count
    first_bad: list[Annotated[str, Field(max_length=2000)]] = Field(max_length=FIRST_BAD)

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.slot}:{self.content}".encode()).hexdigest()


class Shard(_Record):
    file: ShardFile
    tokens: Count
    sha256: Sha256


class SplitPart(_Record):
    tokens: Count
    documents: Count
    shards: list[Shard]


class PieceRecord(_Record):
    """A piece's ``piece.json``."""

    format: Literal[1]
    key: Sha256
    dtype: TokenDtype
    units: list[Unit]
    train: SplitPart
    val: SplitPart

    def split(self, name: str) -> SplitPart:
        return self.train if name == "train" else self.val

    @model_validator(mode="after")
    def _adds_up(self) -> PieceRecord:
        # The units' spans tile each split's stream, which its shards hold: a planted record cannot make a copy
        # read past a shard or leave tokens out (docs/security.md).
        for name in SPLITS:
            part, at, documents = self.split(name), 0, 0
            for unit in self.units:
                span = getattr(unit, name)
                if span.start != at:
                    raise ValueError(f"the {name} spans of the units do not follow each other")
                at += span.tokens
                documents += getattr(unit, f"{name}_documents")
            if at != part.tokens or part.tokens != sum(s.tokens for s in part.shards) or documents != part.documents:
                raise ValueError(f"the {name} split's counts do not add up")
        return self


@dataclass(frozen=True)
class ShardJob:
    """What every shard task of one dataset shares: the settings, the store, the tokenizer."""

    data: DataConfig
    store: StoreConfig
    datasets: str  # the store's datasets/ folder
    tokenizer: TokenizerSpec
    source_options: dict
    threads: int = 0  # the tokenizer's threads in this task (0: its own choice)
    verify: bool = False  # reuse only what hashes to its checksums, and no unit's tokens from elsewhere

    @property
    def dtype(self) -> TokenDtype:
        return token_dtype(self.tokenizer.load().vocab_size)


@dataclass(frozen=True)
class PieceResult:
    """A finished piece, as its task returns it: its record, and what the work took."""

    index: int
    record: PieceRecord
    reused: bool  # found whole in the store
    tokenized_bytes: int
    copied_tokens: int
    seconds: float

    @property
    def folder(self) -> str:
        return piece_folder(self.record.key)


def is_val(key: str, val_fraction: float) -> bool:
    """A document's split: a hash of its file's name (or its record's content), never its position, so adding a
    document moves no other."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 2**32 < val_fraction


def _slot(seg: Segment, job: ShardJob, force: list[tuple[int, str]]) -> str:
    data = job.data
    key = {
        "unit_format": UNIT_FORMAT,
        "name": seg.file.name,
        "kind": seg.file.kind,
        "range": [seg.start, seg.stop, seg.hard, seg.last],
        "tokenizer": job.tokenizer.identity,
        "text_field": data.text_field,
        "val_fraction": data.val_fraction,
        "record_limit": record_limit(data),
        "force": sorted(force),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def piece_key(units: list[Unit], shard_tokens: int, dtype: str) -> str:
    key = {"format": 1, "units": [u.key for u in units], "shard_tokens": shard_tokens, "dtype": dtype}
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def _parse_record(body: bytes) -> PieceRecord:
    # The find pass and the pieces' tasks read the same records in one process: parsed once, keyed by the bytes
    # read (a record changed meanwhile is parsed anew; a parsed one is frozen). Bounded: 16 records of 1 MB.
    return _parse_cached(body) if len(body) <= 1 << 20 else PieceRecord.model_validate_json(body)


@functools.lru_cache(maxsize=16)
def _parse_cached(body: bytes) -> PieceRecord:
    return PieceRecord.model_validate_json(body)


def read_piece(fs, datasets: str, folder: str, verify: bool = False) -> PieceRecord | None:
    """The piece record in ``folder`` (under ``datasets``, a path of ``fs``) when it and every shard it names are
    there at their sizes (with ``verify``, hashing to their checksums); None when not. A store that cannot be
    read is a StoreError."""
    base = join(datasets, folder)
    try:
        fs.invalidate_cache(base)
        record = _parse_record(st.read_record(fs, join(base, PIECE_RECORD)))
        if piece_folder(record.key) != folder:
            return None
        listed = {i["name"].rsplit("/", 1)[-1]: i.get("size") for i in fs.ls(base, detail=True)}
        itemsize = DTYPES[record.dtype].itemsize
        for split in SPLITS:
            for shard in record.split(split).shards:
                name = shard.file.rsplit("/", 1)[-1]
                if not shard.file.startswith(folder + "/") or listed.get(name) != shard.tokens * itemsize:
                    return None
                if verify and st.sha256_file(fs, join(datasets, shard.file)) != shard.sha256:
                    return None
        return record
    except (FileNotFoundError, NotADirectoryError, ValidationError, UnicodeDecodeError, ValueError, st.NotARecord):
        return None
    except StoreError:
        raise
    except OSError as exc:
        raise StoreError(f"cannot read piece {folder} ({exc.__class__.__name__}: {exc})") from None


class _Writer:
    """The tokens of one split of a piece into staged files of ``shard_tokens`` each."""

    def __init__(self, staging: str, split: str, shard_tokens: int, dtype: np.dtype):
        self.staging, self.split = staging, split
        self.buf, self.filled = np.empty(shard_tokens, dtype=dtype), 0
        self.shards: list[tuple[str, int, str]] = []  # (name, tokens, sha256)
        self.tokens = self.documents = 0

    def add(self, ids: np.ndarray) -> None:
        while len(ids):
            take = min(len(ids), len(self.buf) - self.filled)
            self.buf[self.filled : self.filled + take] = ids[:take]
            self.filled, ids = self.filled + take, ids[take:]
            self.tokens += take
            if self.filled == len(self.buf):
                self._flush()

    def _flush(self) -> None:
        blob = self.buf[: self.filled].tobytes()
        name = f"{self.split}-{len(self.shards):06d}.bin"
        with open(os.path.join(self.staging, name), "wb") as fh:
            fh.write(blob)
        self.shards.append((name, self.filled, hashlib.sha256(blob).hexdigest()))
        self.filled = 0

    def close(self, folder: str) -> SplitPart:
        if self.filled:
            self._flush()
        shards = [Shard(file=f"{folder}/{n}", tokens=t, sha256=h) for n, t, h in self.shards]
        return SplitPart(tokens=self.tokens, documents=self.documents, shards=shards)


def _release_freed_memory() -> None:
    # The tokenizer's threads allocate from their own glibc arenas, which keep what each batch freed; trimming
    # after every batch holds the peak near one batch's worth (benchmarks/shard_throughput.py).
    if _TRIM is not None:
        _TRIM(0)


def _malloc_trim():
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


class _Candidates:
    """Units of earlier pieces by slot, to copy tokens from when a segment's bytes are unchanged. Copies are
    queued: the spans of consecutive units that follow each other in one earlier piece are read as one range."""

    def __init__(self, fs, base: str, job: ShardJob, records: tuple[str, ...]):
        self.fs, self.base, self.by_slot = fs, base, {}
        self.open: dict[str, Any] = {}  # the earlier shards being copied from, each opened once
        self.pending: dict[str, tuple[PieceRecord, int, int]] = {}  # split -> (record, start, end) not yet copied
        for path in records:
            folder = path.rsplit("/", 1)[0]
            record = read_piece(fs, base, folder, job.verify)
            if record is None or record.dtype != job.dtype:
                continue  # gone or damaged: its segments are tokenized again
            for unit in record.units:
                self.by_slot.setdefault(unit.slot, (unit, record))

    def queue(self, slot: str, writers: dict[str, _Writer]) -> int:
        """The earlier unit of ``slot`` queued for copying into ``writers`` (after what is already queued);
        tokens queued. ``flush`` copies them."""
        unit, record = self.by_slot[slot]
        queued = 0
        for split in SPLITS:
            span = getattr(unit, split)
            writers[split].documents += getattr(unit, f"{split}_documents")
            queued += span.tokens
            if not span.tokens:
                continue
            held = self.pending.get(split)
            if held is not None and held[0] is record and held[2] == span.start:
                self.pending[split] = (record, held[1], span.start + span.tokens)
                continue
            self._copy(split, writers[split])
            self.pending[split] = (record, span.start, span.start + span.tokens)
        return queued

    def flush(self, writers: dict[str, _Writer]) -> None:
        for split in SPLITS:
            self._copy(split, writers[split])

    def _copy(self, split: str, writer: _Writer) -> None:
        held = self.pending.pop(split, None)
        if held is None:
            return
        record, pos, end = held
        itemsize, first = DTYPES[record.dtype].itemsize, 0
        for shard in record.split(split).shards:
            lo, hi = max(pos, first), min(end, first + shard.tokens)
            if lo < hi:
                fh = self._opened(shard.file)
                fh.seek((lo - first) * itemsize)
                left = hi - lo
                while left:
                    take = min(left, _COPY_TOKENS)
                    blob = fh.read(take * itemsize)
                    if len(blob) != take * itemsize:
                        raise DataError(f"piece shard {shard.file} is shorter than its record says")
                    writer.add(np.frombuffer(blob, dtype=DTYPES[record.dtype]))
                    left -= take
            first += shard.tokens
            if first >= end:
                break

    def _opened(self, file: str):
        if file not in self.open:
            if len(self.open) >= 8:  # units are copied in order: an earlier shard is rarely needed again
                self.close()
            self.open[file] = self.fs.open(join(self.base, file), "rb")
        return self.open[file]

    def close(self) -> None:
        for fh in self.open.values():
            fh.close()
        self.open.clear()


class _Encoder:
    """A piece's units into the writers in segment order: the text of new segments tokenized about
    ``data.buffer_mb`` at a time across segments (a batch of many small files, so the tokenizer's threads have
    work), and the tokens of unchanged segments copied from earlier pieces between them; tokens and documents
    counted per tokenized unit and split."""

    def __init__(self, job: ShardJob, writers: dict[str, _Writer], candidates: _Candidates):
        self.tok, self.writers, self.limit = job.tokenizer.load(), writers, job.data.buffer_mb << 20
        self.candidates = candidates
        self.eot = np.array([self.tok.eot], dtype=writers["train"].buf.dtype)
        self.batch: list[tuple[int, str, Part] | str] = []  # text parts, and slots of units to copy, in order
        self.chars = 0
        self.tokens: dict[int, dict[str, int]] = {}
        self.documents: dict[int, dict[str, int]] = {}

    def read(self, unit: int, read: SegmentRead, force: dict[int, str], val_fraction: float) -> None:
        """Every part of ``read`` routed to its split (``force``: document ordinal -> split) and batched."""
        self.tokens[unit], self.documents[unit] = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
        ordinal = 0
        for part in read.parts():
            split = force.get(ordinal) or ("val" if is_val(part.key, val_fraction) else "train")
            self.batch.append((unit, split, part))
            ordinal += part.last
            self.chars += len(part.text)
            if self.chars >= self.limit:
                self.flush()

    def copy(self, slot: str) -> int:
        """The earlier unit of ``slot`` copied in its place in the order; the tokens it holds."""
        self.batch.append(slot)
        return sum(getattr(self.candidates.by_slot[slot][0], s).tokens for s in SPLITS)

    def flush(self) -> None:
        if not self.batch:
            return
        texts = [item[2].text for item in self.batch if not isinstance(item, str)]
        encoded = iter(self.tok.encode(texts) if texts else ())
        dtype = self.eot.dtype
        for item in self.batch:
            if isinstance(item, str):
                self.candidates.queue(item, self.writers)
                continue
            self.candidates.flush(self.writers)  # what was queued before this part goes first
            unit, split, part = item
            ids = next(encoded)
            writer = self.writers[split]
            writer.add(ids.astype(dtype, copy=False))
            self.tokens[unit][split] += len(ids)
            if part.last:
                writer.add(self.eot)
                writer.documents += 1
                self.tokens[unit][split] += 1
                self.documents[unit][split] += 1
        self.candidates.flush(self.writers)
        self.batch.clear()
        if texts:
            self.chars = 0
            _release_freed_memory()


def _staging_dir(out_fs, base: str) -> tuple[str, bool]:
    """A folder to write a piece into before it is published; (path, on the store's own disk)."""
    if isinstance(out_fs, LocalFileSystem):
        pool = os.path.join(base, "pieces")
        os.makedirs(pool, exist_ok=True)
        return tempfile.mkdtemp(prefix=".staging-", dir=pool), True
    return tempfile.mkdtemp(prefix="trainpipe-piece-"), False


def _publish(out_fs, base: str, staging: str, local: bool, record: PieceRecord) -> None:
    """The staged piece into its folder, its record last. A local store renames the whole folder into place; an
    object store receives the shards, then the record (an object store has no rename)."""
    folder = piece_folder(record.key)
    body = record.model_dump_json(indent=1)
    if local:
        with open(os.path.join(staging, PIECE_RECORD), "w", encoding="utf-8") as fh:
            fh.write(body)
        target = os.path.join(base, folder)
        if os.path.lexists(target):  # damaged (a verify found it so) or a same-content race: replaced whole
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:  # another worker published the same piece first: same bytes, keep theirs
            shutil.rmtree(staging, ignore_errors=True)
        return
    try:
        for split in SPLITS:
            for shard in record.split(split).shards:
                out_fs.put_file(os.path.join(staging, shard.file.rsplit("/", 1)[-1]), join(base, shard.file))
        st.write_text(out_fs, join(base, folder, PIECE_RECORD), body)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass
class _Look:
    """What a piece's task learns before writing: the stores, each segment's slot, the earlier units, and which
    segments an earlier piece holds unchanged."""

    out_fs: object
    base: str
    fs: object
    forced: dict[int, dict[int, str]]
    slots: list[str]
    candidates: _Candidates
    unchanged: dict[int, bool]
    hashed: dict[int, str]  # segment -> the sha256 of its bytes, for the segments an earlier piece holds
    found: PieceRecord | None


def _look(job: ShardJob, piece: PieceSpec, hashed: dict[int, str] | None = None) -> _Look:
    out_fs, base = st.filesystem(job.datasets, job.store.storage_options)
    fs = source_filesystem(job.data.source, job.source_options)
    forced: dict[int, dict[int, str]] = {}
    for segment, split, ordinal in piece.force:
        forced.setdefault(segment, {})[ordinal] = split
    slots = [_slot(s, job, sorted(forced.get(i, {}).items())) for i, s in enumerate(piece.segments)]
    candidates = _Candidates(out_fs, base, job, piece.reuse)
    # Segments an earlier piece holds are hashed first (or were, by the find pass: ``hashed``): when every one is
    # unchanged the whole piece may exist.
    unchanged, seen = {}, {}
    for i, seg in enumerate(piece.segments):
        if slots[i] in candidates.by_slot:
            content = (hashed or {}).get(i) or SegmentRead(fs, seg, job.data, BadRecords(1 << 62)).hash_only()
            seen[i] = content
            unchanged[i] = content == candidates.by_slot[slots[i]][0].content
    found = None
    if len(unchanged) == len(slots) and all(unchanged.values()):
        units = [candidates.by_slot[s][0] for s in slots]
        found = read_piece(out_fs, base, piece_folder(piece_key(units, job.data.shard_tokens, job.dtype)), job.verify)
    return _Look(out_fs, base, fs, forced, slots, candidates, unchanged, seen, found)


@dataclass(frozen=True)
class Lookup:
    """A piece looked up before any worker starts: found whole in the store, or how many of its source bytes
    are new or changed (to tokenize; the rest is copied from earlier pieces), and the hashes of the segments it
    read (so the piece's task does not read them again)."""

    index: int
    found: PieceResult | None
    new_bytes: int
    hashed: dict[int, str]


def find_piece(job: ShardJob, piece: PieceSpec, known: dict[int, str] | None = None) -> Lookup:
    """``piece`` as the store already holds it, when every segment is unchanged since an earlier piece and that
    piece is intact; else the bytes left to tokenize. Reads only the segments an earlier piece holds and whose
    hash is not ``known`` (segment -> sha256, from source_hashes.py)."""
    t0 = time.perf_counter()
    if not piece.reuse:
        return Lookup(piece.index, None, piece.bytes, {})
    look = _look(job, piece, known)
    if look.found is not None:
        found = PieceResult(piece.index, look.found, True, 0, 0, time.perf_counter() - t0)
        return Lookup(piece.index, found, 0, look.hashed)
    new = sum(planned_bytes(s) for i, s in enumerate(piece.segments) if not look.unchanged.get(i))
    return Lookup(piece.index, None, new, look.hashed)


def tokenize_piece(
    job: ShardJob,
    piece: PieceSpec,
    warn: Callable[[str], None] | None = None,
    hashed: dict[int, str] | None = None,
) -> PieceResult:
    """Tokenize ``piece`` into its folder of the store, or find it there; see the module's docstring.
    ``hashed``: the find pass's hashes of its segments (``Lookup.hashed``), which are not read again."""
    t0 = time.perf_counter()
    if job.threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if job.threads > 1 else "false"
    look = _look(job, piece, hashed)
    if look.found is not None:
        return PieceResult(piece.index, look.found, True, 0, 0, time.perf_counter() - t0)
    out_fs, base, fs, forced, slots = look.out_fs, look.base, look.fs, look.forced, look.slots
    candidates, unchanged, dtype = look.candidates, look.unchanged, job.dtype

    staging, local = _staging_dir(out_fs, base)
    try:
        writers = {s: _Writer(staging, s, job.data.shard_tokens, DTYPES[dtype]) for s in SPLITS}
        encoder = _Encoder(job, writers, candidates)
        made: dict[int, Unit] = {}
        reads: dict[int, tuple[SegmentRead, BadRecords]] = {}
        tokenized, copied = 0, 0
        for i, seg in enumerate(piece.segments):
            if unchanged.get(i):
                made[i] = candidates.by_slot[slots[i]][0]
                copied += encoder.copy(slots[i])
                continue
            bad = BadRecords(job.data.max_bad_records, warn)
            reads[i] = SegmentRead(fs, seg, job.data, bad), bad
            encoder.read(i, reads[i][0], forced.get(i, {}), job.data.val_fraction)
        encoder.flush()
        units, at = [], dict.fromkeys(SPLITS, 0)
        for i, seg in enumerate(piece.segments):
            if i in made:
                unit = made[i]
            else:
                read, bad = reads[i]
                tokenized += read.bytes
                counts, documents = encoder.tokens[i], encoder.documents[i]
                unit = Unit(
                    slot=slots[i],
                    content=read.sha256,
                    name=seg.name,
                    bytes=read.bytes,
                    train=Span(start=0, tokens=counts["train"]),
                    val=Span(start=0, tokens=counts["val"]),
                    train_documents=documents["train"],
                    val_documents=documents["val"],
                    bad=bad.count,
                    first_bad=[w[:2000] for w in bad.first[:FIRST_BAD]],
                )
            spans = {s: Span(start=at[s], tokens=getattr(unit, s).tokens) for s in SPLITS}
            units.append(unit.model_copy(update=spans))
            at = {s: at[s] + spans[s].tokens for s in SPLITS}
        key = piece_key(units, job.data.shard_tokens, dtype)
        folder = piece_folder(key)
        existing = read_piece(out_fs, base, folder, job.verify)
        if existing is not None:  # the same work, done before (another dataset, or a worker that died after it)
            return PieceResult(piece.index, existing, True, tokenized, copied, time.perf_counter() - t0)
        parts = {s: writers[s].close(folder) for s in SPLITS}
        record = PieceRecord(format=1, key=key, dtype=dtype, units=units, train=parts["train"], val=parts["val"])
        _publish(out_fs, base, staging, local, record)
        staging = ""
    except OSError as exc:
        reason = f"{exc.__class__.__name__}: {exc}"
        raise StoreError(f"cannot write piece {piece.index} to {job.datasets} ({reason})") from None
    finally:
        candidates.close()
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
    return PieceResult(piece.index, record, False, tokenized, copied, time.perf_counter() - t0)
