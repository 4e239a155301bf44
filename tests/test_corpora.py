"""Corpus formats and tokenizers of the shard stage: JSONL, Parquet, ``save_to_disk`` folders, local and on
S3; byte, trained bpe and tokenizer.json tokenizers; streaming. Pure logic plus moto_server, no ranks."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data import sources
from trainpipe.trainer.data.format import files_base
from trainpipe.trainer.data.shard import read_documents, shard_dataset
from trainpipe.trainer.data.tokens import TokenStream
from trainpipe.trainer.errors import DataError, StoreError

WORDS = ["def", "return", "self", "value", "δέλτα", "→", "import", "class", "(", ")", ":", "\n", "    ", "x", "42"]


def texts(n: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(WORDS) + " " for _ in range(rng.randint(20, 200))) for _ in range(n)]


def write_jsonl(path: Path, rows: list[str], field: str = "text") -> None:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(rows)))


def write_parquet(path: Path, rows: list[str | None], field: str = "text") -> None:
    pq.write_table(pa.table({field: rows, "id": list(range(len(rows)))}), path, row_group_size=7)


def cfg(source, **kw) -> DataConfig:
    kw.setdefault("shard_tokens", 1024)
    kw.setdefault("val_fraction", 0.2)
    return DataConfig(source=str(source), **kw)


def tokens(info) -> dict[str, np.ndarray]:
    out = {}
    for split in ("train", "val"):
        stream = TokenStream(info.uri, split)
        out[split] = stream.window(0, len(stream))
    return out


def wordlevel_tokenizer(path: Path, size: int, eot: str = "<|endoftext|>") -> None:
    """A tokenizer.json of ``size`` tokens whose common words sit above id 65,535 (a uint32 vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [*dict.fromkeys(w.strip() for w in WORDS if w.strip()), "[UNK]", eot]
    vocab = {w: i for i, w in enumerate([f"filler{i}" for i in range(size - len(words))] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.write_text(tok.to_str())


def pool(info) -> Path:
    """The folder a dataset's file names are relative to (the store's datasets/)."""
    return Path(files_base(info.uri, info.manifest))


def test_bpe_sharding_is_deterministic_and_stores_its_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(texts()):
        (src / f"doc{i:03d}.py").write_text(text)
    data = cfg(src, tokenizer="bpe", vocab_size=300)
    a = shard_dataset(data, StoreConfig(root=str(tmp_path / "a")), vocab_size=300)
    b = shard_dataset(data, StoreConfig(root=str(tmp_path / "b")))
    assert a.dataset_id == b.dataset_id and not b.cache_hit and a.manifest == b.manifest
    for split in ("train", "val"):
        for shard in a.manifest["splits"][split]["shards"]:
            assert (pool(a) / shard["file"]).read_bytes() == (pool(b) / shard["file"]).read_bytes()
    stored = a.manifest["tokenizer"]["file"]
    assert (pool(a) / stored).read_bytes() == (pool(b) / stored).read_bytes() and stored.startswith("tokenizers/")
    m = a.manifest
    assert m["dtype"] == "uint16" and m["tokenizer"]["name"] == "bpe" and m["tokenizer"]["eot"] == 0
    assert 256 < m["tokenizer"]["vocab_size"] <= 300
    # The stored tokenizer gives the documents back; each ends with the end-of-text token.
    tok = Tokenizer.from_file(str(pool(a) / m["tokenizer"]["file"]))
    ids = np.concatenate(list(tokens(a).values()))
    assert ids.max() < m["tokenizer"]["vocab_size"] and (ids == 0).sum() == 60
    docs = {tok.decode(list(doc)) for doc in np.split(ids, np.flatnonzero(ids == 0) + 1)[:-1]}
    assert docs == {t for t in texts()}
    # Other vocabulary, other dataset; a model smaller than the vocabulary is refused.
    assert shard_dataset(
        cfg(src, tokenizer="bpe", vocab_size=280), StoreConfig(root=str(tmp_path / "a"))
    ).dataset_id != (a.dataset_id)
    with pytest.raises(DataError, match=r"model.vocab_size 256 is below .* \(bpe, \d+ tokens\): set model.vocab_size"):
        shard_dataset(data, StoreConfig(root=str(tmp_path / "a")), vocab_size=256)


def test_jsonl_parquet_and_saved_datasets_give_the_same_tokens(tmp_path):
    import datasets

    rows = texts()
    write_jsonl(tmp_path / "c.jsonl", rows)
    write_parquet(tmp_path / "c.parquet", rows)
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "saved"), max_shard_size="4KB")
    datasets.DatasetDict(
        {"a": datasets.Dataset.from_dict({"text": rows[:25]}), "b": datasets.Dataset.from_dict({"text": rows[25:]})}
    ).save_to_disk(str(tmp_path / "dict"))
    store = StoreConfig(root=str(tmp_path / "store"))
    for tokenizer in ("byte", "bpe"):
        got = [
            tokens(shard_dataset(cfg(source, tokenizer=tokenizer, vocab_size=300), store))
            for source in (tmp_path / "c.jsonl", tmp_path / "c.parquet", tmp_path / "saved", tmp_path / "dict")
        ]
        for other in got[1:]:
            for split in ("train", "val"):
                np.testing.assert_array_equal(other[split], got[0][split])
    assert len(list((tmp_path / "saved").glob("*.arrow"))) > 1  # several Arrow files, read in state.json's order


def test_a_tokenizer_json_with_a_large_vocabulary_writes_uint32_tokens(tmp_path):
    path = tmp_path / "tokenizer.json"
    wordlevel_tokenizer(path, 70_000)
    write_jsonl(tmp_path / "c.jsonl", texts())
    info = shard_dataset(cfg(tmp_path / "c.jsonl", tokenizer=str(path)), StoreConfig(root=str(tmp_path / "store")))
    m = info.manifest
    assert m["dtype"] == "uint32" and m["tokenizer"]["name"] == "file" and m["tokenizer"]["vocab_size"] == 70_000
    ids = np.concatenate(list(tokens(info).values()))
    assert ids.max() >= 1 << 16 and (ids == m["tokenizer"]["eot"]).sum() == 60
    shard = pool(info) / m["splits"]["train"]["shards"][0]["file"]
    assert shard.stat().st_size == 4 * m["splits"]["train"]["shards"][0]["tokens"]
    # The file is part of the dataset's identity: another tokenizer.json, another dataset.
    wordlevel_tokenizer(path, 70_001)
    assert shard_dataset(
        cfg(tmp_path / "c.jsonl", tokenizer=str(path)), StoreConfig(root=str(tmp_path / "store"))
    ).dataset_id != (info.dataset_id)


def test_pieces_are_cut_the_same_way_streamed_or_whole(monkeypatch):
    """A document longer than PIECE_CHARS is tokenized in pieces cut after a line end; streaming it in blocks
    that split multi-byte characters gives the same pieces as cutting the whole text (so a text file and a
    record of the same text tokenize alike)."""
    monkeypatch.setattr(sources, "PIECE_CHARS", 50)
    rng = random.Random(1)
    for _ in range(200):
        text = "".join(rng.choice(["ab", "δ", "→", "\n", "x" * 60, " "]) for _ in range(rng.randint(0, 80)))
        monkeypatch.setattr(sources, "_READ_BYTES", rng.randint(1, 97))
        streamed = list(sources._text_pieces(io.BytesIO(text.encode()), "doc"))
        assert [p.text for p in streamed] == list(sources.cut_pieces(text))
        assert "".join(p.text for p in streamed) == text
        assert all(len(p.text) <= 50 for p in streamed) and [p.last for p in streamed][-1:] == ([True] if text else [])


def test_bad_records_are_skipped_and_named_up_to_the_threshold(tmp_path):
    rows = texts(20)
    write_parquet(tmp_path / "c.parquet", [*rows[:5], None, *rows[5:]])
    warned = []
    info = shard_dataset(cfg(tmp_path / "c.parquet"), StoreConfig(root=str(tmp_path / "store")), warn=warned.append)
    assert info.manifest["source"]["documents"] == 20 and info.manifest["source"]["skipped_records"] == 1
    assert warned == [f"skipped {tmp_path}/c.parquet row 5: 'text' is null"]
    (tmp_path / "c.jsonl").write_text(
        "\n".join([json.dumps({"text": rows[0]}), "{oops", "[1]", json.dumps({"text": rows[1]})])
    )
    with pytest.raises(
        DataError,
        match=r"2 unreadable records, more than data.max_bad_records=1; the first: .*c\.jsonl line 2: not valid JSON",
    ):
        shard_dataset(cfg(tmp_path / "c.jsonl", max_bad_records=1), StoreConfig(root=str(tmp_path / "store")))
    assert [n for n, _ in read_documents(cfg(tmp_path / "c.jsonl"))] == ["c.jsonl#1", "c.jsonl#4"]


@pytest.mark.parametrize(
    ("make", "field", "message"),
    [
        ("parquet", "body", r"c\.parquet: no column 'body' \(its columns: text, id\); set data.text_field"),
        ("parquet", "id", r"c\.parquet: column 'id' holds int64, not text"),
        ("jsonl", "body", r"c\.jsonl line 1: no field 'body' \(its fields: id, text\); set data.text_field"),
        ("saved", "body", r"data-00000-of-00001\.arrow: no column 'body' \(its columns: text\)"),
        ("not-parquet", "text", r"cannot read .*c\.parquet \(.*\); is it a Parquet file\?"),
        ("escaping-state", "text", r"state\.json names a data file outside its folder"),
        ("bad-tokenizer", "text", r"data.tokenizer .*tok\.json: not a tokenizer.json the tokenizers library loads"),
        ("missing-tokenizer", "text", r"data.tokenizer '.*nowhere\.json': no such file"),
        ("no-eot", "text", r"tokenizer .* has no token '<\|endoftext\|>'; set data.eot_token"),
    ],
)
def test_bad_input_is_one_line_before_anything_is_written(tmp_path, make, field, message):
    import datasets

    rows, tokenizer = texts(10), "byte"
    source = tmp_path / (
        "c.jsonl" if make == "jsonl" else "saved" if make in ("saved", "escaping-state") else "c.parquet"
    )
    if make == "jsonl":
        write_jsonl(source, rows)
    elif make in ("saved", "escaping-state"):
        datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(source))
        if make == "escaping-state":
            state = json.loads((source / "state.json").read_text())
            state["_data_files"][0]["filename"] = "../../etc/passwd"
            (source / "state.json").write_text(json.dumps(state))
    elif make == "not-parquet":
        source.write_text("a text file with the wrong name")
    else:
        write_parquet(source, rows)
    if make == "bad-tokenizer":
        tokenizer = str(tmp_path / "tok.json")
        (tmp_path / "tok.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    elif make == "missing-tokenizer":
        tokenizer = str(tmp_path / "nowhere.json")
    elif make == "no-eot":
        tokenizer = str(tmp_path / "tok.json")
        wordlevel_tokenizer(tmp_path / "tok.json", 400, eot="</s>")
    data, store = cfg(source, text_field=field, tokenizer=tokenizer), StoreConfig(root=str(tmp_path / "store"))
    with pytest.raises(DataError, match=message) as exc:
        if make.endswith("tokenizer") or make == "no-eot":
            shard_dataset(data, store)
        else:
            sources.check_source(data, store)  # what `trainpipe run` checks before Prefect starts
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "store").exists()


