"""The shard stage: a text source becomes fixed-size token shards plus a manifest (DESIGN §3).

    {store.root}/datasets/{dataset_id}/train-000000.bin …   little-endian uint16 tokens
    {store.root}/datasets/{dataset_id}/val-000000.bin …
    {store.root}/datasets/{dataset_id}/manifest.json        written LAST: no manifest, no dataset

The byte tokenizer maps each UTF-8 byte to a token 0..255 and ends every document
with EOT (token 0). ``dataset_id`` hashes the source *content* with the tokenizer and
shard settings, so the same inputs land in the same folder and are not rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from trainer import store as st
from trainer.config import BYTE_VOCAB, DataConfig, StoreConfig
from trainer.data.format import DTYPE, EOT, FORMAT, SPLITS, require_one_block
from trainer.data.sources import list_source, source_options
from trainer.errors import DataError, StoreError
from trainer.layout import DATASET_MANIFEST, dataset_uri, join


@dataclass
class DatasetInfo:
    dataset_id: str
    uri: str
    manifest: dict
    cache_hit: bool


# -----------------------------------------------------------------------------
# reading the source


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


def read_documents(
    data: DataConfig, storage_options: dict | None = None, progress: bool = False
) -> list[tuple[str, bytes]]:
    """[(name, utf-8 bytes)] of the non-empty documents used, in path order, cut at ``data.max_bytes``."""
    fs, files = list_source(data.source, storage_options)
    if not files:
        hint = (
            "check the path"
            if data.source == "stdlib"
            else "check the path/glob (use ** for subfolders) and that files exist"
        )
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
        "format": FORMAT,
        "fingerprint": fingerprint,
        "tokenizer": data.tokenizer,
        "shard_tokens": data.shard_tokens,
        "val_fraction": data.val_fraction,
        "max_bytes": data.max_bytes,
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
        manifest = st.read_json(fs, join(base, DATASET_MANIFEST))
        if manifest.get("format") != FORMAT or manifest.get("dataset_id") != dataset_id:
            return None
        for split in SPLITS:
            for shard in manifest["splits"][split]["shards"]:
                if st.sha256_file(fs, join(base, shard["file"])) != shard["sha256"]:
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
        with fs.open(join(base, name), "wb") as fh:
            fh.write(blob)
        shards.append({"file": name, "tokens": len(blob) // DTYPE.itemsize, "sha256": hashlib.sha256(blob).hexdigest()})
        show(f"shard: wrote {split} {i + 1}/{n_shards} shards", final=(i + 1 == n_shards))
    return {"tokens": len(tokens), "documents": len(docs), "shards": shards}


def shard_dataset(
    data: DataConfig, store: StoreConfig, progress: bool = False, block_size: int | None = None
) -> DatasetInfo:
    """Tokenize ``data.source`` into ``{store.root}/datasets/{dataset_id}``; reuse it when already there.

    With ``block_size``, a split too short for one training sample is an error here, not in the ranks."""
    info = _shard(data, store, progress)
    if block_size is not None:
        require_one_block(info.manifest, block_size)
    return info


def _shard(data: DataConfig, store: StoreConfig, progress: bool) -> DatasetInfo:
    docs = read_documents(data, source_options(data.source, store), progress)
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
    uri = dataset_uri(root, dataset_id)
    fs, base = st.filesystem(uri, store.storage_options)
    existing = _valid_existing(fs, base, dataset_id)
    if existing is not None:
        return DatasetInfo(dataset_id, uri, existing, cache_hit=True)

    st.check_writable(root, store.storage_options)
    show = _Progress(progress)
    manifest_path = join(base, DATASET_MANIFEST)
    try:
        fs.makedirs(base, exist_ok=True)
        if fs.exists(manifest_path):  # a stale manifest must not vouch for half-rewritten shards
            st.remove(fs, manifest_path)
        splits = {
            name: _write_split(fs, base, name, part, data.shard_tokens, show)
            for name, part in (("train", train), ("val", val))
        }
        manifest = {
            "format": FORMAT,
            "dataset_id": dataset_id,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "tokenizer": {"name": data.tokenizer, "vocab_size": BYTE_VOCAB, "eot": EOT},
            "dtype": "uint16",
            "source": {
                "spec": data.source,
                "fingerprint": fingerprint,
                "documents": len(docs),
                "bytes": sum(len(t) for _, t in docs),
            },
            "settings": {
                "shard_tokens": data.shard_tokens,
                "val_fraction": data.val_fraction,
                "max_bytes": data.max_bytes,
            },
            "splits": splits,
        }
        st.write_json(fs, manifest_path, manifest)
    except OSError as exc:
        raise StoreError(f"cannot write dataset {uri} ({exc.__class__.__name__}: {exc})") from None
    return DatasetInfo(dataset_id, uri, manifest, cache_hit=False)
