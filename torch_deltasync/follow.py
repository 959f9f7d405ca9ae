"""``deltasync follow STORE``: apply versions as they appear and report what each one cost.

A standalone receiver for a run published by any sender (a single process, or an FSDP2 job under
``torchrun``: the receiver does not care how many ranks wrote a version). It waits for the first
version, builds its model, then polls: every time a newer version is visible it updates to the
newest (skipping intermediate versions when it fell behind: the receiver plans the cheapest path),
and prints one line per update::

    version      12 delta  path delta   1 applied  density  3.412%    411.2 KiB  lag  153 ms  apply  2.1 ms  total  19.8 ms

* ``density``: changed elements / elements of the model, from the target version's manifest;
* bytes: what the update downloaded (all ranks' objects of every version applied);
* ``lag``: from the manifest's ``created_at`` (sender clock) to the end of the update;
* ``apply``: the in-place writes into the model, the latency a serving engine would see;
  ``total``: plan + download + decode + verify + apply.

Every update is all or nothing and verified against the manifest's per-tensor checksums; a version
that fails (e.g. a corrupt object) is reported, not retried, and the model keeps the version it held
until a newer one appears.

A store that is unavailable for a while (HTTP 503 bursts, a dropped connection: a
:class:`~torch_deltasync.errors.TransientStoreError` once the store's own retries gave up) is
ridden out, as the writer rides it out: the follower reports the outage once, keeps polling (the
version being applied is tried again) and reports when the store answers again. Only
``idle_timeout_s`` without a new version ends it. Other store errors (a missing bucket, refused
credentials) end it at once.

The model is either a state dict of zeros shaped from the first manifest (no download of a model
needed), or a Hugging Face checkpoint (``--model``, loaded with ``transformers`` in the inference
dtype, which must have the same tensor names and shapes as the sender's).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO, TypeVar

from ._metrics import append_metrics, check_metrics_path
from ._units import check_seconds, format_bytes
from .errors import DeltaSyncError, interrupted

__all__ = ["follow", "FollowReport", "follow_newer", "poll_until", "wait_for_newer"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class FollowReport:
    """What a :func:`follow` run did.

    Attributes:
        versions: the versions the model held after each successful update, in order.
        failures: ``"version N: error"`` for each failed update (the model kept its version).
        outages: times the store became unavailable (transient errors) and answered again later.
        rows: one dict per update: version, kind, path, applied, density, nbytes, lag_ms,
            apply_ms, total_ms (times in milliseconds, bytes in bytes).
        model: what the versions were applied to (the state dict or the HF model).
    """

    versions: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    outages: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    model: Any = None


def _build_target(manifest, model: str | None) -> Any:
    dtype = manifest.inference_dtype
    if model is None:
        return manifest.zeros()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype)


def wait_for_newer(
    receiver: Any,
    *,
    poll_s: float,
    idle_timeout_s: float | None = None,
    stop: threading.Event | None = None,
    skip: Callable[[int], bool] | None = None,
    read: Callable[[], int | None] | None = None,
) -> int | None:
    """Poll the store until it shows a version the receiver does not hold; return that version.

    The polling loop of every follower: :func:`follow`, :func:`follow_newer` (the vLLM backend's
    stager), the torchrl scheme's workers (:mod:`torch_deltasync.integrations.torchrl`). Each poll
    is one ``LATEST`` read (:meth:`~torch_deltasync.DeltaReceiver.newest_version`).

    Args:
        receiver: the :class:`~torch_deltasync.DeltaReceiver` whose held ``version`` is compared.
        poll_s: seconds between polls (finite, ``> 0``).
        idle_timeout_s: return ``None`` once the newest visible version has not changed for this
            many seconds (counted from the call; finite, ``>= 0``; ``0``: poll once); ``None``: never.
        stop: return ``None`` once set; polls wait on it, so setting it ends the wait at once.
        skip: versions not to return although newer (e.g. one whose update just failed); called
            with the newest visible version.
        read: reads the newest visible version (default ``receiver.newest_version``); ``None``
            means nothing is visible, e.g. while the store is unavailable. Its errors propagate.

    Returns:
        The newest visible version (not skipped) when the receiver does not hold it: another
        ``version``, or the same number published again by a new run on a wiped prefix
        (:meth:`~torch_deltasync.DeltaReceiver.needs_update`); else ``None``.

    Raises:
        TypeError, ValueError: ``poll_s`` or ``idle_timeout_s`` is not a finite number of seconds
            in range (checked before the first poll).
    """
    check_seconds(poll_s, "poll_s", "wait_for_newer", positive=True)
    check_seconds(idle_timeout_s, "idle_timeout_s", "wait_for_newer", positive=False, none_ok=True)
    read = read or receiver.newest_version
    last_seen, last_new = None, time.monotonic()
    while True:
        newest = read()
        if newest is not None and newest != last_seen:
            last_seen, last_new = newest, time.monotonic()
        if newest is not None and _differs(receiver, newest) and not (skip is not None and skip(newest)):
            return newest
        if stop is not None and stop.is_set():
            return None
        delay = poll_s
        if idle_timeout_s is not None:
            left = idle_timeout_s - (time.monotonic() - last_new)
            if left <= 0:
                return None
            delay = min(poll_s, left)
        if stop is not None:
            stop.wait(delay)
        else:
            time.sleep(delay)


def _differs(receiver: Any, newest: int) -> bool:
    """Whether ``newest`` is not what ``receiver`` holds; a store failure while asking (a ranged
    read of the held manifest's digest) counts as "holds it": the next poll asks again."""
    if newest != receiver.version:
        return True
    try:
        return receiver.needs_update(newest)
    except DeltaSyncError as e:
        log.debug("could not tell whether version %d was published again: %s", newest, e)
        return False


def follow_newer(
    receiver: Any,
    handle: Callable[[int], Any],
    *,
    poll_s: float,
    stop: threading.Event,
    wake: threading.Event | None = None,
    skip: Callable[[int], bool] | None = None,
    read: Callable[[], int | None] | None = None,
    on_error: Callable[[Exception], Any] | None = None,
    max_backoff_s: float = 5.0,
) -> None:
    """Hand each version the receiver does not hold to ``handle`` as it appears, until ``stop``.

    The loop of a background follower (the vLLM backend's stager, which prepares each newest
    version while the engine generates). Each round is one poll (:func:`wait_for_newer` with
    ``idle_timeout_s=0``), ``handle(version)`` if the poll found a version to hand, then a pause of
    ``poll_s`` seconds. The loop never ends on an error: an error from ``read`` or ``handle`` goes
    to ``on_error``, and the pause doubles after each failed round (``2 * poll_s``, ``4 * poll_s``,
    ... at most ``max_backoff_s``) until a round succeeds. A version is handed again in a later
    round if the receiver still does not hold it and ``skip`` does not refuse it: a caller that must
    not retry a failed version by itself says so in ``skip``.

    Args:
        receiver: the :class:`~torch_deltasync.DeltaReceiver` whose held ``version`` is compared.
        handle: called with each newer version (on this thread); its return value is ignored.
        poll_s: seconds of pause between two rounds (finite, ``> 0``).
        stop: ends the loop once set; pauses wait on it (on ``wake`` when given: set ``stop``, then
            ``wake``, to end a pause at once).
        wake: ends the current pause early (then cleared): the next poll happens at once.
        skip: newer versions not to hand (see :func:`wait_for_newer`).
        read: reads the newest visible version (see :func:`wait_for_newer`).
        on_error: called with each error of ``read`` or ``handle`` (default: a logged warning).
        max_backoff_s: the longest pause after errors, in seconds (finite, ``> 0``).

    Raises:
        TypeError, ValueError: ``poll_s`` or ``max_backoff_s`` is not a finite number of seconds
            ``> 0`` (checked before the first round: a pause of ``0`` or less would spin).
    """
    check_seconds(poll_s, "poll_s", "follow_newer", positive=True)
    check_seconds(max_backoff_s, "max_backoff_s", "follow_newer", positive=True)
    pause = poll_s
    waiter = wake if wake is not None else stop
    while not stop.is_set():
        try:
            newest = wait_for_newer(receiver, poll_s=poll_s, idle_timeout_s=0, skip=skip, read=read)
            if newest is not None:
                handle(newest)
            pause = poll_s
        except Exception as e:  # noqa: BLE001 - reported; the caller's skip decides what is retried
            if interrupted(e):  # a Ctrl-C while a compiled kernel returned
                raise KeyboardInterrupt from e
            if on_error is not None:
                on_error(e)
            else:
                log.warning("following %s: %s: %s", getattr(receiver, "store", receiver), type(e).__name__, e)
            pause = min(pause * 2, max_backoff_s)
        waiter.wait(pause)
        if wake is not None:
            wake.clear()


def poll_until(check: Callable[[], T | None], *, timeout_s: float, poll_s: float) -> T | None:
    """Call ``check()`` every ``poll_s`` seconds until it returns something other than ``None``.

    Args:
        check: one poll (e.g. "load the newest version if it is newer"); its errors propagate.
        timeout_s: seconds after the call from which no further poll starts (finite, ``>= 0``;
            ``0``: poll once).
        poll_s: seconds of sleep between two polls (finite, ``> 0``).

    Returns:
        The first result of ``check()`` that is not ``None``, or ``None`` once ``timeout_s`` passed
        (callers raise their own ``TimeoutError`` naming what did not appear).

    Raises:
        TypeError, ValueError: ``timeout_s`` or ``poll_s`` is not a finite number of seconds in
            range (checked before the first poll).
    """
    check_seconds(timeout_s, "timeout_s", "poll_until", positive=False)
    check_seconds(poll_s, "poll_s", "poll_until", positive=True)
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got is not None:
            return got
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


def follow(
    store: Any,
    *,
    prefix: str = "",
    model: str | None = None,
    poll_s: float = 0.2,
    idle_timeout_s: float | None = 60.0,
    max_updates: int | None = None,
    until_version: int | None = None,
    metrics_path: str | Path | None = None,
    verify: bool = False,
    out: TextIO | None = None,
) -> FollowReport:
    """Follow a run: wait for versions and apply each newest one to a local model.

    A version that fails (a damaged object or manifest) is reported once and not retried; the
    model keeps what it held and the next newer version is planned from it. At start the model is
    shaped by the newest manifest that parses (a damaged newest one is reported, and the newest
    readable version applied first).

    Args:
        store: a :class:`~torch_deltasync.store.Store` or anything ``open_store`` accepts.
        prefix: the run's prefix inside the store.
        model: a Hugging Face checkpoint (folder or hub id) to receive into; ``None`` builds a
            state dict of zeros from the first manifest's shapes, in the inference dtype.
        poll_s: seconds between polls of the store (finite, ``> 0``).
        idle_timeout_s: stop after this many seconds without a new version (also while waiting for
            the first one; finite, ``>= 0``); ``None``: never.
        max_updates: stop after this many successful updates; ``None``: never.
        until_version: stop once the model holds this version or a newer one; ``None``: never.
        metrics_path: append one JSON line per update (the printed numbers plus the receiver's
            :class:`~torch_deltasync.UpdateStats`).
        verify: after each update also recompute every checksum from the model (``O(model)``;
            updates already verify what they change).
        out: where to print (default: stdout).

    Returns:
        A :class:`FollowReport`.

    Raises:
        TypeError, ValueError: ``poll_s`` or ``idle_timeout_s`` is not a finite number of seconds
            in range; ``metrics_path`` is a folder; ``model`` is a path to no folder.
        VersionNotFoundError: no version appeared within ``idle_timeout_s``.
        IncompatibleTargetError: ``model`` does not match the published tensors.
        StoreError: the store failed other than transiently (e.g. ``StoreNotFoundError``).
    """
    from .errors import DeltaSyncError, TransientStoreError, VersionNotFoundError
    from .keys import list_versions
    from .manifest import load_manifest
    from .receiver import DeltaReceiver
    from .store import open_store

    check_seconds(poll_s, "poll_s", "follow", positive=True)
    check_seconds(idle_timeout_s, "idle_timeout_s", "follow", positive=False, none_ok=True)
    check_metrics_path("follow: metrics_path", metrics_path)
    metrics_path = metrics_path or None  # "": no file, as in the configs
    if model is not None and model.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(model)):
        raise ValueError(f"follow: model {model!r} is no folder; give a checkpoint folder or a Hugging Face model id")
    out = out or sys.stdout
    st = open_store(store).sub(prefix)
    report = FollowReport()
    down: list[str] = []  # the outage in progress: the first error, if the store is unavailable now

    def reachable(call):
        """``(True, call())``, or ``(False, None)`` while the store is unavailable (reported once)."""
        try:
            result = call()
        except TransientStoreError as e:
            if not down:
                down.append(f"{type(e).__name__}: {e}")
                print(f"store unavailable ({down[0]}); still polling", file=out, flush=True)
            return False, None
        if down:
            down.clear()
            report.outages += 1
            print("store available again", file=out, flush=True)
        return True, result

    deadline = None if idle_timeout_s is None else time.monotonic() + idle_timeout_s
    first = None
    failed: dict[int, str] = {}  # versions whose update (or manifest) failed: not retried
    said_waiting = False
    while first is None:
        ok, versions = reachable(lambda: list_versions(st))
        for v in reversed(versions if ok else []):  # the model is shaped by the newest manifest that parses
            try:
                ok, first = reachable(lambda: load_manifest(st, v))
            except VersionNotFoundError:
                continue  # collected meanwhile
            except DeltaSyncError as e:  # reported, and the follower starts from an older version
                if v not in failed:
                    failed[v] = f"{type(e).__name__}: {e}"
                    print(f"version {v:>7} FAILED: {failed[v]} (starting from an older version)", file=out, flush=True)
                continue
            break
        if first is not None:
            break
        if not said_waiting and ok:  # (a follower started before its writer: say so, once)
            said_waiting = True
            print(f"waiting for a first version in {st.describe()}"
                  + (f" (up to {idle_timeout_s:g} s)" if idle_timeout_s is not None else ""), file=out, flush=True)
        if deadline is not None and time.monotonic() > deadline:
            why = st.absent() if ok else None
            raise VersionNotFoundError(f"{st.describe()}: no version appeared within {idle_timeout_s} s"
                                       + (f": {why}" if why else f" (store unavailable: {down[0]})" if down else ""))
        time.sleep(poll_s)
    report.model = _build_target(first, model)
    receiver = DeltaReceiver(report.model, st, metrics_path=metrics_path)
    print(f"following {st.describe()}: {len(first.tensors)} tensors, {first.numel:,} elements, "
          f"{first.inference_dtype}", file=out, flush=True)
    report.failures += [f"version {v}: {why}" for v, why in failed.items()]
    start = first.version if failed else None  # the newest is unreadable: apply the newest that is
    while max_updates is None or len(report.versions) < max_updates:
        if until_version is not None and receiver.version is not None and receiver.version >= until_version:
            break
        if start is not None:
            newest, start = start, None
        else:
            newest = wait_for_newer(receiver, poll_s=poll_s, idle_timeout_s=idle_timeout_s, skip=failed.__contains__,
                                    read=lambda: reachable(receiver.newest_version)[1])
        if newest is None:
            break
        try:
            ok, _ = reachable(lambda: receiver.update(newest))
            if not ok:  # the store went away mid-update: nothing applied, the version is tried again
                time.sleep(poll_s)
                continue
            if verify:
                receiver.verify()
        except DeltaSyncError as e:
            # not retried: the model keeps its version and the next newer version is planned from it
            failed[newest] = f"{type(e).__name__}: {e}"
            report.failures.append(f"version {newest}: {type(e).__name__}: {e}")
            print(f"version {newest:>7} FAILED: {type(e).__name__}: {e} ({'model still at version ' + str(receiver.version) if receiver.version is not None else 'model holds no version yet'})",
                  file=out, flush=True)
            continue
        s = receiver.last_stats
        m = receiver.manifest(receiver.version)
        row = {"version": s.version, "kind": m.kind, "path": s.path, "applied": s.versions_applied,
               "density": m.changed / max(m.numel, 1), "nbytes": s.nbytes,
               "lag_ms": (time.time() - m.created_at) * 1e3 if m.created_at else None,
               "apply_ms": s.apply_ms, "total_ms": s.total_ms}
        report.versions.append(s.version)
        report.rows.append(row)
        lag = f"{row['lag_ms']:5.0f} ms" if row["lag_ms"] is not None else "    ?   "
        print(f"version {s.version:>7} {m.kind:<6} path {s.path:<6} {s.versions_applied:>3} applied  "
              f"density {row['density']:8.3%}  {format_bytes(s.nbytes):>10}  lag {lag}  "
              f"apply {s.apply_ms:6.1f} ms  total {s.total_ms:7.1f} ms", file=out, flush=True)
        if metrics_path is not None:
            append_metrics(metrics_path, {"event": "follow", **row})
    receiver.close()
    return report
