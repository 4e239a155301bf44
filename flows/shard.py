"""The shard stage as Prefect runs it: plan, map the pieces over the engine's task runner, assemble
(docs/architecture.md §3). Orchestration only: the work is in tasks/shard.py and trainer/data.

Where the map runs is ``data.engine``: ``local`` is Prefect's process pool on this machine (one process per core,
or ``data.workers``; a single worker runs in this process), a ``tcp://`` address is a dask.distributed scheduler
through prefect-dask, whose workers read the source and write the store themselves. The dataset's bytes do not
depend on which: the pieces come from the content, and the manifest lists them in plan order.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TypeVar, cast

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from trainpipe.tasks.common import answered
from trainpipe.tasks.shard import assemble_dataset, find_pieces, plan_shards, tokenize_piece
from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data import source_hashes
from trainpipe.trainer.data.piece import PieceResult
from trainpipe.trainer.data.plan import PieceSpec
from trainpipe.trainer.data.shard import DatasetInfo, ShardPlan, check_dataset, forced_pieces, redo_map
from trainpipe.trainer.errors import DataError, TrainpipeError
from trainpipe.trainer.profile_files import private_home

# A worker process costs seconds to start (spawn, imports): one more is started per this much text to tokenize,
# about what one tokenizes in that time (benchmarks/shard_throughput.py); below it, pieces run in this process.
WORKER_WORTH_BYTES = 32 << 20
POLL_S = 2.0


class ShardProgress:
    """Pieces done, MB/s and the time left: a Prefect progress artifact (at most every two seconds) and a bar
    on the terminal."""

    def __init__(self, plan: ShardPlan, terminal: bool):
        self.total, self.pieces, self.terminal = max(plan.bytes, 1), len(plan.pieces), terminal
        self.source = plan.job.data.source
        self.done_bytes, self.done, self.started, self.shown, self.id = 0, 0, time.monotonic(), 0.0, None
        self.failed = False

    def add(self, piece: PieceSpec) -> None:
        self.done += 1
        self.done_bytes += piece.bytes
        now = time.monotonic()
        if self.done < self.pieces and now - self.shown < 2.0:
            return
        self.shown = now
        rate = self.done_bytes / max(now - self.started, 1e-6)
        left = (self.total - self.done_bytes) / rate if rate else 0.0
        line = f"{self.done}/{self.pieces} pieces, {rate / 2**20:.1f} MB/s, {left:.0f} s left"
        self._artifact(100.0 * self.done_bytes / self.total, f"shard {self.source}: {line}")
        if self.terminal:
            bar = "#" * int(30 * self.done_bytes / self.total)
            sys.stderr.write(f"\rshard: [{bar:<30}] {line}   " + ("\n" if self.done == self.pieces else ""))
            sys.stderr.flush()

    def finish(self, text: str) -> None:
        self._artifact(100.0, f"shard {self.source}: {text}")

    def _artifact(self, percent: float, description: str) -> None:
        if self.failed:
            return
        try:
            if self.id is None:
                self.id = answered(create_progress_artifact(min(percent, 100.0), description=description))
            else:
                update_progress_artifact(self.id, min(percent, 100.0), description=description)
        except Exception as exc:  # noqa: BLE001 - progress is worth a warning, never the stage
            self.failed = True
            get_run_logger().warning("shard progress artifact not updated (%s: %s)", exc.__class__.__name__, exc)


T = TypeVar("T")


def quoted(value: T) -> T:
    """``value`` handed to a task as Prefect's ``quote``: the task gets the value itself, and Prefect does not
    walk it for futures (these hold every file of the corpus: seconds). Typed as the value, which the task sees."""
    return cast(T, quote(value))


def local_workers(data: DataConfig, pieces: int, new_bytes: int | None = None) -> int:
    """``data.workers`` processes, or without it one per core and per WORKER_WORTH_BYTES of new text; never more
    than there are pieces."""
    wanted = data.workers or min(os.cpu_count() or 1, math.ceil((new_bytes or 0) / WORKER_WORTH_BYTES) or 1)
    return max(1, min(wanted, pieces))


@contextlib.contextmanager
def task_runner(data: DataConfig, pieces: int, new_bytes: int | None = None) -> Iterator[TaskRunner]:
    """The task runner ``data.engine`` names, started; one line when a Dask scheduler does not answer."""
    if data.engine == "local":
        workers = local_workers(data, pieces, new_bytes)
        runner: TaskRunner = ThreadPoolTaskRunner(max_workers=1) if workers == 1 else ProcessPoolTaskRunner(workers)
        with runner:
            yield runner
        return
    from prefect_dask.task_runners import DaskTaskRunner

    runner = DaskTaskRunner(address=data.engine, client_kwargs={"timeout": data.engine_connect_s})
    with runner:
        try:
            runner.client  # noqa: B018 - connects now (prefect-dask connects at the first task otherwise)
        except (OSError, TimeoutError) as exc:
            raise DataError(
                f"data.engine {data.engine}: no Dask scheduler answered within {data.engine_connect_s:g} s "
                f"({exc.__class__.__name__}); start one (`dask scheduler`) or set data.engine: local"
            ) from None
        yield runner


def describe(piece: PieceSpec) -> str:
    """A piece as a person finds it: its number and the files it holds."""
    files = piece.first if piece.first == piece.last else f"{piece.first} … {piece.last}"
    return f"piece {piece.index} ({files})"


def failure(exc: BaseException) -> str:
    if exc.__class__.__name__ == "KilledWorker":  # dask.distributed gave up: the piece killed every worker it tried
        return "it ended the Dask worker running it, again and again (see the workers' logs for what ended them)"
    return f"{exc.__class__.__name__}: {exc}".splitlines()[0]


def map_pieces(
    runner: TaskRunner,
    plan: ShardPlan,
    pieces: tuple[PieceSpec, ...],
    show: ShardProgress | None,
    hashed: dict[int, dict[int, str]] | None = None,
):
    """Each piece's result, in plan order, as its task on ``runner`` returns it (``hashed``: the find pass's
    hashes by piece). On Dask, a cluster left without a worker for ``data.engine_no_worker_s`` while pieces
    wait is one line, not a wait without end."""
    finished: queue.Queue = queue.Queue()
    futures = {}
    # quote: Prefect would walk every segment of a piece looking for futures before its task starts. Not on Dask,
    # whose client rebuilds the annotation (a tuple) as a plain tuple on its way to the worker.
    wrap = quote if plan.job.data.engine == "local" else _as_is
    # Largest first: pieces differ in size several fold, and a large one started last would leave the other
    # workers idle at the end. Which worker ran which piece does not change the bytes.
    for p in sorted(pieces, key=lambda p: (-p.bytes, p.index)):
        parameters = {"job": wrap(plan.job), "piece": wrap(p), "hashed": wrap((hashed or {}).get(p.index))}
        future = runner.submit(tokenize_piece, parameters)
        futures[future] = p
        future.add_done_callback(finished.put)
    results: dict[int, PieceResult] = {}
    idle_since = None
    while len(results) < len(pieces):
        try:
            done = [finished.get(timeout=POLL_S)]
        except queue.Empty:
            done = []
        for future in done:
            piece = futures[future]
            try:
                results[piece.index] = future.result()
            except TrainpipeError:
                raise
            except Exception as exc:  # noqa: BLE001 - the engine's own failures (a worker killed for good, …)
                engine = plan.job.data.engine
                raise DataError(f"{describe(piece)} failed on data.engine {engine}: {failure(exc)}") from None
            if show is not None:
                show.add(piece)
        if not done and _workers(runner) == 0:
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > (wait := plan.job.data.engine_no_worker_s):
                raise DataError(
                    f"data.engine {plan.job.data.engine}: no Dask worker for {wait:g} s with "
                    f"{len(pieces) - len(results)} of "
                    f"{len(pieces)} pieces left; start workers (`dask worker {plan.job.data.engine}`) and run the "
                    "shard stage again (the pieces done are kept)"
                )
        else:
            idle_since = None
    return [results[p.index] for p in pieces]


def _as_is(value):
    return value


def _workers(runner: TaskRunner) -> int | None:
    """How many workers a Dask runner's cluster has now; None for another runner."""
    client = getattr(runner, "_client", None)
    if client is None:
        return None
    try:
        return len(client.scheduler_info().get("workers", {}))
    except Exception:  # noqa: BLE001 - the scheduler itself gone: its own error comes with the futures
        return None


