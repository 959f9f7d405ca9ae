"""Acknowledgements: receivers say which version they hold (or why they could not apply one), and a
sender waits for them, with a timeout and failure reporting.

An acknowledgement is a small JSON object, one per receiver ("worker", numbered ``0..n-1``), made
by :func:`ack_message` and read back by :func:`parse_ack`::

    {"worker": 0, "version": 12, "error": null, "time": 1767225600.0}   # holds version 12
    {"worker": 1, "version": 13, "error": "ChecksumMismatchError: ...", "time": ...}  # could not apply 13

A channel carries them from the receivers to the sender: anything with the two methods of
:class:`AckChannel`. :class:`StoreAcks` writes them into the run's store (receivers anywhere, as
long as they may write there); the torchrl scheme adds a channel over multiprocessing queues for a
collector's worker processes (:mod:`torch_deltasync.integrations.torchrl`). :class:`AckBook` is the
sender's side: the newest version each worker acknowledged, and :meth:`AckBook.wait`, which never
hangs: a dead worker process is noticed within one poll, a silent one after the timeout.

Acknowledgements are untrusted input: they are parsed as JSON (never unpickled), and a malformed one
(including one whose ``worker`` is not the worker its key or queue belongs to, or whose ``version``
no run could have) is ignored, as if it had not arrived, and logged at debug level.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Iterable, Literal, Protocol

from ._units import check_seconds
from .errors import ObjectNotFoundError, SyncTimeoutError, WorkerError
from .keys import MAX_VERSION, ack_key, check_ack_model, check_worker

#: The most bytes of an acknowledgement object read from a store (they are ~80 bytes; a larger one is
#: garbage and never read whole).
MAX_ACK_BYTES = 4096

__all__ = ["AckBook", "AckChannel", "OnFailure", "StoreAcks", "ack_message", "parse_ack"]

log = logging.getLogger(__name__)

#: What :meth:`AckBook.wait` does when a worker fails: raise at once, or carry on without it.
OnFailure = Literal["raise", "skip"]


class AckChannel(Protocol):
    """Where acknowledgements travel. ``store`` is the run's store (``None`` for channels that do
    not use it); messages are :func:`ack_message` dicts."""

    def post(self, store: Any, msg: dict[str, Any]) -> None:
        """Send one acknowledgement (receiver side)."""

    def poll(self, store: Any, workers: set[int], wait_s: float) -> list[dict[str, Any]]:
        """The acknowledgements of ``workers`` that arrived, waiting up to ``wait_s`` seconds for
        one (sender side). May return objects that are not acknowledgements: they go through
        :func:`parse_ack`."""


def ack_message(worker: int, version: int | None, error: str | None) -> dict[str, Any]:
    """The acknowledgement a receiver posts.

    Args:
        worker: the receiver's index, ``>= 0``.
        version: the version it now holds, or (with ``error``) the version it could not apply
            (an ``int`` in ``[0, MAX_VERSION]``); ``None`` when unknown.
        error: why the version could not be applied (``"TypeName: message"``), ``None`` on success.

    Returns:
        ``{"worker", "version", "error", "time"}``; ``time`` is the receiver's wall clock (seconds
        since the epoch), for logs only.

    Raises:
        TypeError: ``worker`` or ``version`` is not an ``int`` (``bool`` is refused), or ``error``
            is neither a ``str`` nor ``None``.
        ValueError: ``worker`` is negative, or ``version`` is outside ``[0, MAX_VERSION]``.
    """
    check_worker(worker, "ack_message")
    if version is not None and type(version) is not int:
        raise TypeError(f"ack_message: version must be an int in 0 ... {MAX_VERSION} or None, got "
                        f"{type(version).__name__} {version!r}")
    if version is not None and not 0 <= version <= MAX_VERSION:
        raise ValueError(f"ack_message: version must be an int in 0 ... {MAX_VERSION} or None, got {version}")
    if error is not None and not isinstance(error, str):
        raise TypeError(f"ack_message: error must be a str ('TypeName: message') or None, got "
                        f"{type(error).__name__} {error!r}")
    return {"worker": worker, "version": version, "error": error, "time": time.time()}


def parse_ack(msg: Any) -> tuple[int, int | None, str | None] | None:
    """``(worker, version, error)`` from an acknowledgement, or ``None`` if it is malformed.

    Malformed: not a dict, ``worker`` not an int ``>= 0`` (``bool`` is refused), ``version`` neither
    ``None`` nor an int in ``[0, MAX_VERSION]`` (a version no run could have would count as caught
    up forever). An ``error`` that is not a string reads as ``None`` (no error).

    Example:
        >>> parse_ack({"worker": 2, "version": 7, "error": None})
        (2, 7, None)
        >>> parse_ack({"worker": "2", "version": 7}) is None
        True
    """
    if not isinstance(msg, dict):
        return None
    w, v, err = msg.get("worker"), msg.get("version"), msg.get("error")
    if type(w) is not int or w < 0 or (v is not None and (type(v) is not int or not 0 <= v <= MAX_VERSION)):
        return None
    return w, v, err if isinstance(err, str) else None


class StoreAcks:
    """Acknowledgements as small JSON objects in the run's store, one per worker, each overwritten by
    the worker's next one: ``acks/<model>/worker-<i:05d>.json`` (:func:`torch_deltasync.keys.ack_key`)
    under the run prefix.

    For receivers that share no process tree with the sender (standalone collectors, other hosts).
    Receivers need write access to the store. Objects are read as untrusted JSON: one that is
    missing, unreadable, not a JSON object, or whose ``worker`` is not the worker of its key counts
    as no acknowledgement.

    Args:
        model_key: the model's name as a key segment (no ``/``), shared by sender and receivers.

    Raises:
        TypeError: ``model_key`` is not a ``str``.
        ValueError: ``model_key`` is not one key segment (e.g. it contains ``/``).
    """

    def __init__(self, model_key: str) -> None:
        self.model_key = check_ack_model(model_key, "StoreAcks(model_key=...)")

    def key(self, worker: int) -> str:
        """The key of ``worker``'s acknowledgement, relative to the run prefix."""
        return ack_key(self.model_key, worker)

    def post(self, store: Any, msg: dict[str, Any]) -> None:
        """Write ``msg`` (an :func:`ack_message`) as ``msg["worker"]``'s acknowledgement.

        Raises:
            TypeError, ValueError: ``msg["worker"]`` is not a worker index (an ``int >= 0``).
            StoreError: the store refused the write (the caller decides whether that matters).
        """
        store.put(self.key(msg["worker"]), json.dumps(msg).encode())

    def poll(self, store: Any, workers: set[int], wait_s: float) -> list[dict[str, Any]]:
        """The current acknowledgement object of each of ``workers`` (one store read each, of at
        most :data:`MAX_ACK_BYTES`), in worker order; sleeps ``wait_s`` seconds when there is none.
        A missing, oversized or malformed object is no acknowledgement; one whose ``worker`` is not
        ``w`` (written under another worker's key) is ignored, so no worker can confirm for another.

        Raises:
            StoreError: the store failed (other than a missing object), naming it and the cause.
        """
        out = []
        for w in sorted(workers):
            key = self.key(w)
            try:
                data = store.get(key, start=0, end=MAX_ACK_BYTES + 1)
            except ObjectNotFoundError:  # not written yet
                continue
            try:
                if len(data) > MAX_ACK_BYTES:
                    raise ValueError(f"more than {MAX_ACK_BYTES} bytes")
                raw = json.loads(data.decode())
            except (ValueError, RecursionError) as e:  # garbage (UnicodeDecodeError and JSONDecodeError are
                # ValueErrors; arrays nested a few thousand deep exhaust the parser's recursion)
                log.debug("ignoring the acknowledgement at %r: %s", key, e)
                continue
            if not isinstance(raw, dict):
                log.debug("ignoring the acknowledgement at %r: not a JSON object", key)
                continue
            if type(raw.get("worker")) is not int or raw["worker"] != w:
                log.debug("ignoring the acknowledgement at %r: its worker field %r is not %d",
                          key, raw.get("worker"), w)
                continue
            out.append(raw)
        if not out:
            time.sleep(wait_s)
        return out


