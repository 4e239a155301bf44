"""Where a corpus comes from and how it is read: the files a ``data.source`` spec names, streamed as text.

Formats, by file: ``.jsonl`` (one record per line, the text in ``data.text_field``), ``.parquet`` (the
``data.text_field`` column, read in record batches), a folder written by ``datasets``' ``save_to_disk``
(its Arrow stream files, the ``data.text_field`` column), anything else as one UTF-8 text document per
file. Every file is read through fsspec, locally or from S3, and streamed: memory holds one piece of text
(at most ``PIECE_CHARS``), one record (at most ``record_limit``) or about ``data.buffer_mb`` of a record batch
at a time, whatever the corpus size.

The source is not trusted (a bucket others can write): a local file must be a regular file when it is opened
(a device, FIFO or socket is one line, never a read without end or a wait for a writer), and a record, a
Parquet row group or dictionary declaring more than the record limit is a bad record, skipped unread.

Light on purpose (no torch): the CLI checks a source with it before anything else starts.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import io
import json
import os
import posixpath
import stat
import sysconfig
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from trainpipe.trainer import store_retry
from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data.parquet_pages import page_header
from trainpipe.trainer.errors import DataError, StoreUnavailable
from trainpipe.trainer.store import client_options

STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})
# Documents are tokenized in pieces of at most this many characters, cut after a line end where there is
# one: a fixed rule, so the same text gives the same tokens from every format and at every buffer size.
PIECE_CHARS = 1 << 20
_READ_BYTES = 1 << 20
# How much older than the listing a file's last change must be for its stat to vouch for its bytes: above any
# file system's timestamp granularity (ext4, xfs: a clock tick; NFS: up to a second).
SETTLED_NS = 2_000_000_000
_RECORD_BATCH = 1024
_DATASET_STATE = "state.json"
_DATASET_DICT = "dataset_dict.json"
# A record (a JSONL line, a Parquet or Arrow value) is held whole, since its hash decides its split, so it has
# a limit: data.buffer_mb, but never below this, so that ordinary long documents (a book is a few MB) pass.
MIN_RECORD_BYTES = 32 << 20
MAX_META_BYTES = 16 << 20  # a save_to_disk folder's state.json or dataset_dict.json: a few KB in practice


@dataclass(frozen=True)
class SourceFile:
    name: str  # relative to the source's base: the same corpus has the same names wherever it lives
    path: str  # inside the filesystem
    kind: str  # "text", "jsonl", "parquet" or "arrow"
    size: int
    # What the file's stat said at listing when its last change was SETTLED_NS older ("" otherwise, and for files
    # not on a local disk): equal later, the file holds the same bytes (source_hashes.py).
    version: str = ""


@dataclass(frozen=True)
class Part:
    """A part of one document's text: documents are tokenized in parts of at most PIECE_CHARS characters."""

    doc: str  # the document: a file's name, or name#line / name#row for a record
    text: str
    last: bool  # the document's last piece: an end-of-text token follows it
    key: str  # decides the document's split: a file's name, a record's content hash


def record_limit(data: DataConfig) -> int:
    """The most bytes one record may hold: max(MIN_RECORD_BYTES, data.buffer_mb MB)."""
    return max(MIN_RECORD_BYTES, data.buffer_mb << 20)


def amount(n: int) -> str:
    """``n`` bytes as a person reads it: whole MB when it is one, else bytes."""
    return f"{n >> 20} MB" if n >= 1 << 20 and not n % (1 << 20) else f"{n} bytes"


class NotRegularFile(OSError):
    """A path that is a device, FIFO, socket or folder where a file's bytes were expected."""

    def __init__(self, what: str):
        super().__init__(f"not a regular file ({what})")
        self.what = what


def _irregular(mode: int) -> str | None:
    """What a file of ``mode`` is when it is not a regular file (None when it is one)."""
    if stat.S_ISREG(mode):
        return None
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a file"


