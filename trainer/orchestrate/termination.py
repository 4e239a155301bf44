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
    """Remember SIGTERM and SIGINT in this process from now on (from the main thread only, where signals are
    handled); again after whatever took the wakeup fd away (an asyncio loop in this thread that added and removed
    a signal handler resets it). False when it cannot: another thread, or another wakeup fd set (an event
    loop's, which keeps it)."""
    global _pipe
    if threading.current_thread() is not threading.main_thread():
        return _pipe is not None
    if _pipe is None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)  # the interpreter's write must never block a signal's delivery
        _pipe = (r, w)
    try:
        previous = signal.set_wakeup_fd(_pipe[1], warn_on_full_buffer=False)
    except ValueError:
        return False
    if previous not in (-1, _pipe[1]):  # someone else's (an asyncio loop's signal handling): theirs stays
        signal.set_wakeup_fd(previous)
        return False
    return True


def arm() -> None:
    """An attempt starts: remember from now on (``latch``). A signal caught earlier and not yet acted on stays
    (one lost after the last attempt's last poll stops this one); ``forget`` drops one that was dealt with."""
    latch()


def forget() -> None:
    """The caught signal was dealt with (a person's cancel, turned into a Cancelled state in a process that goes
    on): the next attempt of this process must not stop for it."""
    _drain()
    _seen.clear()


def stop_requested() -> int | None:
    """The first SIGTERM or SIGINT this process caught since it latched and last forgot, or None."""
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
