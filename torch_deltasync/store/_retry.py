"""Retries with exponential backoff and a deadline on every store call, in one place.

Remote stores (:class:`~torch_deltasync.store.FsspecStore`, ``HFBucketStore``) run each driver call
through :func:`call_with_retry`; :class:`RetryingStore` gives any other store (a custom one, or a
fault-injecting wrapper in tests) the same behaviour. Drivers' own retry loops are turned off where
the driver allows it (s3fs, botocore), so :class:`RetryPolicy` is the only retry layer and its
numbers mean what they say.

What is retried: a failure a :data:`Classifier` calls ``"transient"`` (timeouts, dropped or refused
connections, throttling, HTTP 429 and 5xx), and an attempt that runs past its deadline. A missing
key (:class:`~torch_deltasync.errors.ObjectNotFoundError`), a missing bucket
(:class:`~torch_deltasync.errors.StoreNotFoundError`) and every other error (permissions, bad
requests) are raised at once. Every error names the store, the operation, the key and the cause.

:class:`DeadlineStore` gives a store that has no deadline of its own (a custom one) a deadline on
every call and nothing else; :func:`~torch_deltasync.open_store` wraps such stores in it.

Retrying is safe for every :class:`~torch_deltasync.store.Store` operation: ``put`` writes whole
immutable objects (the same bytes again), ``delete`` of a missing key is not an error, and reads
have no side effects.
"""

from __future__ import annotations

import errno
import logging
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal, TypeVar

from ..errors import ObjectNotFoundError, StoreError, StoreNotFoundError, TransientStoreError
from ._http import http_status
from ._base import Store, exception_chain

