"""The shard stage: a corpus becomes token shards plus a manifest (docs/architecture.md §3).

It is a map and a reduce. ``prepare_shards`` lists the source, cuts it into pieces (trainer/data/plan.py) and
settles the tokenizer (a bpe is trained here, on a bounded sample); ``tokenize_piece`` (trainer/data/piece.py)
is the map, one task per piece on whichever engine runs it; ``assemble_dataset`` is the reduce, which writes the
manifest last, so no partial dataset is ever published:

    {store.root}/datasets/{dataset_id}/manifest.json     the dataset: its shards are the pieces' files, in order
    {store.root}/datasets/pieces/{key}/…                  the pieces (shared by every dataset holding them)
    {store.root}/datasets/tokenizers/{sha256}.json        a bpe or tokenizer.json tokenizer

Every document ends with the tokenizer's end-of-text token. ``dataset_id`` hashes the pieces' keys (the source's
bytes, names and ranges, the tokenizer, the settings), so the same inputs land in the same folder and are not
rewritten, whatever the parallelism. ``shard_dataset`` runs the three in this process (tests, benchmarks, the
CLI's checks); the Prefect flow in flows/shard.py maps the pieces over a task runner.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainpipe.trainer import store as st
from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data.format import FORMAT, SPLITS, check_manifest, require_one_block, require_vocab
from trainpipe.trainer.data.piece import PieceResult, ShardJob, is_val, tokenize_piece
from trainpipe.trainer.data.plan import MB, PieceSpec, Previous, plan_pieces, sample_order, source_key, with_reuse
from trainpipe.trainer.data.sources import (
    BadRecords,
    Segment,
    SegmentRead,
    list_source,
    row_group_sizes,
    source_filesystem,
    source_options,
)
from trainpipe.trainer.data.tokenizer import TokenizerSpec, file_tokenizer, manifest_entry, token_dtype, train_bpe
from trainpipe.trainer.errors import DataError, StoreError
from trainpipe.trainer.store_paths import (
    DATASET_MANIFEST,
    PIECE_RECORD,
    datasets_uri,
    join,
    piece_folder,
    source_pointer,
    tokenizer_file,
)

Progress = Callable[[str, float], None]  # (what, fraction done)
FIRST_SKIPPED = 20


@dataclass
class DatasetInfo:
    dataset_id: str
    uri: str
    manifest: dict
    cache_hit: bool
    work: ShardWork = field(default_factory=lambda: ShardWork())


@dataclass(frozen=True)
class ShardWork:
    """What making a dataset took: pieces in all, found whole in the store, source bytes tokenized (the rest
    was reused), tokens copied from earlier pieces, and the wall time."""

    pieces: int = 0
    reused: int = 0
    tokenized_bytes: int = 0
    copied_tokens: int = 0
    seconds: float = 0.0


def dataset_metrics(info: DatasetInfo) -> dict[str, float]:
    """What MLflow records of the dataset a run trains on: its size and what making it took (``shard/``, a section
    MLflow shows after the loss curves)."""
    m, work = info.manifest, info.work
    return {
        "shard/source_mb": m["source"]["bytes"] / MB,
        "shard/train_tokens": float(m["splits"]["train"]["tokens"]),
        "shard/val_tokens": float(m["splits"]["val"]["tokens"]),
        "shard/documents": float(m["source"]["documents"]),
        "shard/pieces": float(work.pieces),
        "shard/pieces_reused": float(work.reused),
        "shard/tokenized_mb": work.tokenized_bytes / MB,
        "shard/shard_s": work.seconds,
        "shard/shard_mb_per_s": m["source"]["bytes"] / MB / work.seconds if work.seconds > 0 else 0.0,
    }


@dataclass(frozen=True)
class ShardPlan:
    """What the map needs: the job every task shares and the pieces, each with what it may reuse."""

    job: ShardJob
    pieces: tuple[PieceSpec, ...]
    files: int
    bytes: int
    source_key: str


class _PieceRef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    record: str = Field(pattern=r"^pieces/[0-9a-f]{32}/piece\.json$")
    first: str = Field(max_length=4096)
    last: str = Field(max_length=4096)


# -----------------------------------------------------------------------------
# the plan


def prepare_shards(data: DataConfig, store: StoreConfig, verify: bool = False, threads: int = 0) -> ShardPlan:
    """List ``data.source``, cut it into pieces and settle the tokenizer; DataError when there is nothing to read."""
    options = source_options(data.source, store)
    fs, files = list_source(data.source, options)
    if not files:
        hint = "check the path" if data.source == "stdlib" else "check the path/glob (use ** for subfolders)"
        raise DataError(f"data.source {data.source!r} matched no files; {hint} and that files exist")
    target = data.piece_mb * MB
    large = [f for f in files if f.kind == "parquet" and f.size > target]
    groups = {f.path: sizes for f in large if (sizes := row_group_sizes(fs, f)) is not None}
    pieces = plan_pieces(files, data, groups)
    root = store.root if "://" in store.root else os.path.abspath(store.root)
    datasets = datasets_uri(root)
    tokenizer = file_tokenizer(data, source_options(data.tokenizer, store))  # a bad one: one line, nothing written
    st.check_writable(root, store.storage_options)
    if tokenizer is None and data.tokenizer == "bpe":
        fs = source_filesystem(data.source, options)
        tokenizer = train_bpe(_sample_texts(fs, pieces, data), data.vocab_size, data.eot_token)
    job = ShardJob(data, store, datasets, tokenizer or TokenizerSpec("byte"), options, threads, verify)
    key = source_key(data)
    previous = _previous(store, datasets, key)
    return ShardPlan(job, tuple(with_reuse(pieces, previous)), len(files), sum(p.bytes for p in pieces), key)


def _sample_texts(fs, pieces: list[PieceSpec], data: DataConfig) -> Iterator[str]:
    """Train-split text for a bpe tokenizer: whole pieces in ``sample_order``, up to ``data.tokenizer_sample_mb``."""
    budget, total = int(data.tokenizer_sample_mb * MB), 0
    for piece in sample_order(pieces):
        for seg in piece.segments:
            for part in SegmentRead(fs, seg, data, BadRecords(1 << 62)).parts():
                if is_val(part.key, data.val_fraction):
                    continue
                size = len(part.text.encode())
                if total + size >= budget:
                    yield part.text.encode()[: budget - total].decode("utf-8", errors="ignore")
                    return
                total += size
                yield part.text


def _previous(store: StoreConfig, datasets: str, key: str) -> Previous | None:
    """The pieces of the newest dataset made from the same source and settings, if the store holds one intact.
    Only a hint: each piece's tokens are reused only for segments whose bytes hash as before."""
    fs, base = st.filesystem(datasets, store.storage_options)
    try:
        pointer = st.read_json(fs, join(base, source_pointer(key)))
        dataset_id = pointer.get("dataset_id") if isinstance(pointer, dict) else None
        if not isinstance(dataset_id, str) or not re.fullmatch(r"[0-9a-f]{16}", dataset_id):
            return None
        manifest = st.read_json(fs, join(base, dataset_id, DATASET_MANIFEST))
        check_manifest(manifest, DATASET_MANIFEST)
        refs = [_PieceRef.model_validate(r) for r in manifest.get("pieces", [])]
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError, ValueError, ValidationError, DataError):
        return None
    except st.NotARecord:
        return None
    if not refs:
        return None
    return Previous(
        dataset_id, tuple(r.record for r in refs), tuple(r.first for r in refs), tuple(r.last for r in refs)
    )


