"""The shard stage: a corpus becomes fixed-size token shards plus a manifest (docs/architecture.md §3).

    {store.root}/datasets/{dataset_id}/build-{hex}/train-000000.bin …  little-endian token ids (uint16, or
    {store.root}/datasets/{dataset_id}/build-{hex}/val-000000.bin …    uint32 above 65,536 tokens: "dtype")
    {store.root}/datasets/{dataset_id}/build-{hex}/tokenizer.json      a bpe or tokenizer.json tokenizer
    {store.root}/datasets/{dataset_id}/manifest.json   written LAST: it publishes one build's files

Every document ends with the tokenizer's end-of-text token. ``dataset_id`` hashes the source *content*
with the tokenizer's identity and the shard settings, so the same inputs land in the same folder and are
not rewritten. The source is streamed, in passes: a fingerprint (which decides ``dataset_id`` and the
splits), a bpe tokenizer's training, then tokenizing and writing; memory stays near ``data.buffer_mb``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import numpy as np

from trainpipe.trainer import store as st
from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data.format import DTYPES, FORMAT, SPLITS, check_manifest, require_one_block, require_vocab
from trainpipe.trainer.data.sources import BadRecords, Piece, SourceFile, list_source, read_pieces, source_options
from trainpipe.trainer.data.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    Tokenizer,
    manifest_entry,
    token_dtype,
    tokenizer_identity,
    train_bpe,
)
from trainpipe.trainer.errors import DataError, StoreError
from trainpipe.trainer.layout import DATASET_MANIFEST, dataset_uri, join

Progress = Callable[[str, float], None]  # (phase, fraction done)


@dataclass
class DatasetInfo:
    dataset_id: str
    uri: str
    manifest: dict
    cache_hit: bool


@dataclass
class _Scan:
    """What the first pass learns: enough to name the dataset and split it before writing anything."""

    fingerprint: str = ""
    documents: int = 0
    bytes: int = 0
    forced: dict[int, str] = field(default_factory=dict)  # document ordinal -> split, for tiny corpora
    skipped: int = 0
    first_skipped: list[str] = field(default_factory=list)


class _Progress:
    """A progress bar on stderr (at most ten updates a second) and/or a callback, per phase."""

    def __init__(self, terminal: bool, callback: Progress | None, total_bytes: int):
        self.terminal, self.callback, self.total, self.last = terminal, callback, max(total_bytes, 1), 0.0

    def __call__(self, phase: str, done_bytes: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < 0.1:
            return
        self.last = now
        fraction = 1.0 if final else min(done_bytes / self.total, 1.0)
        if self.callback is not None:
            self.callback(phase, fraction)
        if self.terminal:
            bar = "#" * int(fraction * 30)
            sys.stderr.write(f"\rshard: {phase:<9} [{bar:<30}] {fraction:4.0%}" + ("\n" if final else ""))
            sys.stderr.flush()


def _is_val(key: str, val_fraction: float) -> bool:
    # A hash of the file name (or a record's content), not its position: adding a file does not reshuffle others.
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 2**32 < val_fraction


def _limited(pieces: Iterator[tuple[int, Piece]], max_bytes: int | None) -> Iterator[tuple[int, Piece]]:
    """The pieces up to ``max_bytes`` of UTF-8 text; the document reaching it is cut there and ends (one the
    cut would leave empty, cut inside its first character, is left out)."""
    total, starts = 0, True
    for at, piece in pieces:
        size = len(piece.text.encode())
        if max_bytes is not None and total + size >= max_bytes:
            text = piece.text.encode()[: max_bytes - total].decode("utf-8", errors="ignore")
            if text or not starts:
                yield at, replace(piece, text=text, last=True)
            return
        total += size
        starts = piece.last
        yield at, piece


def _documents(fs, files, data, bad) -> Iterator[tuple[int, int, Piece]]:
    """(bytes of the source read, document ordinal, piece) of the source, cut at ``data.max_bytes``."""
    ordinal = 0
    for at, piece in _limited(read_pieces(fs, files, data, bad), data.max_bytes):
        yield at, ordinal, piece
        ordinal += piece.last


def read_documents(
    data: DataConfig, storage_options: dict | None = None, warn: Callable[[str], None] | None = None
) -> Iterator[tuple[str, str]]:
    """(name, text) of each document the shard stage reads, in order, cut at ``data.max_bytes``; one
    document is held at a time. Unreadable records are skipped up to ``data.max_bad_records``."""
    fs, files = list_source(data.source, storage_options)
    parts: list[str] = []
    for _, _, piece in _documents(fs, files, data, BadRecords(data.max_bad_records, warn)):
        parts.append(piece.text)
        if piece.last:
            yield piece.doc, "".join(parts)
            parts.clear()


class _Fingerprint:
    """sha256 over (name, bytes, sha256) of every document, fed piece by piece."""

    def __init__(self):
        self.total, self.doc = hashlib.sha256(), hashlib.sha256()
        self.documents = self.bytes = self.doc_bytes = 0

    def add(self, piece: Piece) -> None:
        blob = piece.text.encode()
        self.doc.update(blob)
        self.doc_bytes += len(blob)
        if piece.last:
            self.total.update(f"{piece.doc}\0{self.doc_bytes}\0{self.doc.hexdigest()}\n".encode())
            self.documents, self.bytes = self.documents + 1, self.bytes + self.doc_bytes
            self.doc, self.doc_bytes = hashlib.sha256(), 0

    def hexdigest(self) -> str:
        return self.total.hexdigest()


def _scan(fs, files: list[SourceFile], data: DataConfig, bad: BadRecords, show: _Progress) -> _Scan:
    fingerprint, val = _Fingerprint(), 0
    for at, _, piece in _documents(fs, files, data, bad):
        fingerprint.add(piece)
        val += piece.last and _is_val(piece.key, data.val_fraction)
        show("read", at)
    show("read", 0, final=True)
    documents = fingerprint.documents
    if not documents:
        what = "records are unreadable or empty" if bad.count else "files are empty"
        raise DataError(f"data.source {data.source!r}: all {len(files)} matched {what}")
    if documents < 2:
        raise DataError(
            f"data.source {data.source!r}: too little data ({documents} document(s)); "
            "need at least 2 documents so train and val each get one"
        )
    forced = {}
    if val == 0:  # small corpora: hold out the last document rather than evaluate on nothing
        forced[documents - 1] = "val"
    elif val == documents:
        forced[0] = "train"
    return _Scan(fingerprint.hexdigest(), documents, fingerprint.bytes, forced, bad.count, bad.first)


def _routed(fs, files, data: DataConfig, scan: _Scan) -> Iterator[tuple[int, str, Piece]]:
    """(bytes of the source read, split, piece): the source again, each document sent to the split the scan
    decided. A source that changed since the scan is a DataError at its end: the shards would not be what
    ``dataset_id`` names."""
    fingerprint = _Fingerprint()
    for at, ordinal, piece in _documents(fs, files, data, BadRecords(1 << 62)):  # the scan counted the bad ones
        fingerprint.add(piece)
        split = scan.forced.get(ordinal) or ("val" if _is_val(piece.key, data.val_fraction) else "train")
        yield at, split, piece
    if fingerprint.hexdigest() != scan.fingerprint:
        raise DataError(f"data.source {data.source!r} changed while it was being sharded; run the shard stage again")


def _dataset_id(data: DataConfig, tokenizer: dict, fingerprint: str) -> str:
    key = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "tokenizer": tokenizer,
        "shard_tokens": data.shard_tokens,
        "val_fraction": data.val_fraction,
        "max_bytes": data.max_bytes,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _existing(fs, base: str, uri: str, dataset_id: str, verify: bool) -> dict | None:
    """The dataset already published under ``base``, or None when there is none to reuse (no manifest, a
    malformed or foreign one, a file missing or of the wrong size, or with ``verify`` a wrong sha256): then
    it is built again. Sizes come from one listing; only ``verify`` reads the files.

    A store that cannot be read is a StoreError, retried by the task: an outage is not "no dataset"."""
    try:
        fs.invalidate_cache(base)  # listing caches (s3fs) may predate another process's write
        try:
            manifest = st.read_json(fs, join(base, DATASET_MANIFEST))
            check_manifest(manifest, DATASET_MANIFEST)  # before any file it names is looked at
        except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError, json.JSONDecodeError, DataError):
            return None
        if manifest.get("format") != FORMAT or manifest.get("dataset_id") != dataset_id:
            return None
        itemsize = DTYPES[manifest["dtype"]].itemsize
        files = {
            s["file"]: (s["tokens"] * itemsize, s["sha256"]) for sp in SPLITS for s in manifest["splits"][sp]["shards"]
        }
        if "file" in manifest["tokenizer"]:
            files[manifest["tokenizer"]["file"]] = (None, manifest["tokenizer"]["sha256"])
        listed = {p[len(base) :].lstrip("/"): info.get("size") for p, info in fs.find(base, detail=True).items()}
        for name, (size, digest) in files.items():
            if name not in listed or (size is not None and listed[name] != size):
                return None
            if verify and st.sha256_file(fs, join(base, name)) != digest:
                return None
        return manifest
    except (FileNotFoundError, NotADirectoryError):
        return None
    except StoreError:
        raise  # unavailable through every retry (trainer.retry): said as such
    except Exception as exc:  # noqa: BLE001 - every other backend error (connection, 5xx, throttling) alike
        reason = f"{exc.__class__.__name__}: {exc}".splitlines()[0]
        raise StoreError(f"cannot read dataset {uri} to reuse it ({reason}); the store may be unreachable") from None


class _ShardWriter:
    """Token ids of one split into ``{build}/{split}-NNNNNN.bin`` files of ``shard_tokens`` each."""

    def __init__(self, fs, base: str, build: str, split: str, shard_tokens: int, dtype: np.dtype):
        self.fs, self.base, self.build, self.split = fs, base, build, split
        self.buf, self.filled = np.empty(shard_tokens, dtype=dtype), 0
        self.shards: list[dict] = []
        self.tokens = self.documents = 0

    def add(self, ids: np.ndarray) -> None:
        while len(ids):
            take = min(len(ids), len(self.buf) - self.filled)
            self.buf[self.filled : self.filled + take] = ids[:take]
            self.filled, ids = self.filled + take, ids[take:]
            if self.filled == len(self.buf):
                self._flush()

    def _flush(self) -> None:
        blob = self.buf[: self.filled].tobytes()
        name = f"{self.build}/{self.split}-{len(self.shards):06d}.bin"
        with self.fs.open(join(self.base, name), "wb") as fh:
            fh.write(blob)
        self.shards.append({"file": name, "tokens": self.filled, "sha256": hashlib.sha256(blob).hexdigest()})
        self.tokens += self.filled
        self.filled = 0

    def close(self) -> dict:
        if self.filled:
            self._flush()
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}


def _release_freed_memory() -> None:
    # The tokenizer's worker threads allocate from their own glibc arenas, which keep what each batch freed;
    # trimming after every batch holds the peak near one batch's worth (benchmarks/shard_throughput.py).
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


def _write(fs, out, base, build, files, data: DataConfig, tok: Tokenizer, scan: _Scan, show: _Progress) -> dict:
    """Tokenize the source (read through ``fs``) into shards under ``base/build`` (written through ``out``)."""
    dtype = DTYPES[token_dtype(tok.vocab_size)]
    writers = {s: _ShardWriter(out, base, build, s, data.shard_tokens, dtype) for s in SPLITS}
    eot = np.array([tok.eot], dtype=dtype)
    batch: list[tuple[str, Piece]] = []
    chars = 0

    def flush() -> None:
        for (split, piece), ids in zip(batch, tok.encode([p.text for _, p in batch]), strict=True):
            writer = writers[split]
            writer.add(ids)
            if piece.last:
                writer.add(eot)
                writer.documents += 1
        batch.clear()
        _release_freed_memory()

    for at, split, piece in _routed(fs, files, data, scan):
        batch.append((split, piece))
        chars += len(piece.text)
        if chars >= data.buffer_mb << 20:
            flush()
            chars = 0
        show("tokenize", at)
    flush()
    show("tokenize", 0, final=True)
    return {s: writers[s].close() for s in SPLITS}


def _train_texts(fs, files, data: DataConfig, scan: _Scan, show: _Progress) -> Iterator[str]:
    """Train-split text for a bpe tokenizer, up to ``data.bpe_train_bytes``."""
    total = 0
    routed = _routed(fs, files, data, scan)
    for at, split, piece in routed:
        if split == "train":
            yield piece.text
            total += len(piece.text.encode())
            if total >= data.bpe_train_bytes:
                routed.close()  # a partial read: the source is compared with the scan when tokenizing
                break
        show("train bpe", at)
    show("train bpe", 0, final=True)


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
    """Tokenize ``data.source`` into ``{store.root}/datasets/{dataset_id}``; reuse it when already there.

    ``progress`` draws a bar on stderr, ``on_progress`` receives (phase, fraction) and ``warn`` a line per
    skipped record. With ``block_size``, a split too short for one training sample is an error here, not in
    the ranks; with ``vocab_size`` (the model's), so is a tokenizer with more tokens than the model has rows.
    An existing dataset is reused when its files are all there at their sizes; ``verify`` also checks each
    file's sha256 (and rebuilds a damaged dataset)."""
    info = _shard(data, store, progress, on_progress, warn, verify)
    if block_size is not None:
        require_one_block(info.manifest, block_size)
    if vocab_size is not None:
        require_vocab(info.manifest, vocab_size)
    return info


def _shard(data: DataConfig, store: StoreConfig, progress: bool, on_progress, warn, verify: bool) -> DatasetInfo:
    options = source_options(data.source, store)
    identity, tok = tokenizer_identity(data, source_options(data.tokenizer, store))
    fs, files = list_source(data.source, options)
    if not files:
        hint = "check the path" if data.source == "stdlib" else "check the path/glob (use ** for subfolders)"
        raise DataError(f"data.source {data.source!r} matched no files; {hint} and that files exist")
    total = sum(f.size for f in files)
    show = _Progress(progress, on_progress, min(total, data.max_bytes or total))
    scan = _scan(fs, files, data, BadRecords(data.max_bad_records, warn), show)
    dataset_id = _dataset_id(data, identity, scan.fingerprint)

    root = store.root if "://" in store.root else os.path.abspath(store.root)
    uri = dataset_uri(root, dataset_id)
    out, base = st.filesystem(uri, store.storage_options)
    existing = _existing(out, base, uri, dataset_id, verify)
    if existing is not None:
        return DatasetInfo(dataset_id, uri, existing, cache_hit=True)

    st.check_writable(root, store.storage_options)
    if data.tokenizer == "bpe":
        tok = train_bpe(_train_texts(fs, files, data, scan, show), data.vocab_size, data.eot_token)
    elif tok is None:
        tok = ByteTokenizer()
    # Files go to a folder of this build's own and the manifest, written last, publishes them: a reader of
    # the old manifest (or a second build running at once) never sees a file change under it.
    build = f"build-{secrets.token_hex(4)}"
    try:
        out.makedirs(join(base, build), exist_ok=True)
        tokenizer_json = tok.to_json()
        if tokenizer_json is not None:
            st.write_text(out, join(base, build, TOKENIZER_FILE), tokenizer_json)
        splits = _write(fs, out, base, build, files, data, tok, scan, show)
        manifest = {
            "format": FORMAT,
            "dataset_id": dataset_id,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "tokenizer": manifest_entry(tok, build),
            "dtype": token_dtype(tok.vocab_size),
            "source": {
                "spec": data.source,
                "fingerprint": scan.fingerprint,
                "documents": scan.documents,
                "bytes": scan.bytes,
                "skipped_records": scan.skipped,
                "first_skipped": scan.first_skipped,
            },
            "settings": {
                "shard_tokens": data.shard_tokens,
                "val_fraction": data.val_fraction,
                "max_bytes": data.max_bytes,
            },
            "splits": splits,
        }
        st.write_json(out, join(base, DATASET_MANIFEST), manifest)
    except OSError as exc:
        raise StoreError(f"cannot write dataset {uri} ({exc.__class__.__name__}: {exc})") from None
    return DatasetInfo(dataset_id, uri, manifest, cache_hit=False)
