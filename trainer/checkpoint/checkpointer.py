"""The ranks' one save path: synchronous or DCP-async, committed by rank 0 once every rank's files are written.

Async: the loop blocks only while DCP stages the state into CPU memory; a
background thread uploads it (over its own gloo process group, so it never
shares a communicator with the training collectives), the ranks exchange the
sha256 and size of what they wrote (hashed while writing: nothing is read back),
and rank 0 writes ``trainpipe.json``. At most one save is in flight, and the loop
never queues behind it: while an upload is still running (a slow or absent
store), the next save is skipped and said so, and when the upload ends a
``store_outage`` incident tells how long it took and which recovery points were
lost. A failed upload is a ``checkpoint_failed`` incident that leaves the
previous checkpoint intact and does not stop training; the next save tries
again. The final checkpoint is synchronous.
"""

from __future__ import annotations

import copy
import hashlib
import io
import logging
import posixpath
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict_saver as dcp  # its __all__ names save and async_save
from fsspec.implementations.local import LocalFileSystem
from pydantic import ValidationError
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.tensor import DTensor

from trainpipe.trainer.checkpoint import catalog
from trainpipe.trainer.checkpoint.peer_copy import PeerRing, send_to_peer
from trainpipe.trainer.checkpoint.proof import CheckpointProof, RankProof
from trainpipe.trainer.checkpoint.storage import HashingWriter
from trainpipe.trainer.device import new_group
from trainpipe.trainer.errors import CheckpointError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.loop.callbacks import Callback
from trainpipe.trainer.store import filesystem, write_json
from trainpipe.trainer.store_paths import join, rank_extra, step_uri

log = logging.getLogger("trainpipe.checkpointer")


@dataclass(frozen=True)
class Committed:
    step: int
    uri: str
    digest: str | None
    at: float


@dataclass
class _InFlight:
    """The async save being uploaded, and the saves skipped while it was."""

    step: int
    started: float  # time.monotonic()
    thread: threading.Thread
    skipped: list[int] = field(default_factory=list)
    outcome: str = "uploading"  # then "committed" or "failed"
    ended: float | None = None  # time.monotonic() when it committed or failed