# -----------------------------------------------------------------------------
# the reduce


def _check_bad_records(data: DataConfig, results: list[PieceResult]) -> tuple[int, list[str]]:
    """(unreadable records, the first few named); DataError when more than ``data.max_bad_records``."""
    units = [u for r in sorted(results, key=lambda r: r.index) for u in r.record.units]
    bad = sum(u.bad for u in units)
    first = [w for u in units for w in u.first_bad][:FIRST_SKIPPED]
    if bad > data.max_bad_records:
        raise DataError(
            f"{bad} unreadable records, more than data.max_bad_records={data.max_bad_records}; the first: {first[0]}"
        )
    return bad, first


def forced_pieces(plan: ShardPlan, results: list[PieceResult]) -> list[PieceSpec]:
    """The pieces to tokenize again because a split came out empty: the last document then goes to val (or the
    first to train), as a corpus of a few documents needs. DataError when there are fewer than two documents."""
    _check_bad_records(plan.job.data, results)
    units = [(r.index, i, u) for r in sorted(results, key=lambda r: r.index) for i, u in enumerate(r.record.units)]
    train = sum(u.train_documents for _, _, u in units)
    val = sum(u.val_documents for _, _, u in units)
    source = plan.job.data.source
    if train + val == 0:
        bad = sum(u.bad for _, _, u in units)
        what = "records are unreadable or empty" if bad else "files are empty"
        raise DataError(f"data.source {source!r}: all {plan.files} matched {what}")
    if train + val < 2:
        raise DataError(
            f"data.source {source!r}: too little data ({train + val} document(s)); "
            "need at least 2 documents so train and val each get one"
        )
    if val and train:
        return []
    split, order = ("val", reversed(units)) if val == 0 else ("train", iter(units))
    index, seg_index, unit = next(x for x in order if x[2].train_documents + x[2].val_documents)
    segment = plan.pieces[index].segments[seg_index]
    forces: dict[int, list[tuple[int, str, int]]] = {}
    if segment.file.kind == "text":  # a file's document: every segment of the file
        for p in plan.pieces:
            for i, s in enumerate(p.segments):
                if s.file.name == segment.file.name:
                    forces.setdefault(p.index, []).append((i, split, 0))
    else:
        ordinal = unit.train_documents + unit.val_documents - 1 if split == "val" else 0
        forces[index] = [(seg_index, split, ordinal)]
    return [replace(plan.pieces[i], force=tuple(f), reuse=()) for i, f in sorted(forces.items())]


