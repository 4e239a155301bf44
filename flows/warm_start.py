"""Flow runs of ``trainpipe serve`` forked from a warm process instead of spawned cold.

Prefect's runner starts each flow run of a served flow with ``run_flow_in_subprocess``, which uses a *spawn*
context: every run pays a fresh interpreter that imports Prefect and this package again (about 1.5 s of the
2 s between a click on Run and the run's Running state, measured by ``benchmarks/trigger_latency.py``). Here the
serving process starts one ``forkserver`` up front that has already imported Prefect's flow engine and the
pipeline's flow module; each flow run is forked from it. The forkserver imports no torch and starts no thread,
so a fork is safe; the ranks are still started by torchrun in fresh processes.

The seam is the one Prefect documents in ``prefect.runner._starter_direct`` ("patch the module to override"):
its ``run_flow_in_subprocess``. Prefect's own function still builds the call (environment, settings, control
channel, serialised context); it is only handed the forkserver context where it asks for its spawn one. What a
flow-run process receives is unchanged: the runner's environment and Prefect's serialised call.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.util
import os
import threading
from multiprocessing.process import BaseProcess
from typing import Any

# Imported once in the forkserver, inherited by every flow run forked from it (this module too: its after-fork
# hook below must be registered in the forkserver).
PRELOAD = ("prefect.flow_engine", "trainpipe.flows.pipeline", "trainpipe.flows.warm_start")

_lock = threading.Lock()
log = logging.getLogger("trainpipe.serve")


class _ForkserverFor:
    """Stands in for the ``multiprocessing`` module inside one call of Prefect's ``run_flow_in_subprocess``: its
    ``get_context("spawn")`` (the only attribute that function uses) answers with the warm forkserver."""

    def __init__(self, context: multiprocessing.context.BaseContext) -> None:
        self._context = context

    def get_context(self, method: str | None = None) -> multiprocessing.context.BaseContext:
        return self._context


def _release_the_forkserver(_: object) -> None:
    """In each forked flow run: close the forkserver's "parent alive" pipe that CPython hands every child.

    The forkserver exits when every holder of that pipe's write end is gone; with the flow run holding one, a
    SIGKILLed ``trainpipe serve`` would leave the forkserver up, and with it the flow run's parent, so the flow
    run's parent watch (``tasks/common.py:stop_with_parent``) would never fire. Closed here, the forkserver lives
    exactly as long as the runner, and a flow run outliving its runner is reparented and stops."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # its private pipe end, which no stub names
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


class _AfterFork:
    """The object ``register_after_fork`` keys its hook on (its registry holds weak references)."""


_AFTER_FORK = _AfterFork()
multiprocessing.util.register_after_fork(_AFTER_FORK, _release_the_forkserver)


def run_flow_in_forked_process(*args: Any, **kwargs: Any) -> BaseProcess:
    """Prefect's ``run_flow_in_subprocess`` with the forkserver in place of a spawn context."""
    from prefect import flow_engine as engine

    flow_engine: Any = engine  # the module whose ``multiprocessing`` the seam replaces (not part of its API)

    with _lock:  # the runner calls this from its event loop; the lock keeps the swap to one call at a time
        original = flow_engine.multiprocessing
        flow_engine.multiprocessing = _ForkserverFor(multiprocessing.get_context("forkserver"))
        try:
            return flow_engine.run_flow_in_subprocess(*args, **kwargs)
        except (OSError, EOFError) as exc:  # the forkserver is gone or cannot start (e.g. edited code that fails)
            log.warning("the warm forkserver could not start this flow run (%s); starting it cold", exc)
        finally:
            flow_engine.multiprocessing = original
    return flow_engine.run_flow_in_subprocess(*args, **kwargs)  # Prefect's own spawn


def install_warm_starter() -> None:
    """Start the forkserver now (its imports overlap the runner's own start) and route the runner's flow runs
    through it."""
    from multiprocessing import forkserver

    from prefect.runner import _starter_direct

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()
    _starter_direct.run_flow_in_subprocess = run_flow_in_forked_process  # type: ignore[assignment]