class Checkpointer:
    """Saves a rank's share of each checkpoint under ``root``; rank 0 commits, prunes and announces it.

    ``protect`` (the checkpoint this attempt resumed from) is never pruned while
    the attempt runs; ``stale_steps`` are folders newer than the resume point,
    left by an earlier attempt, replaced (with a warning) when the run reaches
    their step again. ``events`` observe the write (before commit), the commit
    and incidents. A save finding the previous upload still running after
    ``grace_s`` is skipped. ``hash_staged``: an async save's proof is hashed from the
    staged copy on the upload's thread (see ``save``). ``tier``: ``store``, or ``memory``
    for the memory tier's snapshots (trainer.checkpoint.memory_tier), whose commits and
    skips are not news: logged at debug level, and no store outage is reported. ``peers``:
    the memory tier across hosts (trainer.checkpoint.peer_copy): before a snapshot commits,
    each rank's files are copied to its peer on the next host, and each host's leader
    commits and prunes its own host's folder.
    """

    def __init__(
        self,
        root: str,
        keep_last: int,
        storage_options: dict[str, Any] | None,
        use_async: bool,
        protect: str | None = None,
        stale_steps: set[int] | None = None,
        events: Callback | None = None,
        grace_s: float = 1.0,
        hash_staged: bool = False,
        tier: str = "store",
        peers: PeerRing | None = None,
    ):
        self.root, self.keep_last, self.so = root, keep_last, storage_options or {}
        self.use_async, self.protect, self.grace_s = use_async, protect, grace_s
        self.hash_staged, self.tier = hash_staged, tier
        self.peers = peers if use_async else None  # the copies travel on the upload's thread and group
        self.stale_steps = stale_steps or set()
        self.events = events or Callback()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        # Uploads talk over one gloo group, and the "still uploading?" vote over another, so the vote never
        # interleaves with an upload's own collectives.
        self._pg = new_group(backend="gloo") if use_async and dist.is_initialized() else None
        self._vote_pg = new_group(backend="gloo") if use_async and dist.is_initialized() else None
        self._stager = CachedStager()
        self._inflight: _InFlight | None = None
        self.committed: Committed | None = None
        self.failures = 0
        self.skipped: list[int] = []  # steps whose save was skipped behind a running upload
        self.stalls_s: list[float] = []  # time the caller was blocked, per save
        self.saves_s: list[float] = []  # from the start of a save to its commit, per committed save (any thread)
        self.taken_stalls_s: list[float] = []  # time blocked, per save not skipped

    def save(
        self,
        step: int,
        state: dict[str, Any],
        rank_extra_state: dict[str, Any],
        manifest: dict[str, Any],
        sync: bool = False,
        proof: Callable[[dict[str, Any]], RankProof] | None = None,
    ) -> float:
        """Start (async) or complete (sync) the checkpoint of ``step``; return the seconds the caller was blocked.

        ``manifest`` values may be callables, evaluated just before the commit
        (e.g. a digest hashed off the loop's thread). ``proof(state)`` gives this rank's
        part of the checkpoint's proof (``trainer.checkpoint.proof``), computed only when
        the save goes ahead: on the loop's thread from the live state (counted in the
        stall), or with ``hash_staged`` from the async save's staged copy on the upload's
        thread. The commit gathers every rank's and records their sum as the manifest's
        ``proof``.
        """
        t0 = time.perf_counter()
        if not sync and self.use_async and self._still_uploading():
            self._skip(step)
        else:
            self.wait()  # at most one save in flight: a sync save waits for it
            self._start(step, state, rank_extra_state, manifest, sync, t0, proof)
            self.taken_stalls_s.append(time.perf_counter() - t0)
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        return stall

    def _start(
        self,
        step: int,
        state: dict[str, Any],
        extra: dict[str, Any],
        manifest: dict[str, Any],
        sync: bool,
        t0: float,
        make_proof: Callable[[dict[str, Any]], RankProof] | None,
    ) -> None:
        uri = step_uri(self.root, step)
        staged = self.hash_staged and not (sync or not self.use_async)
        proof = make_proof(state) if make_proof and not staged else None
        if step in self.stale_steps:  # every rank knows the same set, so only then do they coordinate
            self._clear_stale(uri)
        buf = io.BytesIO()
        torch.save(extra, buf)
        writer = HashingWriter(uri, **self.so)
        if sync or not self.use_async:
            files = {**self._write_rank_extra(uri, buf.getvalue())}
            dcp.save(state, storage_writer=writer)
            try:
                self._commit(step, uri, manifest, t0, None, *self._gather({**files, **_written(writer)}, proof=proof))
            finally:
                self._settle()
            return
        future = dcp.async_save(state, storage_writer=writer, process_group=self._pg, async_stager=self._stager)
        if staged and make_proof:  # the copy DCP uploads: hashed on the upload's thread, the loop goes on
            copy_of, proof = self._stager.staged, lambda: make_proof(copy_of)  # type: ignore[assignment]
        stall = time.perf_counter() - t0
        thread = threading.Thread(
            target=self._finish,
            args=(future, writer, buf.getvalue(), step, uri, manifest, t0, stall, proof),
            name=f"ckpt-{step}",
            daemon=True,
        )
        self._inflight = _InFlight(step, time.monotonic(), thread)
        thread.start()

    def _still_uploading(self) -> bool:
        """Whether the previous upload is still running on any rank after ``grace_s`` (every rank gets the same
        answer, so all of them skip or none)."""
        busy = False
        if self._inflight is not None:
            self._inflight.thread.join(timeout=self.grace_s)
            busy = self._inflight.thread.is_alive()
        if self._vote_pg is not None:
            flag = torch.tensor([int(busy)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._vote_pg)
            busy = bool(flag.item())
        return busy

    def _skip(self, step: int) -> None:
        inflight = self._inflight
        self.skipped.append(step)
        if inflight is None:  # another rank is still uploading; this one's upload ended
            return
        inflight.skipped.append(step)
        if self.rank == 0 and self.tier == "store":
            log.warning(
                "checkpoint at step %d skipped: the upload of step %d is still running after %.1fs (store slow "
                "or unavailable); the next checkpoint tries again",
                step,
                inflight.step,
                time.monotonic() - inflight.started,
            )

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed or has failed."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        inflight.thread.join()
        if inflight.skipped:
            self._report_outage(inflight)

    def _report_outage(self, inflight: _InFlight) -> None:
        """Rank 0: how long the store held an upload, and which recovery points that cost."""
        if self.rank != 0 or self.tier != "store":
            return
        took = (inflight.ended or time.monotonic()) - inflight.started
        steps = ", ".join(str(s) for s in inflight.skipped)
        interval = inflight.skipped[0] - inflight.step
        incident = Incident(
            kind="store_outage",
            detail=f"the checkpoint upload of step {inflight.step} took {took:.1f}s and {inflight.outcome} "
            f"(store slow or unavailable); {len(inflight.skipped)} checkpoint(s) skipped meanwhile (step {steps}): "
            f"a failure then would have lost up to {interval * len(inflight.skipped)} more step(s)",
            rank=self.rank,
            step=inflight.step,
            detected_after_s=round(took, 1),
            fatal=False,
        )
        log.warning("%s", incident.line())
        self.events.on_incident(incident)

    def _write_rank_extra(self, uri: str, data: bytes) -> dict[str, tuple[str, int]]:
        """This rank's extra state (RNG states), written whole (retried on an object store); its name → (sha256,
        bytes)."""
        fs, base = filesystem(uri, self.so)
        path = rank_extra(base, self.rank)
        if isinstance(fs, LocalFileSystem):
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.pipe_file(path, data)
        return {posixpath.relpath(path, base): (hashlib.sha256(data).hexdigest(), len(data))}

    def _finish(
        self,
        future,
        writer: HashingWriter,
        extra: bytes,
        step: int,
        uri: str,
        manifest: dict,
        t0: float,
        stall: float,
        proof: RankProof | Callable[[], RankProof] | None,
    ) -> None:
        what, files, problem = "upload", {}, None
        if callable(proof):
            try:
                proof = proof()
            except Exception as exc:  # noqa: BLE001 - a proof that cannot be made leaves a checkpoint without one
                log.warning("checkpoint of step %d committed without a proof (%s)", step, _line(exc))
                proof = None
        try:
            files = self._write_rank_extra(uri, extra)
        except Exception as exc:  # noqa: BLE001 - whatever the store raised: this save failed
            problem = exc
        try:  # always awaited before ``_gather``: DCP's upload talks over the same process group
            future.result()
        except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
            problem = problem or _cause(exc)
        if problem is None:
            files.update(_written(writer))
        try:
            gathered = self._gather(None if problem else files, _line(problem) if problem else "", proof)
            if problem is not None:
                raise problem
            if self.peers is not None:
                what = "copy to the peer host"
                self._copy_to_peer(uri, files, gathered[0])
            what = "commit"
            self._commit(step, uri, manifest, t0, stall, *gathered)
            if self._inflight is not None:
                self._inflight.outcome = "committed"
        except BaseException as exc:  # noqa: BLE001 - as above
            self._failed(step, uri, what, exc)
        finally:
            if self._inflight is not None:
                self._inflight.ended = time.monotonic()
            self._settle()

    def _gather(
        self, files: dict[str, tuple[str, int]] | None, error: str = "", proof: RankProof | None = None
    ) -> tuple[dict[str, tuple[str, int]], CheckpointProof | None]:
        """Every rank's written files (name → (sha256, bytes)), merged, and the sum of their proofs (None unless
        every rank gave one). CheckpointError naming the first rank whose write failed (``files`` None, ``error``
        saying why)."""
        every: list[Any] = [(files, error, proof)]
        if dist.is_initialized():
            every = [None] * self.world_size
            dist.all_gather_object(every, (files, error, proof), group=self._pg)
        failed = [(r, e) for r, (f, e, _) in enumerate(every) if f is None]
        if failed:
            raise CheckpointError(f"rank {failed[0][0]}'s files did not upload ({failed[0][1]})")
        proofs = [p for _, _, p in every]
        combined = None
        if None not in proofs:
            try:
                combined = CheckpointProof.combine(proofs)  # type: ignore[arg-type]
            except ValidationError as exc:  # e.g. a count carried from a forged manifest: commit without a proof
                log.warning("checkpoint committed without a proof: %s", str(exc).splitlines()[0])
        return {name: written for f, _, _ in every for name, written in f.items()}, combined

    def _copy_to_peer(self, uri: str, mine: dict[str, tuple[str, int]], every: dict[str, tuple[str, int]]) -> None:
        """Send this rank's files to its peer and keep its source's (every rank alike); CheckpointError on every
        rank naming the first rank whose copy failed."""
        assert self.peers is not None
        _, base = filesystem(uri, self.so)
        problem = send_to_peer(base, mine, every, self.peers, self._pg)  # type: ignore[arg-type]
        problems: list[str] = [""] * self.world_size
        dist.all_gather_object(problems, problem, group=self._pg)
        if failed := next(((r, p) for r, p in enumerate(problems) if p), None):
            raise CheckpointError(f"rank {failed[0]}'s copy on its peer host failed: {failed[1]}")

    def _settle(self) -> None:
        """Every rank waits for rank 0's commit, so ``wait()`` returning means committed (or failed) everywhere."""
        if dist.is_initialized():
            dist.barrier(group=self._pg)  # the checkpointer's own group when async: never the training one

    def _failed(self, step: int, uri: str, what: str, exc: BaseException) -> None:
        self.failures += 1
        if self._inflight is not None:
            self._inflight.outcome = "failed"
        previous = f"step {self.committed.step}" if self.committed else "the previous checkpoint"
        incident = Incident(
            kind="checkpoint_failed",
            detail=f"checkpoint {uri}: {what} failed ({_line(exc)}); {previous} stays the newest; training "
            "continues and the next checkpoint tries again",
            rank=self.rank,
            step=step,
            fatal=False,
            error=exc.__class__.__name__,
        )
        log.error("%s", incident.line())
        if self.rank == 0:  # every rank fails alike (DCP and ``_gather`` share each rank's error): report once
            self.events.on_incident(incident)

    def _commit(
        self,
        step: int,
        uri: str,
        manifest: dict[str, Any],
        t0: float,
        stall: float | None,
        files: dict[str, tuple[str, int]],
        proof: CheckpointProof | None = None,
    ) -> None:
        body = {k: v() if callable(v) else v for k, v in manifest.items()}
        if proof is not None:
            body["proof"] = proof.model_dump()
        self.events.on_checkpoint_written(step)
        self.saves_s.append(time.perf_counter() - t0)
        if self.rank == 0:
            hashes = {name: sha for name, (sha, _) in files.items()}
            sizes = {name: size for name, (_, size) in files.items()}
            written = None
            try:
                written = catalog.commit(uri, {**body, "world_size": self.world_size}, hashes, self.so, sizes)
            finally:  # the other hosts wait for it either way
                self._commit_on_every_host(uri, written)
            removed = catalog.prune_checkpoints(
                self.root, self.keep_last, self.so, protect=[p for p in (self.protect, uri) if p], verify=False
            )
            self.committed = Committed(step, uri, _digest(body), time.time())
            save_s = time.perf_counter() - t0
            blocked = save_s if stall is None else stall
            log.log(
                logging.INFO if self.tier == "store" else logging.DEBUG,
                "committed %s %s (blocked %.0f ms, total %.2fs)%s",
                "checkpoint" if self.tier == "store" else "snapshot",
                uri,
                blocked * 1000,
                save_s,
                f", pruned {len(removed)}" if removed else "",
            )
            self.events.on_checkpoint_committed(step, blocked, save_s)
        else:
            self._commit_on_every_host(uri, None)
            self.committed = Committed(step, uri, _digest(body), time.time())

    def _commit_on_every_host(self, uri: str, written: dict[str, Any] | None) -> None:
        """With ``peers``: rank 0's manifest, as it wrote it, committed by every other host's leader in its own
        host's folder, which it then prunes (every rank calls it)."""
        if self.peers is None:
            return
        box = [written]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        if self.rank != 0 and self.peers.leader and box[0] is not None:
            fs, base = filesystem(uri, self.so)
            write_json(fs, join(base, catalog.MANIFEST), box[0])
            catalog.prune_checkpoints(self.root, self.keep_last, self.so, protect=[uri], verify=False)

    def _clear_stale(self, uri: str) -> None:
        """A folder already at this step is an earlier attempt's invalid or partial save: say so, then replace it."""
        if dist.is_initialized():
            dist.barrier()  # every rank has seen the old folder before rank 0 removes it
        if self.rank == 0:
            info = catalog.inspect_checkpoint(uri, self.so, verify=False)
            if info.reason != "does not exist":
                log.warning(
                    "replacing %s at %s (%s)",
                    "an earlier checkpoint" if info.committed else "a partial save",
                    uri,
                    info.reason or "committed by an earlier attempt",
                )
                catalog.remove_checkpoint(uri, self.so)
        if dist.is_initialized():
            dist.barrier()


def _written(writer: HashingWriter) -> dict[str, tuple[str, int]]:
    """The files ``writer`` wrote: name → (sha256, bytes)."""
    sizes = writer.sizes()
    return {name: (sha, sizes[name]) for name, sha in writer.hashes().items()}


def _cause(exc: BaseException) -> BaseException:
    """The first rank's own error inside DCP's CheckpointException (which maps rank → (error, traceback))."""
    failures = getattr(exc, "failures", None) or {}
    return next(iter(failures.values()))[0] if failures else exc


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{exc.__class__.__name__}: {text.splitlines()[0][:200] if text else ''}"


class CachedStager(BlockingAsyncStager):
    """DCP ``AsyncStager`` that copies the state into CPU buffers allocated once and reused.

    DCP's own caching stager pins its buffers, which needs an accelerator; this one
    pins only when CUDA is there. Reuse is safe because at most one save is in
    flight: the buffers are free again before the next ``stage``.
    """

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=False)
        self._cache: dict[str, torch.Tensor] = {}
        self.staged: dict[str, Any] = {}

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.staged = self._copy(state_dict, "")  # the copy being uploaded, until the next stage
        return self.staged

    def _copy(self, obj: Any, key: str) -> Any:
        if isinstance(obj, DTensor):  # FSDP2: this rank's shard, in a DTensor that still says where it belongs
            return DTensor(self._copy(obj.to_local(), key), obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            buf = self._cache.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=torch.cuda.is_available())
                self._cache[key] = buf
            return buf.copy_(obj.detach(), non_blocking=False)
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{key}.{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, f"{key}.{i}") for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def close(self) -> None:
        self._cache.clear()


def _digest(manifest: dict[str, Any]) -> str | None:
    digest = manifest.get("model_digest")
    return digest if isinstance(digest, str) else None
