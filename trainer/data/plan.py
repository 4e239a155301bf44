"""The shard stage's plan: the source's files cut into pieces, each the work of one shard task (docs/architecture.md
§3, "The shard stage: a map over pieces").

A piece is a run of whole small files, one line-aligned byte range of a large text or JSONL file, or a run of
row groups of a large Parquet file. Where a run of small files ends is decided by each file alone (its name's
hash, weighed by its size), never by the files before it, so a file added to the corpus changes the piece it
joins and no other: the pieces, and with them the shard boundaries, follow from the corpus's content, never from
how many workers there are or which one finished first. Light (no torch, no tokenizer): the orchestrator plans
before any worker starts.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass

from trainpipe.trainer.config import DataConfig
from trainpipe.trainer.data.format import FORMAT
from trainpipe.trainer.data.sources import Segment, SourceFile

MB = 1 << 20
# A run of small files also ends at this many times data.piece_mb, however its names fall: a piece's work stays
# within a small multiple of the mean.
MAX_PIECE_FACTOR = 4


@dataclass(frozen=True)
class PieceSpec:
    """One shard task's work: its segments in corpus order, and what may be reused for them.

    ``reuse`` names the piece records (relative to the store's datasets/ folder) of the newest earlier dataset
    of this source whose files overlap this piece's: their tokens are copied for every segment whose bytes are
    unchanged. ``force`` sends document ``ordinal`` of segment ``segment`` to ``split`` (the rule for corpora so
    small that one split would be empty, decided once every piece is known)."""

    index: int
    segments: tuple[Segment, ...]
    reuse: tuple[str, ...] = ()
    force: tuple[tuple[int, str, int], ...] = ()

    @property
    def bytes(self) -> int:
        return sum(planned_bytes(s) for s in self.segments)

    @property
    def first(self) -> str:
        return self.segments[0].file.name

    @property
    def last(self) -> str:
        return self.segments[-1].file.name


def planned_bytes(seg: Segment) -> int:
    if seg.file.kind in ("parquet", "arrow"):
        return seg.planned or seg.file.size
    return (seg.file.size if seg.stop is None else seg.stop) - seg.start


def _ends_a_run(name: str, size: int, target: int) -> bool:
    """Whether a run of small files ends after this one: with probability size / target, from its name alone."""
    draw = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64
    return draw < size / target


def _group_runs(f: SourceFile, sizes: list[int], target: int) -> list[Segment]:
    """A Parquet file as runs of consecutive row groups of at least ``target`` stored bytes (the last: the rest)."""
    out, lo, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total >= target or i == len(sizes) - 1:
            out.append(Segment(f, lo, i + 1, False, i == len(sizes) - 1, total))
            lo, total = i + 1, 0
    return out


def plan_pieces(
    files: list[SourceFile], data: DataConfig, row_groups: dict[str, list[int]] | None = None
) -> list[PieceSpec]:
    """``files`` (in corpus order) as pieces of about ``data.piece_mb``, read up to ``data.max_bytes``.
    ``row_groups``: the stored size of each row group of the Parquet files larger than a piece, by path
    (``sources.row_group_sizes``); such a file is cut into runs of row groups."""
    target = max(int(data.piece_mb * MB), 1)
    pieces: list[tuple[Segment, ...]] = []
    run: list[Segment] = []
    run_bytes, used, budget = 0, 0, data.max_bytes

    def end_run() -> None:
        nonlocal run, run_bytes
        if run:
            pieces.append(tuple(run))
        run, run_bytes = [], 0

    for f in files:
        if budget is not None and used >= budget:
            break
        whole = f.kind in ("parquet", "arrow")
        cut = None if whole or budget is None or used + f.size <= budget else budget - used
        length = f.size if cut is None else cut
        used += length
        hard = cut is not None and f.kind == "text"  # a text file is cut there; a JSONL file after that line
        runs = _group_runs(f, (row_groups or {})[f.path], target) if f.path in (row_groups or {}) else []
        if f.kind == "parquet" and length > target and len(runs) > 1:
            end_run()
            pieces += [(seg,) for seg in runs]
            continue
        if not whole and length > target:
            end_run()
            for start in range(0, length, target):
                final = start + target >= length
                stop = cut if final else start + target  # the last range runs to the cut, or to the end
                pieces.append((Segment(f, start, stop, hard and final, final),))
            continue
        run.append(Segment(f, 0, cut, hard, True))
        run_bytes += length
        if run_bytes >= MAX_PIECE_FACTOR * target or _ends_a_run(f.name, length, target):
            end_run()
    end_run()
    return [PieceSpec(i, segments) for i, segments in enumerate(pieces)]


@dataclass(frozen=True)
class Previous:
    """The pieces of the newest earlier dataset of the same source and settings, in corpus order."""

    dataset_id: str
    records: tuple[str, ...]
    firsts: tuple[str, ...]
    lasts: tuple[str, ...]


def with_reuse(pieces: list[PieceSpec], previous: Previous | None) -> list[PieceSpec]:
    """Each piece with the earlier pieces whose names overlap its own (names are in corpus order)."""
    if previous is None:
        return pieces
    out = []
    for p in pieces:
        lo = bisect.bisect_left(previous.lasts, p.first)  # the first earlier piece that ends at or after p starts
        hi = bisect.bisect_right(previous.firsts, p.last)  # past the last one that starts at or before p ends
        out.append(PieceSpec(p.index, p.segments, previous.records[lo:hi], p.force))
    return out


def source_key(data: DataConfig) -> str:
    """What identifies "the same source and settings" for reuse: the spec, not the content (which changes)."""
    key = {
        "format": FORMAT,
        "source": data.source,
        "text_field": data.text_field,
        "tokenizer": data.tokenizer,
        "vocab_size": data.vocab_size,
        "eot_token": data.eot_token,
        "val_fraction": data.val_fraction,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def sample_order(pieces: list[PieceSpec]) -> list[PieceSpec]:
    """The pieces in the order a bpe tokenizer's sample takes them: by their first segment's name's hash, so the
    sample is spread over the corpus and the same for the same corpus."""
    return sorted(pieces, key=lambda p: hashlib.sha256(p.segments[0].name.encode()).hexdigest())
