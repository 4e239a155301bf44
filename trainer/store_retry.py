"""Transient object-store errors, retried with capped exponential backoff and jitter.

One policy for every store operation trainpipe makes (reads, writes, listings,
deletes): a refused or reset connection, a timeout, a 5xx or a throttling reply
is tried again after a random wait of up to ``min(cap, base·2^n)`` seconds, until
``budget_s`` seconds have passed (the last try comes at the budget). Anything else (no such key or bucket,
access denied, a malformed request) raises at once. An outage is said in a few lines, not one per retry
(``Outage``): when the first request fails, once a minute while requests still fail, and when one succeeds
again, with how long it lasted and how many requests were retried how often; each retry is a DEBUG line.
When the budget is spent the operation raises ``StoreUnavailable``: a retryable
failure of the attempt or task, not a verdict on the data.

botocore's own retries are turned off for trainpipe's S3 clients
(``s3_client_defaults``) so that this is the one place that waits, and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from trainpipe.trainer.errors import StoreUnavailable

log = logging.getLogger("trainpipe.store")
T = TypeVar("T")

# s3fs maps HTTP replies onto errnos: 503 SlowDown → EBUSY, 500 → EREMOTEIO; the rest are socket errors.
_TRANSIENT_ERRNOS = {
    errno.EBUSY,
    getattr(errno, "EREMOTEIO", errno.EIO),
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EPIPE,
    errno.EAGAIN,
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
}
_TRANSIENT_CODES = ("SlowDown", "Throttl", "RequestTimeout", "ServiceUnavailable", "InternalError", "RequestLimit")


@dataclass(frozen=True)
class RetryPolicy:
    budget_s: float = 120.0  # per operation, from its first try to giving up
    base_s: float = 0.25
    cap_s: float = 10.0


_policy = RetryPolicy()
_limit: ContextVar[tuple[float, int] | None] = ContextVar("trainpipe_store_retry_limit", default=None)


def set_budget(seconds: float) -> None:
    """This process's time budget per store operation (``store.retry_s`` of the profile it runs)."""
    global _policy
    _policy = RetryPolicy(budget_s=max(0.0, float(seconds)), base_s=_policy.base_s, cap_s=_policy.cap_s)


def budget_s() -> float:
    return _policy.budget_s


@contextlib.contextmanager
def limited(budget_s: float, log_level: int = logging.DEBUG) -> Iterator[None]:
    """Store calls in this context give up after ``budget_s`` at most and log their retries at ``log_level``:
    a check before anything starts answers in seconds, in one line."""
    token = _limit.set((budget_s, log_level))
    try:
        yield
    finally:
        _limit.reset(token)