__all__ = ["RetryPolicy", "RetryingStore", "DeadlineStore", "DEFAULT_TIMEOUT_S", "call_with_retry",
           "classify_error", "Classifier"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: ``"missing"``: the key does not exist (raise :class:`ObjectNotFoundError`, never retry);
#: ``"no_store"``: the bucket itself does not exist (raise :class:`StoreNotFoundError`, never retry);
#: ``"transient"``: retry; ``"fatal"``: raise :class:`StoreError` at once; ``"reraise"``: not a
#: store failure at all (e.g. an invalid key): raise the original exception unchanged.
Verdict = Literal["missing", "no_store", "transient", "fatal", "reraise"]

#: Default deadline of one store call, in seconds (:attr:`RetryPolicy.timeout_s`, :class:`DeadlineStore`).
DEFAULT_TIMEOUT_S = 120.0
Classifier = Callable[[BaseException], Verdict]


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how long a remote store call is tried.

    Attempt ``i`` (0-based) that fails transiently is followed by a sleep of
    ``min(max_delay_s, base_delay_s * 2**i)`` seconds, shortened by a random fraction of up to
    ``jitter`` so that many replicas hitting the same throttled bucket spread out ("exponential
    backoff with jitter", https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/).
    With the defaults a call gives up after 6 attempts and at most ~6.2 s of sleeping.

    Every attempt also runs under a deadline of ``timeout_s + nbytes / min_bytes_per_s`` seconds
    (``nbytes``: the bytes the call moves when known: a ``put``, a ranged ``get``), on top of the
    driver's own connect/read timeouts. An attempt past its deadline counts as a transient failure;
    it is abandoned on a daemon thread (Python cannot interrupt a blocking call), and since store
    operations are idempotent a late finish is harmless.
    """

    attempts: int = 6
    """Tries per call, the first included (``>= 1``; ``1`` = no retries)."""

    base_delay_s: float = 0.1
    """Sleep after the first failed attempt, in seconds; doubles after each further one."""

    max_delay_s: float = 5.0
    """Upper bound of one sleep, in seconds."""

    jitter: float = 0.5
    """Fraction in ``[0, 1]`` by which each sleep is randomly shortened (``0``: deterministic)."""

    timeout_s: float | None = DEFAULT_TIMEOUT_S
    """Deadline of one attempt in seconds, before the size allowance. ``None``: no deadline (the
    driver's socket timeouts still apply: s3fs's; ``huggingface_hub`` sets none, so an HF Bucket
    call can then wait for ever on a server that never answers)."""

    min_bytes_per_s: float = 8 * 2**20
    """Slowest transfer rate tolerated (bytes/s): a call moving ``n`` known bytes gets ``n /
    min_bytes_per_s`` seconds more. Full-object ``get``\\ s of unknown size get ``timeout_s`` only,
    so raise ``timeout_s`` for very large objects on slow links."""

    def __post_init__(self) -> None:
        if type(self.attempts) is not int or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an integer >= 1, got {self.attempts!r}")
        if not (self.base_delay_s >= 0 and self.max_delay_s >= 0):
            raise ValueError("RetryPolicy.base_delay_s and max_delay_s must be >= 0")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"RetryPolicy.timeout_s must be > 0 or None, got {self.timeout_s}")
        if not self.min_bytes_per_s > 0:
            raise ValueError(f"RetryPolicy.min_bytes_per_s must be > 0, got {self.min_bytes_per_s}")

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep after failed attempt ``attempt`` (0-based)."""
        d = min(self.max_delay_s, self.base_delay_s * (2.0**attempt))
        return d * (1.0 - self.jitter * (rng or random).random())

    def deadline_s(self, nbytes: int = 0) -> float | None:
        """Deadline of one attempt that moves ``nbytes`` bytes, in seconds (``None``: none)."""
        if self.timeout_s is None:
            return None
        return self.timeout_s + max(0, nbytes) / self.min_bytes_per_s


#: The backoff sleep of :func:`call_with_retry` (a seam: tests record the delays instead of waiting).
_sleep = time.sleep


class _DeadlineExceeded(Exception):
    pass


def _with_deadline(fn: Callable[[], T], timeout_s: float | None) -> T:
    """``fn()``, or :class:`_DeadlineExceeded` after ``timeout_s`` seconds.

    The call runs on a daemon thread so that a hung socket can neither block the caller past its
    deadline nor keep the interpreter alive at exit. A deadline beyond what a thread can wait
    (``threading.TIMEOUT_MAX``, ``inf``) is none.
    """
    if timeout_s is None or timeout_s >= threading.TIMEOUT_MAX:
        return fn()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="deltasync-store-call", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise _DeadlineExceeded()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


# --- classification ------------------------------------------------------------------------------

_TRANSIENT_ERRNOS = {
    errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
    errno.ECONNABORTED, errno.EPIPE, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN,
    getattr(errno, "EREMOTEIO", 121),
}
#: S3 error codes that mean "the bucket is not there" (a typo in the URI, or the wrong endpoint).
_NO_STORE_CODES = {"NoSuchBucket"}
#: S3 error codes that mean "try again" (https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html).
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "OperationAborted", "RequestLimitExceeded",
}


def _driver_transient_types() -> tuple[type, ...]:
    """Retryable exception types of drivers that are already imported (never imports them)."""
    types: list[type] = []
    s3 = sys.modules.get("s3fs.core")
    if s3 is not None:
        types += list(getattr(s3, "S3_RETRYABLE_ERRORS", ()))
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    for mod in ("httpx", "httpx2"):
        h = sys.modules.get(mod)
        if h is not None:
            types += [getattr(h, "TransportError", None) or getattr(h, "TimeoutException")]
    bc = sys.modules.get("botocore.exceptions")
    if bc is not None:
        types += [bc.ConnectionError, bc.HTTPClientError, bc.ReadTimeoutError, bc.IncompleteReadError]
    return tuple(t for t in types if isinstance(t, type))


def classify_error(e: BaseException) -> Verdict:
    """The default :data:`Classifier` for driver exceptions (fsspec/s3fs/botocore, httpx, OS errors).

    Looks at the exception and its causes: S3's ``NoSuchBucket`` anywhere in the chain is
    ``"no_store"`` (s3fs reports it as a ``FileNotFoundError``, which must not read as a missing
    key); a ``FileNotFoundError`` on top is ``"missing"``; timeouts, connection errors, the drivers' retryable types, S3 throttling/5xx codes, HTTP 429 and
    5xx, and errnos such as ``EBUSY``/``ECONNRESET`` are ``"transient"``; a
    :class:`~torch_deltasync.errors.DeltaSyncError` that is not a store error (e.g. an invalid key)
    is ``"reraise"``; anything else is ``"fatal"``.
    """
    from ..errors import DeltaSyncError

    if isinstance(e, StoreNotFoundError):
        return "no_store"
    if isinstance(e, ObjectNotFoundError):
        return "missing"
    if isinstance(e, TransientStoreError):
        return "transient"
    if isinstance(e, StoreError):
        return "fatal"
    if isinstance(e, DeltaSyncError):
        return "reraise"
    if isinstance(e, PermissionError):
        return "fatal"
    for x in exception_chain(e):
        resp = getattr(x, "response", None)
        if isinstance(resp, dict) and resp.get("Error", {}).get("Code") in _NO_STORE_CODES:
            return "no_store"
    if isinstance(e, FileNotFoundError):
        return "missing"
    transient_types = _driver_transient_types()
    for x in exception_chain(e):
        if isinstance(x, (TimeoutError, ConnectionError)) or (transient_types and isinstance(x, transient_types)):
            return "transient"
        if isinstance(x, OSError) and x.errno in _TRANSIENT_ERRNOS:
            return "transient"
        status = http_status(x)
        if status is not None and (status == 429 or status >= 500):
            return "transient"
        resp = getattr(x, "response", None)
        if isinstance(resp, dict) and resp.get("Error", {}).get("Code") in _TRANSIENT_CODES:
            return "transient"
    return "fatal"


def _cause(e: BaseException) -> str:
    text = str(e) or repr(e)
    return f"{type(e).__name__}: {text}"


def call_with_retry(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    store: str,
    op: str,
    key: str,
    classify: Classifier = classify_error,
    nbytes: int = 0,
) -> T:
    """Run ``fn()`` under ``policy``: a deadline per attempt, retries with backoff on transient errors.

    Args:
        fn: one attempt of the call (no arguments); raises the driver's exceptions.
        policy: attempts, backoff and deadline.
        store: the store's name for messages (:meth:`Store.describe`).
        op: what the call does, for messages (``"read"``, ``"write"``, ``"list"``, ...).
        key: the key (or prefix) concerned, for messages.
        classify: maps an exception to a :data:`Verdict`.
        nbytes: bytes the call moves, when known (extends the deadline).

    Returns:
        What ``fn`` returns.

    Raises:
        ObjectNotFoundError: the key does not exist (never retried).
        StoreNotFoundError: the bucket does not exist (never retried).
        TransientStoreError: every attempt failed transiently or ran past its deadline, or one ran
            past its deadline and a later one failed for good: the abandoned attempt may still land,
            so the call's outcome is unknown (a caller must not assume a write did not happen).
        StoreError: a non-transient failure.
    """
    deadline = policy.deadline_s(nbytes)
    abandoned = False  # an attempt ran past its deadline and may still be under way
    for attempt in range(policy.attempts):
        try:
            return _with_deadline(fn, deadline)
        except _DeadlineExceeded:
            verdict: Verdict = "transient"
            cause = f"timed out after {deadline:.1f} s"
            err: BaseException | None = None
            abandoned = True
        except Exception as e:  # noqa: BLE001 - drivers raise many types; classify decides
            verdict, cause, err = classify(e), _cause(e), e
        if verdict == "reraise":
            raise err  # type: ignore[misc]
        if verdict == "missing":
            if isinstance(err, ObjectNotFoundError):
                raise err
            raise ObjectNotFoundError(f"{store}: no object {key!r}") from err
        if verdict == "no_store":
            if isinstance(err, StoreNotFoundError):
                raise err
            raise StoreNotFoundError(
                f"{store}: the bucket does not exist (while trying to {op} {key!r}: {cause}); check the "
                "bucket name in the URI and the endpoint, or create the bucket"
            ) from err
        last = attempt + 1 == policy.attempts
        if verdict == "fatal" or last:
            tries = f" (gave up after {attempt + 1} attempts)" if verdict == "transient" and attempt else ""
            if isinstance(err, StoreError) and not tries:
                raise err  # already names store, key and cause
            if verdict == "fatal" and abandoned:
                raise TransientStoreError(f"{store}: cannot {op} {key!r}: {cause}, after an attempt that ran past "
                                          f"its deadline and may still land") from err
            cls = TransientStoreError if verdict == "transient" else StoreError
            raise cls(f"{store}: cannot {op} {key!r}: {cause}{tries}") from err
        delay = policy.delay_s(attempt)
        log.debug("%s: %s %r failed (%s); retry %d/%d in %.2f s", store, op, key, cause,
                  attempt + 1, policy.attempts - 1, delay)
        _sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


class _CallWrappingStore(Store):
    """A store that forwards every call to ``inner`` through ``self._call(op, key, fn, nbytes)``
    (``op`` and ``key`` name the call in errors; ``nbytes``: bytes it moves, for deadlines)."""

    inner: Store

    def _call(self, op: str, key: str, fn: Callable[[], T], nbytes: int = 0) -> T:
        raise NotImplementedError

    def put(self, key: str, data: bytes) -> None:
        self._call("write", key, lambda: self.inner.put(key, data), len(data))

    def put_new(self, key: str, data: bytes) -> None:
        self._call("write", key, lambda: self.inner.put_new(key, data), len(data))

    def get(self, key: str, *, start: int | None = None, end: int | None = None) -> bytes:
        n = (end - (start or 0)) if end is not None else 0
        return self._call("read", key, lambda: self.inner.get(key, start=start, end=end), n)

    def exists(self, key: str) -> bool:
        return self._call("stat", key, lambda: self.inner.exists(key))

    def size(self, key: str) -> int:
        return self._call("stat", key, lambda: self.inner.size(key))

    def list(self, prefix: str = "") -> list[str]:
        return self._call("list", prefix or "/", lambda: self.inner.list(prefix))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner.delete(key))

    def delete_many(self, keys: list[str]) -> None:
        keys = list(keys)
        if keys:
            self._call("delete", f"{keys[0]} (+{len(keys) - 1} more)", lambda: self.inner.delete_many(keys))

    def sweep_temporaries(self, older_than_s: float = 3600.0, prefix: str = "") -> int:
        return self._call("sweep", prefix or "/", lambda: self.inner.sweep_temporaries(older_than_s, prefix))

    def absent(self) -> str | None:
        return self._call("stat", "/", self.inner.absent)

    def describe(self) -> str:
        return self.inner.describe()


