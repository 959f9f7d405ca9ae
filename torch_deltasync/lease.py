"""A writer's lease on its run prefix: one live :class:`~torch_deltasync.DeltaSender` per prefix.

Two writers on one prefix would publish alternating versions of two models (each version a valid
delta on its own run's previous one), and receivers following the newest version would switch
models without noticing. So a sender owns its prefix while it runs:

* ``<prefix>/OWNER`` (JSON, written by rank 0) names the owning writer: its ``run_id``, a random
  ``session`` (unique per sender object, so two writers configured with the same ``run_id`` are still
  told apart), host, process id, ``renewed_at`` (Unix seconds, the writer's clock) and ``lease_s``;
* a daemon thread renews ``renewed_at`` every ``lease_s / 4`` seconds while the sender is open, so a
  writer that takes long training steps stays live; :meth:`PrefixLease.release` (``close()``)
  deletes the record;
* a new sender refuses a prefix whose record is *live* (renewed less than ``lease_s`` ago by the
  record's own clock compared with ours: keep clock skew well below ``lease_s``), unless told to
  take over (``takeover=True``, e.g. a restart right after a crash). A record that expired (the
  writer died without ``close()``), is malformed, or is missing is claimed; a record is replaced
  only by the writer that creates ``OWNER.claims/<hash of its bytes>`` (a conditional put;
  :meth:`PrefixLease._claim_marker`), so of two writers starting at once on a dead writer's prefix
  one is refused;
* before writing each manifest the owner reads the record again: if another writer took the prefix
  over, the publish is refused (:class:`~torch_deltasync.errors.PrefixInUseError`) and so is every
  later one, so at most the version in flight at the moment of a takeover lands after it. A record
  that is gone is written again only while the owner's own lease is live; an owner whose lease ran
  out (a paused process, a partition) cannot tell whether another writer claimed the prefix,
  published and closed meanwhile, so it refuses as after a takeover.

The record is advisory for readers (they never read it) and kept by retention. The renewal is a
read followed by a write, not a compare-and-swap: a takeover that lands between the two is undone by
the renewal, and then the *new* writer's next publish is refused. Either way one writer goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import asdict, dataclass

from ._units import is_real_number
from .errors import ObjectExistsError, ObjectNotFoundError, PrefixInUseError

__all__ = ["OWNER_KEY", "OwnerRecord", "PrefixLease", "DEFAULT_LEASE_S"]

log = logging.getLogger(__name__)

OWNER_KEY = "OWNER"
#: Markers of replaced owner records (one small object per expiry or takeover; kept, like ``OWNER``).
CLAIMS_PREFIX = "OWNER.claims"
#: Default lease (seconds): a writer that stops renewing (killed) frees its prefix after this long.
DEFAULT_LEASE_S = 60.0
#: The shortest lease (seconds): the record is renewed every ``lease_s / 4``.
MIN_LEASE_S = 0.1
#: The longest ``run_id`` (and host name) an owner record holds.
MAX_RUN_ID_CHARS = 256

#: Largest owner record read (bytes); anything larger is malformed.
_MAX_RECORD_NBYTES = 64 << 10
#: Most claims of one owner record tried (each abandoned one, older than ``lease_s``, moves on).
_MAX_CLAIM_GENERATIONS = 64


@dataclass(frozen=True)
class OwnerRecord:
    """The content of ``<prefix>/OWNER``.

    Attributes:
        run_id: the owning sender's ``run_id`` (as in its manifests).
        session: random hex string, unique per sender object.
        host, pid: where the owner runs (for error messages only).
        renewed_at: Unix seconds (owner's clock) of the last renewal.
        lease_s: seconds after ``renewed_at`` during which the owner counts as live.
    """

    run_id: str
    session: str
    host: str
    pid: int
    renewed_at: float
    lease_s: float

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "OwnerRecord | None":
        """Parse an untrusted record; ``None`` when it is malformed (it then protects nothing)."""
        if len(data) > _MAX_RECORD_NBYTES:
            return None
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        if not isinstance(doc, dict):
            return None
        strings = [doc.get(k) for k in ("run_id", "session", "host")]
        numbers = [doc.get(k) for k in ("renewed_at", "lease_s")]
        if (not all(isinstance(s, str) and len(s) <= MAX_RUN_ID_CHARS for s in strings) or type(doc.get("pid")) is not int
                or not all((type(x) is int and 0 <= x < 2**63) or (type(x) is float and 0 <= x < math.inf)
                           for x in numbers)):  # (math.isfinite of a 400-digit int raises OverflowError)
            return None
        return cls(doc["run_id"], doc["session"], doc["host"], doc["pid"], float(doc["renewed_at"]),
                   float(doc["lease_s"]))

    def describe(self, now: float) -> str:
        age = now - self.renewed_at
        when = (f"{max(age, 0.0):.1f} s ago" if age > -1.0 else  # (renewed while this was read: just now)
                f"{-age:.1f} s in the future by this host's clock (the owner's clock runs ahead, or the "
                "record is damaged)")
        return f"run {self.run_id!r} (host {self.host}, pid {self.pid}), lease renewed {when} for {self.lease_s:g} s"

    def live(self, now: float) -> bool:
        return now - self.renewed_at < self.lease_s

    def may_be_running(self) -> bool:
        """Whether the owner's process may still run: ``False`` only for a process of this host that
        is gone (one killed with SIGKILL leaves its record live for ``lease_s`` seconds; a caller on
        the same host may take its place at once). Another host's process: ``True`` (cannot tell)."""
        if self.host != socket.gethostname() or not 0 < self.pid < 2**31:
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            pass
        return True


def read_owner(store) -> OwnerRecord | None:
    """The owner record of ``store`` (a run prefix), ``None`` when missing or malformed.

    Raises:
        StoreError: the store failed.
    """
    data = _read_record(store)
    return None if data is None else OwnerRecord.from_json(data)


def _read_record(store) -> bytes | None:
    """The bytes of ``OWNER`` (at most one more than a record may hold), ``None`` when missing."""
    try:
        return store.get(OWNER_KEY, start=0, end=_MAX_RECORD_NBYTES + 1)
    except ObjectNotFoundError:
        return None


class PrefixLease:
    """Rank 0's ownership of a run prefix: claim it, keep it renewed, check it, release it.

    Args:
        store: the run's prefix (``Store.sub(prefix)``).
        run_id: the sender's run id.
        lease_s: seconds a record stays live without renewal (> 0; renewed every ``lease_s / 4``).
        takeover: claim the prefix even when another writer's record is live.

    Raises:
        ValueError: ``lease_s`` is not a positive number of seconds.
        PrefixInUseError: another writer's record is live and ``takeover`` is false, or another
            writer replaced the same record at the same moment.
        StoreError: the store failed.

    Example:
        >>> lease = PrefixLease(store.sub("grpo-7"), "run-a")          # claims, starts renewing
        >>> lease.check()                                               # before each manifest
        >>> lease.release()                                             # on close()
    """

    def __init__(self, store, run_id: str, *, lease_s: float = DEFAULT_LEASE_S, takeover: bool = False) -> None:
        if not is_real_number(lease_s) or not math.isfinite(lease_s) or lease_s < MIN_LEASE_S:
            raise ValueError(f"lease_s must be a positive number of seconds (at least {MIN_LEASE_S:g}), got {lease_s!r}")
        if not isinstance(run_id, str) or not 0 < len(run_id) <= MAX_RUN_ID_CHARS:
            raise ValueError(f"run_id must be a non-empty string of at most {MAX_RUN_ID_CHARS} characters, got "
                             f"{run_id!r:.80}")
        lease_s = float(lease_s)
        self.store = store
        self.record = OwnerRecord(run_id, uuid.uuid4().hex, socket.gethostname(), os.getpid(), 0.0, float(lease_s))
        self._lost: str | None = None  # why the prefix is no longer ours
        self._written_at = 0.0  # time.time() of the stamp of our last record that landed
        self._stop = threading.Event()
        self._io = threading.Lock()  # a renewal and the release never interleave
        self._claim(takeover)
        # The renewing thread holds the lease only weakly, and a lease that is garbage-collected (its
        # sender was dropped without close(), or the process exits normally) releases the record:
        # nobody can publish through it any more. A killed process leaves the record to expire.
        self._release = weakref.finalize(self, _release_record, store, self.record.session, self._stop,
                                         self._io, self.record.lease_s)
        self._thread = threading.Thread(target=_renew_loop, args=(weakref.ref(self), self._stop, lease_s / 4),
                                        name="deltasync-lease", daemon=True)
        self._thread.start()

    @property
    def session(self) -> str:
        return self.record.session

    def _claim(self, takeover: bool) -> None:
        now = time.time()
        for _ in range(2):  # (once more if the record was deleted between the two calls)
            try:
                self._put(self.store.put_new)
                return
            except ObjectExistsError:
                raw = _read_record(self.store)
                if raw is not None:
                    break
        else:
            raise PrefixInUseError(f"{self.store.describe()}: other writers keep claiming and releasing this prefix")
        other = OwnerRecord.from_json(raw)
        if other is not None and other.session == self.session:
            return  # our own record: a retried put whose first reply was lost
        if other is not None and other.live(now) and not takeover:
            raise PrefixInUseError(
                f"{self.store.describe()} is owned by a live writer: {other.describe(now)}. Two writers on one "
                "prefix would interleave their versions. Publish under another prefix, stop the other writer "
                f"(its lease frees the prefix {other.lease_s:g} s after it stops), or pass takeover=True "
                "if that writer is gone (e.g. a restart right after a crash)"
            )
        if other is not None and other.live(now):
            log.warning("%s: taking over from %s", self.store.describe(), other.describe(now))
        marker = self._claim_marker(raw, other, now)
        try:
            self._put(self.store.put)
        except Exception:
            if _read_record(self.store) != self.record.to_json():  # (else our put landed: a lost reply)
                try:  # let the next claimant go on at once rather than after the marker expires
                    self.store.delete(marker)
                except Exception:  # noqa: BLE001 - it expires by itself
                    pass
                raise

    def _claim_marker(self, raw: bytes, other: OwnerRecord | None, now: float) -> str:
        """Create the marker that makes this writer the one that replaces the record ``raw``.

        Replacing a record is a read and a write: of two writers that read the same record, only the
        one that creates ``OWNER.claims/<sha256 of raw>`` (a conditional put) goes on. The marker
        holds the claimant's session and time: a retried put that finds our own marker goes on, and
        a claim older than ``lease_s`` whose record is still there was abandoned (its writer died
        between the marker and the record), so the next generation (``<hash>.1``, ...) is tried.

        Returns:
            The marker's key.

        Raises:
            PrefixInUseError: another writer's claim of the same record is younger than ``lease_s``.
        """
        base = f"{CLAIMS_PREFIX}/{hashlib.sha256(raw).hexdigest()[:32]}"
        mine = json.dumps({"session": self.session, "at": now}).encode()
        for generation in range(_MAX_CLAIM_GENERATIONS):
            key = base if generation == 0 else f"{base}.{generation}"
            try:
                self.store.put_new(key, mine)
                return key
            except ObjectExistsError:
                pass
            try:
                doc = json.loads(self.store.get(key, start=0, end=_MAX_RECORD_NBYTES + 1))
                session, at = doc["session"], float(doc["at"])
            except ObjectNotFoundError:
                return self._claim_marker(raw, other, now)  # its claimant gave it up: try again
            except (ValueError, TypeError, KeyError, UnicodeDecodeError):
                continue  # malformed: protects nothing
            if session == self.session:
                return key  # ours: a retried put whose first reply was lost
            if 0 <= now - at < self.record.lease_s:
                raise PrefixInUseError(
                    f"{self.store.describe()}: another writer is replacing the same owner record ("
                    + (other.describe(now) if other is not None else "a malformed record")
                    + f") right now: its claim {key} is {now - at:.1f} s old. Two writers on one prefix would "
                    "interleave their versions: publish under another prefix, or, if that writer failed, try again "
                    f"after its claim expires ({self.record.lease_s - (now - at):.0f} s)")
        raise PrefixInUseError(f"{self.store.describe()}: {_MAX_CLAIM_GENERATIONS} abandoned claims of one owner record "
                               f"({base}...): delete {OWNER_KEY} and {CLAIMS_PREFIX}/ if no writer uses the prefix")

    def _stamped(self, now: float) -> bytes:
        self.record = OwnerRecord(**{**asdict(self.record), "renewed_at": now})
        return self.record.to_json()

    def _put(self, put) -> None:
        """Write a freshly stamped record with ``put`` (``store.put`` or ``store.put_new``); once it
        landed, the lease counts from that stamp."""
        stamp = time.time()
        put(OWNER_KEY, self._stamped(stamp))
        self._written_at = stamp

    def check(self) -> None:
        """Confirm the prefix is still ours (reads the record once).

        Raises:
            PrefixInUseError: another writer took the prefix over (or the record was removed); this
                and every later call raise.
            StoreError: the store failed.
        """
        if self._lost is None:
            other = read_owner(self.store)
            now = time.time()
            if other is None and not self._stop.is_set() and now - self._written_at >= self.record.lease_s:
                # Our own lease ran out before the record went (this process was paused or cut off
                # from the store): another writer may have taken the prefix over, published and
                # closed meanwhile. Claiming it again would interleave the two runs.
                self._lost = (f"{self.store.describe()}: this writer's lease expired ({now - self._written_at:.1f} s "
                              f"since its last renewal, lease {self.record.lease_s:g} s: the process was paused "
                              "or could not reach the store) and its OWNER record is gone, so another writer "
                              "may have used the prefix meanwhile")
                self._stop.set()
            elif other is None and not self._stop.is_set():
                # Deleted (or garbled) by someone else while our lease was live: claim it again,
                # unless another writer gets there first.
                try:
                    self._put(self.store.put_new)
                    return
                except ObjectExistsError:
                    other = read_owner(self.store)
                    if other is not None and other.session == self.session:
                        return
            if self._lost is None and (other is None or other.session != self.session):
                self._lost = (f"{self.store.describe()} was taken over by "
                              + (other.describe(now) if other is not None else "another writer (unreadable record)"))
                self._stop.set()
        if self._lost is not None:
            raise PrefixInUseError(
                f"{self._lost}; this sender (run {self.record.run_id!r}) stops publishing there so that the two "
                "runs do not interleave. Create a new sender (takeover=True) to publish again"
            )

    def holds(self) -> bool:
        """Whether the prefix is still ours: :meth:`check` as a bool.

        Raises:
            StoreError: the store failed.
        """
        try:
            self.check()
            return True
        except PrefixInUseError:
            return False

    def renew(self) -> None:
        """Write a fresh ``renewed_at`` if the record is still ours (the renewing thread calls this).

        Raises:
            PrefixInUseError: the prefix was taken over.
            StoreError: the store failed.
        """
        with self._io:
            self.check()
            if not self._stop.is_set():
                self._put(self.store.put)

    def release(self) -> None:
        """Stop renewing and delete the record if it is still ours. Idempotent; store errors are
        logged (the record then expires after ``lease_s``)."""
        self._release()
        self._lost = self._lost or f"{self.store.describe()}: the lease was released (the sender was closed)"


def _release_record(store, session: str, stop: threading.Event, io: threading.Lock, lease_s: float) -> None:
    with io:
        stop.set()
    try:
        other = read_owner(store)
        if other is not None and other.session == session:
            store.delete(OWNER_KEY)
    except Exception as e:  # noqa: BLE001 - the lease expires by itself
        log.warning("%s: could not release the writer lease (%s); it expires in %g s", store.describe(), e, lease_s)


def _renew_loop(ref: "weakref.ref[PrefixLease]", stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        lease = ref()
        if lease is None:
            return
        try:
            lease.renew()
        except PrefixInUseError as e:
            log.warning("%s", e)
            return
        except Exception as e:  # noqa: BLE001 - a store hiccup: the next renewal may succeed
            log.warning("%s: renewing the writer lease failed (%s); retrying in %g s",
                        lease.store.describe(), e, every_s)
        del lease
