"""Bounded inputs (issue 23, item 6): a source, a saved dataset or a tokenizer path the attacker controls costs a
bounded amount of memory and time. Devices, FIFOs and sockets are refused in one line; a JSONL line, a Parquet
or Arrow value and a Parquet row group beyond the record limit are bad records.

Memory is measured in a child process (its own peak RSS, under an address-space limit so that the unbounded
reader of before fails there, not on this machine)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data import sources, tokenizer
from trainpipe.trainer.data.shard import read_documents
from trainpipe.trainer.errors import DataError

MB = 1 << 20
CHILD_LIMIT_MB = 3072  # the child's address space: an unbounded read dies there with MemoryError
ALLOWED_GROWTH_MB = 200  # what reading a bomb may add to the reader's peak RSS at data.buffer_mb=1
RAISE = "raise data.buffer_mb to read it"  # what a record over the limit says to do


def cfg(source, **kw) -> DataConfig:
    kw.setdefault("shard_tokens", 1024)
    kw.setdefault("val_fraction", 0.2)
    return DataConfig(source=str(source), **kw)


def in_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` (which may print) in a fresh interpreter whose address space is capped."""

    def cap() -> None:
        limit = CHILD_LIMIT_MB * MB
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=cap,
        cwd=Path(__file__).resolve().parents[1],
    )


# What the first few pieces of a source cost the reader: its peak RSS growth in MB, printed by the child.
READ_GROWTH = """
    import resource, sys
    import pyarrow, pyarrow.parquet, pyarrow.compute  # loaded before the baseline
    from trainpipe.trainer.config import DataConfig
    from trainpipe.trainer.data import sources
    data = DataConfig(source=sys.argv[1], buffer_mb=1)
    fs, files = sources.list_source(data.source, None)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    bad = sources.BadRecords(1 << 62)
    pieces = (p for f in files for p in sources.SegmentRead(fs, sources.Segment(f), data, bad).parts())
    for _ in range(int(sys.argv[2])):
        next(pieces, None)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(f"grown_mb={grown / 1024:.0f}")
"""


def read_growth_mb(path: Path, pieces: int = 3) -> float:
    done = in_child(READ_GROWTH, str(path), str(pieces))
    assert done.returncode == 0, f"the reader failed: {done.stderr.strip().splitlines()[-1:]}"
    return float(done.stdout.split("grown_mb=")[1])


def make_fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


# -----------------------------------------------------------------------------
# a. the tokenizer path


def test_a_tokenizer_path_that_is_a_device_is_one_line_not_a_memory_error():
    """/dev/zero reports size 0, which passed the size cap; it was then read until MemoryError."""
    done = in_child(
        """
        from trainpipe.trainer.data.tokenizer import read_tokenizer_file
        from trainpipe.trainer.errors import DataError
        try:
            read_tokenizer_file("/dev/zero", None)
        except DataError as exc:
            print("DataError:", exc)
        """
    )
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]
    line = done.stdout.strip()
    assert line.startswith("DataError: data.tokenizer /dev/zero: not a regular file") and "\n" not in line


@pytest.mark.timeout(30)
def test_a_tokenizer_path_that_is_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = make_fifo(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match=r"data.tokenizer .*tokenizer\.json: not a regular file \(a FIFO\)"):
        tokenizer.read_tokenizer_file(str(fifo), None)


def test_a_tokenizer_is_read_with_a_bounded_read_not_by_its_reported_size(monkeypatch):
    """/proc files are regular files that report size 0 whatever they hold: the read itself is capped."""
    monkeypatch.setattr(tokenizer, "MAX_TOKENIZER_BYTES", 64)
    assert os.path.getsize("/proc/self/status") == 0
    with pytest.raises(DataError, match=r"data.tokenizer /proc/self/status: larger than 64 bytes"):
        tokenizer.read_tokenizer_file("/proc/self/status", None)


# -----------------------------------------------------------------------------
# b. every source file is a regular file


