"""The shard stage: a text source becomes fixed-size token shards plus a manifest (DESIGN §3).

    {store.root}/datasets/{dataset_id}/train-000000.bin …   little-endian uint16 tokens
    {store.root}/datasets/{dataset_id}/val-000000.bin …
    {store.root}/datasets/{dataset_id}/manifest.json        written LAST: no manifest, no dataset

The byte tokenizer maps each UTF-8 byte to a token 0..255 and ends every document
with EOT (token 0). ``dataset_id`` hashes the source *content* with the tokenizer and
shard settings, so the same inputs land in the same folder and are not rewritten.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import itertools
import json
import os
import posixpath
import sys
import sysconfig
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterator

import numpy as np
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from trainer import store as st
from trainer.config import BYTE_VOCAB, DataConfig, StoreConfig
from trainer.errors import DataError, StoreError

FORMAT = 1
EOT = 0
DTYPE = np.dtype("<u2")
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})


@dataclass
class DatasetInfo:
    dataset_id: str
    uri: str
    manifest: dict
    cache_hit: bool


# -----------------------------------------------------------------------------
# source discovery and reading

def _glob_base(pattern: str) -> str:
    """The folder above the first wildcard: document names are relative to it, so the
    same corpus gives the same dataset_id wherever it lives."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if glob.has_magic(part):
            return "/".join(parts[:i])
    return posixpath.dirname(pattern)


