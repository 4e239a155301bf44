"""A run's checkpoints as the store holds them: inspect, verify, list, choose, prune, commit.

``step-{N:08d}/`` holds the torch.distributed.checkpoint files (model,
optimizer, scheduler, counters), one ``extra/rank-{r:05d}.pt`` per rank (RNG
states) and the commit manifest ``trainpipe.json``. Object stores have no
rename, so a checkpoint is real only once its manifest exists and every
checksum in it verifies.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import posixpath
from dataclasses import dataclass, field
from typing import Any

from trainer.errors import CheckpointError
from trainer.layout import CHECKPOINT_MANIFEST as MANIFEST
from trainer.layout import join, step_of, step_uri
from trainer.store import filesystem, read_json, sha256_file, write_json

FORMAT = 1


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


# ---------------------------------------------------------------- commit


def commit(uri: str, manifest: dict[str, Any], storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank 0, after every rank's files are complete: checksum them and write the manifest last."""
    fs, base = filesystem(uri, storage_options)
    files = {posixpath.relpath(p, base): sha256_file(fs, p) for p in sorted(fs.find(base)) if not p.endswith(MANIFEST)}
    body = {
        "format": FORMAT,
        "world_size": 1,
        **manifest,
        "files": files,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    write_json(fs, join(base, MANIFEST), body)
    return body


# ---------------------------------------------------------------- inspect / verify


def inspect_checkpoint(uri: str, storage_options: dict[str, Any] | None = None, verify: bool = True) -> CheckpointInfo:
    """Read a checkpoint's manifest and (optionally) verify every file's checksum."""
    fs, base = filesystem(uri, storage_options)
    step = step_of(base)
    step = -1 if step is None else step
    info = CheckpointInfo(uri=uri, step=step, committed=False, valid=False)
    if not fs.exists(base):
        info.reason = "does not exist"
        return info
    with contextlib.suppress(Exception):  # size is informative only
        info.size_bytes = sum(fs.du(base, total=False).values())
    manifest_path = join(base, MANIFEST)
    if not fs.exists(manifest_path):
        info.reason = f"not committed (no {MANIFEST}): an interrupted save"
        return info
    try:
        info.manifest = read_json(fs, manifest_path)
    except Exception as exc:  # noqa: BLE001 - whatever the store returned, the manifest is unusable
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


def list_checkpoints(
    ckpt_root: str, storage_options: dict[str, Any] | None = None, verify: bool = True
) -> list[CheckpointInfo]:
    """All step directories under ``ckpt_root``, oldest first."""
    fs, base = filesystem(ckpt_root, storage_options)
    if not fs.exists(base):
        return []
    steps = [s for entry in fs.ls(base, detail=False) if (s := step_of(entry)) is not None]
    return [inspect_checkpoint(step_uri(ckpt_root, s), storage_options, verify) for s in sorted(steps)]


def latest_valid(
    ckpt_root: str, storage_options: dict[str, Any] | None = None
) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
    """Newest valid checkpoint and the newer ones skipped as invalid (reported, never deleted)."""
    skipped: list[CheckpointInfo] = []
    for info in reversed(list_checkpoints(ckpt_root, storage_options, verify=False)):
        full = inspect_checkpoint(info.uri, storage_options, verify=True) if info.committed else info
        if full.valid:
            return full, skipped
        skipped.append(full)
    return None, skipped


def prune_checkpoints(
    ckpt_root: str,
    keep_last: int,
    storage_options: dict[str, Any] | None = None,
    protect: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """Delete committed checkpoints beyond the newest ``keep_last``; the newest valid one and ``protect`` stay."""
    infos = [i for i in list_checkpoints(ckpt_root, storage_options, verify=False) if i.committed]
    doomed = [i for i in (infos[:-keep_last] if keep_last > 0 else []) if i.uri not in protect]
    if doomed:
        # Newer checkpoints may be committed but corrupt (kept for inspection): never prune the one resume needs.
        newest_valid, _ = latest_valid(ckpt_root, storage_options)
        if newest_valid is not None:
            doomed = [i for i in doomed if i.uri != newest_valid.uri]
    for info in doomed:
        remove_checkpoint(info.uri, storage_options)
    return [info.uri for info in doomed]


def remove_checkpoint(uri: str, storage_options: dict[str, Any] | None = None) -> None:
    """Delete a checkpoint folder, its manifest first: a half-deleted checkpoint must never look committed."""
    fs, path = filesystem(uri, storage_options)
    if fs.exists(join(path, MANIFEST)):
        fs.rm(join(path, MANIFEST))
    if fs.exists(path):
        fs.rm(path, recursive=True)


def require_valid(uri: str, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    info = inspect_checkpoint(uri, storage_options, verify=True)
    if not info.valid:
        raise CheckpointError(f"checkpoint {uri} is not usable: {info.reason}")
    return info
