"""Checkpoint state back into memory: DCP state dicts and each rank's extra state."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException

from trainer.errors import CheckpointError, StoreError
from trainer.layout import rank_extra
from trainer.store import filesystem


def load_checkpoint(uri: str, state: dict[str, Any], storage_options: dict[str, Any] | None = None) -> None:
    """Load ``state`` in place from a checkpoint (collective when a process group exists)."""
    try:
        dcp.load(state, storage_reader=FsspecReader(uri, **(storage_options or {})))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises many kinds; the user needs the location
        # DCP's CheckpointException derives from BaseException (not caught by ``except Exception``);
        # it wraps each failing rank's (exception, traceback): report the first cause.
        failures = getattr(exc, "failures", None) or {}
        cause = next(iter(failures.values()))[0] if failures else exc
        first = (str(cause).splitlines() or [""])[0][:300]
        if isinstance(cause, OSError):  # the store failed us, not the checkpoint: another attempt may succeed
            raise StoreError(f"cannot read checkpoint {uri}: {cause.__class__.__name__}: {first}") from None
        raise CheckpointError(f"cannot load checkpoint {uri}: {cause.__class__.__name__}: {first}") from None


def load_rank_extra(uri: str, rank: int, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """This rank's extra state (RNG states), or None when the checkpoint has none for it."""
    fs, base = filesystem(uri, storage_options)
    path = rank_extra(base, rank)
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as fh:
        # Our own file, checksummed in the manifest: full unpickling is safe here.
        return torch.load(io.BytesIO(fh.read()), weights_only=False)