def open_regular(fs, path: str):
    """``path`` opened for binary reading; NotRegularFile when a local path is not a regular file.

    Checked before opening (opening a device may do something) and again on the open descriptor, since the
    path may be swapped between the two: a FIFO opens non-blocking, so it is refused instead of waited on."""
    if not isinstance(fs, LocalFileSystem):
        return fs.open(path, "rb")  # an object store holds objects only
    if what := _irregular(os.stat(path).st_mode):
        raise NotRegularFile(what)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if what := _irregular(os.fstat(fd).st_mode):
            raise NotRegularFile(what)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(fs, path: str, limit: int) -> bytes | None:
    """The bytes of the regular file at ``path``, or None when it holds more than ``limit``: the read itself
    stops there, whatever size the file reports (/proc files report 0)."""
    with open_regular(fs, path) as fh:
        body = fh.read(limit + 1)
    return None if len(body) > limit else body


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

    def small_json(where: str, what: str):
        try:
            body = read_bounded(fs, where, MAX_META_BYTES)
        except NotRegularFile as exc:
            raise DataError(f"{shown}: {where} is not a regular file ({exc.what}); save the dataset again") from None
        if body is None:
            raise DataError(f"{shown}: {where} is larger than {amount(MAX_META_BYTES)}, not {what}")
        return json.loads(body)

    def state_files(sub: str, prefix: str) -> list[tuple[str, str]]:
        where = posixpath.join(sub, _DATASET_STATE)
        try:
            state = small_json(where, "a datasets state file")
            names = [entry["filename"] for entry in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{shown}: {where} is not a datasets state file ({exc.__class__.__name__})") from None
        if not all(_plain_name(n) for n in names):
            raise DataError(f"{shown}: {where} names a data file outside its folder")
        for n in names:
            if problem := _file_problem(fs, posixpath.join(sub, n)):
                raise DataError(f"{shown}: {where} names {n}, which is {problem}; save the dataset again")
        return [(f"{prefix}{n}", posixpath.join(sub, n)) for n in names]

    if fs.isfile(posixpath.join(folder, _DATASET_STATE)):
        return state_files(folder, "")
    if fs.isfile(posixpath.join(folder, _DATASET_DICT)):
        try:
            splits = small_json(posixpath.join(folder, _DATASET_DICT), "a datasets file")["splits"]
            if not isinstance(splits, list):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{shown}: {_DATASET_DICT} is not a datasets file ({exc.__class__.__name__})") from None
        if not all(_plain_name(s) for s in splits):
            raise DataError(f"{shown}: {_DATASET_DICT} names a split outside its folder")
        return [f for s in splits for f in state_files(posixpath.join(folder, s), f"{s}/")]
    return None


def _file_problem(fs, path: str) -> str | None:
    """Why ``path`` cannot be read as a data file ("missing", "not a regular file (a FIFO)"), or None."""
    if not isinstance(fs, LocalFileSystem):
        return None if fs.isfile(path) else "missing"
    try:
        what = _irregular(os.stat(path).st_mode)
    except OSError:
        return "missing"
    return f"not a regular file ({what})" if what else None


def _local_files(paths: list[str], source: str) -> list[tuple[str, int, str]]:
    """(path, size, version) of the regular files among ``paths``; folders and dangling links are passed over, and
    anything else (a device, FIFO or socket) is one line: it would be read without end or wait forever."""
    out = []
    settled = time.time_ns() - SETTLED_NS
    for p in paths:
        try:
            info = os.stat(p)
        except OSError:
            continue
        what = _irregular(info.st_mode)
        if what == "a directory":
            continue
        if what:
            raise DataError(
                f"data.source {source!r}: {p} is not a regular file ({what}); a source names files and folders only"
            )
        out.append((p, info.st_size, _version(info, settled)))
    return out


def _version(info: os.stat_result, settled: int) -> str:
    # ctime, not mtime, decides: a write always moves it forward, and no program can set it back.
    if info.st_ctime_ns >= settled or info.st_mtime_ns >= settled:
        return ""
    return f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}"


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
        paths = [os.path.abspath(p) for p in glob.glob(pattern, recursive=True)]
        base = os.path.abspath(_glob_base(pattern) or ".")
    else:
        fs, pattern = None, source
        try:
            fs, pattern = url_to_fs(source, **client_options(source, storage_options))
            fs.invalidate_cache()  # a cached instance (s3fs) keeps listings from earlier runs of this process
            if not glob.has_magic(pattern) and fs.isdir(pattern):
                saved = _saved_dataset(fs, pattern.rstrip("/"), source)
                if saved is not None:
                    return fs, [SourceFile(n, p, "arrow", fs.size(p)) for n, p in saved]
                pattern = pattern.rstrip("/") + "/**"
            found = store_retry.call(f"listing {source}", fs.glob, pattern, detail=True)
        except FileNotFoundError:
            if fs is None:  # the store's own address, not a file in it
                raise DataError(f"cannot list data.source {source!r} (not found)") from None
            found = {}
        except StoreUnavailable:
            raise
        except Exception as exc:
            reason = f"{exc.__class__.__name__}: {exc}".splitlines()[0]
            if store_retry.is_transient(exc):
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
        SourceFile(_relative(p, base), p, _kind(p), size, version)
        for p, size, version in _local_files(sorted(paths), source)
    ]


