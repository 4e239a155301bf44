"""Checkpoint state back into memory: DCP state dicts and each rank's extra state."""

from __future__ import annotations

import hashlib
import io
import pickle
import posixpath
from typing import Any

import torch
import torch.distributed.checkpoint.state_dict_loader as dcp  # its __all__ names load
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from trainpipe.trainer.checkpoint.files import inside_folder, read_file
from trainpipe.trainer.checkpoint.storage import ChecksumMismatch, StoreFiles
from trainpipe.trainer.errors import CheckpointError, StoreError, StoreUnavailable
from trainpipe.trainer.store import filesystem
from trainpipe.trainer.store_paths import rank_extra

# A rank's extra state is its RNG states: a few KiB. More is not one, and a reader must not hold whatever the
# store offers.
EXTRA_MAX_BYTES = 64 << 20

# What the ``.metadata`` pickle of a checkpoint holds; anything else in it is refused (docs/security.md: the store's
# contents are not trusted, and unpickling runs whatever a pickle names).
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which no checkpoint holds")


class SafeReader(FsspecReader):
    """DCP's fsspec reader, reading ``.metadata`` with an unpickler that builds only checkpoint metadata, and only
    the files inside the checkpoint's folder.

    With ``expected`` (the commit manifest's relative names → sha256) every file DCP's metadata names must be one
    the manifest lists, and is verified as it is read, up to the size ``sizes`` states when given
    (``trainer.checkpoint.storage``): a rank reads each file it needs once, and checks exactly those."""

    def __init__(
        self,
        path: str,
        expected: dict[str, str] | None = None,
        sizes: dict[str, int] | None = None,
        **storage_options: Any,
    ) -> None:
        super().__init__(path, **storage_options)
        self.fs = StoreFiles(expected, sizes)
        self.path = self.fs.init_path(path, **storage_options)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"checkpoint metadata is a {type(metadata).__name__}, not DCP Metadata")
        self._check_storage(metadata)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()  # absent from older metadata
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def _check_storage(self, metadata: Metadata) -> None:
        """Every file DCP's metadata says holds tensor data lies inside the checkpoint's folder and, with a
        manifest, is one it lists: DCP joins the names to the folder as they are (``/dev/zero``, ``../x``)."""
        storage = metadata.storage_data
        if not isinstance(storage, dict):
            raise ChecksumMismatch("its DCP metadata has no storage index")
        for item in storage.values():
            rel = getattr(item, "relative_path", None)
            if not isinstance(rel, str):
                raise ChecksumMismatch(f"its DCP metadata names a {type(rel).__name__} for tensor data, not a file")
            if self.fs.expected is not None and rel not in self.fs.expected:  # those all lie inside (manifest_problem)
                raise ChecksumMismatch(
                    f"its DCP metadata names {rel!r} for tensor data, which is not one of its manifest's files"
                )
            if not inside_folder(rel):
                raise ChecksumMismatch(f"its DCP metadata names {rel!r} for tensor data, outside its checkpoint folder")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor values (counters, scheduler and optimizer settings) are read with
    ``weights_only=True``: DCP's own planner unpickles them in full."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(uri: str, reader: SafeReader) -> Metadata:
    """The checkpoint's DCP metadata through ``reader``; each way it can fail is one line."""
    try:
        return reader.read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"cannot load checkpoint {uri}: it has no DCP metadata (.metadata)") from None
    except (StoreError, ChecksumMismatch) as exc:
        raise type(exc)(f"cannot load checkpoint {uri}: {exc}") from None
    except OSError as exc:
        raise StoreError(f"cannot read checkpoint {uri}: {exc.__class__.__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - whatever a hostile or damaged pickle raises
        first = (str(exc).splitlines() or [""])[0][:300]
        raise CheckpointError(f"checkpoint {uri} is invalid: its DCP metadata cannot be read ({first})") from None


def load_checkpoint(
    uri: str,
    state: dict[str, Any],
    storage_options: dict[str, Any] | None = None,
    expected: dict[str, str] | None = None,
    single: bool = False,
    sizes: dict[str, int] | None = None,
) -> None:
    """Load ``state`` in place from a checkpoint (collective when a process group exists, unless ``single``),
    reading only the files ``expected`` lists (relative name → sha256), each verified as it is read, up to its
    size in ``sizes`` when given. A failure on any rank fails every rank alike (DCP gathers each rank's read
    errors)."""
    reader = SafeReader(uri, expected, sizes, **(storage_options or {}))
    read_metadata(uri, reader)  # first on its own: DCP would log a refusal with a traceback, then look elsewhere
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=single)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises many kinds; the user needs the location
        # DCP's CheckpointException derives from BaseException (not caught by ``except Exception``);
        # it wraps each failing rank's (exception, traceback): report the first cause.
        failures = getattr(exc, "failures", None) or {}
        cause = next(iter(failures.values()))[0] if failures else exc
        first = (str(cause).splitlines() or [""])[0][:300]
        if isinstance(cause, ChecksumMismatch):
            raise ChecksumMismatch(f"cannot load checkpoint {uri}: {first}") from None
        if isinstance(cause, StoreUnavailable):
            raise StoreUnavailable(f"cannot read checkpoint {uri}: {first}") from None
        if isinstance(cause, (OSError, StoreError)):  # the store failed us, not the checkpoint: retry may succeed
            raise StoreError(f"cannot read checkpoint {uri}: {cause.__class__.__name__}: {first}") from None
        raise CheckpointError(f"cannot load checkpoint {uri}: {cause.__class__.__name__}: {first}") from None


def load_rank_extra(
    uri: str,
    rank: int,
    storage_options: dict[str, Any] | None = None,
    expected: dict[str, str] | None = None,
    sizes: dict[str, int] | None = None,
) -> dict[str, Any] | None:
    """This rank's extra state (RNG states), or None when the checkpoint has none for it; verified against
    ``expected`` (relative name → sha256) and ``sizes`` (relative name → bytes) when given."""
    fs, base = filesystem(uri, storage_options)
    rel = posixpath.relpath(rank_extra(base, rank), base)
    if expected is not None and rel not in expected:  # read only what the manifest lists (another world size)
        return None
    try:
        data = read_file(fs, base, rel, (sizes or {}).get(rel), limit=EXTRA_MAX_BYTES, kind="rank's extra state")
    except FileNotFoundError:
        if expected is not None:
            raise ChecksumMismatch(f"checkpoint {uri}: file {rel} is missing") from None
        return None
    except ChecksumMismatch as exc:  # not a regular file, or not of its size
        raise ChecksumMismatch(f"checkpoint {uri}: {exc}") from None
    if expected is not None and expected.get(rel) != hashlib.sha256(data).hexdigest():
        raise ChecksumMismatch(f"checkpoint {uri}: file {rel} fails its sha256 (truncated or altered)")
    try:  # tensors, numbers, strings and tuples only (``rng.rng_state``): nothing from the store is unpickled
        extra = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever a hostile or foreign file raises
        first = (str(exc).splitlines() or [""])[0][:200]
        raise CheckpointError(f"checkpoint {uri}: its extra state for rank {rank} is invalid ({first})") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"checkpoint {uri}: its extra state for rank {rank} is invalid (not a dict)")
    return extra
