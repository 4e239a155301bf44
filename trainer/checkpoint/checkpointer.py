"""The ranks' one save path: synchronous or DCP-async, committed by rank 0 once every rank's files are written.

Async: the loop blocks only while DCP stages the state into CPU memory; a
background thread writes it (over its own gloo process group, so it never
shares a communicator with the training collectives), then rank 0 checksums
the files and writes ``trainpipe.json``. At most one save is in flight. A failed
background write is logged and counted, leaves the previous checkpoint intact,
and does not stop training; the final checkpoint is synchronous.

DCP's save returns on rank 0 only after every rank reported its writes, and each
rank writes its extra file before it starts, so rank 0 commits without a barrier.
"""

from __future__ import annotations

import copy
import io
import logging
import posixpath
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from trainer.checkpoint import catalog
from trainer.layout import rank_extra, step_uri
from trainer.loop.callbacks import Callback
from trainer.store import filesystem

log = logging.getLogger("trainpipe.checkpointer")


@dataclass(frozen=True)
class Committed:
    step: int
    uri: str
    digest: str | None
    at: float


class Checkpointer:
    """Saves a rank's share of each checkpoint under ``root``; rank 0 commits, prunes and announces it.

    ``protect`` (the checkpoint this attempt resumed from) is never pruned while
    the attempt runs; ``stale_steps`` are folders newer than the resume point,
    left by an earlier attempt, replaced (with a warning) when the run reaches
    their step again. ``events`` observe the write (before commit) and the commit.
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
    ):
        self.root, self.keep_last, self.so = root, keep_last, storage_options or {}
        self.use_async, self.protect = use_async, protect
        self.stale_steps = stale_steps or set()
        self.events = events or Callback()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._pg = dist.new_group(backend="gloo") if use_async and dist.is_initialized() else None
        self._stager = CachedStager()
        self._inflight: threading.Thread | None = None
        self.committed: Committed | None = None
        self.failures = 0
        self.stalls_s: list[float] = []  # time the caller was blocked, per save

    def save(
        self,
        step: int,
        state: dict[str, Any],
        rank_extra_state: dict[str, Any],
        manifest: dict[str, Any],
        sync: bool = False,
    ) -> float:
        """Start (async) or complete (sync) the checkpoint of ``step``; return the seconds the caller was blocked.

        ``manifest`` values may be callables, evaluated just before the commit
        (e.g. a digest hashed off the loop's thread).
        """
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight
        uri = step_uri(self.root, step)
        if step in self.stale_steps:  # every rank knows the same set, so only then do they coordinate
            self._clear_stale(uri)
        self._write_rank_extra(uri, rank_extra_state)
        if sync or not self.use_async:
            dcp.save(state, storage_writer=FsspecWriter(uri, **self.so))
            try:
                self._commit(step, uri, manifest, t0, stall=None)
            finally:
                self._settle()
            stall = time.perf_counter() - t0  # the commit (checksums, manifest) blocks the caller too
        else:
            future = dcp.async_save(
                state, storage_writer=FsspecWriter(uri, **self.so), process_group=self._pg, async_stager=self._stager
            )
            stall = time.perf_counter() - t0
            self._inflight = threading.Thread(
                target=self._finish, args=(future, step, uri, manifest, t0, stall), name=f"ckpt-{step}", daemon=True
            )
            self._inflight.start()
        self.stalls_s.append(stall)
        return stall

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed or has failed."""
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None

    def _write_rank_extra(self, uri: str, extra: dict[str, Any]) -> None:
        fs, base = filesystem(uri, self.so)
        buf = io.BytesIO()
        torch.save(extra, buf)
        path = rank_extra(base, self.rank)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as fh:
            fh.write(buf.getvalue())

    def _finish(self, future, step: int, uri: str, manifest: dict[str, Any], t0: float, stall: float) -> None:
        what = "background write"
        try:
            future.result()
            what = "commit"
            self._commit(step, uri, manifest, t0, stall)
        except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
            self._failed(uri, what, exc)
        finally:
            self._settle()

    def _settle(self) -> None:
        """Every rank waits for rank 0's commit, so ``wait()`` returning means committed (or failed) everywhere."""
        if dist.is_initialized():
            dist.barrier(group=self._pg)  # the checkpointer's own group when async: never the training one

    def _failed(self, uri: str, what: str, exc: BaseException) -> None:
        self.failures += 1
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        log.error(
            "checkpoint %s: %s failed (%s: %s); the previous checkpoint stays; training continues",
            uri,
            what,
            exc.__class__.__name__,
            first,
        )

    def _commit(self, step: int, uri: str, manifest: dict[str, Any], t0: float, stall: float | None) -> None:
        body = {k: v() if callable(v) else v for k, v in manifest.items()}
        self.events.on_checkpoint_written(step)
        if self.rank == 0:
            catalog.commit(uri, {**body, "world_size": self.world_size}, self.so)
            removed = catalog.prune_checkpoints(
                self.root, self.keep_last, self.so, protect=[p for p in (self.protect,) if p]
            )
            self.committed = Committed(step, uri, body.get("model_digest"), time.time())
            save_s = time.perf_counter() - t0
            blocked = save_s if stall is None else stall
            log.info(
                "committed checkpoint %s (blocked %.0f ms, total %.2fs)%s",
                uri,
                blocked * 1000,
                save_s,
                f", pruned {len(removed)}" if removed else "",
            )
            self.events.on_checkpoint_committed(step, blocked, save_s)
        else:
            self.committed = Committed(step, uri, body.get("model_digest"), time.time())

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