def _relative(path: str, base: str) -> str:
    """``path``'s name under ``base``, with / between folders (a prefix cut where it can be: relpath costs a
    tenth of a second for every 3,000 files)."""
    prefix = base.rstrip(os.sep) + os.sep
    name = path[len(prefix) :] if path.startswith(prefix) else os.path.relpath(path, base)
    return name.replace(os.sep, "/")


def source_filesystem(source: str, storage_options: dict | None):
    """The filesystem the files of ``source`` are read through (each shard worker opens its own)."""
    if source == "stdlib" or "://" not in source:
        return LocalFileSystem()
    try:
        return url_to_fs(source, **client_options(source, storage_options))[0]
    except (ImportError, ValueError) as exc:
        raise DataError(f"cannot open data.source {source!r} ({exc.__class__.__name__}: {exc})") from None


def check_source(data: DataConfig, store: StoreConfig) -> int:
    """Number of files ``data.source`` matches. DataError when none, or when the first file lacks the text
    field or column or cannot be read, so a bad source fails before any work."""
    fs, files = list_source(data.source, source_options(data.source, store))
    if not files:
        raise DataError(
            f"data.source {data.source!r} matched no files; "
            "check the path/glob (use ** for subfolders) and that files exist"
        )
    first = SegmentRead(fs, Segment(files[0]), data, BadRecords(1 << 62)).parts()
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


def _text_pieces(fh, name: str) -> Iterator[Part]:
    # The same cuts as cut_pieces on the whole text: a cut looks only at the first PIECE_CHARS characters.
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    buf, held, eof = "", None, False
    while not eof:
        block = fh.read(_READ_BYTES)
        eof = not block
        buf += decode(block, final=eof)
        while len(buf) > PIECE_CHARS or (eof and buf):
            if held is not None:
                yield Part(name, held, False, name)
            cut = _cut(buf)
            held, buf = buf[:cut], buf[cut:]
    if held is not None:
        yield Part(name, held, True, name)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _record_pieces(doc: str, text: str) -> Iterator[Part]:
    key = hashlib.sha256(text.encode("utf-8")).hexdigest()
    pieces = list(cut_pieces(text))
    for i, piece in enumerate(pieces):
        yield Part(doc, piece, i == len(pieces) - 1, key)