def shard_corpus(
    data: DataConfig,
    store: StoreConfig,
    progress: bool = False,
    block_size: int | None = None,
    vocab_size: int | None = None,
    verify: bool = False,
) -> DatasetInfo:
    """Tokenize ``data.source`` into the store as mapped Prefect tasks on ``data.engine``; reuse what is there.

    With ``block_size`` a split too short for one sample is an error here, with ``vocab_size`` a tokenizer with
    more tokens than the model has rows. ``verify`` hashes reused files against their checksums."""
    started = time.perf_counter()
    plan = plan_shards(data, store, verify)
    show = ShardProgress(plan, progress)
    found: dict[int, PieceResult] = {}
    hashed: dict[int, dict[int, str]] = {}
    new_bytes = None
    # The hashes of unchanged files, by their stat, on the machine that runs the find pass (not under verify).
    hash_cache = None if verify or data.engine != "local" else source_hashes.cache_path(private_home())
    if data.engine == "local":  # start only as many worker processes as there is new text for
        # quote: these and the results below hold every file of the corpus, which Prefect would walk (seconds).
        looked = find_pieces(quoted(plan.job), quoted(list(plan.pieces)), hash_cache)
        found = {x.index: x.found for x in looked if x.found is not None}
        hashed = {x.index: x.hashed for x in looked if x.hashed}
        for index in found:
            show.add(plan.pieces[index])
        new_bytes = sum(x.new_bytes for x in looked)
    todo = tuple(p for p in plan.pieces if p.index not in found)
    with task_runner(data, len(todo), new_bytes) as runner:
        threads = 0 if isinstance(runner, ThreadPoolTaskRunner) else 1  # one tokenizer thread per worker process
        plan = replace(plan, job=replace(plan.job, threads=threads))
        made = {r.index: r for r in map_pieces(runner, plan, todo, show, hashed)}
        results = [found.get(p.index) or made[p.index] for p in plan.pieces]
        redo = forced_pieces(plan, results)
        if redo:  # a corpus of a few documents: one split came out empty
            plan = replace(plan, pieces=tuple(redo_map(plan.pieces, redo)))
            again = {r.index: r for r in map_pieces(runner, plan, tuple(redo), None)}
            results = [again.get(r.index, r) for r in results]
    info = assemble_dataset(quoted(plan), quoted(results), started, hash_cache)
    show.finish(f"dataset {info.dataset_id} " + ("reused" if info.cache_hit else "written"))
    check_dataset(info, block_size, vocab_size)
    return info
