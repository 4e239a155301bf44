"""The shard stage (trainer/data/shard.py) and reading shards (trainer/data/tokens.py): pure logic, no processes."""

from __future__ import annotations

import hashlib
import json
import random
import re
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data.format import FORMAT, files_base, load_manifest
from trainpipe.trainer.data.shard import read_documents, shard_dataset
from trainpipe.trainer.data.sources import STDLIB_EXCLUDE
from trainpipe.trainer.data.tokens import TokenStream
from trainpipe.trainer.errors import DataError, StoreError


def make_corpus(folder: Path, n_docs: int = 24, seed: int = 0) -> dict[str, bytes]:
    """Text files of 300..3000 bytes (some non-ASCII), enough for several 1024-token shards."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "δέλτα", "epsilon", "zeta", "def", "return", "→", "\n"]
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for i in range(n_docs):
        text = ""
        target = rng.randint(300, 3000)
        while len(text.encode()) < target:
            text += rng.choice(words) + " "
        path = folder / f"doc{i:03d}.txt"
        path.write_text(text, encoding="utf-8")
        files[path.name] = text.encode()
    return files


def data_cfg(source, **kw) -> DataConfig:
    kw.setdefault("shard_tokens", 1024)
    kw.setdefault("val_fraction", 0.2)
    return DataConfig(source=str(source), **kw)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


def shard_path(info, entry: dict) -> Path:
    """Where a shard the manifest names lies: its file names are relative to the store's datasets/ folder."""
    return Path(files_base(info.uri, info.manifest)) / entry["file"]


def split_bytes(info, split: str) -> bytes:
    folder = Path(files_base(info.uri, info.manifest))
    return b"".join((folder / s["file"]).read_bytes() for s in info.manifest["splits"][split]["shards"])


@pytest.fixture
def corpus(tmp_path):
    return tmp_path / "corpus", make_corpus(tmp_path / "corpus")


def test_same_inputs_same_id_and_bytes(tmp_path, corpus):
    folder, _ = corpus
    data = data_cfg(f"{folder}/*.txt")
    a = shard_dataset(data, StoreConfig(root=str(tmp_path / "store-a")))
    b = shard_dataset(data, StoreConfig(root=str(tmp_path / "store-b")))
    assert a.dataset_id == b.dataset_id and len(a.dataset_id) == 16
    assert not a.cache_hit and not b.cache_hit
    assert a.uri == str(tmp_path / "store-a" / "datasets" / a.dataset_id)
    assert a.manifest == b.manifest  # nothing random in it: the same bytes in any store, at any parallelism
    for split in ("train", "val"):
        assert split_bytes(a, split) == split_bytes(b, split)


def test_settings_and_content_change_the_id(tmp_path, corpus):
    folder, _ = corpus
    store = StoreConfig(root=str(tmp_path / "store"))
    base = shard_dataset(data_cfg(f"{folder}/*.txt"), store).dataset_id
    assert shard_dataset(data_cfg(f"{folder}/*.txt", shard_tokens=2048), store).dataset_id != base
    assert shard_dataset(data_cfg(f"{folder}/*.txt", val_fraction=0.1), store).dataset_id != base
    (folder / "doc000.txt").write_text("changed")
    assert shard_dataset(data_cfg(f"{folder}/*.txt"), store).dataset_id != base


def test_second_call_is_a_cache_hit_and_writes_nothing(tmp_path, corpus):
    folder, _ = corpus
    data, store = data_cfg(f"{folder}/*.txt"), StoreConfig(root=str(tmp_path / "store"))
    first = shard_dataset(data, store)
    before = snapshot(tmp_path / "store")
    second = shard_dataset(data, store)
    assert second.cache_hit and second.dataset_id == first.dataset_id
    assert second.manifest == first.manifest
    assert snapshot(tmp_path / "store") == before


def test_manifest_checksums_and_token_counts(tmp_path, corpus):
    folder, files = corpus
    info = shard_dataset(data_cfg(f"{folder}/*.txt"), StoreConfig(root=str(tmp_path / "store")))
    m = info.manifest
    assert m == load_manifest(info.uri)
    assert m["format"] == FORMAT and m["dataset_id"] == info.dataset_id and m["dtype"] == "uint16"
    assert m["tokenizer"] == {"name": "byte", "vocab_size": 256, "eot": 0}
    assert m["settings"] == {"shard_tokens": 1024, "val_fraction": 0.2, "max_bytes": None, "piece_mb": 16.0}
    assert m["source"]["documents"] == len(files)
    assert m["source"]["bytes"] == sum(len(b) for b in files.values())
    for split in ("train", "val"):
        s = m["splits"][split]
        assert s["documents"] > 0 and s["shards"]
        assert s["tokens"] == sum(sh["tokens"] for sh in s["shards"])
        assert all(sh["tokens"] == 1024 for sh in s["shards"][:-1]) and 0 < s["shards"][-1]["tokens"] <= 1024
        for i, sh in enumerate(s["shards"]):  # one piece here: its shards are the split's
            assert re.fullmatch(rf"pieces/[0-9a-f]{{32}}/{split}-{i:06d}\.bin", sh["file"])
            blob = shard_path(info, sh).read_bytes()
            assert hashlib.sha256(blob).hexdigest() == sh["sha256"] and len(blob) == 2 * sh["tokens"]
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert train["documents"] + val["documents"] == len(files)
    assert train["tokens"] + val["tokens"] == m["source"]["bytes"] + len(files)


