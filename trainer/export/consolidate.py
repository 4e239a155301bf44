"""A checkpoint's model weights out of its DCP files block by block, each file verified as it streams
(docs/architecture.md §14).

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

from trainpipe.trainer import retry
from trainpipe.trainer.checkpoint.files import CHUNK, ChecksumMismatch, open_file
from trainpipe.trainer.errors import CheckpointError
from trainpipe.trainer.export.safetensors_out import DTYPES, TensorSpec
from trainpipe.trainer.store import filesystem

PREFIX = "model."  # the model's part of a checkpoint's state dict (``trainer.loop.trainer``)


@dataclass(frozen=True)
class Block:
    """One stored chunk of a model weight: where its record lies and which part of the weight it is."""

    name: str  # the weight's name in the model (no ``model.``)
    file: str  # relative to the checkpoint's folder
    offset: int
    length: int
    at: tuple[int, ...]
    size: tuple[int, ...]


@dataclass(frozen=True)
class ModelLayout:
    """The model's weights (name → dtype and global shape) and their blocks, by the file that holds them."""

    weights: dict[str, TensorSpec]
    files: dict[str, list[Block]]


def model_layout(uri: str, metadata: Metadata, sizes: dict[str, int]) -> ModelLayout:
    """The model's weights and blocks as ``metadata`` states them; CheckpointError when they do not add up.
    ``sizes``: each file's size (the manifest's)."""
    weights: dict[str, TensorSpec] = {}
    chunks: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not fqn.startswith(PREFIX):
            continue
        if not isinstance(meta, TensorStorageMetadata) or meta.properties.dtype not in DTYPES:
            raise CheckpointError(f"checkpoint {uri}: its weight {fqn} is not a tensor safetensors can hold")
        name, shape = fqn.removeprefix(PREFIX), tuple(int(n) for n in meta.size)
        weights[name] = TensorSpec(meta.properties.dtype, shape)
        boxes = {tuple(int(o) for o in c.offsets): tuple(int(n) for n in c.sizes) for c in meta.chunks}
        _require_tiling(uri, fqn, shape, list(boxes.items()))
        chunks[name] = boxes
    if not weights:
        raise CheckpointError(f"checkpoint {uri} holds no model weights ({PREFIX}*)")
    files: dict[str, list[Block]] = {}
    placed: set[tuple[str, tuple[int, ...]]] = set()
    for index, info in metadata.storage_data.items():
        name = index.fqn.removeprefix(PREFIX)
        if not index.fqn.startswith(PREFIX) or name not in weights:
            continue
        at = tuple(int(o) for o in index.offset)
        if at not in chunks[name] or (name, at) in placed:
            raise CheckpointError(f"checkpoint {uri}: its storage index names a chunk of {index.fqn} it does not have")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"checkpoint {uri}: {index.fqn} is stored transformed, which trainpipe does not write"
            )
        rel, offset, length = info.relative_path, int(info.offset), int(info.length)
        if rel not in sizes or offset < 0 or length <= 0 or offset + length > sizes[rel]:
            raise ChecksumMismatch(f"its storage index places {index.fqn} outside the files its manifest lists")
        placed.add((name, at))
        files.setdefault(rel, []).append(Block(name, rel, offset, length, at, chunks[name][at]))
    missing = sorted(f"{n}@{list(at)}" for n, boxes in chunks.items() for at in boxes if (n, at) not in placed)
    if missing:
        raise CheckpointError(f"checkpoint {uri}: no stored data for {', '.join(missing[:3])}")
    for blocks in files.values():
        blocks.sort(key=lambda b: b.offset)
        for before, after in itertools.pairwise(blocks):
            if before.offset + before.length > after.offset:
                raise ChecksumMismatch(f"its storage index overlaps {before.name} and {after.name} in {before.file}")
    return ModelLayout(weights, files)


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


def stream_model(
    uri: str,
    layout: ModelLayout,
    expected: dict[str, str],
    sizes: dict[str, int],
    on_block: OnBlock,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Read each file holding model blocks once, hashing all of it against ``expected`` (relative name → sha256)
    and handing each block, decoded, to ``on_block`` as it passes. The bytes read, in all. A block handed on is
    only trusted once its file's hash is checked: the caller discards its output when this raises."""
    fs, base = filesystem(uri, storage_options)
    total = 0
    for rel, blocks in layout.files.items():
        if rel not in expected:
            raise ChecksumMismatch(f"its DCP metadata names {rel!r} for tensor data, which its manifest does not list")

        def one(rel: str = rel, blocks: list[Block] = blocks) -> int:
            with open_file(fs, base, rel, sizes[rel]) as (fh, n):
                return _stream_file(fh, n, rel, expected[rel], blocks, layout, on_block)

        total += retry.call(f"reading {uri}/{rel}", one)
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
    fh: IO[bytes], n: int, rel: str, sha256: str, blocks: list[Block], layout: ModelLayout, on_block: OnBlock
) -> int:
    digest, pos = _BackgroundHash(), 0
    try:
        for block in blocks:
            pos += _skip(fh, block.offset - pos, digest, rel)
            record = _take(fh, block.length, rel)
            digest.update(record)
            pos += len(record)
            on_block(block, _decode(record, block, layout.weights[block.name]))
            del record
        pos += _skip(fh, n - pos, digest, rel)
    finally:
        found = digest.hexdigest()  # the hashing thread ends with the file, on an error too
    if found != sha256:
        raise ChecksumMismatch(f"file {rel} fails its sha256 (truncated or altered)")
    return pos


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


def _decode(record: bytes, block: Block, spec: TensorSpec) -> torch.Tensor:
    try:  # a tensor's record is torch.save's; weights_only builds tensors and nothing else
        value = torch.load(io.BytesIO(record), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - whatever a damaged or hostile record raises
        first = (str(exc).splitlines() or [""])[0][:200]
        raise CheckpointError(f"{block.name} in {block.file} is not a tensor record ({first})") from None
    if not isinstance(value, torch.Tensor) or value.dtype != spec.dtype or tuple(value.shape) != block.size:
        raise CheckpointError(f"{block.name} in {block.file} does not hold the {list(block.size)} block it claims")
    return value
