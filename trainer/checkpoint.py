"""Checkpoints in the object store, committed by writing ``trainpipe.json`` last (DESIGN §3).

Layout: ``{store}/runs/{run}/checkpoints/step-{N:08d}/`` holds the
torch.distributed.checkpoint files (model, optimizer, scheduler, counters),
one ``extra/rank-{r:05d}.pt`` per rank (RNG states, data position), and the
commit manifest. Object stores have no rename, so a checkpoint is real only
once its manifest exists and every checksum in it verifies.
"""

from __future__ import annotations

import datetime as dt
import io
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from trainer.errors import CheckpointError
from trainer.store import filesystem, join, read_json, sha256_file, write_json

MANIFEST = "trainpipe.json"
FORMAT = 1
_STEP_DIR = re.compile(r"step-(\d{8})$")


def run_uri(store_root: str, run_name: str) -> str:
    return join(store_root, "runs", run_name)


def checkpoints_uri(store_root: str, run_name: str) -> str:
    return join(run_uri(store_root, run_name), "checkpoints")


def step_uri(ckpt_root: str, step: int) -> str:
    return join(ckpt_root, f"step-{step:08d}")


@dataclass
class CheckpointInfo:
    uri: str
    step: int
    committed: bool
    valid: bool
    reason: str = ""
    manifest: dict[str, Any] = field(default_factory=dict)
    size_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "uri": self.uri,
            "step": self.step,
            "committed": self.committed,
            "valid": self.valid,
            "reason": self.reason,
            "world_size": m.get("world_size"),
            "created": m.get("created"),
            "model_digest": m.get("model_digest"),
            "size_bytes": self.size_bytes,
        }


# ---------------------------------------------------------------- save / commit


def _rank_extra_path(uri: str, rank: int) -> str:
    return join(uri, "extra", f"rank-{rank:05d}.pt")


def write_rank_extra(uri: str, rank: int, extra: dict[str, Any], storage_options: dict[str, Any] | None = None) -> None:
    """This rank's non-tensor state (RNG states, counters): small, written before the DCP save starts."""
    fs, base = filesystem(uri, storage_options)
    buf = io.BytesIO()
    torch.save(extra, buf)
    path = _rank_extra_path(base, rank)
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with fs.open(path, "wb") as fh:
        fh.write(buf.getvalue())