def test_every_format_streams_from_s3(tmp_path, s3_bucket):
    import datasets
    import s3fs

    bucket, options = s3_bucket
    rows = texts(30)
    fs = s3fs.S3FileSystem(**options)
    write_jsonl(tmp_path / "c.jsonl", rows)
    write_parquet(tmp_path / "c.parquet", rows)
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "saved"))
    fs.put(str(tmp_path / "c.jsonl"), f"{bucket}/corpus/c.jsonl")
    fs.put(str(tmp_path / "c.parquet"), f"{bucket}/corpus/c.parquet")
    fs.put(str(tmp_path / "saved"), f"{bucket}/corpus/saved", recursive=True)
    wordlevel_tokenizer(tmp_path / "tok.json", 500)
    fs.put(str(tmp_path / "tok.json"), f"{bucket}/tok.json")
    store = StoreConfig(root=f"s3://{bucket}/store", storage_options=options)
    local = tokens(
        shard_dataset(
            cfg(tmp_path / "c.jsonl", tokenizer=str(tmp_path / "tok.json")), StoreConfig(root=str(tmp_path / "s"))
        )
    )
    for source in ("c.jsonl", "c.parquet", "saved"):
        info = shard_dataset(cfg(f"s3://{bucket}/corpus/{source}", tokenizer=f"s3://{bucket}/tok.json"), store)
        assert info.uri.startswith(f"s3://{bucket}/store/datasets/")
        stream = TokenStream(info.uri, "val", options)
        np.testing.assert_array_equal(stream.window(0, len(stream)), local["val"])