def _lines(fh, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) of a file; None for a line of more than ``limit`` bytes, which is passed over a
    bounded chunk at a time: a line without end never sits in memory whole."""
    reader = fh if isinstance(fh, (io.BufferedReader, io.BytesIO)) else io.BufferedReader(fh, _READ_BYTES)
    lineno = 0
    while line := reader.readline(limit + 1):
        lineno += 1
        if len(line) > limit and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = reader.readline(_READ_BYTES)
            yield lineno, None
        else:
            yield lineno, line


_RAISE = "raise data.buffer_mb to read it"


def _over_limit(limit: int) -> str:
    return f"longer than the record limit of {amount(limit)}; {_RAISE}"


def _jsonl_pieces(fh, doc_prefix: str, shown: str, field: str, bad: BadRecords, limit: int) -> Iterator[Part]:
    checked = False
    for lineno, line in _lines(fh, limit):
        where = f"{shown} line {lineno}"
        if line is None:
            bad.skip(f"{where}: {_over_limit(limit)}")
            continue
        if not line.strip():
            continue
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
            yield from _record_pieces(f"{doc_prefix}#{lineno}", text)


@dataclass(frozen=True)
class _Skipped:
    """Rows passed over unread (a Parquet row group beyond the record limit), and why."""

    rows: int
    why: str


def _check_column(schema, shown: str, field: str) -> None:
    if field not in schema.names:
        columns = ", ".join(schema.names[:10]) or "none"
        raise DataError(f"{shown}: no column {field!r} (its columns: {columns}); set data.text_field")
    if not _is_text(schema.field(field).type):
        kind = schema.field(field).type
        raise DataError(f"{shown}: column {field!r} holds {kind}, not text; set data.text_field to a text column")


def _texts(column, limit: int, budget: int) -> Iterator[str | int | None]:
    """Each value of a text ``column``: its text, None when null, or its size when over ``limit`` bytes (not
    decoded). Sizes are known before anything is decoded, and at most ``budget`` bytes are decoded at once: a
    dictionary column's few stored values may stand for gigabytes of rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    dictionary = pa.types.is_dictionary(column.type)
    if dictionary:
        sizes = pc.call_function("binary_length", [column.dictionary]).take(column.indices).to_pylist()
    else:
        sizes = pc.call_function("binary_length", [column]).to_pylist()
    i = 0
    while i < len(sizes):
        if (sizes[i] or 0) > limit:
            yield sizes[i]
            i += 1
            continue
        end, total = i + 1, sizes[i] or 0
        while end < len(sizes) and (sizes[end] or 0) <= limit and total + (sizes[end] or 0) <= budget:
            total += sizes[end] or 0
            end += 1
        part = column.slice(i, end - i)
        yield from (part.dictionary_decode() if dictionary else part).to_pylist()
        i = end


def _column_pieces(batches, f: SourceFile, shown: str, field: str, bad: BadRecords, data: DataConfig, row: int):
    limit = record_limit(data)
    for batch in batches:
        if isinstance(batch, _Skipped):
            bad.skip(f"{shown} {batch.why}")
            row += batch.rows
            continue
        for text in _texts(batch.column(batch.schema.get_field_index(field)), limit, data.buffer_mb << 20):
            if text is None:
                bad.skip(f"{shown} row {row}: {field!r} is null")
            elif isinstance(text, int):
                bad.skip(f"{shown} row {row}: {_over_limit(limit)}")
            elif text:
                yield from _record_pieces(f"{f.name}#{row}", text)
            row += 1


