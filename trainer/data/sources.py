"""Where a corpus comes from and how it is read: the files a ``data.source`` spec names, streamed as text.

Formats, by file: ``.jsonl`` (one record per line, the text in ``data.text_field``), ``.parquet`` (the
``data.text_field`` column, read in record batches), a folder written by ``datasets``' ``save_to_disk``
(its Arrow stream files, the ``data.text_field`` column), anything else as one UTF-8 text document per
file. Every file is read through fsspec, locally or from S3, and streamed: memory holds one piece of text
(at most ``PIECE_CHARS``) or one record batch at a time, whatever the corpus size.

Light on purpose (no torch): the CLI checks a source with it before anything else starts.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import posixpath
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from trainer import retry
from trainer.config import DataConfig, StoreConfig
from trainer.errors import DataError, StoreUnavailable
from trainer.store import client_options

STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})
# Documents are tokenized in pieces of at most this many characters, cut after a line end where there is
# one: a fixed rule, so the same text gives the same tokens from every format and at every buffer size.
PIECE_CHARS = 1 << 20
_READ_BYTES = 1 << 20
_RECORD_BATCH = 1024
_DATASET_STATE = "state.json"
_DATASET_DICT = "dataset_dict.json"


@dataclass(frozen=True)
class SourceFile:
    name: str  # relative to the source's base: the same corpus has the same names wherever it lives
    path: str  # inside the filesystem
    kind: str  # "text", "jsonl", "parquet" or "arrow"
    size: int


@dataclass(frozen=True)
class Piece:
    doc: str  # the document: a file's name, or name#line / name#row for a record
    text: str
    last: bool  # the document's last piece: an end-of-text token follows it
    key: str  # decides the document's split: a file's name, a record's content hash


class BadRecords:
    """Unreadable records, counted and named; more than ``limit`` is a DataError."""

    def __init__(self, limit: int, warn: Callable[[str], None] | None = None):
        self.limit, self.warn, self.count, self.first = limit, warn, 0, []

    def skip(self, where: str) -> None:
        self.count += 1
        if len(self.first) < 20:
            self.first.append(where)
        if self.warn and self.count <= 10:
            self.warn(f"skipped {where}" + ("" if self.count < 10 else " (further skips are only counted)"))
        if self.count > self.limit:
            raise DataError(
                f"{self.count} unreadable records, more than data.max_bad_records={self.limit}; "
                f"the first: {self.first[0]}"
            )


# -----------------------------------------------------------------------------
# listing


def _glob_base(pattern: str) -> str:
    """The folder above the first wildcard: document names are relative to it, so the
    same corpus gives the same dataset_id wherever it lives."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if glob.has_magic(part):
            return "/".join(parts[:i])
    return posixpath.dirname(pattern)


def _kind(path: str) -> str:
    ext = posixpath.splitext(path.lower())[1]
    return {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}.get(ext, "text")


