"""Transient object-store errors, retried with capped exponential backoff and jitter.

One policy for every store operation trainpipe makes (reads, writes, listings,
deletes): a refused or reset connection, a timeout, a 5xx or a throttling reply
is tried again after a random wait of up to ``min(cap, base·2^n)`` seconds, until
``budget_s`` seconds have passed (the last try comes at the budget), with one log line per retry. Anything
else (no such key or bucket, access denied, a malformed request) raises at once.
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


def call(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, retried through transient store errors within the budget; ``what`` names it."""
    policy, level = _policy, logging.WARNING
    if (limit := _limit.get()) is not None:
        policy, level = RetryPolicy(min(policy.budget_s, limit[0]), policy.base_s, policy.cap_s), limit[1]
    start = time.monotonic()
    tries = 0
    while True:
        try:
            return fn(*args, **kwargs)
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
                raise unavailable from None
            # The last wait ends at the budget: the store gets the whole budget to come back, never less.
            wait = random.uniform(policy.base_s, max(policy.base_s, min(policy.cap_s, policy.base_s * 2**tries)))
            wait = min(wait, policy.budget_s - elapsed)
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