def assemble_dataset(plan: ShardPlan, results: list[PieceResult], started: float | None = None) -> DatasetInfo:
    """The dataset of the pieces' ``results`` (one per planned piece, any order): its manifest written last."""
    job, data = plan.job, plan.job.data
    ordered = sorted(results, key=lambda r: r.index)
    if [r.index for r in ordered] != [p.index for p in plan.pieces]:
        raise DataError("the shard stage's results do not match its plan; run it again")
    units = [u for r in ordered for u in r.record.units]
    bad, first_bad = _check_bad_records(data, results)
    fingerprint = hashlib.sha256()
    for u in units:
        fingerprint.update(f"{u.name}\0{u.bytes}\0{u.content}\n".encode())
    settings = {
        "shard_tokens": data.shard_tokens,
        "val_fraction": data.val_fraction,
        "max_bytes": data.max_bytes,
        "piece_mb": data.piece_mb,
    }
    identity = {
        "format": FORMAT,
        "pieces": [r.record.key for r in ordered],
        "tokenizer": job.tokenizer.identity,
        "settings": settings,
    }
    dataset_id = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    splits = {}
    for split in SPLITS:
        parts = [r.record.split(split) for r in ordered]
        splits[split] = {
            "tokens": sum(p.tokens for p in parts),
            "documents": sum(p.documents for p in parts),
            "shards": [s.model_dump() for p in parts for s in p.shards],
        }
    tok_file = tokenizer_file(sha) if (sha := job.tokenizer.sha256) is not None else None
    manifest = {
        "format": FORMAT,
        "dataset_id": dataset_id,
        "tokenizer": manifest_entry(job.tokenizer, tok_file),
        "dtype": token_dtype(job.tokenizer.load().vocab_size),
        "source": {
            "spec": data.source,
            "fingerprint": fingerprint.hexdigest(),
            "files": plan.files,
            "documents": splits["train"]["documents"] + splits["val"]["documents"],
            "bytes": sum(u.bytes for u in units),
            "skipped_records": bad,
            "first_skipped": first_bad,
        },
        "settings": settings,
        "pieces": [
            {"record": f"{piece_folder(r.record.key)}/{PIECE_RECORD}", "first": p.first, "last": p.last}
            for r, p in zip(ordered, plan.pieces, strict=True)
        ],
        "splits": splits,
    }
    work = ShardWork(
        len(ordered),
        sum(r.reused for r in ordered),
        sum(r.tokenized_bytes for r in ordered),
        sum(r.copied_tokens for r in ordered),
        time.perf_counter() - started if started is not None else 0.0,
    )
    uri = join(job.datasets, dataset_id)
    fs, base = st.filesystem(job.datasets, job.store.storage_options)
    try:
        if _published(fs, join(base, dataset_id, DATASET_MANIFEST)) == manifest:
            return DatasetInfo(dataset_id, uri, manifest, True, work)
        if job.tokenizer.json is not None and tok_file is not None and not fs.exists(join(base, tok_file)):
            st.write_text(fs, join(base, tok_file), job.tokenizer.json)
        st.write_json(fs, join(base, dataset_id, DATASET_MANIFEST), manifest)
        st.write_json(fs, join(base, source_pointer(plan.source_key)), {"dataset_id": dataset_id})
    except OSError as exc:
        raise StoreError(f"cannot write dataset {uri} ({exc.__class__.__name__}: {exc})") from None
    return DatasetInfo(dataset_id, uri, manifest, False, work)


def segment_hashes(plan: ShardPlan, results: list[PieceResult]) -> Iterator[tuple[Segment, str]]:
    """Each planned segment with the sha256 of its bytes as its piece's record holds it (a piece's units are its
    segments, in order)."""
    by_index = {r.index: r for r in results}
    for piece in plan.pieces:
        units = by_index[piece.index].record.units
        if len(units) == len(piece.segments):
            yield from ((seg, u.content) for seg, u in zip(piece.segments, units, strict=True) if u.name == seg.name)