def is_transient(exc: BaseException) -> bool:
    """Whether another try of the same request may succeed: the store (or the way to it) failed, not the request."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    status = _http_status(exc)
    if status is not None:
        return status == 429 or status >= 500
    if isinstance(exc, OSError) and any(code in str(exc) for code in _TRANSIENT_CODES):
        return True
    return _is_network_error(exc)


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of the S3 reply behind ``exc`` (s3fs keeps botocore's ClientError as the cause)."""
    for e in (exc, exc.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


def _is_network_error(exc: BaseException) -> bool:
    """botocore's and aiohttp's connection errors, which are not OSErrors (imported only if installed)."""
    kinds: list[type] = []
    try:
        from botocore import exceptions as bx

        kinds += [bx.ConnectionError, bx.HTTPClientError, bx.ResponseStreamingError, bx.IncompleteReadError]
    except ImportError:
        pass
    try:
        import aiohttp

        kinds.append(aiohttp.ClientError)
    except ImportError:
        pass
    try:
        from fsspec.exceptions import FSTimeoutError

        kinds.append(FSTimeoutError)
    except ImportError:
        pass
    return isinstance(exc, tuple(kinds))


class Outage:
    """The store failing this process's requests, said in a few lines: when the first request fails, once every
    ``every_s`` while requests are retried, and when it ends: a retried request got through ("back"), or every
    retried request gave up (``StoreUnavailable``). Each line says how long it lasted and how many requests were
    retried how often. A request that succeeds at its first try says nothing (a part of the store may be up while
    another is not). Requests on several threads share it."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic, while an outage lasts
        self._said = 0.0
        self._requests = self._retries = self._active = 0
        self._number = 0  # which outage: a request counts once in each it is retried through
        self._ended_at = -1.0  # monotonic: a try begun before it failed in the outage that ended then

    def retried(self, what: str, reason: str, seen: int, budget_s: float, tried_at: float) -> int:
        """A request whose try began at ``tried_at`` failed transiently and is about to be tried again; ``seen``:
        the outage it was last retried in (0: none). Returns this outage's number, for the request's next retry
        and its end."""
        now, line = time.monotonic(), None
        with self._lock:
            if self._since is None and tried_at <= self._ended_at:
                return seen  # a try in flight when the store came back: no new outage
            if self._since is None:
                self._since, self._said, self._requests, self._retries, self._active = now, now, 0, 0, 0
                self._number += 1
                line = (f"store unreachable: {what} failed ({reason}); each request is retried for up to "
                        f"{budget_s:.0f}s, and this says once a minute how it goes")  # fmt: skip
            if seen != self._number:
                self._requests, self._active = self._requests + 1, self._active + 1
            self._retries += 1
            if line is None and now - self._said >= self.every_s:
                self._said = now
                line = f"store still unreachable after {self._cost(now)} so far ({reason})"
            number = self._number
        if line:
            log.warning("%s", line)
        return number

    def ended(self, number: int, ok: bool) -> None:
        """A request retried in outage ``number`` got through (``ok``) or gave up."""
        with self._lock:
            if self._since is None or number != self._number:
                return  # that outage was already said to end
            self._active -= 1
            if not ok and self._active > 0:
                return
            line = f"store back after {self._cost()}" if ok else f"store: gave up after {self._cost()}"
            self._since, self._ended_at = None, time.monotonic()
        log.warning("%s", line)

    def gave_up_at_once(self, what: str, reason: str, elapsed_s: float, budget_s: float, tried_at: float) -> None:
        """A request whose first try failed transiently only after its whole budget (a loaded host, a store that
        holds the connection): never retried, so no outage began. Said as one that began and gave up at once,
        unless an outage already said counts it, or the store came back while it was being tried."""
        with self._lock:
            if self._since is not None:
                self._requests += 1
                return
            if tried_at <= self._ended_at:
                return
        log.warning(
            "store unreachable: %s failed after %.1fs (%s); gave up: its one try outlasted the %gs retry budget",
            what,
            elapsed_s,
            reason,
            budget_s,
        )

    def _cost(self, now: float | None = None) -> str:
        lasted = (now or time.monotonic()) - (self._since or 0.0)
        return f"{lasted:.0f}s: {self._requests} request(s) retried {self._retries} time(s)"


_outage = Outage()


def call(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, retried through transient store errors within the budget; ``what`` names it.
    In a ``limited`` context (a check that answers in one line) retries are logged at its level and are no
    ``Outage``."""
    policy, level, outage = _policy, logging.DEBUG, _outage
    if (limit := _limit.get()) is not None:
        policy, level, outage = RetryPolicy(min(policy.budget_s, limit[0]), policy.base_s, policy.cap_s), limit[1], None
    start = time.monotonic()
    tries = seen = 0
    while True:
        tried_at = time.monotonic()
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, StoreUnavailable) or not is_transient(exc):
                raise
            tries += 1
            elapsed = time.monotonic() - start
            reason = f"{exc.__class__.__name__}: {_first_line(exc)}"
            if elapsed >= policy.budget_s:
                unavailable = StoreUnavailable(
                    f"store unavailable: {what} failed for {elapsed:.0f}s over {tries} tries ({reason}); "
                    "it succeeds on a retry once the store is back"
                )
                unavailable.reason = reason
                if outage is not None and seen:
                    outage.ended(seen, ok=False)
                elif outage is not None:
                    outage.gave_up_at_once(what, reason, elapsed, policy.budget_s, tried_at)
                raise unavailable from None
            # The last wait ends at the budget: the store gets the whole budget to come back, never less.
            wait = random.uniform(policy.base_s, max(policy.base_s, min(policy.cap_s, policy.base_s * 2**tries)))
            wait = min(wait, policy.budget_s - elapsed)
            if outage is not None:
                seen = outage.retried(what, reason, seen, policy.budget_s, tried_at)
            log.log(
                level,
                "store: %s failed (%s); retry %d in %.1fs (%.0fs of %.0fs spent)",
                what,
                reason,
                tries,
                wait,
                elapsed,
                policy.budget_s,
            )
            time.sleep(wait)
            continue
        if outage is not None and seen:
            outage.ended(seen, ok=True)
        return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else ""


def s3_client_defaults(storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` for s3fs with botocore's own retries off and bounded connect/read timeouts (the user's
    own ``config_kwargs`` win): a dead endpoint fails a try in seconds, and ``call`` decides what happens next.
    No listing cache: ranks, supervisor and orchestrator write the same folders, and a cached listing in one
    process would not see another's files."""
    config = {"retries": {"total_max_attempts": 1}, "connect_timeout": 5, "read_timeout": 60}
    return {
        "use_listings_cache": False,
        **storage_options,
        "config_kwargs": {**config, **(storage_options.get("config_kwargs") or {})},
    }
