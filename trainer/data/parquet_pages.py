"""Parquet page headers, read apart from pyarrow's reader: how big a page is before the reader decompresses it.

pyarrow decompresses a data page whole and exposes no page headers, and its own
writer puts up to about 1,024 values into one page, so a few hundred bytes of a
file can stand for a gigabyte of text. The shard stage reads each header of the
text column first (``trainer/data/sources.py``) and skips a row group whose
pages are beyond its limit. A header is a Thrift compact-protocol struct
(parquet-format's ``PageHeader``); only the fields the check needs are kept.
"""

from __future__ import annotations

import os

from fsspec.implementations.local import LocalFileSystem


def page_header(fs, fh, path: str, offset: int) -> tuple[int, int, int, int, int | None, int] | None:
    """(page type, uncompressed size, compressed size, values, encoding, header length) of the Parquet page header
    at ``offset``, read apart from the reader's position; None when it is not one (the encoding: None when the
    header has none)."""
    for size in (256, 1 << 16):  # a header with statistics can be long
        if isinstance(fs, LocalFileSystem):
            head = os.pread(fh.fileno(), size, offset)
        else:
            head = fs.cat_file(path, start=offset, end=offset + size)
        try:
            fields, length = _thrift_struct(head, 0, 0)
        except IndexError:
            if len(head) < size:
                return None
            continue
        except ValueError:
            return None
        kind, uncompressed, compressed = fields.get(1), fields.get(2), fields.get(3)
        data = fields.get(5) or fields.get(8) or {}  # DataPageHeader or DataPageHeaderV2
        values = data.get(1) if isinstance(data, dict) else None
        encoding = data.get(2 if 5 in fields else 4) if isinstance(data, dict) else None
        if not (isinstance(kind, int) and isinstance(uncompressed, int) and isinstance(compressed, int)):
            return None
        if min(kind, uncompressed, compressed) < 0:
            return None
        encoding = encoding if isinstance(encoding, int) else None
        return kind, uncompressed, compressed, values if isinstance(values, int) else 1, encoding, length
    return None


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
        if shift > 63:
            raise ValueError("varint too long")


def _thrift_value(buf: bytes, pos: int, kind: int, depth: int, in_list: bool = False):
    """One Thrift compact-protocol value of type ``kind`` at ``pos``: (value or None when skipped, next pos)."""
    if kind in (1, 2):  # a bool: in a field header its value is the type; in a list, one byte
        return (buf[pos] == 1, pos + 1) if in_list else (kind == 1, pos)
    if kind == 3:
        return buf[pos], pos + 1
    if kind in (4, 5, 6):
        value, pos = _varint(buf, pos)
        return (value >> 1) ^ -(value & 1), pos
    if kind == 7:
        return None, pos + 8
    if kind == 8:
        size, pos = _varint(buf, pos)
        return None, pos + size
    if kind in (9, 10):
        head = buf[pos]
        size, element, pos = head >> 4, head & 0x0F, pos + 1
        if size == 15:
            size, pos = _varint(buf, pos)
        for _ in range(size):
            _, pos = _thrift_value(buf, pos, element, depth + 1, in_list=True)
        return None, pos
    if kind == 11:
        size, pos = _varint(buf, pos)
        if size:
            types, pos = buf[pos], pos + 1
            for _ in range(size):
                _, pos = _thrift_value(buf, pos, types >> 4, depth + 1, in_list=True)
                _, pos = _thrift_value(buf, pos, types & 0x0F, depth + 1, in_list=True)
        return None, pos
    if kind == 12:
        return _thrift_struct(buf, pos, depth + 1)
    raise ValueError(f"thrift type {kind}")


def _thrift_struct(buf: bytes, pos: int, depth: int) -> tuple[dict, int]:
    """A Thrift compact-protocol struct at ``pos``: ({field id: value}, next pos); nested structs as dicts."""
    if depth > 8:
        raise ValueError("nested too deep")
    fields, field = {}, 0
    while True:
        head = buf[pos]
        pos += 1
        if head == 0:
            return fields, pos
        if head >> 4:
            field += head >> 4
        else:
            value, pos = _varint(buf, pos)
            field = (value >> 1) ^ -(value & 1)
        fields[field], pos = _thrift_value(buf, pos, head & 0x0F, depth)
