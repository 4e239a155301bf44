"""The find pass's cache of source hashes (trainer/data/source_hashes.py): a grown corpus reads only the files
that changed, a file rewritten behind its old size and mtime is read again, and a broken cache costs a warning."""

from __future__ import annotations

import os
import stat

import pytest

from tests.test_shard_pieces import cfg, make_files, stored_files
from trainpipe.trainer.config import StoreConfig
from trainpipe.trainer.data import piece as pieces
from trainpipe.trainer.data import source_hashes, sources
from trainpipe.trainer.data.shard import assemble_dataset, prepare_shards, segment_hashes, shard_dataset
from trainpipe.trainer.data.sources import SegmentRead, list_source


def shard_with_cache(data, store, cache_file, warn=None):
    """The local engine's order (flows/shard.py): the find pass with the cache's hashes, the pieces left, the
    dataset, the hashes remembered. Returns the dataset and the segments hashed by the find pass."""
    warnings = [] if warn is None else warn
    plan = prepare_shards(data, store)
    with source_hashes.opened(str(cache_file), warnings.append) as cache:
        assert cache is not None
        looked = [pieces.find_piece(plan.job, p, cache.known(enumerate(p.segments))) for p in plan.pieces]
        results = [
            x.found or pieces.tokenize_piece(plan.job, p, hashed=x.hashed)
            for p, x in zip(plan.pieces, looked, strict=True)
        ]
        info = assemble_dataset(plan, results)
        cache.remember(segment_hashes(plan, results))
    return info


@pytest.fixture
def settled_now(monkeypatch):
    """Files count as settled as soon as they are listed (the tests' files are milliseconds old)."""
    monkeypatch.setattr(sources, "SETTLED_NS", 0)


@pytest.fixture
def hashed(monkeypatch):
    """The names of the segments hashed without being tokenized (the find pass's reads)."""
    names: list[str] = []
    real = SegmentRead.hash_only
    monkeypatch.setattr(SegmentRead, "hash_only", lambda self: names.append(self.seg.name) or real(self))
    return names


def test_a_grown_corpus_reads_only_its_new_file(tmp_path, settled_now, hashed):
    src = tmp_path / "src"
    make_files(src, 40)
    data, store, cache = cfg(src, piece_mb=0.01), StoreConfig(root=str(tmp_path / "store")), tmp_path / "h.sqlite"
    first = shard_with_cache(data, store, cache)
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o600  # in TRAINPIPE_HOME (0700), and its own file owner-only
    (src / "f0010b.txt").write_text("a new file\n" * 30, encoding="utf-8")
    hashed.clear()
    grown = shard_with_cache(data, store, cache)
    assert hashed == [] and grown.work.tokenized_bytes == (src / "f0010b.txt").stat().st_size
    assert grown.dataset_id != first.dataset_id
    fresh = shard_dataset(data, StoreConfig(root=str(tmp_path / "fresh")))
    assert fresh.manifest == grown.manifest and stored_files(fresh) == stored_files(grown)
    # Without the cache every file an earlier piece holds is read again: the same dataset.
    hashed.clear()
    again = shard_with_cache(data, StoreConfig(root=str(tmp_path / "store")), tmp_path / "other.sqlite")
    assert len(hashed) == 41 and again.manifest == grown.manifest


def test_a_file_rewritten_behind_its_old_size_and_mtime_is_read_again(tmp_path, settled_now, hashed):
    """ctime, which no program can set back, gives the rewrite away: the dataset holds the new bytes."""
    src = tmp_path / "src"
    make_files(src, 20)
    data, store, cache = cfg(src, piece_mb=0.01), StoreConfig(root=str(tmp_path / "store")), tmp_path / "h.sqlite"
    shard_with_cache(data, store, cache)
    victim = src / "f0005.txt"
    before = victim.stat()
    body = victim.read_bytes()
    victim.write_bytes(body[::-1].replace(b"\n", b" ")[: len(body)])
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (victim.stat().st_size, victim.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    hashed.clear()
    changed = shard_with_cache(data, store, cache)
    assert hashed == ["f0005.txt"] and changed.work.tokenized_bytes == before.st_size
    fresh = shard_dataset(data, StoreConfig(root=str(tmp_path / "fresh")))
    assert fresh.manifest == changed.manifest


def test_a_file_changed_just_before_the_listing_has_no_version(tmp_path):
    """Within SETTLED_NS of the listing a write could share the stat's clock tick: such a file is always read."""
    src = tmp_path / "src"
    make_files(src, 3)
    _, files = list_source(str(src), None)
    assert [f.version for f in files] == ["", "", ""]
    cache = source_hashes.SourceHashes(str(tmp_path / "h.sqlite"), pytest.fail)
    data = cfg(src)
    plan = prepare_shards(data, StoreConfig(root=str(tmp_path / "store")))
    cache.remember((seg, "0" * 64) for p in plan.pieces for seg in p.segments)
    assert cache.db.execute("SELECT count(*) FROM hashes").fetchone() == (0,)
    cache.close()


def test_a_cache_that_cannot_be_used_is_one_warning_and_every_file_is_read(tmp_path, settled_now, hashed):
    src = tmp_path / "src"
    make_files(src, 20)
    data, store = cfg(src, piece_mb=0.01), StoreConfig(root=str(tmp_path / "store"))
    first = shard_dataset(data, store)
    garbage = tmp_path / "h.sqlite"
    garbage.write_bytes(b"not a database, " * 100)
    warnings: list[str] = []
    again = shard_with_cache(data, store, garbage, warnings)
    assert again.dataset_id == first.dataset_id and len(hashed) == 20
    assert len(warnings) == 1 and "h.sqlite not usable" in warnings[0] and "every file is hashed" in warnings[0]
    assert garbage.read_bytes() == b"not a database, " * 100  # left as it was, for whoever wants to look