def commit(uri: str, manifest: dict[str, Any], storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank 0, after every rank's files are complete: checksum them and write the manifest last."""
    fs, base = filesystem(uri, storage_options)
    files = {posixpath.relpath(p, base): sha256_file(fs, p) for p in sorted(fs.find(base)) if not p.endswith(MANIFEST)}
    body = {
        "format": FORMAT,
        "world_size": 1,
        **manifest,
        "files": files,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    write_json(fs, join(base, MANIFEST), body)
    return body


def save_checkpoint(
    uri: str,
    state: dict[str, Any],
    rank_extra: dict[str, Any],
    manifest: dict[str, Any],
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Synchronous and collective: every rank writes its part; rank 0 commits. Returns the manifest on rank 0.

    DCP's save returns on the coordinator only after every rank reported its
    writes, and each rank wrote its extra file before that, so the commit
    needs no further barrier.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    write_rank_extra(uri, rank, rank_extra, storage_options)
    dcp.save(state, storage_writer=FsspecWriter(uri, **(storage_options or {})))
    if rank != 0:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    return commit(uri, {**manifest, "world_size": world}, storage_options)


# ---------------------------------------------------------------- inspect / verify


def inspect_checkpoint(uri: str, storage_options: dict[str, Any] | None = None, verify: bool = True) -> CheckpointInfo:
    """Read a checkpoint's manifest and (optionally) verify every file's checksum."""
    fs, base = filesystem(uri, storage_options)
    m = _STEP_DIR.search(base.rstrip("/"))
    step = int(m.group(1)) if m else -1
    info = CheckpointInfo(uri=uri, step=step, committed=False, valid=False)
    if not fs.exists(base):
        info.reason = "does not exist"
        return info
    try:
        info.size_bytes = sum(fs.du(base, total=False).values())
    except Exception:  # noqa: BLE001 - size is informative only
        pass
    manifest_path = join(base, MANIFEST)
    if not fs.exists(manifest_path):
        info.reason = f"not committed (no {MANIFEST}): an interrupted save"
        return info
    try:
        info.manifest = read_json(fs, manifest_path)
    except Exception as exc:  # noqa: BLE001
        info.reason = f"unreadable {MANIFEST} ({exc.__class__.__name__})"
        return info
    info.committed = True
    info.step = int(info.manifest.get("step", step))
    if not verify:
        info.valid = True
        return info
    for rel, expected in sorted(info.manifest.get("files", {}).items()):
        path = join(base, rel)
        if not fs.exists(path):
            info.reason = f"file {rel} is missing"
            return info
        if sha256_file(fs, path) != expected:
            info.reason = f"file {rel} fails its sha256 (truncated or altered)"
            return info
    if not info.manifest.get("files"):
        info.reason = "manifest lists no files"
        return info
    info.valid = True
    return info


def list_checkpoints(ckpt_root: str, storage_options: dict[str, Any] | None = None, verify: bool = True) -> list[CheckpointInfo]:
    """All step directories under ``ckpt_root``, oldest first."""
    fs, base = filesystem(ckpt_root, storage_options)
    if not fs.exists(base):
        return []
    steps = []
    for entry in fs.ls(base, detail=False):
        m = _STEP_DIR.search(entry.rstrip("/"))
        if m:
            steps.append(int(m.group(1)))
    return [inspect_checkpoint(step_uri(ckpt_root, s), storage_options, verify) for s in sorted(steps)]


def latest_valid(ckpt_root: str, storage_options: dict[str, Any] | None = None) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
    """Newest valid checkpoint and the newer ones skipped as invalid (reported, never deleted)."""
    skipped: list[CheckpointInfo] = []
    for info in reversed(list_checkpoints(ckpt_root, storage_options, verify=False)):
        full = inspect_checkpoint(info.uri, storage_options, verify=True) if info.committed else info
        if full.valid:
            return full, skipped
        skipped.append(full)
    return None, skipped


def prune_checkpoints(ckpt_root: str, keep_last: int, storage_options: dict[str, Any] | None = None,
                      protect: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Delete committed checkpoints beyond the newest ``keep_last``; the newest valid one and ``protect`` always stay."""
    infos = [i for i in list_checkpoints(ckpt_root, storage_options, verify=False) if i.committed]
    doomed = [i for i in (infos[:-keep_last] if keep_last > 0 else []) if i.uri not in protect]
    if doomed:
        # Newer checkpoints may be committed but corrupt (kept for inspection): never prune the one resume needs.
        newest_valid, _ = latest_valid(ckpt_root, storage_options)
        if newest_valid is not None:
            doomed = [i for i in doomed if i.uri != newest_valid.uri]
    fs, _ = filesystem(ckpt_root, storage_options)
    removed = []
    for info in doomed:
        _, path = filesystem(info.uri, storage_options)
        # Remove the manifest first: a half-deleted checkpoint must never look committed.
        fs.rm(join(path, MANIFEST))
        fs.rm(path, recursive=True)
        removed.append(info.uri)
    return removed


# ---------------------------------------------------------------- load


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
        raise CheckpointError(f"cannot load checkpoint {uri}: {cause.__class__.__name__}: {first}") from None


def load_rank_extra(uri: str, rank: int, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    fs, base = filesystem(uri, storage_options)
    path = _rank_extra_path(base, rank)
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as fh:
        # Our own file, checksummed in the manifest: full unpickling is safe here.
        return torch.load(io.BytesIO(fh.read()), weights_only=False)


def require_valid(uri: str, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    info = inspect_checkpoint(uri, storage_options, verify=True)
    if not info.valid:
        raise CheckpointError(f"checkpoint {uri} is not usable: {info.reason}")
    return info