def _published(fs, path: str) -> dict | None:
    """The manifest at ``path``, or None when there is none (or not a valid one: then it is written again)."""
    try:
        fs.invalidate_cache(path.rsplit("/", 1)[0])
        manifest = st.read_json(fs, path)
        check_manifest(manifest, DATASET_MANIFEST)
        return manifest
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError, ValueError, DataError, st.NotARecord):
        return None
    except StoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - every other backend error (connection, 5xx, throttling) alike
        reason = f"{exc.__class__.__name__}: {exc}".splitlines()[0]
        raise StoreError(f"cannot read {path} ({reason}); the store may be unreachable") from None


# -----------------------------------------------------------------------------
# in this process


class _Bar:
    """A progress bar on stderr (at most ten updates a second) and/or a callback."""

    def __init__(self, terminal: bool, callback: Progress | None):
        self.terminal, self.callback, self.last = terminal, callback, 0.0

    def __call__(self, what: str, fraction: float) -> None:
        now = time.monotonic()
        if fraction < 1.0 and now - self.last < 0.1:
            return
        self.last = now
        if self.callback is not None:
            self.callback(what, fraction)
        if self.terminal:
            bar = "#" * int(fraction * 30)
            sys.stderr.write(f"\rshard: {what:<14} [{bar:<30}] {fraction:4.0%}" + ("\n" if fraction >= 1.0 else ""))
            sys.stderr.flush()


def shard_dataset(
    data: DataConfig,
    store: StoreConfig,
    progress: bool = False,
    block_size: int | None = None,
    vocab_size: int | None = None,
    on_progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
    verify: bool = False,
) -> DatasetInfo:
    """Tokenize ``data.source`` into ``{store.root}/datasets/{dataset_id}`` in this process, piece after piece;
    reuse what the store holds.

    ``progress`` draws a bar on stderr, ``on_progress`` receives (what, fraction) and ``warn`` a line per skipped
    record. With ``block_size``, a split too short for one training sample is an error here, not in the ranks;
    with ``vocab_size`` (the model's), so is a tokenizer with more tokens than the model has rows. ``verify``
    hashes every reused file against its checksum (and makes a damaged piece again)."""
    started = time.perf_counter()
    plan = prepare_shards(data, store, verify)
    show = _Bar(progress, on_progress)
    total, done = max(plan.bytes, 1), 0
    results: list[PieceResult] = []
    for piece in plan.pieces:
        results.append(tokenize_piece(plan.job, piece, warn))
        done += piece.bytes
        show(f"{len(results)}/{len(plan.pieces)} pieces", min(done / total, 0.999))
    redo = forced_pieces(plan, results)
    if redo:
        plan = replace(plan, pieces=tuple(redo_map(plan.pieces, redo)))
        again = {p.index: tokenize_piece(plan.job, p, warn) for p in redo}
        results = [again.get(r.index, r) for r in results]
    info = assemble_dataset(plan, results, started)
    show("done", 1.0)
    check_dataset(info, block_size, vocab_size)
    return info


def redo_map(pieces: tuple[PieceSpec, ...], redo: list[PieceSpec]) -> list[PieceSpec]:
    """``pieces`` with the ones in ``redo`` put in their place."""
    by_index = {p.index: p for p in redo}
    return [by_index.get(p.index, p) for p in pieces]


def check_dataset(info: DatasetInfo, block_size: int | None, vocab_size: int | None) -> None:
    """DataError when a split is too short for one sample of ``block_size`` or the model's ``vocab_size`` does
    not cover the tokenizer."""
    if block_size is not None:
        require_one_block(info.manifest, block_size)
    if vocab_size is not None:
        require_vocab(info.manifest, vocab_size)


def read_documents(
    data: DataConfig, storage_options: dict | None = None, warn: Callable[[str], None] | None = None
) -> Iterator[tuple[str, str]]:
    """(name, text) of each document the shard stage reads, in order, within ``data.max_bytes``; one document is
    held at a time. Unreadable records are skipped up to ``data.max_bad_records``."""
    fs, files = list_source(data.source, storage_options)
    bad = BadRecords(data.max_bad_records, warn)
    parts: list[str] = []
    for piece in plan_pieces(files, data):
        for seg in piece.segments:
            for part in SegmentRead(fs, seg, data, bad).parts():
                parts.append(part.text)
                if part.last:
                    yield part.doc, "".join(parts)
                    parts.clear()
