"""The dataset format the shard stage writes and the readers check: version, token dtype, splits, manifest.

Kept free of torch, so the orchestrator shards without importing it.
"""

from __future__ import annotations

import json
import posixpath
import re

import numpy as np

from trainpipe.trainer import store as st
from trainpipe.trainer.errors import DataError, StoreError
from trainpipe.trainer.store_paths import DATASET_MANIFEST, join

# 2: the token dtype follows the tokenizer (the manifest's "dtype"); a tokenizer.json may be stored.
# 3: shards are the pieces' own files in the store's datasets/pieces/, named relative to datasets/.
FORMAT = 3
READABLE = (1, 2, 3)  # format 1 is uint16 byte tokens, the same layout
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SPLITS = ("train", "val")


def load_manifest(dataset_uri: str, storage_options: dict | None = None) -> dict:
    fs, base = st.filesystem(dataset_uri, storage_options)
    where = join(dataset_uri, DATASET_MANIFEST)
    try:
        manifest = st.read_json(fs, join(base, DATASET_MANIFEST))
    except FileNotFoundError:
        raise DataError(
            f"no dataset at {dataset_uri} ({DATASET_MANIFEST} missing); run `trainpipe shard` first"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{where} is not valid JSON ({exc}); re-run `trainpipe shard`") from None
    except OSError as exc:
        raise StoreError(f"cannot read {where} ({exc.__class__.__name__}: {exc})") from None
    check_manifest(manifest, where)
    return manifest


def check_manifest(manifest: object, where: str) -> None:
    """DataError unless ``manifest`` is a dataset manifest this version reads. The store is not trusted
    (docs/security.md): every file it names must be one of the dataset's own, before any is opened."""
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") not in READABLE
        or not isinstance(manifest.get("splits"), dict)
        or not all(s in manifest["splits"] for s in SPLITS)
        or not isinstance(manifest.get("dtype", "uint16"), str)
        or manifest.get("dtype", "uint16") not in DTYPES
    ):
        raise DataError(f"{where} is not a trainpipe dataset manifest (format {FORMAT}); re-run `trainpipe shard`")
    pooled = manifest["format"] >= 3
    for split in SPLITS:
        part = manifest["splits"][split]
        shards = part.get("shards") if isinstance(part, dict) else None
        if not isinstance(shards, list) or not all(_is_shard(s, split, pooled) for s in shards):
            raise DataError(f"{where}: the {split} split's shard list is malformed; re-run `trainpipe shard`")
        if part.get("tokens") != sum(s["tokens"] for s in shards):
            raise DataError(
                f"{where}: the {split} split's token count disagrees with its shards; re-run `trainpipe shard`"
            )
    tok = manifest.get("tokenizer")
    if not (
        isinstance(tok, dict)
        and _is_count(tok.get("vocab_size"))
        and _is_count(tok.get("eot"))
        and tok["eot"] < tok["vocab_size"]
        and ("file" not in tok or (_is_file(tok["file"], "tokenizer.json", pooled) and _is_sha256(tok.get("sha256"))))
    ):
        raise DataError(f"{where}: its tokenizer entry is malformed; re-run `trainpipe shard`")


# A dataset's files: at its top (format 1 and the first format 2 builds) or in one build's folder; from format 3
# in the pool of pieces and tokenizers every dataset of the store shares (trainer/data/piece.py).
_FILE = re.compile(r"(build-[0-9a-f]{8}/)?(?P<name>(train|val)-\d{6}\.bin|tokenizer\.json)")
_POOL_FILE = re.compile(r"pieces/[0-9a-f]{32}/(?P<name>(train|val)-\d{6}\.bin)|tokenizers/[0-9a-f]{64}\.json")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and bool(_SHA256.fullmatch(value))


def _is_file(name: object, expected: str, pooled: bool) -> bool:
    """``name`` is a dataset file path whose own name is ``expected`` (or, ending in '-', starts with it)."""
    match = (_POOL_FILE if pooled else _FILE).fullmatch(name) if isinstance(name, str) else None
    own = (match["name"] or "tokenizer.json") if match else ""
    return own.startswith(expected) if expected.endswith("-") else own == expected


def _is_shard(entry: object, split: str, pooled: bool) -> bool:
    return (
        isinstance(entry, dict)
        and _is_file(entry.get("file"), f"{split}-", pooled)
        and _is_count(entry.get("tokens"))
        and _is_sha256(entry.get("sha256"))
    )


def files_base(dataset_uri: str, manifest: dict) -> str:
    """What a (checked) manifest's file names are relative to: the dataset's folder up to format 2, the store's
    datasets/ folder from format 3 (whose pieces every dataset shares)."""
    return posixpath.dirname(dataset_uri.rstrip("/")) if manifest["format"] >= 3 else dataset_uri


def listed_sizes(fs, base: str, files: list[str]) -> dict[str, int | None]:
    """{file: size} of what the store holds of ``files`` (relative to ``base``), one listing per folder they are
    in: a dataset's pieces share the store's datasets/ folder with every other dataset's."""
    listed: dict[str, int | None] = {}
    for folder in sorted({posixpath.dirname(f) for f in files}):
        where = posixpath.join(base.rstrip("/"), folder) if folder else base.rstrip("/")
        try:
            entries = fs.ls(where, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            name = (
                posixpath.join(folder, entry["name"].rstrip("/").rsplit("/", 1)[-1])
                if folder
                else entry["name"].rstrip("/").rsplit("/", 1)[-1]
            )
            if entry.get("type") == "file":
                listed[name] = entry.get("size")
    return listed


def token_dtype_of(manifest: dict) -> np.dtype:
    """The on-disk dtype of a (checked) manifest's tokens."""
    return DTYPES[manifest.get("dtype", "uint16")]


def require_one_block(manifest: dict, block_size: int) -> None:
    """Every split must hold at least one sample: ``block_size`` tokens plus the next one as its target."""
    for split in SPLITS:
        tokens = manifest["splits"][split]["tokens"]
        if tokens < block_size + 1:
            raise DataError(
                f"the {split} split of dataset {manifest.get('dataset_id')} holds {tokens} tokens, fewer than one "
                f"sample (model.block_size {block_size} + 1): give data.source more text, or lower model.block_size"
                + (" or raise data.val_fraction" if split == "val" else "")
            )


def require_vocab(manifest: dict, model_vocab: int) -> None:
    """The model must have a row for every token id a (checked) manifest's dataset holds."""
    tok = manifest["tokenizer"]  # checked by check_manifest
    need = tok["vocab_size"]
    if model_vocab < need:
        raise DataError(
            f"model.vocab_size {model_vocab} is below the vocabulary of dataset {manifest.get('dataset_id')}'s "
            f"tokenizer ({tok.get('name')}, {need} tokens): set model.vocab_size: {need}"
        )
