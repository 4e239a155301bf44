"""A checkpoint's model weights out of its DCP files block by block, each file verified as it streams
(docs/architecture.md §11).

DCP's metadata says, for every tensor, its global shape and its chunks (a rank's shard, a tensor-parallel column
block), and for every chunk the file, byte offset and length of its ``torch.save`` record. Each file the model's
chunks lie in is read once, front to back: every byte goes into its sha256, which must be the commit manifest's,
and each model chunk is decoded (``weights_only``) as it passes and handed on. Optimizer state is hashed and
skipped. One chunk is in memory at a time, never the model; any layout the trainer writes (DDP, FSDP2, HSDP,
tensor and pipeline parallel, virtual ranks) is only chunks.

The metadata comes from the store, which is not trusted (docs/security.md): chunks must tile their tensor
exactly (inside it, not overlapping, covering it), lie inside their file, and decode to the dtype and shape
they claim.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trainpipe.trainer import store_retry
from trainpipe.trainer.checkpoint.files import CHUNK, ChecksumMismatch, open_file
from trainpipe.trainer.checkpoint.proof import Sum
from trainpipe.trainer.checkpoint.state_hash import stored_sum
from trainpipe.trainer.errors import CheckpointError
from trainpipe.trainer.export.safetensors_out import DTYPES, TensorSpec
from trainpipe.trainer.store import filesystem

PREFIX = "model."  # the model's part of a checkpoint's state dict (``trainer.loop.trainer``)


@dataclass(frozen=True)
class Block:
    """One stored record: where it lies and, for a tensor's chunk, which part of the tensor it is. ``name`` is
    the model weight's name (no ``model.``) for a chunk of the model, "" for the rest of the state."""

    name: str
    file: str  # relative to the checkpoint's folder
    offset: int
    length: int
    at: tuple[int, ...]
    size: tuple[int, ...]
    fqn: str = ""  # its key in the checkpoint's state dict
    shape: tuple[int, ...] | None = None  # the whole tensor's; None: a value, not a tensor
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ModelLayout:
    """The model's weights (name → dtype and global shape) and the records to read, by the file that holds them:
    the model's chunks, and with ``whole`` every other record of the state too (to hash it)."""

    weights: dict[str, TensorSpec]
    files: dict[str, list[Block]]
    whole: bool = False


def model_layout(uri: str, metadata: Metadata, sizes: dict[str, int], whole: bool = False) -> ModelLayout:
    """The model's weights and the records to read as ``metadata`` states them (``whole``: all of the state's);
    CheckpointError when they do not add up. ``sizes``: each file's size (the manifest's)."""
    weights: dict[str, TensorSpec] = {}
    chunks: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        model = fqn.startswith(PREFIX)
        if not model and not whole:
            continue
        if not isinstance(meta, TensorStorageMetadata):
            if model:
                raise CheckpointError(f"checkpoint {uri}: its weight {fqn} is not a tensor safetensors can hold")
            continue
        shape = tuple(int(n) for n in meta.size)
        if model:
            if meta.properties.dtype not in DTYPES:
                raise CheckpointError(f"checkpoint {uri}: its weight {fqn} is not a tensor safetensors can hold")
            weights[fqn.removeprefix(PREFIX)] = TensorSpec(meta.properties.dtype, shape)
        boxes = {tuple(int(o) for o in c.offsets): tuple(int(n) for n in c.sizes) for c in meta.chunks}
        _require_tiling(uri, fqn, shape, list(boxes.items()))
        chunks[fqn] = boxes
    if not weights:
        raise CheckpointError(f"checkpoint {uri} holds no model weights ({PREFIX}*)")
    files = _records(uri, metadata, sizes, chunks, whole)
    for blocks in files.values():
        blocks.sort(key=lambda b: b.offset)
        for before, after in itertools.pairwise(blocks):
            if before.offset + before.length > after.offset:
                raise ChecksumMismatch(f"its storage index overlaps {before.fqn} and {after.fqn} in {before.file}")
    return ModelLayout(weights, files, whole)


