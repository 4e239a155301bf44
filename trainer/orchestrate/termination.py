"""A SIGTERM or Ctrl-C that reached this process, remembered even when its exception was lost.

Python runs a signal's handler between two bytecodes of the main thread, wherever that is; when it is inside a
finalizer (``__del__``, a weakref callback, which the garbage collector may run at any allocation), the exception
the handler raises (Prefect's ``TerminationSignal``, the CLI's ``Terminated``, ``KeyboardInterrupt``) is printed
as "Exception ignored in …" and dropped, and a run asked to stop trains on to its end. ``latch()`` makes the
interpreter also write each caught signal's number into a pipe (``signal.set_wakeup_fd``); the train task
``arm``s it as an attempt starts and asks ``stop_requested`` at every poll of its job (docs/architecture.md,
"A stop that cannot be lost").
"""

from __future__ import annotations

import os
import signal
import threading

_STOPS = (signal.SIGTERM, signal.SIGINT)
_pipe: tuple[int, int] | None = None
_seen: list[int] = []


def latch() -> bool:
    """Start remembering SIGTERM and SIGINT in this process (once; from the main thread only, where signals are
    handled). False when it cannot: another thread, or another wakeup fd already set (an event loop's)."""
    global _pipe
    if _pipe is not None:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)  # the interpreter's write must never block a signal's delivery
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:
        previous = -2
    if previous != -1:  # someone else's (an asyncio loop's signal handling): theirs stays
        if previous >= 0:
            signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
        return False
    _pipe = (r, w)
    return True


def arm() -> None:
    """Remember from now on (an attempt's start): ``latch()``, and forget what was caught before, which its own
    handler dealt with (a cancel the train task turned into a Cancelled state, in a process that goes on)."""
    if latch():
        _drain()
        _seen.clear()


def stop_requested() -> int | None:
    """The first SIGTERM or SIGINT this process caught since ``arm()``, or None."""
    _drain()
    return _seen[0] if _seen else None


def _drain() -> None:
    """Each signal with a Python handler is written (SIGCHLD and the like have none): read at every poll."""
    if _pipe is None:
        return
    while True:
        try:
            data = os.read(_pipe[0], 4096)
        except BlockingIOError:
            break
        if not data:
            break
        _seen.extend(n for n in data if n in _STOPS)
