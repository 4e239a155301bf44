"""Reading a dataset: its manifest and the token stream of one split, through fsspec.

Used by the ranks (training batches, evaluation) and by validation; the shard
stage in ``trainer.data.shard`` writes what this module reads.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from trainpipe.trainer import store as st
from trainpipe.trainer.checkpoint.files import ChecksumMismatch, read_file
from trainpipe.trainer.data.format import SPLITS, files_base, listed_sizes, load_manifest, token_dtype_of
from trainpipe.trainer.errors import DataError


@dataclass(frozen=True)
class ReadTimes:
    """Seconds a stream spent loading shards so far: fetching them from the store (one whole-object read each,
    retried through transient errors, so opening and reading are one figure) and checking their sha256. The rest
    of a batch read is slicing the loaded shards and copying the batch to the device (docs/architecture.md §9).
    Tokens were made by the shard stage: nothing is tokenized while training."""

    fetch_s: float = 0.0
    verify_s: float = 0.0

    def __sub__(self, before: ReadTimes) -> ReadTimes:
        return ReadTimes(self.fetch_s - before.fetch_s, self.verify_s - before.verify_s)


class TokenStream:
    """The concatenated tokens of one split ('train' or 'val'), read through fsspec."""

    def __init__(self, dataset_uri: str, split: str, storage_options: dict | None = None, verify: bool = True):
        self.uri, self.split, self.verify = dataset_uri, split, verify
        self.manifest = load_manifest(dataset_uri, storage_options)
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r} (splits: {', '.join(SPLITS)})")
        self.shards = self.manifest["splits"][split]["shards"]
        self.starts = list(itertools.accumulate((s["tokens"] for s in self.shards), initial=0))
        self._fs, self._base = st.filesystem(files_base(dataset_uri, self.manifest), storage_options)
        self._loaded: dict[int, np.ndarray] = {}
        self.dtype = token_dtype_of(self.manifest)
        self.times = ReadTimes()
        self._require_shards()

    def _require_shards(self) -> None:
        """DataError unless every shard of the split is in the store at the size its token count says: the counts
        size the sample order and the evaluation windows, and the manifest lies in a store others may write (a
        forged count of 2^27 samples would allocate gigabytes before any shard is read)."""
        listed = listed_sizes(self._fs, self._base, [s["file"] for s in self.shards])
        for meta in self.shards:
            if meta["file"] not in listed:
                raise DataError(f"shard {meta['file']} of {self.uri} is missing; re-run `trainpipe shard`")
            if listed[meta["file"]] != meta["tokens"] * self.dtype.itemsize:
                raise DataError(
                    f"shard {meta['file']} of {self.uri} is not of the size its manifest's token count says; "
                    "re-run `trainpipe shard`"
                )

    def __len__(self) -> int:
        return self.starts[-1]

    def windows(self, block: int) -> int:
        """How many whole samples of ``block`` tokens (plus the next one as target) the split holds."""
        return (len(self) - 1) // block

    def shard(self, i: int) -> np.ndarray:
        """Shard ``i`` as a read-only array of the manifest's dtype, loaded (and verified) once."""
        if i not in self._loaded:
            meta = self.shards[i]
            t0 = time.perf_counter()
            size = meta["tokens"] * self.dtype.itemsize
            try:  # as a checkpoint's files are read: a regular file of the manifest's size, or nothing
                blob = read_file(self._fs, self._base, meta["file"], size)
            except FileNotFoundError:
                raise DataError(f"shard {meta['file']} of {self.uri} is missing; re-run `trainpipe shard`") from None
            except ChecksumMismatch:
                blob = b""
            t1 = time.perf_counter()
            intact = len(blob) == size and (not self.verify or hashlib.sha256(blob).hexdigest() == meta["sha256"])
            self.times = ReadTimes(self.times.fetch_s + t1 - t0, self.times.verify_s + time.perf_counter() - t1)
            if not intact:
                raise DataError(
                    f"shard {meta['file']} of {self.uri} is corrupt (size or sha256 mismatch); re-run `trainpipe shard`"
                )
            self._loaded[i] = np.frombuffer(blob, dtype=self.dtype)
        return self._loaded[i]

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64, across shard boundaries."""
        end = start + length
        if start < 0 or length < 0 or end > len(self):
            raise IndexError(f"window [{start}, {end}) outside the {self.split} split of {len(self)} tokens")
        pieces, pos = [], start
        while pos < end:
            i = bisect.bisect_right(self.starts, pos) - 1
            stop = min(end, self.starts[i + 1])
            pieces.append(self.shard(i)[pos - self.starts[i] : stop - self.starts[i]])
            pos = stop
        if len(pieces) == 1:
            return pieces[0].astype(np.int64)
        return np.concatenate(pieces).astype(np.int64) if pieces else np.empty(0, dtype=np.int64)

    def batch(self, sample_ids: np.ndarray, block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) for samples ``sample_ids``: sample ``j`` is tokens ``[j·block, j·block + block + 1)``."""
        rows = np.stack([self.window(int(j) * block, block + 1) for j in sample_ids])
        t = torch.from_numpy(rows)
        # On a GPU a pinned, queued copy: the host does not wait here for the kernels queued before it.
        t = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