@pytest.mark.timeout(30)
@pytest.mark.parametrize("source", ["/dev/zero", "/dev/zer[o]", "{tmp}/corpus", "{tmp}/corpus/*.jsonl"])
def test_a_source_matching_a_device_or_a_fifo_is_one_line(tmp_path, source):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text(json.dumps({"text": "a document"}) + "\n")
    make_fifo(tmp_path / "corpus" / "b.jsonl")
    data = cfg(source.format(tmp=tmp_path))
    with pytest.raises(DataError, match=r"data.source .*: .* is not a regular file \(a (character device|FIFO)\)"):
        sources.check_source(data, StoreConfig(root=str(tmp_path / "store")))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["a.txt", "a.jsonl", "a.parquet"])
def test_a_source_file_swapped_for_a_fifo_after_listing_is_one_line_not_a_hang(tmp_path, name):
    """The corpus is listed before it is read: what was a file at listing may be a FIFO when it is opened."""
    path = tmp_path / name
    path.write_text("a document")
    fs, files = sources.list_source(str(path), None)
    path.unlink()
    make_fifo(path)
    with pytest.raises(DataError, match=rf"cannot read {path}: not a regular file \(a FIFO\)"):
        list(sources.SegmentRead(fs, sources.Segment(files[0]), cfg(path), sources.BadRecords(0)).parts())


@pytest.mark.timeout(30)
def test_a_saved_datasets_state_file_is_read_bounded_and_its_data_files_must_be_regular(tmp_path, monkeypatch):
    import datasets

    datasets.Dataset.from_dict({"text": ["one", "two"]}).save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    arrow.unlink()
    make_fifo(arrow)
    with pytest.raises(DataError, match=rf"state\.json names {arrow.name}, which is not a regular file \(a FIFO\)"):
        sources.list_source(str(tmp_path / "saved"), None)
    monkeypatch.setattr(sources, "MAX_META_BYTES", 16)
    with pytest.raises(DataError, match=r"state\.json is larger than 16 bytes"):
        sources.list_source(str(tmp_path / "saved"), None)


# -----------------------------------------------------------------------------
# c. a JSONL line is read with a cap


def test_a_jsonl_line_over_the_record_limit_is_a_bad_record_and_reading_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "record_limit", lambda data: 1000)
    lines = [json.dumps({"text": "first"}), json.dumps({"text": "x" * 5000}), json.dumps({"text": "third"})]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n" + json.dumps({"text": "y" * 3000}))
    warned: list[str] = []
    docs = list(read_documents(cfg(tmp_path / "c.jsonl"), warn=warned.append))
    assert [text for _, text in docs] == ["first", "third"]
    assert [n for n, _ in docs] == ["c.jsonl#1", "c.jsonl#3"]
    assert len(warned) == 2 and "c.jsonl line 2: longer than the record limit of 1000 bytes" in warned[0]
    assert "c.jsonl line 4: longer than" in warned[1]


def test_the_record_limit_follows_data_buffer_mb():
    assert sources.record_limit(DataConfig(buffer_mb=1)) == sources.MIN_RECORD_BYTES == 32 * MB
    assert sources.record_limit(DataConfig(buffer_mb=100)) == 100 * MB


@pytest.mark.timeout(60)
def test_a_gigabyte_jsonl_line_without_a_newline_costs_bounded_memory(tmp_path):
    path = tmp_path / "c.jsonl"
    with path.open("wb") as fh:  # a sparse gigabyte of NUL bytes: no newline anywhere
        fh.write(json.dumps({"text": "first"}).encode() + b"\n")
        fh.truncate(1 << 30)
    assert read_growth_mb(path, pieces=3) < ALLOWED_GROWTH_MB


# -----------------------------------------------------------------------------
# d. Parquet and Arrow values and row groups