def _saved_dataset(fs, folder: str, shown: str) -> list[tuple[str, str]] | None:
    """[(name, path)] of the Arrow files of a ``save_to_disk`` folder (a Dataset or a DatasetDict); None if
    ``folder`` is not one. File names come from its JSON and are confined to the folder."""

    def state_files(sub: str, prefix: str) -> list[tuple[str, str]]:
        where = posixpath.join(sub, _DATASET_STATE)
        try:
            state = json.loads(fs.cat_file(where))
            names = [entry["filename"] for entry in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{shown}: {where} is not a datasets state file ({exc.__class__.__name__})") from None
        if not all(_plain_name(n) for n in names):
            raise DataError(f"{shown}: {where} names a data file outside its folder")
        for n in names:
            if not fs.isfile(posixpath.join(sub, n)):
                raise DataError(f"{shown}: {where} names {n}, which is missing; save the dataset again")
        return [(f"{prefix}{n}", posixpath.join(sub, n)) for n in names]

    if fs.isfile(posixpath.join(folder, _DATASET_STATE)):
        return state_files(folder, "")
    if fs.isfile(posixpath.join(folder, _DATASET_DICT)):
        try:
            splits = json.loads(fs.cat_file(posixpath.join(folder, _DATASET_DICT)))["splits"]
            if not isinstance(splits, list):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{shown}: {_DATASET_DICT} is not a datasets file ({exc.__class__.__name__})") from None
        if not all(_plain_name(s) for s in splits):
            raise DataError(f"{shown}: {_DATASET_DICT} names a split outside its folder")
        return [f for s in splits for f in state_files(posixpath.join(folder, s), f"{s}/")]
    return None


def _plain_name(name: object) -> bool:
    """A file or folder name inside its folder: no separator, not '.' or '..'."""
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def list_source(source: str, storage_options: dict | None) -> tuple[Any, list[SourceFile]]:
    """(filesystem, [SourceFile] in reading order) of what a ``data.source`` spec names."""
    if source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        paths = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDE]
            paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
        fs, base = LocalFileSystem(), root
    elif "://" not in source:
        pattern = os.path.expanduser(source)
        fs = LocalFileSystem()
        if os.path.isdir(pattern):
            saved = _saved_dataset(fs, os.path.abspath(pattern), source)
            if saved is not None:
                return fs, [SourceFile(n, p, "arrow", os.path.getsize(p)) for n, p in saved]
            pattern = os.path.join(pattern, "**", "*")
        paths = [os.path.abspath(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        base = os.path.abspath(_glob_base(pattern) or ".")
    else:
        try:
            fs, pattern = url_to_fs(source, **client_options(source, storage_options))
            fs.invalidate_cache()  # a cached instance (s3fs) keeps listings from earlier runs of this process
            if not glob.has_magic(pattern) and fs.isdir(pattern):
                saved = _saved_dataset(fs, pattern.rstrip("/"), source)
                if saved is not None:
                    return fs, [SourceFile(n, p, "arrow", fs.size(p)) for n, p in saved]
                pattern = pattern.rstrip("/") + "/**"
            found = retry.call(f"listing {source}", fs.glob, pattern, detail=True)
        except FileNotFoundError:
            found = {}
        except StoreUnavailable:
            raise
        except Exception as exc:
            reason = f"{exc.__class__.__name__}: {exc}".splitlines()[0]
            if retry.is_transient(exc):
                raise StoreUnavailable(f"cannot list {source!r} ({reason}); the store may be unreachable") from None
            if not isinstance(exc, (ImportError, ValueError, OSError)):
                raise
            raise DataError(f"cannot list data.source {source!r} ({reason})") from None
        base = _glob_base(pattern)
        return fs, [
            SourceFile(p[len(base) :].lstrip("/"), p, _kind(p), int(info.get("size") or 0))
            for p, info in sorted(found.items())
            if info.get("type") == "file"
        ]
    return fs, [
        SourceFile(os.path.relpath(p, base).replace(os.sep, "/"), p, _kind(p), os.path.getsize(p))
        for p in sorted(paths)
    ]


def check_source(data: DataConfig, store: StoreConfig) -> int:
    """Number of files ``data.source`` matches. DataError when none, or when the first file lacks the text
    field or column or cannot be read, so a bad source fails before any work."""
    fs, files = list_source(data.source, source_options(data.source, store))
    if not files:
        raise DataError(
            f"data.source {data.source!r} matched no files; "
            "check the path/glob (use ** for subfolders) and that files exist"
        )
    first = read_pieces(fs, files[:1], data, BadRecords(1 << 62))
    next(first, None)
    first.close()
    return len(files)


def source_options(source: str, store: StoreConfig) -> dict:
    # DataConfig has no credentials of its own: a source on the store's protocol
    # (e.g. the same S3 endpoint) uses the store's storage_options.
    if "://" in source and store.root.startswith(source.split("://", 1)[0] + "://"):
        return store.storage_options
    return {}


# -----------------------------------------------------------------------------
# reading


def _cut(text: str) -> int:
    """Where the first piece of ``text`` ends: after the last line end within PIECE_CHARS characters."""
    if len(text) <= PIECE_CHARS:
        return len(text)
    return (text.rfind("\n", 0, PIECE_CHARS) + 1) or PIECE_CHARS


def cut_pieces(text: str) -> Iterator[str]:
    """``text`` in pieces of at most PIECE_CHARS characters, each cut after its last line end if it has one."""
    while text:
        cut = _cut(text)
        yield text[:cut]
        text = text[cut:]


def _text_pieces(fh, name: str) -> Iterator[Piece]:
    # The same cuts as cut_pieces on the whole text: a cut looks only at the first PIECE_CHARS characters.
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    buf, held, eof = "", None, False
    while not eof:
        block = fh.read(_READ_BYTES)
        eof = not block
        buf += decode(block, final=eof)
        while len(buf) > PIECE_CHARS or (eof and buf):
            if held is not None:
                yield Piece(name, held, False, name)
            cut = _cut(buf)
            held, buf = buf[:cut], buf[cut:]
    if held is not None:
        yield Piece(name, held, True, name)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _record_pieces(doc: str, text: str) -> Iterator[Piece]:
    key = hashlib.sha256(text.encode("utf-8")).hexdigest()
    pieces = list(cut_pieces(text))
    for i, piece in enumerate(pieces):
        yield Piece(doc, piece, i == len(pieces) - 1, key)


def _jsonl_pieces(fh, f: SourceFile, shown: str, field: str, bad: BadRecords) -> Iterator[Piece]:
    checked = False
    for lineno, line in enumerate(fh, 1):
        if not line.strip():
            continue
        where = f"{shown} line {lineno}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            bad.skip(f"{where}: not valid JSON ({getattr(exc, 'msg', exc.__class__.__name__)})")
            continue
        if not isinstance(record, dict):
            bad.skip(f"{where}: not a JSON object")
            continue
        if not checked and field not in record:  # the first record shows whether the field exists at all
            fields = ", ".join(sorted(map(str, record))[:10]) or "none"
            raise DataError(f"{where}: no field {field!r} (its fields: {fields}); set data.text_field")
        checked = True
        text = record.get(field)
        if not isinstance(text, str):
            bad.skip(f"{where}: field {field!r} is {type(text).__name__}, not a string")
            continue
        if not _encodes(text):
            bad.skip(f"{where}: field {field!r} is not valid Unicode (an unpaired surrogate escape)")
            continue
        if text:
            yield from _record_pieces(f"{f.name}#{lineno}", text)


def _column_pieces(batches, schema, f: SourceFile, shown: str, field: str, bad: BadRecords) -> Iterator[Piece]:
    if field not in schema.names:
        columns = ", ".join(schema.names[:10]) or "none"
        raise DataError(f"{shown}: no column {field!r} (its columns: {columns}); set data.text_field")
    if not _is_text(schema.field(field).type):
        kind = schema.field(field).type
        raise DataError(f"{shown}: column {field!r} holds {kind}, not text; set data.text_field to a text column")
    row = 0
    for batch in batches:
        for text in batch.column(batch.schema.get_field_index(field)).to_pylist():
            if text is None:
                bad.skip(f"{shown} row {row}: {field!r} is null")
            elif text:
                yield from _record_pieces(f"{f.name}#{row}", text)
            row += 1


def _is_text(kind) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _open_columns(fh, f: SourceFile, field: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if f.kind == "parquet":
        pf = pq.ParquetFile(fh)
        schema = pf.schema_arrow
        columns = [field] if field in schema.names else []
        return pf.iter_batches(batch_size=_RECORD_BATCH, columns=columns), schema
    reader = pa.ipc.open_stream(fh)
    return reader, reader.schema


def _format_errors(kind: str) -> tuple[type[Exception], ...]:
    """What a malformed file of ``kind`` raises besides OSError and ValueError: pyarrow's own errors."""
    if kind not in ("parquet", "arrow"):
        return ()
    import pyarrow as pa

    return (pa.ArrowException, KeyError, TypeError)  # a Parquet schema with a duplicate column: KeyError


def read_pieces(fs, files: list[SourceFile], data: DataConfig, bad: BadRecords) -> Iterator[tuple[int, Piece]]:
    """(bytes of the source read so far, piece) for every non-empty document of ``files``, in order."""
    before = 0
    for f in files:
        shown = f.path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(f.path)
        try:
            with fs.open(f.path, "rb") as fh:
                if f.kind == "text":
                    pieces = _text_pieces(fh, f.name)
                elif f.kind == "jsonl":
                    pieces = _jsonl_pieces(fh, f, shown, data.text_field, bad)
                else:
                    pieces = _column_pieces(*_open_columns(fh, f, data.text_field), f, shown, data.text_field, bad)
                for piece in pieces:
                    yield before + min(fh.tell(), f.size), piece
        except DataError:
            raise
        except Exception as exc:
            reason = f"{exc.__class__.__name__}: {exc}".splitlines()[0]
            if retry.is_transient(exc):  # the store failed, not the file: the shard stage is retried
                raise StoreUnavailable(f"cannot read {shown} ({reason}); the store may be unreachable") from None
            if not isinstance(exc, (OSError, ValueError, *_format_errors(f.kind))):
                raise
            what = {"parquet": "a Parquet file", "arrow": "an Arrow stream"}.get(f.kind)
            hint = f"; is it {what}?" if what and not isinstance(exc, OSError) else ""
            raise DataError(f"cannot read {shown} ({reason}){hint}") from None
        before += f.size