class RetryingStore(_CallWrappingStore):
    """Any store, with :func:`call_with_retry` around every call.

    Remote stores retry on their own; wrap a store in this when it raises
    :class:`~torch_deltasync.errors.TransientStoreError` but does not retry (a custom store, or
    :class:`~torch_deltasync.store.faults.FaultyStore` in tests).

    Args:
        inner: the store to wrap.
        policy: attempts, backoff and deadlines (default :class:`RetryPolicy`).

    Example:
        >>> store = RetryingStore(FaultyStore(LocalStore("bucket"), error_rate=0.1))
    """

    needs_deadline = False

    def __init__(self, inner: Store, policy: RetryPolicy | None = None) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy()

    def _call(self, op: str, key: str, fn: Callable[[], T], nbytes: int = 0) -> T:
        return call_with_retry(fn, policy=self.policy, store=self.inner.describe(), op=op, key=key,
                               nbytes=nbytes)

    def __repr__(self) -> str:
        return f"RetryingStore({self.inner!r}, {self.policy!r})"


class DeadlineStore(_CallWrappingStore):
    """Any store, with a deadline on every call and nothing else (no retries, errors unchanged).

    :func:`~torch_deltasync.open_store` wraps every store whose :attr:`Store.needs_deadline` is
    true (custom stores) in one, so a ``get`` that never returns fails with
    :class:`~torch_deltasync.errors.TransientStoreError` after the deadline instead of hanging an
    update forever. A call past its deadline is abandoned on a daemon thread, as in
    :func:`call_with_retry`; store operations are idempotent, so a late finish is harmless.

    Args:
        inner: the store to wrap.
        timeout_s: deadline of one call in seconds, plus ``nbytes / min_bytes_per_s`` for a call
            that moves ``nbytes`` known bytes (a ``put``, a ranged ``get``).
        min_bytes_per_s: slowest transfer rate tolerated, bytes per second.

    Raises:
        ValueError: ``timeout_s`` or ``min_bytes_per_s`` is not positive.

    Example:
        >>> store = open_store(MyStore(), timeout_s=30)   # DeadlineStore(MyStore(), timeout_s=30)
    """

    needs_deadline = False

    def __init__(self, inner: Store, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 min_bytes_per_s: float = RetryPolicy.min_bytes_per_s) -> None:
        if timeout_s is None:
            raise ValueError("DeadlineStore needs a deadline; use the store itself for none")
        self.inner = inner
        self.policy = RetryPolicy(attempts=1, timeout_s=timeout_s, min_bytes_per_s=min_bytes_per_s)
        self.timeout_s = float(timeout_s)

    def _call(self, op: str, key: str, fn: Callable[[], T], nbytes: int = 0) -> T:
        deadline = self.policy.deadline_s(nbytes)
        try:
            return _with_deadline(fn, deadline)
        except _DeadlineExceeded:
            raise TransientStoreError(
                f"{self.inner.describe()}: cannot {op} {key!r}: no answer within {deadline:.1f} s (the store "
                "call deadline: raise it with open_store(store, timeout_s=...) or deltasync --timeout)"
            ) from None

    def __repr__(self) -> str:
        return f"DeadlineStore({self.inner!r}, timeout_s={self.timeout_s:g})"
