"""Saving during training: synchronous or DCP-async, committed by rank 0 once every rank's files are written.

Async: the loop blocks only while DCP stages the state into CPU memory; a
background thread writes it (over its own gloo process group, so it never
shares a communicator with the training collectives), then rank 0 checksums
the files and writes ``trainpipe.json``. At most one save is in flight. A failed
background write is logged and counted, leaves the previous checkpoint intact,
and does not stop training; the final checkpoint is synchronous.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from trainer import checkpoint as ckpt
from trainer.store import filesystem, join

log = logging.getLogger("trainpipe.checkpointer")


class Checkpointer:
    def __init__(self, ckpt_root: str, keep_last: int, storage_options: dict[str, Any] | None, use_async: bool,
                 protect: str | None = None, stale_steps: set[int] | None = None, before_commit: Callable[[int], None] | None = None,
                 on_commit: Callable[[int, float, float], None] | None = None):
        self.root, self.keep_last, self.so = ckpt_root, keep_last, storage_options or {}
        self.use_async = use_async
        self.protect = protect  # the checkpoint this attempt resumed from: never pruned while we run
        self.stale_steps = stale_steps or set()  # directories newer than the resume point: invalid or partial
        self.before_commit = before_commit  # fault drills: delay or die between write and commit
        self.on_commit = on_commit  # (step, stall_s, save_s) on rank 0
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._pg = dist.new_group(backend="gloo") if use_async and dist.is_initialized() else None
        self._stager = CachedStager()
        self._inflight: threading.Thread | None = None
        self.committed: dict[str, Any] = {}
        self.failures = 0
        self.stalls_s: list[float] = []  # time the loop was blocked, per save

    def save(self, step: int, state: dict[str, Any], rank_extra: dict[str, Any], manifest: dict[str, Any], sync: bool = False) -> float:
        """Start (async) or complete (sync) a checkpoint of ``step``; return the seconds the caller was blocked."""
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight
        uri = ckpt.step_uri(self.root, step)
        if step in self.stale_steps:  # every rank knows the same set, so only then do they coordinate
            self._clear_stale(uri)
        ckpt.write_rank_extra(uri, self.rank, rank_extra, self.so)
        if sync or not self.use_async:
            dcp.save(state, storage_writer=FsspecWriter(uri, **self.so))
            self._commit(step, uri, manifest, t0, time.perf_counter() - t0)
            stall = time.perf_counter() - t0  # the commit (checksums, manifest) blocks the loop too
            self.stalls_s.append(stall)
            return stall
        future = dcp.async_save(state, storage_writer=FsspecWriter(uri, **self.so), process_group=self._pg,
                                async_stager=self._stager)
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        self._inflight = threading.Thread(target=self._finish, args=(future, step, uri, manifest, t0, stall),
                                          name=f"ckpt-{step}", daemon=True)
        self._inflight.start()
        return stall

    def wait(self) -> None:
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None

    def _finish(self, future, step: int, uri: str, manifest: dict[str, Any], t0: float, stall: float) -> None:
        try:
            future.result()
        except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
            self.failures += 1
            log.error("background checkpoint %s failed (%s: %s); the previous checkpoint stays; training continues",
                      uri, exc.__class__.__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            return
        try:
            self._commit(step, uri, manifest, t0, stall)
        except Exception as exc:  # noqa: BLE001
            self.failures += 1
            log.error("committing checkpoint %s failed (%s); the previous checkpoint stays", uri, exc)

    def _commit(self, step: int, uri: str, manifest: dict[str, Any], t0: float, stall: float) -> None:
        manifest = {k: v() if callable(v) else v for k, v in manifest.items()}  # deferred values, e.g. the digest
        # DCP returns on rank 0 only after every rank reported its writes (and each
        # wrote its extra file before starting), so rank 0 may commit without a barrier.
        if self.before_commit:
            self.before_commit(step)
        if self.rank != 0:
            self.committed = {"step": step, "uri": uri, "at": time.time(), "digest": manifest.get("model_digest")}
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        ckpt.commit(uri, {**manifest, "world_size": world}, self.so)
        removed = ckpt.prune_checkpoints(self.root, self.keep_last, self.so, protect=[p for p in (self.protect,) if p])
        save_s = time.perf_counter() - t0
        self.committed = {"step": step, "uri": uri, "at": time.time(), "digest": manifest.get("model_digest")}
        log.info("committed checkpoint %s (blocked %.0f ms, total %.2fs)%s", uri, stall * 1000, save_s,
                 f", pruned {len(removed)}" if removed else "")
        if self.on_commit:
            self.on_commit(step, stall, save_s)

    def _clear_stale(self, uri: str) -> None:
        """A directory already at this step is an earlier attempt's invalid or partial save: say so, then replace it."""
        fs, path = filesystem(uri, self.so)
        if dist.is_initialized():
            dist.barrier()  # every rank has seen the old directory before rank 0 removes it
        if self.rank == 0 and fs.exists(path):
            info = ckpt.inspect_checkpoint(uri, self.so, verify=False)
            log.warning("replacing %s at %s (%s)", "an earlier checkpoint" if info.committed else "a partial save", uri,
                        info.reason or "committed by an earlier attempt")
            if info.committed:
                fs.rm(join(path, ckpt.MANIFEST))
            fs.rm(path, recursive=True)
        if dist.is_initialized():
            dist.barrier()


class CachedStager(BlockingAsyncStager):
    """DCP ``AsyncStager`` that copies the state into CPU buffers allocated once and reused.

    DCP's own caching stager pins its buffers, which needs an accelerator; this one
    pins only when CUDA is there. Reuse is safe because at most one save is in
    flight: the buffers are free again before the next ``stage``.
    """

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=False)
        self._cache: dict[str, torch.Tensor] = {}

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._copy(state_dict, "")

    def _copy(self, obj: Any, key: str) -> Any:
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