#: Failed workers a message names one by one (the rest are counted).
_NAMED_FAILURES = 8


def _ended(proc: Any) -> str | None:
    """How a worker's process ended, for messages (``None``: it runs, or there is none). A process
    its owner already closed (``multiprocessing.Process.close()``: torchrl does after a collector
    failed) has ended too."""
    if proc is None:
        return None
    try:
        return None if proc.is_alive() else f"(pid {proc.pid}) exited with code {proc.exitcode}"
    except ValueError:  # "process object is closed"
        return "(its process was closed by the collector after a failure)"


class AckBook:
    """The sender's record of its workers' acknowledgements, and the wait for a version.

    Args:
        channel: where acknowledgements arrive (an :class:`AckChannel`).
        expected: the worker ids that acknowledge (usually ``0..n-1``).
        who: names the sender in messages (``"DeltaWeightSyncScheme ('policy')"``).
        on_failure: ``"raise"``: :meth:`wait` raises at the first failed worker, without waiting
            for the others. ``"skip"``: it logs a warning and stops waiting for the failed workers
            until they acknowledge a newer version again.
        skip_hint: appended to the errors raised with ``on_failure="raise"``, saying how to skip.
        logger: where warnings and notices go (default: this module's logger).

    Attributes:
        acked: the newest version each worker acknowledged (workers never heard from are absent).
        errors: ``worker -> (version, error)`` reported and not yet raised or logged.
        lost: skipped workers, waited for again once they acknowledge a newer version.

    Raises:
        ValueError: ``on_failure`` is neither ``"raise"`` nor ``"skip"``.
    """

    def __init__(self, channel: AckChannel, expected: Iterable[int], *, who: str, on_failure: OnFailure = "raise",
                 skip_hint: str = "Pass on_failure='skip' to carry on with the other workers",
                 logger: logging.Logger | None = None) -> None:
        if on_failure not in ("raise", "skip"):
            raise ValueError(f"on_failure must be 'raise' or 'skip', got {on_failure!r}")
        self.channel, self.expected, self.on_failure = channel, list(expected), on_failure
        self.who, self.skip_hint, self.log = who, skip_hint, logger or log
        self.acked: dict[int, int] = {}
        self.errors: dict[int, tuple[int | None, str]] = {}
        self.lost: set[int] = set()

    def wait(self, version: int, store: Any = None, *, workers: Iterable[int] | None = None, timeout_s: float,
             poll_s: float, process_of: Callable[[int], Any] | None = None) -> None:
        """Block until the target workers acknowledged ``version`` (or a newer one).

        Never waits forever (the failure mode of NCCL-based weight sync, research/anchors.md #18):
        a dead worker process is noticed within one poll, a silent one after ``timeout_s``.
        Skipped workers (:attr:`lost`) are not waited for until they acknowledge again.

        Args:
            version: the version to wait for.
            store: passed to the channel (the run's store for :class:`StoreAcks`).
            workers: the workers to wait for, ``None``: all expected; ids not expected are ignored.
            timeout_s: seconds to wait for the slowest worker, counted from the call (finite,
                ``>= 0``; ``0``: read once).
            poll_s: seconds between reads of the channel (finite, ``> 0``; at most 0.05 s are used).
            process_of: the process of a worker (``None`` when unknown), with ``is_alive()``,
                ``pid`` and ``exitcode`` (a ``multiprocessing.Process``); ``None``: never checked.

        Raises:
            TypeError, ValueError: ``timeout_s`` or ``poll_s`` is not a finite number of seconds in
                range (checked before anything is read).
            WorkerError: (``on_failure="raise"``) a worker died or reported an error applying
                ``version`` or a newer one.
            SyncTimeoutError: (same) a worker did not confirm within ``timeout_s``; the message
                names each such worker, ``version`` and the version it holds.
            StoreError: (:class:`StoreAcks`) the store failed, whatever ``on_failure`` says.
        """
        check_seconds(timeout_s, "timeout_s", "AckBook.wait", positive=False)
        check_seconds(poll_s, "poll_s", "AckBook.wait", positive=True)
        deadline = time.monotonic() + timeout_s
        # Read what arrived since the last wait first: a skipped worker that acknowledged since is
        # waited for again, even when every target worker had been skipped.
        self.read(store, 0.0)
        targets = self.expected if workers is None else [w for w in workers if w in self.expected]
        pending = {w for w in targets if w not in self.lost}
        failures: list[tuple[int, str, type]] = []
        while True:
            pending = {w for w in pending if self.acked.get(w, -1) < version}
            for w in list(pending):
                err = self.errors.get(w)
                if err is not None and (err[0] is None or err[0] >= version):
                    del self.errors[w]
                    failures.append((w, err[1] if err[0] is None else f"could not apply version {err[0]}: {err[1]}",
                                     WorkerError))
                    pending.discard(w)
                    continue
                ended = _ended(process_of(w)) if process_of is not None else None
                if ended is not None:
                    failures.append((w, f"{ended} before applying version {version}", WorkerError))
                    pending.discard(w)
            if not pending or (failures and self.on_failure == "raise"):
                break  # "raise" fails fast: no waiting for the other workers first
            if time.monotonic() >= deadline:
                for w in sorted(pending):
                    failures.append((w, f"did not confirm version {version} within {timeout_s:g} s "
                                        f"(it holds version {self.acked.get(w)})", SyncTimeoutError))
                break
            self.read(store, min(poll_s, 0.05))
        if failures:
            self._fail(failures)

    def read(self, store: Any, wait_s: float) -> None:
        """Read the acknowledgements of every expected worker (waiting up to ``wait_s`` seconds for
        one), not just the pending ones: nothing piles up unread, and a skipped worker that
        acknowledges a newer version than it had is back (waited for from then on). A worker's
        error not yet raised is dropped when it later acknowledges that version or a newer one (or
        any version, for an error that names none). Malformed acknowledgements are ignored."""
        for msg in self.channel.poll(store, set(self.expected), wait_s):
            parsed = parse_ack(msg)
            if parsed is None:
                if self.log.isEnabledFor(logging.DEBUG):
                    self.log.debug(f"{self.who}: ignoring a malformed acknowledgement {msg!r:.200}")
                continue
            w, ver, err = parsed
            if err is not None:
                self.errors[w] = (ver, err)
            elif ver is not None:
                reported = self.errors.get(w)
                if reported is not None and (reported[0] is None or reported[0] <= ver):
                    del self.errors[w]  # the worker recovered: it holds a version since its error
                newer = ver > self.acked.get(w, -1)
                self.acked[w] = max(self.acked.get(w, -1), ver)
                if newer and w in self.lost:
                    self.log.info(f"{self.who}: worker {w} is back at version {ver}")
                    self.lost.discard(w)

    def _fail(self, failures: list[tuple[int, str, type]]) -> None:
        failures = sorted(failures, key=lambda f: f[0])
        text = "; ".join(f"worker {w} {msg}" for w, msg, _ in failures[:_NAMED_FAILURES])
        if len(failures) > _NAMED_FAILURES:  # a message names a few; the count says how many
            more = failures[_NAMED_FAILURES:]
            timed_out = sum(c is SyncTimeoutError for _, _, c in more)
            text += (f"; and {len(more)} more workers, {more[0][0]} to {more[-1][0]} ({timed_out} did not confirm in "
                     f"time, {len(more) - timed_out} failed)")
        if self.on_failure == "raise":
            cls = WorkerError if any(c is WorkerError for _, _, c in failures) else SyncTimeoutError
            raise cls(f"{self.who}: {text}. {self.skip_hint}")
        for w, _, _ in failures:
            self.lost.add(w)
        lost = sorted(w for w, _, _ in failures)
        named = f"{lost}" if len(lost) <= _NAMED_FAILURES else f"{lost[:_NAMED_FAILURES]} and {len(lost) - _NAMED_FAILURES} more"
        self.log.warning(f"{self.who}: {text}; carrying on without worker(s) {named} until they acknowledge again")