def _is_text(kind) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _open_columns(fs, fh, f: SourceFile, shown: str, data: DataConfig, seg: Segment):
    """The record batches (or _Skipped row groups) of a Parquet file's or Arrow stream's text column (of
    ``seg``'s row groups), and the number of the first row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if f.kind != "parquet":
        reader = pa.ipc.open_stream(fh)
        _check_column(reader.schema, shown, data.text_field)
        return reader, 0
    pf = pq.ParquetFile(fh)
    _check_column(pf.schema_arrow, shown, data.text_field)
    # Read as a dictionary only to learn a row group's longest dictionary value (a dictionary page holds few
    # values that any number of rows may repeat); the rows are read plain, since reading plain pages as a
    # dictionary gathers every value of the row group.
    values = pq.ParquetFile(fh, metadata=pf.metadata, read_dictionary=[data.text_field])
    meta = pf.metadata
    groups = range(seg.start, meta.num_row_groups if seg.stop is None else min(seg.stop, meta.num_row_groups))
    first = sum(meta.row_group(i).num_rows for i in range(min(seg.start, meta.num_row_groups)))
    return _row_groups(fs, fh, f, pf, values, data, groups, first), first


def _row_groups(fs, fh, f: SourceFile, pf, values, data: DataConfig, groups: range, first: int):
    """Each row group's text column in batches of about ``data.buffer_mb``. The column's page headers (what the
    reader allocates from) are read first: a row group with a page beyond the record limit is skipped unread,
    and the batch size follows the largest text a row of any page can stand for."""
    limit, budget, meta = record_limit(data), data.buffer_mb << 20, pf.metadata
    for i in groups:
        group = meta.row_group(i)
        rows, where = group.num_rows, f"row group {i} (rows {first}-{first + group.num_rows - 1})"
        first += rows
        chunk = next(
            (group.column(c) for c in range(group.num_columns) if group.column(c).path_in_schema == data.text_field),
            None,
        )
        if not rows or chunk is None:
            continue
        declared = max(chunk.total_uncompressed_size, 0)
        if -(-declared // rows) > limit:
            yield _Skipped(
                rows, f"{where}: declares {amount(declared)} of text, over the record limit of {amount(limit)} a row"
            )
            continue
        try:
            per_row = _per_row(fs, fh, f.path, chunk, limit, lambda i=i: _longest_value(values, i, data.text_field))
        except _Oversized as exc:
            yield _Skipped(rows, f"{where}: {exc}, over {PAGE_RECORDS} x the record limit of {amount(limit)}; {_RAISE}")
            continue
        batch = min(max(budget // max(per_row, 1), 1), _RECORD_BATCH)
        yield from pf.iter_batches(batch_size=batch, row_groups=[i], columns=[data.text_field])


def _group_spans(meta, start: int, stop: int | None) -> list[tuple[int, int]] | None:
    """The byte span of each row group in ``[start, stop)``: from its first column chunk's first page to its
    last one's end, as the footer says; None when a chunk has no place."""
    spans = []
    for i in range(start, meta.num_row_groups if stop is None else min(stop, meta.num_row_groups)):
        group, lo, hi = meta.row_group(i), None, None
        for c in range(group.num_columns):
            chunk = group.column(c)
            at = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
            if at is None or at < 4 or chunk.total_compressed_size < 0:
                return None
            lo, hi = min(at, lo or at), max(at + chunk.total_compressed_size, hi or 0)
        spans.append((lo, hi) if lo is not None and hi is not None else (0, 0))  # (0, 0): a group of no column
    return spans


# A footer larger than this is not read by the plan (the file is one piece, read by a worker as before).
MAX_PLAN_FOOTER = 16 << 20


def row_group_sizes(fs, f: SourceFile) -> list[int] | None:
    """The stored size of each row group of Parquet file ``f``, from its footer, for the plan to cut the file
    into runs of row groups; None when the file is not one to cut (a footer that cannot be read, or is larger
    than MAX_PLAN_FOOTER: the file stays whole, and its worker says what is wrong with it)."""
    import pyarrow.parquet as pq

    try:
        with fs.open(f.path, "rb") as fh:
            fh.seek(max(f.size - 8, 0))
            tail = fh.read(8)
            if len(tail) != 8 or tail[4:] != b"PAR1" or int.from_bytes(tail[:4], "little") > MAX_PLAN_FOOTER:
                return None
            fh.seek(0)
            spans = _group_spans(pq.ParquetFile(fh).metadata, 0, None)
    except (OSError, ValueError, *_format_errors("parquet")):
        return None
    return None if spans is None else [hi - lo for lo, hi in spans]