def test_streams_give_back_the_documents(tmp_path, corpus):
    folder, files = corpus
    info = shard_dataset(data_cfg(f"{folder}/*.txt"), StoreConfig(root=str(tmp_path / "store")))
    docs = []
    for split in ("train", "val"):
        stream = TokenStream(info.uri, split)
        tokens = stream.window(0, len(stream))
        assert tokens.dtype == np.int64 and tokens.max() < 256 and tokens[-1] == 0
        assert bytes(tokens.astype(np.uint8)) == split_bytes(info, split)[::2]  # low bytes of little-endian uint16
        docs += bytes(tokens.astype(np.uint8)).split(b"\0")[:-1]
    assert sorted(docs) == sorted(files.values())


def test_window_crosses_shard_boundaries(tmp_path, corpus):
    folder, _ = corpus
    info = shard_dataset(data_cfg(f"{folder}/*.txt"), StoreConfig(root=str(tmp_path / "store")))
    stream = TokenStream(info.uri, "train")
    full = np.frombuffer(split_bytes(info, "train"), dtype="<u2").astype(np.int64)
    assert len(stream) == len(full) == info.manifest["splits"]["train"]["tokens"] > 3 * 1024
    for start, length in [(1000, 100), (1024, 1), (1023, 2), (500, 2600), (0, 0), (len(full) - 5, 5)]:
        np.testing.assert_array_equal(stream.window(start, length), full[start : start + length])
    for start, length in [(-1, 2), (len(full) - 1, 2), (0, len(full) + 1), (5, -1)]:
        with pytest.raises(IndexError):
            stream.window(start, length)


def test_jsonl_text_field(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    records = [{"body": f"record {i} " * (i + 1), "id": i} for i in range(30)]
    (src / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records[:20]) + "\n\n")
    (src / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records[20:]))
    info = shard_dataset(data_cfg(f"{src}/*.jsonl", text_field="body"), StoreConfig(root=str(tmp_path / "store")))
    m = info.manifest
    assert m["source"]["documents"] == 30  # one document per record
    assert m["source"]["bytes"] == (src / "a.jsonl").stat().st_size + (src / "b.jsonl").stat().st_size
    text = sum(len(r["body"].encode()) for r in records)
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == text + 30

    # A record without the field is skipped and named; more of them than max_bad_records fail the stage.
    (src / "b.jsonl").write_text(json.dumps({"body": "ok"}) + "\n" + json.dumps({"text": "wrong field"}) + "\n")
    warned = []
    m = shard_dataset(
        data_cfg(f"{src}/*.jsonl", text_field="body"), StoreConfig(root=str(tmp_path / "store")), warn=warned.append
    ).manifest
    assert m["source"]["documents"] == 21 and m["source"]["skipped_records"] == 1
    assert m["source"]["first_skipped"] == [f"{src}/b.jsonl line 2: field 'body' is NoneType, not a string"]
    assert warned == [f"skipped {src}/b.jsonl line 2: field 'body' is NoneType, not a string"]
    with pytest.raises(DataError, match=r"1 unreadable records, more than data.max_bad_records=0; .*b\.jsonl line 2"):
        shard_dataset(
            data_cfg(f"{src}/*.jsonl", text_field="body", max_bad_records=0), StoreConfig(root=str(tmp_path / "s2"))
        )
    # A field no record has is one line naming the fields there are.
    with pytest.raises(DataError, match=r"a\.jsonl line 1: no field 'txt' \(its fields: body, id\); set data"):
        shard_dataset(data_cfg(f"{src}/*.jsonl", text_field="txt"), StoreConfig(root=str(tmp_path / "store")))


def test_source_matching_no_files(tmp_path):
    source = str(tmp_path / "nowhere" / "*.txt")
    with pytest.raises(DataError, match="matched no files") as exc:
        shard_dataset(data_cfg(source), StoreConfig(root=str(tmp_path / "store")))
    assert repr(source) in str(exc.value)