def _list_source(source: str, storage_options: dict | None) -> tuple[Any, list[tuple[str, str]]]:
    """(filesystem, sorted [(name, path)]) of the files a ``data.source`` spec names."""
    if source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        paths = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDE]
            paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
        fs, base = LocalFileSystem(), root
    elif "://" not in source:
        pattern = os.path.expanduser(source)
        if os.path.isdir(pattern):
            pattern = os.path.join(pattern, "**", "*")
        paths = [os.path.abspath(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        fs, base = LocalFileSystem(), os.path.abspath(_glob_base(pattern) or ".")
    else:
        try:
            fs, pattern = url_to_fs(source, **(storage_options or {}))
            if not glob.has_magic(pattern) and fs.isdir(pattern):
                pattern = pattern.rstrip("/") + "/**"
            found = fs.glob(pattern, detail=True)
        except FileNotFoundError:
            found = {}
        except (ImportError, ValueError, OSError) as exc:
            raise DataError(f"cannot list data.source {source!r} ({exc.__class__.__name__}: {exc})") from None
        paths = [p for p, info in found.items() if info.get("type") == "file"]
        base = _glob_base(pattern)
    files = []
    for path in sorted(paths):
        name = os.path.relpath(path, base).replace(os.sep, "/") if isinstance(fs, LocalFileSystem) else path[len(base):].lstrip("/")
        files.append((name, path))
    return fs, files


def _jsonl_texts(name: str, shown: str, raw: bytes, field: str) -> Iterator[tuple[str, bytes]]:
    for lineno, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{shown} line {lineno}: not valid JSON ({exc.msg})") from None
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(f"{shown} line {lineno}: no string field {field!r} (set data.text_field)")
        yield f"{name}#{lineno}", text.encode("utf-8")


def read_documents(data: DataConfig, storage_options: dict | None = None, progress: bool = False) -> list[tuple[str, bytes]]:
    """[(name, utf-8 bytes)] of the non-empty documents used, in path order, cut at ``data.max_bytes``."""
    fs, files = _list_source(data.source, storage_options)
    if not files:
        hint = "check the path" if data.source == "stdlib" else "check the path/glob (use ** for subfolders) and that files exist"
        raise DataError(f"data.source {data.source!r} matched no files; {hint}")
    show = _Progress(progress)
    docs: list[tuple[str, bytes]] = []
    total, limit = 0, data.max_bytes
    for name, path in files:
        shown = path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)
        try:
            raw = fs.cat_file(path)
        except OSError as exc:
            raise DataError(f"cannot read {shown} ({exc.__class__.__name__}: {exc})") from None
        if name.lower().endswith(".jsonl"):
            texts = _jsonl_texts(name, shown, raw, data.text_field)
        else:
            texts = iter([(name, raw.decode("utf-8", errors="replace").encode("utf-8"))])
        for doc_name, text in texts:
            if not text:
                continue
            if limit is not None and total + len(text) >= limit:
                docs.append((doc_name, text[: limit - total]))
                show(f"shard: read {len(docs)} documents, {limit / 1e6:.1f} MB (max_bytes)", final=True)
                return docs
            docs.append((doc_name, text))
            total += len(text)
        show(f"shard: read {len(docs)} documents, {total / 1e6:.1f} MB")
    if not docs:
        raise DataError(f"data.source {data.source!r}: all {len(files)} matched files are empty")
    show(f"shard: read {len(docs)} documents, {total / 1e6:.1f} MB", final=True)
    return docs


def check_source(data: DataConfig, store: StoreConfig) -> int:
    """Number of files ``data.source`` matches; DataError when none, so a bad source fails before any work."""
    _, files = _list_source(data.source, _source_options(data.source, store))
    if not files:
        raise DataError(f"data.source {data.source!r} matched no files; check the path/glob (use ** for subfolders) and that files exist")
    return len(files)


def _source_options(source: str, store: StoreConfig) -> dict:
    # DataConfig has no credentials of its own: a source on the store's protocol
    # (e.g. the same S3 endpoint) uses the store's storage_options.
    if "://" in source and store.root.startswith(source.split("://", 1)[0] + "://"):
        return store.storage_options
    return {}


# -----------------------------------------------------------------------------
# shard stage

class _Progress:
    """A plain ``\\r`` status line on stderr, at most ten updates a second."""

    def __init__(self, on: bool):
        self.on, self.last = on, 0.0

    def __call__(self, msg: str, final: bool = False) -> None:
        now = time.monotonic()
        if self.on and (final or now - self.last > 0.1):
            self.last = now
            sys.stderr.write(f"\r{msg:<70}" + ("\n" if final else ""))
            sys.stderr.flush()


def _fingerprint(docs: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, text in docs:
        h.update(f"{name}\0{len(text)}\0{hashlib.sha256(text).hexdigest()}\n".encode())
    return h.hexdigest()


def _dataset_id(data: DataConfig, fingerprint: str) -> str:
    key = {
        "format": FORMAT, "fingerprint": fingerprint, "tokenizer": data.tokenizer,
        "shard_tokens": data.shard_tokens, "val_fraction": data.val_fraction, "max_bytes": data.max_bytes,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _is_val(name: str, val_fraction: float) -> bool:
    # Hash of the name, not its position: adding a file does not reshuffle the others.
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 2**32 < val_fraction


def _valid_existing(fs, base: str, dataset_id: str) -> dict | None:
    """The manifest already under ``base`` when it is ours and every shard's checksum
    verifies (so re-running shard repairs a damaged dataset); else None."""
    try:
        fs.invalidate_cache(base)  # listing caches (s3fs) may predate another process's write
        manifest = st.read_json(fs, st.join(base, MANIFEST))
        if manifest.get("format") != FORMAT or manifest.get("dataset_id") != dataset_id:
            return None
        for split in SPLITS:
            for shard in manifest["splits"][split]["shards"]:
                if st.sha256_file(fs, st.join(base, shard["file"])) != shard["sha256"]:
                    return None
        return manifest
    except Exception:  # noqa: BLE001 - missing, unreadable or malformed all mean "build it"
        return None


def _write_split(fs, base: str, split: str, docs: list[tuple[str, bytes]], shard_tokens: int, show: _Progress) -> dict:
    # Joining with NUL is appending EOT (token 0) after every document.
    tokens = np.frombuffer(b"\0".join(text for _, text in docs) + b"\0", dtype=np.uint8).astype(DTYPE)
    n_shards = -(-len(tokens) // shard_tokens)
    shards = []
    for i in range(n_shards):
        blob = tokens[i * shard_tokens : (i + 1) * shard_tokens].tobytes()
        name = f"{split}-{i:06d}.bin"
        with fs.open(st.join(base, name), "wb") as fh:
            fh.write(blob)
        shards.append({"file": name, "tokens": len(blob) // DTYPE.itemsize, "sha256": hashlib.sha256(blob).hexdigest()})
        show(f"shard: wrote {split} {i + 1}/{n_shards} shards", final=(i + 1 == n_shards))
    return {"tokens": int(len(tokens)), "documents": len(docs), "shards": shards}


def shard_dataset(data: DataConfig, store: StoreConfig, progress: bool = False) -> DatasetInfo:
    """Tokenize ``data.source`` into ``{store.root}/datasets/{dataset_id}``; reuse it when already there."""
    docs = read_documents(data, _source_options(data.source, store), progress)
    fingerprint = _fingerprint(docs)
    dataset_id = _dataset_id(data, fingerprint)
    val = [d for d in docs if _is_val(d[0], data.val_fraction)]
    train = [d for d in docs if not _is_val(d[0], data.val_fraction)]
    if not val:  # small corpora: hold out the last document rather than evaluate on nothing
        train, val = docs[:-1], docs[-1:]
    if not train:
        raise DataError(
            f"data.source {data.source!r}: too little data ({len(docs)} document(s)); "
            "need at least 2 documents so train and val each get one"
        )

    root = store.root if "://" in store.root else os.path.abspath(store.root)
    uri = st.join(root, "datasets", dataset_id)
    fs, base = st.filesystem(uri, store.storage_options)
    existing = _valid_existing(fs, base, dataset_id)
    if existing is not None:
        return DatasetInfo(dataset_id, uri, existing, cache_hit=True)

    st.check_writable(root, store.storage_options)
    show = _Progress(progress)
    manifest_path = st.join(base, MANIFEST)
    try:
        fs.makedirs(base, exist_ok=True)
        if fs.exists(manifest_path):  # a stale manifest must not vouch for half-rewritten shards
            fs.rm(manifest_path)
        splits = {name: _write_split(fs, base, name, part, data.shard_tokens, show) for name, part in (("train", train), ("val", val))}
        manifest = {
            "format": FORMAT,
            "dataset_id": dataset_id,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "tokenizer": {"name": data.tokenizer, "vocab_size": BYTE_VOCAB, "eot": EOT},
            "dtype": "uint16",
            "source": {"spec": data.source, "fingerprint": fingerprint, "documents": len(docs), "bytes": sum(len(t) for _, t in docs)},
            "settings": {"shard_tokens": data.shard_tokens, "val_fraction": data.val_fraction, "max_bytes": data.max_bytes},
            "splits": splits,
        }
        st.write_json(fs, manifest_path, manifest)
    except OSError as exc:
        raise StoreError(f"cannot write dataset {uri} ({exc.__class__.__name__}: {exc})") from None
    return DatasetInfo(dataset_id, uri, manifest, cache_hit=False)


# -----------------------------------------------------------------------------
# reading a dataset

def load_manifest(dataset_uri: str, storage_options: dict | None = None) -> dict:
    fs, base = st.filesystem(dataset_uri, storage_options)
    where = st.join(dataset_uri, MANIFEST)
    try:
        manifest = st.read_json(fs, st.join(base, MANIFEST))
    except FileNotFoundError:
        raise DataError(f"no dataset at {dataset_uri} ({MANIFEST} missing); run `trainpipe shard` first") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{where} is not valid JSON ({exc}); re-run `trainpipe shard`") from None
    except OSError as exc:
        raise StoreError(f"cannot read {where} ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not all(
        s in manifest.get("splits", {}) for s in SPLITS
    ):
        raise DataError(f"{where} is not a trainpipe dataset manifest (format {FORMAT}); re-run `trainpipe shard`")
    return manifest


class TokenStream:
    """The concatenated tokens of one split ('train' or 'val'), read through fsspec."""

    def __init__(self, dataset_uri: str, split: str, storage_options: dict | None = None, verify: bool = True):
        self.uri, self.split, self.verify = dataset_uri, split, verify
        self.manifest = load_manifest(dataset_uri, storage_options)
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r} (splits: {', '.join(SPLITS)})")
        self.shards = self.manifest["splits"][split]["shards"]
        self.starts = list(itertools.accumulate((s["tokens"] for s in self.shards), initial=0))
        self._fs, self._base = st.filesystem(dataset_uri, storage_options)
        self._loaded: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def shard(self, i: int) -> np.ndarray:
        """Shard ``i`` as a read-only uint16 array, loaded (and verified) once."""
        if i not in self._loaded:
            meta = self.shards[i]
            try:
                blob = self._fs.cat_file(st.join(self._base, meta["file"]))
            except FileNotFoundError:
                raise DataError(f"shard {meta['file']} of {self.uri} is missing; re-run `trainpipe shard`") from None
            if len(blob) != meta["tokens"] * DTYPE.itemsize or (
                self.verify and hashlib.sha256(blob).hexdigest() != meta["sha256"]
            ):
                raise DataError(f"shard {meta['file']} of {self.uri} is corrupt (size or sha256 mismatch); re-run `trainpipe shard`")
            self._loaded[i] = np.frombuffer(blob, dtype=DTYPE)
        return self._loaded[i]

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64, across shard boundaries."""
        end = start + length
        if start < 0 or length < 0 or end > len(self):
            raise IndexError(f"window [{start}, {end}) outside the {self.split} split of {len(self)} tokens")
        pieces, pos = [], start
        while pos < end:
            i = bisect.bisect_right(self.starts, pos) - 1
            stop = min(end, self.starts[i + 1])
            pieces.append(self.shard(i)[pos - self.starts[i] : stop - self.starts[i]])
            pos = stop
        if len(pieces) == 1:
            return pieces[0].astype(np.int64)
        return np.concatenate(pieces).astype(np.int64) if pieces else np.empty(0, dtype=np.int64)
