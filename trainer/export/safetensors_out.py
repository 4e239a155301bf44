"""A safetensors file written block by block: its header first, from the shapes alone, then each tensor's bytes
in place as its blocks arrive, in any order (docs/architecture.md §11).

``safetensors.torch.save_file`` takes every tensor at once; a consolidated model must never be whole in the
publishing process, so the file is laid out from the shapes, sized on disk, and each block (a rank's shard of a
tensor, possibly a column block) is written at its own offsets. The format is safetensors' own: an 8-byte
little-endian header length, a JSON header of names, dtypes, shapes and byte ranges (padded to 8 bytes), then
the tensors' bytes. ``safetensors.safe_open`` reads what this writes; the tests load it that way.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the file: its dtype and shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsOut:
    """One safetensors file under construction at ``path`` (created new: never an existing file). ``put`` writes
    a block of a tensor at its offsets; ``filled`` says whether every byte of every tensor was written once."""

    def __init__(self, path: str, tensors: dict[str, TensorSpec], metadata: dict[str, str] | None = None):
        unknown = sorted({str(s.dtype) for s in tensors.values() if s.dtype not in DTYPES})
        if unknown:
            raise ValueError(f"safetensors holds no {', '.join(unknown)} tensors")
        self.path, self.specs = path, dict(sorted(tensors.items()))
        header: dict[str, object] = {"__metadata__": dict(metadata or {})} if metadata else {}
        self.starts: dict[str, int] = {}
        at = 0
        for name, spec in self.specs.items():
            header[name] = {
                "dtype": DTYPES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [at, at + spec.nbytes],
            }
            self.starts[name] = at
            at += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.data_start = 8 + len(text)
        self.size = self.data_start + at
        self.written: dict[str, dict[tuple[int, ...], int]] = {name: {} for name in self.specs}  # block → elements
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.write(self.fd, struct.pack("<Q", len(text)) + text)
        os.ftruncate(self.fd, self.size)

    def put(self, name: str, block: torch.Tensor, at: tuple[int, ...]) -> None:
        """Write ``block`` into tensor ``name`` starting at index ``at`` (one offset per dimension)."""
        spec = self.specs[name]
        if block.dtype != spec.dtype or block.dim() != len(spec.shape) or len(at) != len(spec.shape):
            raise ValueError(f"{name}: a {block.dtype} block of {list(block.shape)} does not fit {spec}")
        if any(o < 0 or o + n > s for o, n, s in zip(at, block.shape, spec.shape, strict=True)):
            raise ValueError(f"{name}: a block of {list(block.shape)} at {list(at)} lies outside {list(spec.shape)}")
        if block.numel() == 0:
            return
        base = self.data_start + self.starts[name]
        data = block.detach().contiguous()
        if data.dim() == 0 or tuple(data.shape[1:]) == spec.shape[1:]:  # whole rows: one run of bytes
            row = math.prod(spec.shape[1:]) * spec.dtype.itemsize
            _pwrite_all(self.fd, data.reshape(-1).view(torch.uint8).numpy(), base + (at[0] * row if at else 0))
        else:  # a column block: its rows are strided in the file
            width = spec.dtype.itemsize
            shape = (*spec.shape[:-1], spec.shape[-1] * width)
            mapped = np.memmap(self.path, dtype=np.uint8, mode="r+", offset=base, shape=shape)
            index = tuple(slice(o * (width if d == len(at) - 1 else 1), (o + n) * (width if d == len(at) - 1 else 1))
                          for d, (o, n) in enumerate(zip(at, data.shape, strict=True)))  # fmt: skip
            mapped[index] = data.view(torch.uint8).numpy().reshape(mapped[index].shape)
            mapped.flush()
            del mapped  # unmapped: its pages leave this process's memory
        self.written[name][tuple(at)] = data.numel()  # again on a retried read: counted once

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as the file now holds it, read with ``pread`` into memory of its own (a memory map would
        keep the whole file's pages in this process's resident set)."""
        spec = self.specs[name]
        buf = bytearray(spec.nbytes)
        view, at, base = memoryview(buf), 0, self.data_start + self.starts[name]
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while at < spec.nbytes:
                n = os.preadv(fd, [view[at:]], base + at)
                if n <= 0:
                    raise OSError(f"{self.path} ended inside {name}")
                at += n
        finally:
            os.close(fd)
        if not spec.nbytes:
            return torch.empty(spec.shape, dtype=spec.dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(spec.dtype).reshape(spec.shape)

    def filled(self) -> list[str]:
        """The tensors not yet written whole (by element count: the caller's plan has blocks that do not overlap)."""
        return [name for name, spec in self.specs.items() if sum(self.written[name].values()) != math.prod(spec.shape)]

    def close(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = data.data.cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