class _Oversized(Exception):
    """A Parquet column chunk that cannot be read within the record limit (the message says why)."""


# The reader decompresses a page whole, and writers put up to ~1024 values in one, so a page may hold a few
# record limits (long documents); beyond that the row group is not read.
PAGE_RECORDS = 4
_DICTIONARY_ENCODINGS = (2, 8)  # PLAIN_DICTIONARY, RLE_DICTIONARY: a row is an index into the dictionary


def _per_row(fs, fh, path: str, chunk, limit: int, longest_value: Callable[[], int]) -> int:
    """The most text (bytes) one row of the column chunk can stand for once decoded: a plain page's size over its
    values, or the longest dictionary value for a dictionary-encoded page. _Oversized when a page (decompressed
    whole by the reader) is beyond PAGE_RECORDS x ``limit`` or a header cannot be read."""
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    if start is None or start < 0:
        raise _Oversized("its pages cannot be found")
    pos, end, most, longest = start, start + chunk.total_compressed_size, 1, None
    while pos < end:
        header = page_header(fs, fh, path, pos)
        if header is None:
            raise _Oversized("a page header cannot be read")
        kind, size, stored, values, encoding, length = header
        if size > PAGE_RECORDS * limit:
            raise _Oversized(f"a {'dictionary ' if kind == 2 else ''}page holds {amount(size)}")
        if kind in (0, 3):  # DATA_PAGE, DATA_PAGE_V2
            if encoding in _DICTIONARY_ENCODINGS:
                longest = longest_value() if longest is None else longest
                most = max(most, longest)
            else:
                most = max(most, -(-size // max(values, 1)))
        pos += length + stored
    return most


def _longest_value(values, group: int, field: str) -> int:
    """The longest value (bytes) of row group ``group``'s dictionary, read with its first row."""
    import pyarrow.compute as pc

    batches = values.iter_batches(batch_size=1, row_groups=[group], columns=[field])
    try:
        column = next(batches).column(0)
    except StopIteration:
        return 0
    finally:
        batches.close()
    # (by name: pyarrow.compute makes its functions at import, where type checkers do not see them)
    lengths = pc.call_function("binary_length", [column.dictionary if hasattr(column, "dictionary") else column])
    return pc.call_function("max", [lengths]).as_py() or 0


def _format_errors(kind: str) -> tuple[type[Exception], ...]:
    """What a malformed file of ``kind`` raises besides OSError and ValueError: pyarrow's own errors."""
    if kind not in ("parquet", "arrow"):
        return ()
    import pyarrow as pa

    return (pa.ArrowException, KeyError, TypeError)  # a Parquet schema with a duplicate column: KeyError


@dataclass(frozen=True)
class Segment:
    """What one unit of the shard stage reads: a whole file, a line-aligned byte range of a text or JSONL file, or
    a run of row groups of a Parquet file.

    A byte range ``[start, stop)`` holds the lines that begin inside it, so consecutive ranges of one file hold
    every line once whatever their sizes; a file's text document ends in its ``last`` segment. ``hard`` cuts a
    text file exactly at ``stop`` (data.max_bytes), at the UTF-8 character boundary before it. For a Parquet
    file ``start`` and ``stop`` count row groups, and ``planned`` is their stored size."""

    file: SourceFile
    start: int = 0
    stop: int | None = None  # None: to the end of the file
    hard: bool = False
    last: bool = True
    planned: int = 0  # bytes, for a run of row groups (the plan's weight; a file's other segments have their size)

    @property
    def row_groups(self) -> bool:
        """A run of a Parquet file's row groups, not the whole file."""
        return self.file.kind == "parquet" and (self.start, self.stop) != (0, None)

    @property
    def name(self) -> str:
        return self.file.name if (self.start, self.stop) == (0, None) else f"{self.file.name}@{self.start}"


class _Range(io.RawIOBase):
    """The bytes of one segment of an open file, hashed (sha256) as they are read.

    The start moves to the first line start at or after ``start``; the end is the first line start at or after
    ``stop`` (or exactly ``stop`` when ``hard``, minus an unfinished UTF-8 character)."""

    def __init__(self, fh, seg: Segment):
        super().__init__()
        self.fh, self.stop, self.hard, self.sha = fh, seg.stop, seg.hard, hashlib.sha256()
        self.pos, self.done, self.newline_at_end = seg.start, False, True  # a start of 0 is a line start
        if seg.start > 0:
            fh.seek(seg.start - 1)
            self.pos = seg.start - 1 + self._through_newline()
        self.begin = self.pos

    def _through_newline(self) -> int:
        """Bytes up to and including the next newline (or to the end of the file), read and not kept."""
        passed = 0
        while block := self.fh.read(_READ_BYTES):
            at = block.find(b"\n")
            if at >= 0:
                self.fh.seek(at + 1 - len(block), os.SEEK_CUR)
                return passed + at + 1
            passed += len(block)
        return passed

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.done:
            return 0
        want = len(buffer)
        if self.stop is not None and self.pos < self.stop:
            want = min(want, self.stop - self.pos)
        elif self.stop is not None and (self.hard or self.newline_at_end):
            self.done = True
            return 0
        block = self.fh.read(want)
        if not block:
            self.done = True
            return 0
        if self.stop is not None and self.pos >= self.stop:  # past the end: only to the end of this line
            at = block.find(b"\n")
            if at >= 0:
                self.fh.seek(at + 1 - len(block), os.SEEK_CUR)
                block, self.done = block[: at + 1], True
        elif self.hard and self.pos + len(block) == self.stop:
            block = _whole_characters(block)
            self.done = True
        n = len(block)
        buffer[:n] = block
        self.sha.update(block)
        self.pos += n
        self.newline_at_end = block.endswith(b"\n")
        return n

    def tell(self) -> int:
        return self.pos - self.begin


def _whole_characters(block: bytes) -> bytes:
    """``block`` without an unfinished UTF-8 character at its end (its lead byte is in the last three bytes)."""
    for back in range(1, min(3, len(block)) + 1):
        byte = block[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back
            continue
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return block[:-back] if need > back else block
    return block


class SegmentRead:
    """The text parts of one segment, in order (``parts``), and afterwards the sha256 and size of the bytes they
    came from (``sha256``, ``bytes``). Parquet and Arrow files are hashed whole first: their reader seeks."""

    def __init__(self, fs, seg: Segment, data: DataConfig, bad: BadRecords):
        self.fs, self.seg, self.data, self.bad = fs, seg, data, bad
        self.sha256, self.bytes = "", 0

    def hash_only(self) -> str:
        """The sha256 of the segment's bytes, read without parsing them."""
        with self._opened() as fh:
            if self.seg.file.kind in ("parquet", "arrow"):
                return self._hash_groups(fh) if self.seg.row_groups else self._hash_whole(fh)
            raw = _Range(fh, self.seg)
            while raw.read(_READ_BYTES):
                pass
            self.sha256, self.bytes = raw.sha.hexdigest(), raw.tell()
        return self.sha256

    def _hash_groups(self, fh) -> str:
        """The sha256 of what a run of row groups is read from: the file's footer and each row group's bytes (its
        column chunks, as the footer places them), so a change elsewhere in the file leaves it as it was. A footer
        that places a row group outside the file: the whole file is hashed."""
        import pyarrow.parquet as pq

        size = self.seg.file.size
        fh.seek(max(size - 8, 0))
        tail = fh.read(8)
        footer = int.from_bytes(tail[:4], "little") + 8 if len(tail) == 8 else size + 1
        spans = _group_spans(pq.ParquetFile(fh).metadata, self.seg.start, self.seg.stop) if footer <= size else None
        if spans is None or any(hi > size - footer for _, hi in spans):
            return self._hash_whole(fh)
        sha, read = hashlib.sha256(), 0
        fh.seek(size - footer)
        sha.update(fh.read(footer))
        for lo, hi in spans:
            fh.seek(lo)
            left = hi - lo
            while left and (block := fh.read(min(left, _READ_BYTES))):
                sha.update(block)
                left -= len(block)
                read += len(block)
        fh.seek(0)
        self.sha256, self.bytes = sha.hexdigest(), read
        return self.sha256

    def _hash_whole(self, fh) -> str:
        sha, size = hashlib.sha256(), 0
        while block := fh.read(_READ_BYTES):
            sha.update(block)
            size += len(block)
        fh.seek(0)
        self.sha256, self.bytes = sha.hexdigest(), size
        return self.sha256

    def parts(self) -> Generator[Part, None, None]:
        """The segment's text parts; a text file's document ends only in its file's last segment."""
        held = None
        for part in self._parts():
            if held is not None:
                yield held
            held = part
        if held is not None:
            yield held if self.seg.last or self.seg.file.kind != "text" else Part(held.doc, held.text, False, held.key)
        elif self.seg.last and self.seg.start and self.seg.file.kind == "text":
            # The file's last line began in an earlier range: its document (not empty, it spans ranges) ends here.
            yield Part(self.seg.file.name, "", True, self.seg.file.name)

    def _parts(self) -> Iterator[Part]:
        f, data = self.seg.file, self.data
        where = "row group" if self.seg.file.kind == "parquet" else "byte"
        shown = self.shown + (f" (from {where} {self.seg.start})" if self.seg.start else "")
        with self._opened() as fh:
            if f.kind in ("parquet", "arrow"):
                self._hash_groups(fh) if self.seg.row_groups else self._hash_whole(fh)
                columns, first_row = _open_columns(self.fs, fh, f, shown, data, self.seg)
                yield from _column_pieces(columns, f, shown, data.text_field, self.bad, data, first_row)
                return
            raw = _Range(fh, self.seg)
            reader = io.BufferedReader(raw, _READ_BYTES)
            if f.kind == "jsonl":
                prefix = f"{f.name}@{self.seg.start}" if self.seg.start else f.name
                yield from _jsonl_pieces(reader, prefix, shown, data.text_field, self.bad, record_limit(data))
            else:
                yield from _text_pieces(reader, f.name)
            while reader.read(_READ_BYTES):  # a parser may stop before the end: the hash covers the segment
                pass
            self.sha256, self.bytes = raw.sha.hexdigest(), raw.tell()

    @property
    def shown(self) -> str:
        f = self.seg.file
        return f.path if isinstance(self.fs, LocalFileSystem) else self.fs.unstrip_protocol(f.path)

    @contextlib.contextmanager
    def _opened(self):
        """The segment's file, open; what goes wrong reading it is one line naming the file (docs/security.md)."""
        f, shown = self.seg.file, self.shown
        try:
            with open_regular(self.fs, f.path) as fh:
                yield fh
        except DataError:
            raise
        except NotRegularFile as exc:  # listed as a file, something else when opened: swapped meanwhile
            raise DataError(
                f"cannot read {shown}: not a regular file ({exc.what}); data.source must name files"
            ) from None
        except Exception as exc:
            reason = f"{exc.__class__.__name__}: {exc}".splitlines()[0]
            if store_retry.is_transient(exc):  # the store failed, not the file: the shard stage is retried
                raise StoreUnavailable(f"cannot read {shown} ({reason}); the store may be unreachable") from None
            if not isinstance(exc, (OSError, ValueError, *_format_errors(f.kind))):
                raise
            what = {"parquet": "a Parquet file", "arrow": "an Arrow stream"}.get(f.kind)
            hint = f"; is it {what}?" if what and not isinstance(exc, OSError) else ""
            raise DataError(f"cannot read {shown} ({reason}){hint}") from None