@pytest.mark.timeout(60)
def test_a_planted_manifest_cannot_make_sharding_read_outside_the_dataset(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(texts(10)):
        (src / f"d{i}.txt").write_text(text)
    store = StoreConfig(root=str(tmp_path / "store"))
    info = shard_dataset(cfg(src), store)
    manifest = json.loads((Path(info.uri) / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["file"] = "../" * 12 + "dev/zero"  # would never finish hashing
    (Path(info.uri) / "manifest.json").write_text(json.dumps(manifest))
    again = shard_dataset(cfg(src), store)
    shards = [[(sh["tokens"], sh["sha256"]) for sh in d.manifest["splits"]["train"]["shards"]] for d in (info, again)]
    assert not again.cache_hit and shards[0] == shards[1]


def test_records_that_cannot_be_text_are_skipped_not_fatal(tmp_path):
    rows = texts(5)
    lines = [json.dumps({"text": r}) for r in rows]
    lines[1:1] = ['{"text": "lone \\ud800 surrogate"}', "[" * 100_000 + "]" * 100_000]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    warned = []
    docs = list(read_documents(cfg(tmp_path / "c.jsonl"), warn=warned.append))
    assert [text for _, text in docs] == rows
    assert len(warned) == 2 and "line 2: field 'text' is not valid Unicode" in warned[0]
    assert "line 3: not valid JSON (RecursionError)" in warned[1]


def test_a_cut_at_max_bytes_inside_a_documents_first_character_leaves_it_out(tmp_path):
    (tmp_path / "a.txt").write_text("123456789")
    (tmp_path / "b.txt").write_text("éééé")
    assert list(read_documents(cfg(f"{tmp_path}/*.txt", max_bytes=10))) == [("a.txt", "123456789")]
    assert list(read_documents(cfg(f"{tmp_path}/*.txt", max_bytes=11))) == [("a.txt", "123456789"), ("b.txt", "é")]


def test_a_sparse_tokenizer_vocabulary_is_sized_by_its_highest_id(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "def": 70_000, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tok.json"))
    write_jsonl(tmp_path / "c.jsonl", ["def def x", "def", "x def"])
    info = shard_dataset(
        cfg(tmp_path / "c.jsonl", tokenizer=str(tmp_path / "tok.json")), StoreConfig(root=str(tmp_path / "s"))
    )
    assert info.manifest["tokenizer"]["vocab_size"] == 70_001 and info.manifest["dtype"] == "uint32"
    ids = np.concatenate(list(tokens(info).values()))
    assert sorted(set(ids.tolist())) == [0, 1, 70_000]
    assert (ids == 0).sum() == 3


def test_the_end_of_text_tokens_text_inside_a_document_is_not_the_token(tmp_path):
    rows = [*texts(20), "a document quoting <|endoftext|> in its text"]
    write_jsonl(tmp_path / "c.jsonl", rows)
    info = shard_dataset(cfg(tmp_path / "c.jsonl", tokenizer="bpe", vocab_size=300), StoreConfig(root=str(tmp_path)))
    assert (np.concatenate(list(tokens(info).values())) == 0).sum() == len(rows)


def test_hostile_or_broken_saved_datasets_are_one_line(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": texts(5)}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "saved" / "data-00000-of-00001.arrow").unlink()
    store = StoreConfig(root=str(tmp_path / "store"))
    with pytest.raises(DataError, match=r"state\.json names data-00000-of-00001\.arrow, which is missing"):
        shard_dataset(cfg(tmp_path / "saved"), store)
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text('{"splits": 5}')
    with pytest.raises(DataError, match=r"dataset_dict\.json is not a datasets file"):
        shard_dataset(cfg(tmp_path / "dict"), store)
    pq.write_table(pa.table([pa.array(["a"]), pa.array(["b"])], names=["text", "text"]), tmp_path / "dup.parquet")
    with pytest.raises(DataError, match=r"cannot read .*dup\.parquet") as exc:
        shard_dataset(cfg(tmp_path / "dup.parquet"), store)
    assert "\n" not in str(exc.value)


def test_an_arrow_stream_with_a_dictionary_encoded_text_column_is_text(tmp_path):
    table = pa.table({"text": pa.array(["alpha beta", "gamma", "alpha beta"]).dictionary_encode()})
    with pa.OSFile(str(tmp_path / "x.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    assert [t for _, t in read_documents(cfg(tmp_path / "x.arrow"))] == ["alpha beta", "gamma", "alpha beta"]


def test_a_store_outage_during_the_cache_check_is_a_retryable_error_not_a_rebuild(
    tmp_path, s3_endpoint, s3_bucket, monkeypatch
):
    """Through a proxy in front of moto_server: while the store answers 503 or resets connections, the shard
    stage fails as a StoreError (the task retries it) and writes nothing; once it is back the dataset is
    reused. Before, any error read as "no dataset" and rebuilt it."""
    import s3fs

    from tests.fault_proxy import FaultProxy
    from trainpipe.trainer import store_retry

    bucket, _ = s3_bucket
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retries: one
    monkeypatch.setattr(store_retry, "_policy", store_retry.RetryPolicy(budget_s=1.0))
    write_jsonl(tmp_path / "c.jsonl", texts(20))
    with FaultProxy(int(s3_endpoint.rsplit(":", 1)[1])) as proxy:
        options = {
            "endpoint_url": proxy.url,
            "key": "testing",
            "secret": "testing",
            "skip_instance_cache": True,
        }
        store = StoreConfig(root=f"s3://{bucket}/store", storage_options=options)
        first = shard_dataset(cfg(tmp_path / "c.jsonl"), store)
        for mode in ("503", "reset"):
            proxy.mode = mode
            with pytest.raises(StoreError, match=rf"store s3://{bucket}/store is not reachable"):
                shard_dataset(cfg(tmp_path / "c.jsonl"), store)
        proxy.mode = "pass"
        again = shard_dataset(cfg(tmp_path / "c.jsonl"), store)
    assert again.cache_hit and again.manifest == first.manifest
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key="testing", secret="testing", skip_instance_cache=True)
    assert len(fs.glob(f"{bucket}/store/datasets/pieces/*/piece.json")) == 1  # nothing was made twice


def test_a_large_parquet_file_is_cut_into_runs_of_row_groups_with_the_tokens_of_one_read(tmp_path):
    """A Parquet file larger than a piece becomes several pieces (runs of its row groups, cut from its footer),
    each a task of its own: the tokens are those of the file read whole, rows keep their numbers in what is said
    about them, and a second run finds every piece (a run's hash covers the footer and its row groups' bytes)."""
    rows: list[str | None] = [t * 20 for t in texts(120, seed=3)]
    rows[17] = None  # in row group 2 (7 rows a group)
    write_parquet(tmp_path / "c.parquet", rows)
    write_jsonl(tmp_path / "c.jsonl", [r for r in rows if r is not None])
    store = StoreConfig(root=str(tmp_path / "store"))
    warned: list[str] = []
    cut = shard_dataset(cfg(tmp_path / "c.parquet", piece_mb=0.01), store, warn=warned.append)
    whole = shard_dataset(cfg(tmp_path / "c.parquet", piece_mb=64), StoreConfig(root=str(tmp_path / "whole")))
    lines = shard_dataset(cfg(tmp_path / "c.jsonl", piece_mb=64), StoreConfig(root=str(tmp_path / "jsonl")))
    assert cut.work.pieces > 3 and whole.work.pieces == 1
    for split in ("train", "val"):
        np.testing.assert_array_equal(tokens(cut)[split], tokens(whole)[split])
        np.testing.assert_array_equal(tokens(cut)[split], tokens(lines)[split])
    assert len(warned) == 1 and warned[0].endswith("row 17: 'text' is null") and "c.parquet" in warned[0]
    again = shard_dataset(cfg(tmp_path / "c.parquet", piece_mb=0.01), store)
    assert again.cache_hit and again.work.reused == again.work.pieces and again.work.tokenized_bytes == 0


def test_a_parquet_file_whose_footer_cannot_be_read_stays_one_piece_and_is_one_line(tmp_path):
    rows = [t * 20 for t in texts(60, seed=4)]
    write_parquet(tmp_path / "c.parquet", rows)
    body = (tmp_path / "c.parquet").read_bytes()
    (tmp_path / "c.parquet").write_bytes(body[:-8] + (1 << 30).to_bytes(4, "little") + b"PAR1")  # a 1 GB footer
    with pytest.raises(DataError, match=r"cannot read .*c\.parquet \(.*\); is it a Parquet file\?"):
        shard_dataset(cfg(tmp_path / "c.parquet", piece_mb=0.01), StoreConfig(root=str(tmp_path / "store")))