def test_empty_or_tiny_sources(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("")
    (src / "b.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        shard_dataset(data_cfg(f"{src}/*.txt"), StoreConfig(root=str(tmp_path / "store")))
    (src / "a.txt").write_text("just one document")
    with pytest.raises(DataError, match="too little data"):
        shard_dataset(data_cfg(f"{src}/*.txt"), StoreConfig(root=str(tmp_path / "store")))


def test_two_documents_fill_both_splits(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("first document")
    (src / "b.txt").write_text("second document")
    m = shard_dataset(data_cfg(src), StoreConfig(root=str(tmp_path / "store"))).manifest  # a folder works too
    assert m["splits"]["train"]["documents"] == 1 and m["splits"]["val"]["documents"] == 1


def test_max_bytes_truncates_the_last_document(tmp_path, corpus):
    folder, files = corpus
    info = shard_dataset(data_cfg(f"{folder}/*.txt", max_bytes=5000), StoreConfig(root=str(tmp_path / "store")))
    m = info.manifest
    assert m["source"]["bytes"] == 5000
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == 5000 + m["source"]["documents"]
    sizes = [len(files[k]) for k in sorted(files)]
    used = next(i for i in range(len(sizes)) if sum(sizes[: i + 1]) >= 5000) + 1
    assert m["source"]["documents"] == used


def test_corrupt_shard_is_detected_and_reshard_verify_repairs_it(tmp_path, corpus):
    folder, _ = corpus
    data, store = data_cfg(f"{folder}/*.txt"), StoreConfig(root=str(tmp_path / "store"))
    info = shard_dataset(data, store)
    shard = shard_path(info, info.manifest["splits"]["train"]["shards"][1])
    blob = bytearray(shard.read_bytes())
    blob[10] ^= 0xFF
    shard.write_bytes(bytes(blob))
    stream = TokenStream(info.uri, "train")
    stream.window(0, 1024)  # shard 0 is fine
    with pytest.raises(DataError, match=r"train-000001\.bin.*re-run `trainpipe shard`"):
        stream.window(1000, 100)
    TokenStream(info.uri, "train", verify=False).window(1000, 100)  # size still right: unverified read passes

    # A piece found again is trusted by its files' sizes (one listing, nothing read); --verify hashes them and
    # makes a damaged piece again, in its own folder: the same dataset, intact.
    assert shard_dataset(data, store).cache_hit
    again = shard_dataset(data, store, verify=True)
    assert again.cache_hit and again.manifest == info.manifest and again.work.reused == 0
    TokenStream(info.uri, "train").window(1000, 100)
    assert shard.read_bytes() != bytes(blob)

    # A file of the wrong size or missing is noticed without --verify: its piece is made again.
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"train-000001\.bin.*not of the size"):
        TokenStream(info.uri, "train")
    latest = shard_dataset(data, store)
    assert latest.cache_hit and latest.work.reused == 0
    TokenStream(info.uri, "train").window(1000, 100)
    shard_path(latest, latest.manifest["splits"]["val"]["shards"][0]).unlink()
    with pytest.raises(DataError, match=r"val-000000\.bin.*missing"):
        TokenStream(latest.uri, "val").window(0, 10)
    assert shard_dataset(data, store).work.reused == 0
    TokenStream(latest.uri, "val").window(0, 10)


def test_a_build_without_its_manifest_is_not_a_dataset(tmp_path, corpus):
    folder, _ = corpus
    data, store = data_cfg(f"{folder}/*.txt"), StoreConfig(root=str(tmp_path / "store"))
    info = shard_dataset(data, store)
    (Path(info.uri) / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"manifest\.json missing"):
        TokenStream(info.uri, "train")
    again = shard_dataset(data, store)
    assert not again.cache_hit and again.manifest == info.manifest and again.work.reused == again.work.pieces
    assert len(TokenStream(info.uri, "train").window(0, 2000)) == 2000


def test_missing_or_invalid_manifest(tmp_path):
    with pytest.raises(DataError, match="run `trainpipe shard`"):
        load_manifest(str(tmp_path / "nothing"))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        TokenStream(str(tmp_path), "train")
    (tmp_path / "manifest.json").write_text('{"format": 99}')
    with pytest.raises(DataError, match="not a trainpipe dataset manifest"):
        load_manifest(str(tmp_path))


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m["splits"]["train"]["shards"][0].update(file="../../../../etc/passwd"),
        lambda m: m["splits"]["train"]["shards"][0].update(file="val-000000.bin"),
        lambda m: m["splits"]["val"]["shards"][0].update(tokens="12"),
        lambda m: m["splits"]["val"]["shards"][0].update(sha256="x"),
        lambda m: m["splits"]["val"].update(tokens=1),
        lambda m: m.update(splits="train val"),
        lambda m: m.update(dtype="float64"),
        lambda m: m.update(dtype=[]),
        lambda m: m.update(tokenizer="x"),
        lambda m: m["tokenizer"].update(file="../../elsewhere.json", sha256="0" * 64),
        lambda m: m["tokenizer"].update(eot=256),
    ],
)
def test_a_hostile_dataset_manifest_names_no_file_outside_its_shards(tmp_path, corpus, change):
    folder, _ = corpus
    info = shard_dataset(data_cfg(f"{folder}/*.txt"), StoreConfig(root=str(tmp_path / "store")))
    manifest = json.loads((Path(info.uri) / "manifest.json").read_text())
    change(manifest)
    (Path(info.uri) / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="re-run `trainpipe shard`"):
        TokenStream(info.uri, "train")


def test_unwritable_store(tmp_path, corpus):
    folder, _ = corpus
    (tmp_path / "a-file").write_text("in the way")
    with pytest.raises(StoreError, match="not writable"):
        shard_dataset(data_cfg(f"{folder}/*.txt"), StoreConfig(root=str(tmp_path / "a-file" / "store")))


def test_fsspec_source_and_store(tmp_path, corpus):
    """URIs go through fsspec (memory:// stands in for s3://); names are relative to the
    glob, so the same corpus gives the same dataset_id wherever it lives."""
    folder, files = corpus
    prefix = f"memory://trainpipe-test-{uuid.uuid4().hex}"
    mem = fsspec.filesystem("memory")
    try:
        for name, blob in files.items():
            mem.pipe_file(f"{prefix}/corpus/{name}", blob)
        local = shard_dataset(data_cfg(f"{folder}/*.txt"), StoreConfig(root=str(tmp_path / "store")))
        remote = shard_dataset(data_cfg(f"{prefix}/corpus/*.txt"), StoreConfig(root=f"{prefix}/store"))
        assert remote.dataset_id == local.dataset_id and not remote.cache_hit
        assert remote.uri == f"{prefix}/store/datasets/{remote.dataset_id}"
        stream = TokenStream(remote.uri, "val")
        np.testing.assert_array_equal(
            stream.window(0, len(stream)), TokenStream(local.uri, "val").window(0, len(stream))
        )
        assert shard_dataset(data_cfg(f"{prefix}/corpus/*.txt"), StoreConfig(root=f"{prefix}/store")).cache_hit
        with pytest.raises(DataError, match="matched no files"):
            shard_dataset(data_cfg(f"{prefix}/missing/*.txt"), StoreConfig(root=f"{prefix}/store"))
    finally:
        mem.rm(prefix.removeprefix("memory://"), recursive=True)


def test_progress_goes_to_stderr(tmp_path, corpus, capsys):
    folder, _ = corpus
    shard_dataset(data_cfg(f"{folder}/*.txt"), StoreConfig(root=str(tmp_path / "store")), progress=True)
    out = capsys.readouterr()
    assert out.out == "" and "shard:" in out.err and "\r" in out.err


def test_stdlib_source(tmp_path):
    data = DataConfig(source="stdlib", max_bytes=200_000, shard_tokens=1 << 16)
    docs = list(read_documents(data))
    names = [name for name, _ in docs]
    assert names == sorted(names) and all(n.endswith(".py") for n in names)
    assert not any(set(n.split("/")[:-1]) & STDLIB_EXCLUDE for n in names)
    assert sum(len(t.encode()) for _, t in docs) == 200_000

    info = shard_dataset(data, StoreConfig(root=str(tmp_path / "store")))
    m = info.manifest
    assert m["source"] == {
        "spec": "stdlib",
        "fingerprint": m["source"]["fingerprint"],
        "files": m["source"]["files"],
        "documents": len(docs),
        "bytes": 200_000,
        "skipped_records": 0,
        "first_skipped": [],
    }
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == 200_000 + len(docs)
    assert m["splits"]["val"]["documents"] >= 1
    assert shard_dataset(data, StoreConfig(root=str(tmp_path / "store"))).cache_hit


def test_a_split_shorter_than_one_sample_is_a_shard_time_error_naming_it(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a long enough document " * 20)
    (src / "b.txt").write_text("short")  # 6 tokens with its end-of-text
    store = StoreConfig(root=str(tmp_path / "store"))
    splits = shard_dataset(data_cfg(src), store, block_size=4).manifest["splits"]  # fine for a short block
    short = next(s for s in ("train", "val") if splits[s]["tokens"] == 6)
    with pytest.raises(DataError, match=rf"the {short} split of dataset \w+ holds 6 tokens, fewer than one sample"):
        shard_dataset(data_cfg(src), store, block_size=128)