def _records(
    uri: str,
    metadata: Metadata,
    sizes: dict[str, int],
    chunks: dict[str, dict[tuple[int, ...], tuple[int, ...]]],
    whole: bool,
) -> dict[str, list[Block]]:
    """Each record to read, by file: every chunk of ``chunks`` exactly once, and with ``whole`` each value."""
    files: dict[str, list[Block]] = {}
    placed: set[tuple[str, tuple[int, ...]]] = set()
    for index, info in metadata.storage_data.items():
        fqn = index.fqn
        meta = metadata.state_dict_metadata.get(fqn)
        tensor = fqn in chunks
        if meta is None or not (tensor or (whole and not isinstance(meta, TensorStorageMetadata))):
            continue
        if tensor and not isinstance(meta, TensorStorageMetadata):  # a forged index: its chunks say tensor
            raise CheckpointError(f"checkpoint {uri}: {fqn} has tensor chunks but is not stored as a tensor")
        at = tuple(int(o) for o in index.offset) if tensor else ()
        if (tensor and at not in chunks[fqn]) or (fqn, at) in placed:
            raise CheckpointError(f"checkpoint {uri}: its storage index names a chunk of {fqn} it does not have")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"checkpoint {uri}: {fqn} is stored transformed, which trainpipe does not write")
        rel, offset, length = info.relative_path, int(info.offset), int(info.length)
        if rel not in sizes or offset < 0 or length <= 0 or offset + length > sizes[rel]:
            raise ChecksumMismatch(f"its storage index places {fqn} outside the files its manifest lists")
        placed.add((fqn, at))
        name = fqn.removeprefix(PREFIX) if fqn.startswith(PREFIX) else ""
        size = chunks[fqn][at] if tensor else ()
        shape = tuple(int(n) for n in meta.size) if isinstance(meta, TensorStorageMetadata) and tensor else None
        dtype = meta.properties.dtype if isinstance(meta, TensorStorageMetadata) and tensor else None
        files.setdefault(rel, []).append(Block(name, rel, offset, length, at, size, fqn, shape, dtype))
    missing = sorted(f"{n}@{list(at)}" for n, boxes in chunks.items() for at in boxes if (n, at) not in placed)
    if missing:
        raise CheckpointError(f"checkpoint {uri}: no stored data for {', '.join(missing[:3])}")
    return files


def _require_tiling(uri: str, fqn: str, shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]):
    """The chunks lie inside the tensor, do not overlap, and so cover it when their volumes add up to it."""
    for at, size in boxes:
        if len(at) != len(shape) or len(size) != len(shape):
            raise CheckpointError(f"checkpoint {uri}: a chunk of {fqn} has another number of dimensions than it")
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(at, size, shape, strict=True)):
            raise CheckpointError(f"checkpoint {uri}: a chunk of {fqn} lies outside its shape {list(shape)}")
    if sum(math.prod(size) for _, size in boxes) != math.prod(shape):
        raise CheckpointError(f"checkpoint {uri}: the chunks of {fqn} do not cover it exactly")
    ordered = sorted(boxes)
    for i, (a, sa) in enumerate(ordered):  # pairwise: the chunk count is at most the world size
        for b, sb in ordered[i + 1 :]:
            if all(x < y + m and y < x + n for x, n, y, m in zip(a, sa, b, sb, strict=True)) and math.prod(sa):
                raise CheckpointError(f"checkpoint {uri}: two chunks of {fqn} overlap")


OnBlock = Callable[[Block, torch.Tensor], None]


@dataclass
class Streamed:
    """What streaming the files found: the bytes read, and with a whole layout the state hash's sum."""

    read: int = 0
    state: Sum | None = None


