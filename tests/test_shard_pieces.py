"""The shard stage as a map over pieces (trainer/data/plan.py, piece.py, shard.py): pure logic, in this process.

The engines that run the map (Prefect's process pool, dask.distributed) are in tests/test_shard_engines.py.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem

from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data.format import files_base
from trainpipe.trainer.data.piece import PieceRecord, read_piece
from trainpipe.trainer.data.plan import plan_pieces
from trainpipe.trainer.data.shard import read_documents, shard_dataset
from trainpipe.trainer.data.sources import BadRecords, Segment, SegmentRead, list_source
from trainpipe.trainer.data.tokens import TokenStream
from trainpipe.trainer.errors import DataError

WORDS = ["alpha", "beta", "gamma", "δέλτα", "→", "def", "return", "\n", "x = 1\n", "    "]


def text(rng: random.Random, size: int) -> str:
    out = ""
    while len(out.encode()) < size:
        out += rng.choice(WORDS) + " "
    return out


def make_files(folder: Path, n: int, seed: int = 0, lo: int = 200, hi: int = 3000) -> None:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"f{i:04d}.txt").write_text(text(rng, rng.randint(lo, hi)), encoding="utf-8")


def make_jsonl(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(json.dumps({"text": text(rng, rng.randint(10, 400)), "id": i}) + "\n")


def cfg(source, **kw) -> DataConfig:
    kw.setdefault("shard_tokens", 1024)
    kw.setdefault("val_fraction", 0.2)
    return DataConfig(source=str(source), **kw)


def split_tokens(info) -> dict[str, np.ndarray]:
    return {s: (lambda t: t.window(0, len(t)))(TokenStream(info.uri, s)) for s in ("train", "val")}


def stored_files(info) -> dict[str, bytes]:
    base = Path(files_base(info.uri, info.manifest))
    shards = [s["file"] for split in ("train", "val") for s in info.manifest["splits"][split]["shards"]]
    return {f: (base / f).read_bytes() for f in shards}


@pytest.mark.parametrize("piece_bytes", [1, 7, 64, 1000, 5000])
def test_line_aligned_ranges_hold_every_line_once(tmp_path, piece_bytes):
    """Cut into ranges of any size, a JSONL file gives the same records in the same order, and a text file the
    same document; each range's bytes, hashed, are the file's bytes between line starts."""
    make_jsonl(tmp_path / "c.jsonl", 60)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "big.txt").write_text(text(random.Random(3), 6000) + "\nlast line, no newline")
    for source in (tmp_path / "c.jsonl", tmp_path / "t"):
        whole = [t for _, t in read_documents(cfg(source))]
        cut = [t for _, t in read_documents(cfg(source, piece_mb=piece_bytes / 2**20))]
        assert cut == whole and whole
    fs, files = list_source(str(tmp_path / "c.jsonl"), None)
    pieces = plan_pieces(files, cfg(tmp_path / "c.jsonl", piece_mb=piece_bytes / 2**20))
    consumed = b""
    for piece in pieces:
        for seg in piece.segments:
            read = SegmentRead(fs, seg, cfg(tmp_path / "c.jsonl"), BadRecords(0))
            read.hash_only()
            consumed += b"x" * read.bytes
    assert len(consumed) == (tmp_path / "c.jsonl").stat().st_size


def test_a_hard_cut_ends_at_a_character_boundary(tmp_path):
    (tmp_path / "a.txt").write_text("ab→cd")  # → is three bytes: 2..4
    fs, files = list_source(str(tmp_path / "a.txt"), None)
    for stop, expected in [(2, "ab"), (3, "ab"), (4, "ab"), (5, "ab→"), (6, "ab→c")]:
        read = SegmentRead(fs, Segment(files[0], 0, stop, hard=True), cfg(tmp_path), BadRecords(0))
        assert "".join(p.text for p in read.parts()) == expected


def test_the_tokens_of_each_split_do_not_depend_on_the_piece_size(tmp_path):
    """Documents keep their order and their split whatever the pieces: only the shard boundaries move."""
    make_jsonl(tmp_path / "c.jsonl", 200)
    make_files(tmp_path / "txt", 30)
    for source in (tmp_path / "c.jsonl", tmp_path / "txt"):
        big = shard_dataset(cfg(source), StoreConfig(root=str(tmp_path / "s1")))
        small = shard_dataset(cfg(source, piece_mb=0.004), StoreConfig(root=str(tmp_path / "s2")))
        assert big.work.pieces == 1 and small.work.pieces > 3
        assert big.dataset_id != small.dataset_id
        for split in ("train", "val"):
            np.testing.assert_array_equal(split_tokens(big)[split], split_tokens(small)[split])


def test_a_file_added_changes_only_the_piece_it_joins():
    """Where a run of small files ends is decided by each file alone: the plan of a grown corpus keeps every
    piece the new file does not join."""
    from trainpipe.trainer.data.sources import SourceFile

    rng = random.Random(1)
    files = [SourceFile(f"d/{i:05d}.py", f"/x/{i:05d}.py", "text", rng.randint(100, 40_000)) for i in range(2000)]
    data = cfg("unused", piece_mb=0.5)

    def runs(fs):
        return {tuple(s.file.name for s in p.segments) for p in plan_pieces(fs, data)}

    before = runs(files)
    assert 20 < len(before) < 200
    for k in range(20):
        at = rng.randrange(len(files))
        new = SourceFile(f"d/{at:05d}-new{k}.py", "/x/n", "text", rng.randint(100, 40_000))
        grown = sorted([*files, new], key=lambda f: f.name)
        after = runs(grown)
        assert len(before - after) <= 2 and len(after - before) <= 3  # its own piece, split in two at most


def test_a_grown_or_changed_corpus_tokenizes_only_what_is_new(tmp_path):
    """Content addressing: a re-run reads everything once and tokenizes nothing; a new file or a changed one is
    the only text tokenized (its piece's other files are copied from the earlier piece); the result is the
    dataset a fresh store would get, byte for byte."""
    src = tmp_path / "src"
    make_files(src, 120)
    store = StoreConfig(root=str(tmp_path / "store"))
    data = cfg(src, piece_mb=0.02)
    first = shard_dataset(data, store)
    assert first.work.pieces > 5 and first.work.tokenized_bytes == sum(p.stat().st_size for p in src.iterdir())
    again = shard_dataset(data, store)
    assert again.cache_hit and again.work.tokenized_bytes == 0 and again.work.reused == again.work.pieces

    (src / "f0050a.txt").write_text("a new file between two others\n" * 20)
    (src / "f0090.txt").write_text("a file changed in place\n" * 10)
    grown = shard_dataset(data, store)
    new_bytes = (src / "f0050a.txt").stat().st_size + (src / "f0090.txt").stat().st_size
    assert not grown.cache_hit and grown.work.tokenized_bytes == new_bytes
    assert grown.work.reused >= grown.work.pieces - 3 and grown.work.copied_tokens > 0
    fresh = shard_dataset(data, StoreConfig(root=str(tmp_path / "fresh")))
    assert fresh.manifest == grown.manifest and stored_files(fresh) == stored_files(grown)


def test_new_files_among_unchanged_ones_interleave_their_tokens_with_the_copied_ones(tmp_path):
    """A piece of many files, most unchanged: the copies of runs of unchanged files (read as one range, across
    the earlier piece's shard boundaries) and the tokens of the new files between them, batched together, land
    in segment order, with the tokens of removed files left out: the bytes a fresh store gets."""
    src = tmp_path / "src"
    make_files(src, 200, lo=400, hi=3000)
    store = StoreConfig(root=str(tmp_path / "store"))
    data = cfg(src, piece_mb=0.1)
    first = shard_dataset(data, store)
    assert first.work.pieces >= 2
    for at in (3, 4, 60, 61, 62, 150, 199):
        (src / f"f{at:04d}b.txt").write_text(f"new file {at} → " * (at % 7 + 1), encoding="utf-8")
    (src / "f0100.txt").write_text("changed in place\n" * 5, encoding="utf-8")
    for gone in (30, 120, 121):  # the units around them follow each other now, their earlier spans do not
        (src / f"f{gone:04d}.txt").unlink()
    grown = shard_dataset(data, store)
    assert grown.work.copied_tokens > 0 and grown.work.reused < grown.work.pieces
    fresh = shard_dataset(data, StoreConfig(root=str(tmp_path / "fresh")))
    assert fresh.manifest == grown.manifest and stored_files(fresh) == stored_files(grown)


def test_the_find_pass_hashes_each_unchanged_file_once(tmp_path, monkeypatch):
    """The orchestrator's find pass hashes the files earlier pieces hold; the piece's task takes those hashes
    and reads again only what it tokenizes."""
    from trainpipe.trainer.data import piece as pieces
    from trainpipe.trainer.data.shard import prepare_shards

    src = tmp_path / "src"
    make_files(src, 40)
    store = StoreConfig(root=str(tmp_path / "store"))
    data = cfg(src, piece_mb=0.5)
    shard_dataset(data, store)
    (src / "f0010b.txt").write_text("a new file\n" * 30, encoding="utf-8")
    plan = prepare_shards(data, store)
    looked = [pieces.find_piece(plan.job, p) for p in plan.pieces]
    todo = [(p, x) for p, x in zip(plan.pieces, looked, strict=True) if x.found is None]
    assert len(todo) == 1 and len(todo[0][1].hashed) == len(todo[0][0].segments) - 1

    hashed = []
    real = SegmentRead.hash_only
    monkeypatch.setattr(SegmentRead, "hash_only", lambda self: hashed.append(self.seg.name) or real(self))
    made = pieces.tokenize_piece(plan.job, todo[0][0], hashed=todo[0][1].hashed)
    assert hashed == [] and made.tokenized_bytes == (src / "f0010b.txt").stat().st_size
    again = pieces.tokenize_piece(plan.job, todo[0][0])  # without them: every unchanged file hashed here
    assert len(hashed) == len(todo[0][1].hashed) and again.record == made.record


def test_a_tiny_corpus_still_fills_both_splits(tmp_path):
    """Two documents that both hash to train: the last one is held out, in whichever piece it lies."""
    folder = tmp_path / "two"
    folder.mkdir()
    names = [n for n in (f"n{i}.txt" for i in range(400)) if not _val(n, 0.05)][:2]
    for n in names:
        (folder / n).write_text(f"document {n} " * 40)
    for piece_mb in (16.0, 0.0001):
        info = shard_dataset(cfg(folder, val_fraction=0.05, piece_mb=piece_mb), StoreConfig(root=str(tmp_path / "s")))
        assert (info.manifest["splits"]["train"]["documents"], info.manifest["splits"]["val"]["documents"]) == (1, 1)


def _val(key: str, fraction: float) -> bool:
    from trainpipe.trainer.data.piece import is_val

    return is_val(key, fraction)


def test_too_many_bad_records_across_pieces_fail_the_stage(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"p{i}.jsonl").write_text(json.dumps({"text": f"fine {i}"}) + "\nnot json\n")
    data = cfg(f"{src}/*.jsonl", piece_mb=0.00001, max_bad_records=3)
    with pytest.raises(DataError, match=r"4 unreadable records, more than data.max_bad_records=3; the first: .*p0"):
        shard_dataset(data, StoreConfig(root=str(tmp_path / "s")))
    assert not list((tmp_path / "s").rglob("manifest.json"))
    info = shard_dataset(
        cfg(f"{src}/*.jsonl", piece_mb=0.00001, max_bad_records=4), StoreConfig(root=str(tmp_path / "s"))
    )
    assert info.manifest["source"]["skipped_records"] == 4 and info.manifest["source"]["documents"] == 4


def _first_piece(info) -> Path:
    return Path(files_base(info.uri, info.manifest)) / info.manifest["pieces"][0]["record"]


@pytest.mark.parametrize(
    "forge",
    [
        "shard outside the pool",
        "span past its shards",
        "counts that do not add up",
        "not json",
        "a folder for a record",
    ],
)
def test_a_planted_piece_record_is_never_used(tmp_path, forge):
    """The pieces' folder is the bucket's (docs/security.md): a record that names a file outside the pool, claims
    tokens its shards do not hold or does not parse is not reused whole nor copied from; the piece is made again
    and the dataset is what it should be."""
    src = tmp_path / "src"
    make_files(src, 40)
    store = StoreConfig(root=str(tmp_path / "store"))
    data = cfg(src, piece_mb=0.02)
    info = shard_dataset(data, store)
    record_path = _first_piece(info)
    record = json.loads(record_path.read_text())
    if forge == "shard outside the pool":
        record["train"]["shards"][0]["file"] = "../../../etc/passwd"
    elif forge == "span past its shards":
        record["units"][0]["train"]["tokens"] += 10**6
    elif forge == "counts that do not add up":
        record["train"]["tokens"] += 1
    if forge == "not json":
        record_path.write_text("{" * 100_000)
    elif forge == "a folder for a record":
        record_path.unlink()
        record_path.mkdir()
    else:
        record_path.write_text(json.dumps(record))
    pool = str(tmp_path / "store" / "datasets")
    assert read_piece(LocalFileSystem(), pool, f"pieces/{record_path.parent.name}") is None
    (src / "f0001.txt").write_text("changed, so its piece copies from the forged one if it were trusted\n")
    again = shard_dataset(data, store)
    fresh = shard_dataset(data, StoreConfig(root=str(tmp_path / "fresh")))
    assert again.manifest == fresh.manifest and stored_files(again) == stored_files(fresh)
    assert isinstance(PieceRecord.model_validate_json(_first_piece(again).read_text()), PieceRecord)


def test_a_planted_source_pointer_only_costs_reuse(tmp_path):
    src = tmp_path / "src"
    make_files(src, 20)
    store = StoreConfig(root=str(tmp_path / "store"))
    first = shard_dataset(cfg(src), store)
    for pointer in (tmp_path / "store/datasets/sources").iterdir():
        pointer.write_text(json.dumps({"dataset_id": "../../../../etc"}))
    again = shard_dataset(cfg(src), store)
    assert again.cache_hit and again.manifest == first.manifest


def test_a_dataset_needs_only_its_manifest_and_the_pieces_it_names(tmp_path):
    """The pieces are shared by every dataset of the store: removing another dataset's manifest leaves this one
    whole; a piece folder removed is made again on the next run."""
    src = tmp_path / "src"
    make_files(src, 30)
    store = StoreConfig(root=str(tmp_path / "store"))
    a = shard_dataset(cfg(src, piece_mb=0.02), store)
    b = shard_dataset(cfg(src, piece_mb=0.02, shard_tokens=2048), store)
    (Path(b.uri) / "manifest.json").unlink()
    assert len(TokenStream(a.uri, "train")) == a.manifest["splits"]["train"]["tokens"]
    shutil.rmtree(_first_piece(a).parent)
    with pytest.raises(DataError, match="missing; re-run `trainpipe shard`"):
        TokenStream(a.uri, "train")
    again = shard_dataset(cfg(src, piece_mb=0.02), store)
    assert again.manifest == a.manifest and again.work.reused == again.work.pieces - 1
    TokenStream(a.uri, "train")