def one_big_value_repeated(path: Path, kind: str, rows: int = 1500, size: int = MB) -> None:
    """A file of a few KB whose ``rows`` text values are ``size`` bytes each once decoded."""
    if kind == "parquet-plain":  # distinct compressible values; pyarrow puts them all in one 400 MB page
        values = [("a" * size)[:-8] + f"{i:08d}" for i in range(400)]
        pq.write_table(pa.table({"text": values}), path, compression="zstd", use_dictionary=False)
        return
    column = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(["a" * size]))
    table = pa.table({"text": column})
    if kind == "parquet-dictionary":
        pq.write_table(table, path, compression="zstd", row_group_size=rows)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["parquet-dictionary", "parquet-plain", "arrow-dictionary"])
def test_a_small_file_of_huge_repeated_values_costs_bounded_memory(tmp_path, kind):
    path = tmp_path / ("bomb.arrow" if kind.startswith("arrow") else "bomb.parquet")
    one_big_value_repeated(path, kind)
    assert path.stat().st_size < {"parquet-dictionary": 8192, "parquet-plain": 100_000}.get(kind, MB + 8192)
    assert read_growth_mb(path, pieces=3) < ALLOWED_GROWTH_MB


def test_a_parquet_or_arrow_value_over_the_record_limit_is_a_bad_record(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "record_limit", lambda data: 1000)
    rows = ["first", "x" * 2500, "third", *(f"more {i}" for i in range(20))]  # one page, under 4 record limits
    pq.write_table(pa.table({"text": rows}), tmp_path / "c.parquet", use_dictionary=False)
    table = pa.table({"text": pa.array(rows).dictionary_encode()})
    with pa.OSFile(str(tmp_path / "c.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    for name in ("c.parquet", "c.arrow"):
        warned: list[str] = []
        docs = list(read_documents(cfg(tmp_path / name), warn=warned.append))
        assert [text for _, text in docs] == [rows[0], *rows[2:]], name
        assert warned == [f"skipped {tmp_path / name} row 1: longer than the record limit of 1000 bytes; {RAISE}"]


def test_a_parquet_row_group_declaring_more_than_the_record_limit_per_row_is_skipped_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "record_limit", lambda data: 1000)
    pq.write_table(pa.table({"text": ["a" * 3000, "b" * 3000, "c", "d"]}), tmp_path / "c.parquet", row_group_size=2)
    warned: list[str] = []
    docs = list(read_documents(cfg(tmp_path / "c.parquet"), warn=warned.append))
    assert [text for _, text in docs] == ["c", "d"]
    assert len(warned) == 1 and "row group 0 (rows 0-1): declares" in warned[0] and "record limit" in warned[0]


def test_a_parquet_dictionary_over_the_record_limit_is_skipped_unread(tmp_path, monkeypatch):
    """One huge dictionary value shared by many rows: the dictionary page's own header says how big it is (a page
    may hold up to sources.PAGE_RECORDS record limits)."""
    monkeypatch.setattr(sources, "record_limit", lambda data: 10_000)
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(tmp_path / "c.parquet", schema, compression="zstd") as writer:
        writer.write_table(pa.table({"text": ["a" * 50_000] * 1000}, schema))  # one 50 KB dictionary value
        writer.write_table(pa.table({"text": ["ok", "fine"]}, schema))
    assert pq.ParquetFile(tmp_path / "c.parquet").metadata.row_group(0).column(0).has_dictionary_page
    warned: list[str] = []
    docs = list(read_documents(cfg(tmp_path / "c.parquet"), warn=warned.append))
    assert [text for _, text in docs] == ["ok", "fine"]
    assert len(warned) == 1 and "row group 0 (rows 0-999): a dictionary page holds" in warned[0]


def test_ordinary_parquet_and_jsonl_read_the_same_as_before(tmp_path):
    """The bounded readers change nothing for ordinary files: nulls, empty values, several row groups."""
    rows = [f"document {i} " * (i % 7) for i in range(50)]
    pq.write_table(pa.table({"text": [*rows[:10], None, *rows[10:]]}), tmp_path / "c.parquet", row_group_size=7)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    for name in ("c.parquet", "c.jsonl"):
        assert [t for _, t in read_documents(cfg(tmp_path / name))] == [r for r in rows if r], name