def stream_model(
    uri: str,
    layout: ModelLayout,
    expected: dict[str, str],
    sizes: dict[str, int],
    on_block: OnBlock,
    storage_options: dict[str, Any] | None = None,
) -> Streamed:
    """Read each file holding records to read once, hashing all of it against ``expected`` (relative name →
    sha256), handing each model chunk, decoded, to ``on_block`` as it passes, and with a whole layout adding
    every record to the state hash (``state_hash.stored_sum``). A block handed on is only trusted once its file's
    hash is checked: the caller discards its output when this raises."""
    fs, base = filesystem(uri, storage_options)
    total = Streamed(0, Sum() if layout.whole else None)
    for rel, blocks in layout.files.items():
        if rel not in expected:
            raise ChecksumMismatch(f"its DCP metadata names {rel!r} for tensor data, which its manifest does not list")

        def one(rel: str = rel, blocks: list[Block] = blocks) -> tuple[int, Sum]:
            with open_file(fs, base, rel, sizes[rel]) as (fh, n):
                return _stream_file(fh, n, rel, expected[rel], blocks, layout.whole, on_block)

        read, state = store_retry.call(f"reading {uri}/{rel}", one)  # a retried file starts its sum again
        total.read += read
        if total.state is not None:
            total.state = total.state + state
    return total


class _BackgroundHash:
    """sha256 on a thread of its own, in order, a few chunks behind the reader (hashlib lets go of the GIL): the
    file's hash costs about as much as decoding and writing its blocks, and the two overlap."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.pool = ThreadPoolExecutor(1)
        self.room = threading.BoundedSemaphore(4)  # at most four chunks held for it: memory stays a few chunks

    def update(self, data: bytes) -> None:
        self.room.acquire()
        self.pool.submit(self._add, data)

    def _add(self, data: bytes) -> None:
        try:
            self.digest.update(data)
        finally:
            self.room.release()

    def hexdigest(self) -> str:
        self.pool.shutdown(wait=True)
        return self.digest.hexdigest()


def _stream_file(
    fh: IO[bytes], n: int, rel: str, sha256: str, blocks: list[Block], whole: bool, on_block: OnBlock
) -> tuple[int, Sum]:
    digest, pos, state = _BackgroundHash(), 0, Sum()
    try:
        for block in blocks:
            pos += _skip(fh, block.offset - pos, digest, rel)
            record = _take(fh, block.length, rel)
            digest.update(record)
            pos += len(record)
            value = _decode(record, block)
            del record
            if whole:
                state = state + stored_sum(block.fqn, value, block.shape, block.at)
            if block.name:
                on_block(block, value)
        pos += _skip(fh, n - pos, digest, rel)
    finally:
        found = digest.hexdigest()  # the hashing thread ends with the file, on an error too
    if found != sha256:
        raise ChecksumMismatch(f"file {rel} fails its sha256 (truncated or altered)")
    return pos, state


def _skip(fh: IO[bytes], count: int, digest: Any, rel: str) -> int:
    left = count
    while left > 0:
        data = fh.read(min(CHUNK, left))
        if not data:
            raise ChecksumMismatch(f"file {rel} ended early")
        digest.update(data)
        left -= len(data)
    return count


def _take(fh: IO[bytes], count: int, rel: str) -> bytes:
    parts, left = [], count
    while left > 0:
        data = fh.read(left)
        if not data:
            raise ChecksumMismatch(f"file {rel} ended early")
        parts.append(data)
        left -= len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _decode(record: bytes, block: Block) -> Any:
    try:  # a record is torch.save's; weights_only builds tensors and plain values, nothing else
        value = torch.load(io.BytesIO(record), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - whatever a damaged or hostile record raises
        first = (str(exc).splitlines() or [""])[0][:200]
        raise CheckpointError(f"{block.fqn} in {block.file} is not a record DCP wrote ({first})") from None
    if block.shape is not None and (
        not isinstance(value, torch.Tensor) or value.dtype != block.dtype or tuple(value.shape) != block.size
    ):
        raise CheckpointError(f"{block.fqn} in {block.file} does not hold the {list(block.size)} block it claims")
    return value
