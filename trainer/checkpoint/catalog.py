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
import json
import re
from dataclasses import dataclass, field
from typing import Any, cast

from pydantic import ValidationError

from trainpipe.trainer.checkpoint.files import ChecksumMismatch, file_size, inside_folder, read_file, sha256_of
from trainpipe.trainer.checkpoint.proof import CheckpointProof
from trainpipe.trainer.errors import CheckpointError, StoreError
from trainpipe.trainer.store import filesystem, remove, write_json
from trainpipe.trainer.store_paths import CHECKPOINT_MANIFEST as MANIFEST
from trainpipe.trainer.store_paths import join, step_of, step_uri

FORMAT = 1
# A manifest lists a few files per rank and the resolved profile: tens of KiB. More is not a manifest, and a reader
# must not hold whatever the store offers.
MANIFEST_MAX_BYTES = 8 << 20


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
            "model_factory": ((m.get("profile") or {}).get("model") or {}).get("factory"),
            "size_bytes": self.size_bytes,
        }


# ---------------------------------------------------------------- commit


def commit(
    uri: str,
    manifest: dict[str, Any],
    files: dict[str, str],
    storage_options: dict[str, Any] | None = None,
    sizes: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Rank 0, after every rank's files are complete: write the manifest last, listing ``files`` (relative
    name → sha256, as each rank hashed them while writing: nothing is read back) and their ``sizes`` (bytes)."""
    fs, base = filesystem(uri, storage_options)
    body = {
        "format": FORMAT,
        "world_size": 1,
        **manifest,
        "files": dict(sorted(files.items())),
        **({"sizes": dict(sorted(sizes.items()))} if sizes is not None else {}),
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    write_json(fs, join(base, MANIFEST), body)
    return body


# ---------------------------------------------------------------- inspect / verify

_SHA256 = re.compile(r"[0-9a-f]{64}")
# ``model.factory``'s pattern (trainer/config.py): what ``ckpt inspect`` shows of a recorded one, and validate checks
_FACTORY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # nothing shown on a terminal may move its cursor or retitle it
_OPTIONAL: dict[str, tuple[type, ...]] = {  # manifest fields readers use, and the types they may have
    "run_name": (str,),
    "created": (str,),
    "model_digest": (str,),
    "config_hash": (str,),
    "dataset_uri": (str,),
    "profile": (dict,),
    "val_loss": (int, float, type(None)),
    "tokens_seen": (int,),
    "data_position": (dict,),
}


def required_files(world_size: int) -> list[str]:
    """What every complete checkpoint of this world size lists besides its tensor data (``*.distcp``)."""
    return [".metadata", *(f"extra/rank-{r:05d}.pt" for r in range(world_size))]


def manifest_problem(manifest: Any, step: int | None) -> str | None:
    """Why a commit manifest does not describe a complete checkpoint of its own folder; None when it does.

    The store is not trusted (docs/security.md): every file a manifest names must lie inside the checkpoint's folder,
    so a hostile ``../../dev/zero`` is refused before anything is read.
    """
    if not isinstance(manifest, dict):
        return "the manifest is not a JSON object"
    if manifest.get("format") != FORMAT:
        return f"manifest format {manifest.get('format')!r}, expected {FORMAT}"
    s, world, files = manifest.get("step"), manifest.get("world_size"), manifest.get("files")
    if type(s) is not int or s < 0 or (step is not None and step >= 0 and s != step):
        return f"manifest step {s!r} does not match its folder (step {step})"
    if type(world) is not int or world < 1:
        return f"manifest world_size {world!r} is not a positive integer"
    for key, types in _OPTIONAL.items():
        if (key in manifest and not isinstance(manifest[key], types)) or isinstance(manifest.get(key), bool):
            return f"manifest field {key} has the wrong type ({type(manifest[key]).__name__})"
        if isinstance(manifest.get(key), str) and _CONTROL.search(manifest[key]):
            return f"manifest field {key} holds control characters"
    model = manifest.get("profile", {}).get("model", {})
    if not isinstance(model, dict):
        return f"manifest field profile.model has the wrong type ({type(model).__name__})"
    if "factory" in model and not (isinstance(model["factory"], str) and _FACTORY.fullmatch(model["factory"])):
        return "manifest field profile.model.factory is not a 'package.module:function'"
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    for rel, digest in files.items():
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            return f"manifest entry {rel!r} has no sha256"
        if not inside_folder(rel):
            return f"manifest names {rel!r}, outside its checkpoint folder"
    if len(files) <= world:  # checked first: a forged world size must not make a list that large
        return f"manifest lists {len(files)} files, fewer than a checkpoint of world size {world} has"
    missing = [f for f in required_files(world) if f not in files]
    if missing:
        return f"manifest lacks {missing[0]} (a checkpoint of world size {world} has .metadata and one extra per rank)"
    if not any(f.endswith(".distcp") for f in files):
        return "manifest lists no tensor data (*.distcp)"
    if "proof" in manifest and (problem := proof_problem(manifest["proof"], world)):
        return problem
    sizes = manifest.get("sizes", {})  # absent from checkpoints written before manifests stated sizes
    if not isinstance(sizes, dict) or ("sizes" in manifest and set(sizes) != set(files)):
        rel = next(iter(set(files) - set(sizes) if isinstance(sizes, dict) else files), None)
        return f"manifest entry {rel!r} has no size" if rel else "manifest states sizes of files it does not list"
    for rel, size in sizes.items():
        if type(size) is not int or size < 0:
            return f"manifest entry {rel!r} has no size"
    return None


def proof_problem(raw: Any, world_size: int) -> str | None:
    """Why a manifest's ``proof`` is not one (a checkpoint written before proofs has none, which is no problem)."""
    try:
        proof = CheckpointProof.model_validate(raw)
    except ValidationError as exc:
        return f"manifest field proof is not a proof ({str(exc).splitlines()[0]})"
    if len(proof.rng) != world_size:
        return f"manifest field proof has {len(proof.rng)} RNG hashes for world size {world_size}"
    return None


