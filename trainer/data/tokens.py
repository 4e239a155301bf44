"""Reading a dataset: its manifest and the token stream of one split, through fsspec.

Used by the ranks (training batches, evaluation) and by validation; the shard
stage in ``trainer.data.shard`` writes what this module reads.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools

import numpy as np
import torch

from trainpipe.trainer import store as st
from trainpipe.trainer.data.format import SPLITS, load_manifest, token_dtype_of
from trainpipe.trainer.errors import DataError
from trainpipe.trainer.layout import join


class TokenStream:
    """The concatenated tokens of one split ('train' or 'val'), read through fsspec."""

    def __init__(self, dataset_uri: str, split: str, storage_options: dict | None = None, verify: bool = True):
        self.uri, self.split, self.verify = dataset_uri, split, verify
        self.manifest = load_manifest(dataset_uri, storage_options)
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r} (splits: {', '.join(SPLITS)})")
        self.shards = self.manifest["splits"][split]["shards"]
        self.starts = list(itertools.accumulate((s["tokens"] for s in self.shards), initial=0))
        self._fs, self._base = st.filesystem(dataset_uri, storage_options)
        self._loaded: dict[int, np.ndarray] = {}
        self.dtype = token_dtype_of(self.manifest)

    def __len__(self) -> int:
        return self.starts[-1]

    def windows(self, block: int) -> int:
        """How many whole samples of ``block`` tokens (plus the next one as target) the split holds."""
        return (len(self) - 1) // block

    def shard(self, i: int) -> np.ndarray:
        """Shard ``i`` as a read-only array of the manifest's dtype, loaded (and verified) once."""
        if i not in self._loaded:
            meta = self.shards[i]
            try:
                blob = self._fs.cat_file(join(self._base, meta["file"]))
            except FileNotFoundError:
                raise DataError(f"shard {meta['file']} of {self.uri} is missing; re-run `trainpipe shard`") from None
            if len(blob) != meta["tokens"] * self.dtype.itemsize or (
                self.verify and hashlib.sha256(blob).hexdigest() != meta["sha256"]
            ):
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
        t = torch.from_numpy(rows).to(device)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