def read_proof(manifest: dict[str, Any]) -> CheckpointProof | None:
    """The proof of a manifest ``manifest_problem`` passed; None when it has none."""
    return CheckpointProof.model_validate(manifest["proof"]) if "proof" in manifest else None


def inspect_checkpoint(uri: str, storage_options: dict[str, Any] | None = None, verify: bool = True) -> CheckpointInfo:
    """Read a checkpoint's manifest and (optionally) verify every file's checksum."""
    fs, base = filesystem(uri, storage_options)
    step = step_of(base)
    step = -1 if step is None else step
    info = CheckpointInfo(uri=uri, step=step, committed=False, valid=False)
    if not fs.exists(base):
        info.reason = "does not exist"
        return info
    with contextlib.suppress(FileNotFoundError):  # deleted meanwhile: the manifest check below says so
        info.size_bytes = sum(cast(dict[str, int], fs.du(base, total=False)).values())  # total=False: per file
    manifest_path = join(base, MANIFEST)
    if not fs.exists(manifest_path):
        info.reason = f"not committed (no {MANIFEST}): an interrupted save"
        return info
    try:
        info.manifest = json.loads(read_file(fs, base, MANIFEST, limit=MANIFEST_MAX_BYTES, kind="manifest"))
    except StoreError:
        raise  # the store is away, which says nothing about this checkpoint
    except FileNotFoundError:  # deleted since: as if never committed
        info.reason = f"not committed (no {MANIFEST}): an interrupted save"
        return info
    except ChecksumMismatch as exc:  # not a regular file, or too large to be a manifest
        info.reason = str(exc)
        return info
    except Exception as exc:  # noqa: BLE001 - whatever the store returned, the manifest is unusable
        info.reason = f"unreadable {MANIFEST} ({exc.__class__.__name__})"
        return info
    info.committed = True
    if problem := manifest_problem(info.manifest, step):
        info.reason = problem
        info.manifest = {}  # nothing of an untrustworthy manifest is used
        return info
    if not verify:
        info.valid = True
        return info
    info.reason = _files_problem(fs, base, info.manifest) or ""
    info.valid = not info.reason
    return info


def _files_problem(fs: Any, base: str, manifest: dict[str, Any]) -> str | None:
    """Why the files a (well-formed) manifest lists are not what it says; None when every one is. Each is read only
    as a regular file inside the folder, up to the size the manifest states (``trainer.checkpoint.files``)."""
    files, sizes = sorted(manifest["files"].items()), manifest.get("sizes", {})
    rel = ""
    try:
        for rel, _ in files:  # sizes first: a truncated, grown or swapped file is found before anything is hashed
            file_size(fs, base, rel, sizes.get(rel))
        for rel, expected in files:
            if sha256_of(fs, base, rel, sizes.get(rel)) != expected:
                return f"file {rel} fails its sha256 (truncated or altered)"
    except FileNotFoundError:
        return f"file {rel} is missing"
    except ChecksumMismatch as exc:
        return str(exc)
    return None


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
    verify: bool = True,
) -> list[str]:
    """Delete committed checkpoints beyond the newest ``keep_last``; the newest valid one and ``protect`` stay.

    ``verify=False`` (the checkpointer, which protects what it just committed and what it resumed from) judges
    "valid" by the manifests alone, so pruning reads no checkpoint data back."""
    infos = [i for i in list_checkpoints(ckpt_root, storage_options, verify=False) if i.committed]
    doomed = [i for i in (infos[:-keep_last] if keep_last > 0 else []) if i.uri not in protect]
    if doomed:
        # Newer checkpoints may be committed but corrupt (kept for inspection): never prune the one resume needs.
        if verify:
            newest_valid, _ = latest_valid(ckpt_root, storage_options)
        else:
            newest_valid = next((i for i in reversed(infos) if i.valid), None)
        if newest_valid is not None:
            doomed = [i for i in doomed if i.uri != newest_valid.uri]
    for info in doomed:
        remove_checkpoint(info.uri, storage_options)
    return [info.uri for info in doomed]


def remove_checkpoint(uri: str, storage_options: dict[str, Any] | None = None) -> None:
    """Delete a checkpoint folder, its manifest first: a half-deleted checkpoint must never look committed."""
    fs, path = filesystem(uri, storage_options)
    remove(fs, join(path, MANIFEST))
    remove(fs, path, recursive=True)


def require_valid(uri: str, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    info = inspect_checkpoint(uri, storage_options, verify=True)
    if not info.valid:
        raise CheckpointError(f"checkpoint {uri} is not usable: {info.reason}")
    return info
