"""``DeltaReceiver``: plan, download, validate, stage, verify, then apply in place.

An update from the version a receiver holds to a target version ``T`` (the newest by default):

1. **plan** (:meth:`DeltaReceiver.plan`): walk the manifests back from ``T`` along ``base_version``
   links and take the smallest download: the delta parts from the version held (a *delta path*,
   crossing anchors by the delta they carry) or an anchor on the chain plus the delta parts after it
   (an *anchor path*). A receiver that holds nothing, is ahead of ``T``, or is off ``T``'s chain
   (e.g. after a writer restart: another run) takes an anchor path. Manifests are immutable and cached.
2. **download** every object of the plan in parallel and check its size and sha256;
3. **decode and validate** every object (names, shapes, dtypes, index ranges and order);
4. **stage** the result without touching the target: per changed tensor the union of positions with
   their final values (delta path), or full tensors rebuilt from the anchor blocks (anchor path);
5. **verify** the per-tensor checksums of the state this would produce against ``T``'s manifest. For
   a delta path this costs ``O(changed elements)``: ``C' = C - partial(old) + partial(new)``. A
   mismatch on a delta path falls back to the anchor path once; a mismatch there raises.
6. **apply** in place (``index_copy_`` for deltas, ``copy_`` for anchors).

Steps 1-5 are :meth:`DeltaReceiver.prepare`: it reads the live weights (old values, for checksums
and relative steps) and writes none, so it can run while an engine keeps generating and returns a
:class:`StagedUpdate`. Step 6 is :meth:`DeltaReceiver.commit`, the only part that has to happen
inside an engine's pause; it refuses a staged update whose base is no longer what the target holds
(:class:`~torch_deltasync.errors.StaleUpdateError`). :meth:`DeltaReceiver.update` is both.

So a receiver serves version ``v-1`` or version ``v``, never a mix (docs/design.md invariant 2): nothing is
written before step 6, and step 6 cannot fail on validated input. Should it fail anyway (e.g. out of
device memory), the receiver marks its state unknown and the next update takes the anchor path.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch
from torch import nn

from .checksum import checksum_change, combine, tensor_checksum
from .codec import TensorDelta
from .errors import (
    ChecksumMismatchError, CorruptObjectError, ObjectNotFoundError, StaleUpdateError, SyncTimeoutError,
    VersionNotFoundError,
)
from .format import decode_anchor, decode_delta, verify_bytes
from .manifest import LATEST_KEY, MAX_VERSION, Manifest, list_versions, load_manifest, manifest_key
from .store import Store, open_store
from .targets import ModuleTarget, Target

__all__ = ["DeltaReceiver", "UpdatePlan", "PlanStep", "StagedUpdate", "UpdateStats"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Reads of one object before a size/sha256 mismatch counts as corruption (not a bad transfer).
_REREAD_ATTEMPTS = 3
#: Plans of one ``update()`` toward the newest version when retention removes the chain meanwhile.
_REPLAN_ATTEMPTS = 3


@dataclass(frozen=True)
class PlanStep:
    """One version to download and apply, and why.

    Attributes:
        kind: ``"anchor"`` (rebuild from the anchor objects) or ``"delta"`` (apply the delta objects).
        objects: the objects of this version to download (a version can carry both kinds).
    """

    version: int
    kind: str
    nbytes: int
    reason: str
    objects: tuple = ()


@dataclass(frozen=True)
class UpdatePlan:
    """How a receiver gets from ``from_version`` to ``to_version``.

    Attributes:
        from_version: the version held now (``None``: nothing held yet).
        to_version: the version it will hold.
        path: ``"noop"``, ``"delta"`` (from the version held) or ``"anchor"`` (from an anchor).
        steps: the versions to apply, oldest first.
    """

    from_version: int | None
    to_version: int
    path: str
    steps: tuple[PlanStep, ...]
    manifests: tuple[Manifest, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes to download."""
        return sum(s.nbytes for s in self.steps)

    def __str__(self) -> str:
        lines = [f"update {self.from_version} -> {self.to_version} via {self.path} path, {self.nbytes:,} bytes"]
        lines += [f"  v{s.version:<8d} {s.kind:<6s} {s.nbytes:>14,d} B  {s.reason}" for s in self.steps]
        return "\n".join(lines)


@dataclass
class UpdateStats:
    """Numbers of one update. Times in milliseconds."""

    version: int
    from_version: int | None
    path: str
    versions_applied: int
    nbytes: int  # downloaded
    changed: int  # elements written (delta path) or elements of the model (anchor path)
    plan_ms: float = 0.0
    download_ms: float = 0.0
    decode_ms: float = 0.0
    verify_ms: float = 0.0
    apply_ms: float = 0.0  # commit: every write, plus the target's finish (e.g. a vLLM re-pack)
    total_ms: float = 0.0
    recovered: bool = False  # a delta path failed verification and the anchor path was used

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(eq=False)
class StagedUpdate:
    """A version downloaded, decoded, validated and checked against the published checksums, not yet
    written: the result of :meth:`DeltaReceiver.prepare`, the input of :meth:`DeltaReceiver.commit`.

    Attributes:
        plan: how it was reached (``plan.path == "noop"``: nothing to write).
        base_version: the version the target held when it was staged (``None``: nothing).
        version: the version a commit makes the target hold.
        stats: times so far (plan, download, decode, verify; ms); ``commit`` adds the apply time.
        written: HF names of the tensors a commit writes.
        nbytes_staged: bytes of staged positions and values held in memory (host).
    """

    plan: UpdatePlan
    base_version: int | None
    stats: UpdateStats | None
    _dense: dict[str, torch.Tensor] | None = None
    _sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    _checksums: dict[str, int] | None = None
    _generation: int = -1

    @property
    def version(self) -> int:
        return self.plan.to_version

    @property
    def written(self) -> frozenset[str]:
        if self._dense is not None:
            return frozenset(self._dense)
        return frozenset(n for n, (pos, _) in (self._sparse or {}).items() if pos.numel())

    @property
    def nbytes_staged(self) -> int:
        if self._dense is not None:
            return sum(t.numel() * t.element_size() for t in self._dense.values())
        return sum(p.numel() * p.element_size() + v.numel() * v.element_size()
                   for p, v in (self._sparse or {}).values())


def _merge(pos_a: torch.Tensor, val_a: torch.Tensor, pos_b: torch.Tensor, val_b: torch.Tensor):
    """Union of two sorted change sets; where both have a position, ``b`` (the later) wins."""
    if pos_a.numel() == 0:
        return pos_b, val_b
    if pos_b.numel() == 0:
        return pos_a, val_a
    pos = torch.cat([pos_a, pos_b])
    val = torch.cat([val_a, val_b])
    pos, order = torch.sort(pos, stable=True)
    val = val[order]
    last = torch.ones_like(pos, dtype=torch.bool)
    last[:-1] = pos[1:] != pos[:-1]  # keep the last of equal positions: b's, by stability
    return pos[last], val[last]


def _concat(parts: list[TensorDelta], what: str) -> TensorDelta:
    """One tensor's changes from several rank objects (disjoint positions) as one sorted delta."""
    if len(parts) == 1:
        return parts[0]
    pos = torch.cat([p.positions for p in parts])
    val = torch.cat([p.values for p in parts])
    steps = rel = None
    if any(p.steps is not None for p in parts):
        steps = torch.cat([p.steps if p.steps is not None else torch.zeros(p.numel, dtype=torch.int64) for p in parts])
        rel = torch.cat([
            (p.relative if p.relative is not None else torch.ones(p.numel, dtype=torch.bool))
            if p.steps is not None else torch.zeros(p.numel, dtype=torch.bool)
            for p in parts
        ])
    pos, order = torch.sort(pos)
    if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
        raise CorruptObjectError(f"{what}: two objects change the same element")
    # Partial checksums of disjoint position sets add up (mod 2**64) to the checksum of the union.
    base = combine(*(p.base_checksum for p in parts)) if all(p.base_checksum is not None for p in parts) else None
    return TensorDelta(pos, val[order], None if steps is None else steps[order], None if rel is None else rel[order],
                       base)


_GENERATIONS = itertools.count()  # generations of every receiver's held state (DeltaReceiver._generation)


def _check_version(version: object) -> int:
    """A version number from the caller: a non-negative ``int`` (``bool`` is not a version)."""
    if type(version) is not int:
        raise TypeError(f"a version is an int, got {type(version).__name__} {version!r}")
    if not 0 <= version <= MAX_VERSION:
        raise VersionNotFoundError(f"invalid version {version}: versions are 0 ... {MAX_VERSION}")
    return version


class DeltaReceiver:
    """Follows a run in a store and applies its versions to a model, bit-exactly.

    Args:
        target: an ``nn.Module`` or state dict (wrapped in :class:`ModuleTarget`), or any
            :class:`~torch_deltasync.targets.Target` (e.g. ``VLLMTarget``).
        store: a :class:`~torch_deltasync.store.Store` or anything :func:`open_store` accepts.
        prefix: the run's sub-path in the store (as given to the sender).
        max_workers: parallel downloads.
        metrics_path: append one JSON line of :class:`UpdateStats` per update.

    Attributes:
        version: the version the target holds (``None`` before the first update, or after a
            failure that left the target's state unknown).

    Example:
        >>> receiver = DeltaReceiver(model, LocalStore("runs/x/bucket"))
        >>> receiver.update()          # -> newest version, now held bit-exactly
        12
    """

    def __init__(
        self,
        target: Target | nn.Module | Mapping[str, torch.Tensor],
        store: Store | str,
        *,
        prefix: str = "",
        max_workers: int = 8,
        metrics_path: str | Path | None = None,
    ) -> None:
        self.target = target if isinstance(target, Target) else ModuleTarget(target)
        self.store = open_store(store).sub(prefix)
        self.max_workers = max_workers
        self.metrics_path = Path(metrics_path) if metrics_path else None
        # A new value whenever the held state changes; a staged update records it. Drawn from one
        # counter for every receiver, so an update staged by another receiver is never current here.
        self._generation = next(_GENERATIONS)
        self._version: int | None = None
        self.last_stats: UpdateStats | None = None
        self._checksums: dict[str, int] = {}  # full checksums of the held state (holds_all targets)
        self._manifests: dict[int, Manifest] = {}
        self._held_runs: dict[int, str] = {}  # version -> run id of the manifest planned for it
        self._checked: tuple | None = None  # the manifest layout the target was last checked for
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def version(self) -> int | None:
        """The version the target holds (``None``: nothing, or unknown after a failed write)."""
        return self._version

    @version.setter
    def version(self, value: int | None) -> None:
        # Setting it (e.g. to None to force an anchor rebuild) invalidates every staged update.
        self._version = value
        self._generation = next(_GENERATIONS)

    # --- discovery -------------------------------------------------------------------------------

    def manifest(self, version: int, *, fresh: bool = False) -> Manifest:
        """The validated manifest of ``version`` (cached; manifests are immutable).

        Args:
            fresh: read it from the store even if cached. If it differs from the cached copy (the
                bucket was wiped and a new run reused the number), the whole cache is dropped.

        Raises:
            VersionNotFoundError: no such version is visible (never published, or not retained).
            CorruptObjectError: the manifest is malformed.
        """
        _check_version(version)
        cached = self._manifests.get(version)
        if cached is not None and not fresh:
            return cached
        try:
            m = self._reread(lambda: load_manifest(self.store, version))
        except VersionNotFoundError as e:
            why = self.store.absent()  # a mistyped path reads differently from a version not published
            if why:
                raise VersionNotFoundError(f"{e}: {why}") from None
            raise
        if cached is not None and cached != m:
            log.warning("%s: the manifest of version %d changed (a new run on a wiped prefix?); "
                        "forgetting every cached manifest", self.store.describe(), version)
            self._manifests.clear()
        if len(self._manifests) >= 512:
            self._manifests.pop(next(iter(self._manifests)))
        self._manifests[version] = m
        return m

    def newest_version(self) -> int | None:
        """The newest visible version (``LATEST`` if it is current, else a listing), or ``None``."""
        try:
            latest = int(self.store.get(LATEST_KEY).decode().strip())
            if (0 <= latest < MAX_VERSION and self.store.exists(manifest_key(latest))
                    and not self.store.exists(manifest_key(latest + 1))):
                return latest
        except (ObjectNotFoundError, ValueError, UnicodeDecodeError):
            pass  # LATEST is advisory: missing, stale or garbage -> list
        versions = list_versions(self.store)
        return versions[-1] if versions else None

    def wait_for(self, version: int | None = None, *, timeout_s: float = 60.0, poll_s: float = 0.05) -> int:
        """Block until a version ``>= version`` (any version when ``None``) is visible; return the newest.

        Raises:
            SyncTimeoutError: (a ``TimeoutError``) nothing new appeared within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            newest = self.newest_version()
            if newest is not None and (version is None or newest >= version):
                return newest
            if time.monotonic() >= deadline:
                raise SyncTimeoutError(f"{self.store.describe()}: no version >= {version} after {timeout_s} s (newest: {newest})")
            time.sleep(poll_s)

    # --- planning --------------------------------------------------------------------------------

    def plan(self, version: int | None = None, *, force_anchor: bool = False) -> UpdatePlan:
        """Work out which versions to download to reach ``version`` (the newest when ``None``), and
        take the path that downloads the fewest bytes.

        The versions that can lead to the target ``T`` are the ones on its chain: ``T``, its
        ``base_version``, that version's base, and so on. Every one of them may carry a *delta part*
        (its delta objects: from its base to it) and, if it is an anchor, an *anchor part* (its anchor
        objects: from nothing to it). So the candidates are:

        * **delta path**: the held version ``H`` is on ``T``'s chain; download the delta parts of
          every version after ``H`` up to ``T``, anchors included (an anchor that also carries a
          delta from its predecessor is crossed by its delta part);
        * **anchor path** from an anchor ``A`` on the chain: ``A``'s anchor part, then the delta parts
          of the versions after ``A``.

        The walk back from ``T`` stops once no cheaper candidate can follow (the delta parts walked
        so far already cost as much as the best candidate), at the first version without a base
        (a run's first anchor), and, when ``H`` cannot be on the rest of the chain (nothing held,
        ``H`` ahead of the walk, or ``force_anchor``), at the first anchor: older anchors hold the
        same tensors, so they cost as much plus more deltas. Ties go to the delta path.

        Runs: a receiver never crosses from one writer run (``Manifest.run_id``) to another without
        an anchor. A held version of another run than ``T``'s chain is not a delta base (the prefix
        was wiped and the number reused), and a chain link whose base belongs to another run is not
        followed (two writers interleaved on one prefix).

        Args:
            version: the target version; ``None``: the newest visible one.
            force_anchor: ignore the held version (recovery after a failed delta path).

        Returns:
            The plan: its steps oldest first; ``path`` is ``"noop"`` when ``T`` is held already.

        Raises:
            VersionNotFoundError: no version at all, the target version is not visible, or its
                chain needs a version that is no longer retained.
            CorruptObjectError: ``T``'s chain crosses into another run before any anchor, so
                nothing can rebuild it (two writers shared the prefix).
        """
        target = self.newest_version() if version is None else _check_version(version)
        if target is None:
            why = self.store.absent()  # a mistyped path reads differently from a run not started yet
            raise VersionNotFoundError(f"{self.store.describe()}: no version has been published yet"
                                       + (f": {why}" if why else ""))
        if target == self.version and not force_anchor:
            return UpdatePlan(self.version, target, "noop", ())
        head = self.manifest(target, fresh=True)  # the head of the walk is never a stale cached copy
        self._held_runs[target] = head.run_id
        while len(self._held_runs) > 64:
            self._held_runs.pop(next(iter(self._held_runs)))
        chain, start, path, why = self._walk(head, None if force_anchor else self.version)
        ms = chain[start::-1]
        held = self.version
        first_reason = (
            f"delta on {held}" if path == "delta"
            else "anchor: nothing held yet" if held is None
            else "anchor: recovering from the anchor" if force_anchor
            else why
        )
        held_run = self._held_runs.get(held) if held is not None else None
        if held_run is not None and held_run != head.run_id:
            log.info("%s: version %d belongs to run %r, the held version %s to run %r; crossing by an anchor",
                     self.store.describe(), target, head.run_id, held, held_run)
        steps = tuple(
            PlanStep(m.version, "anchor", m.anchor_nbytes, first_reason, m.anchor_objects)
            if i == 0 and path == "anchor" else
            PlanStep(m.version, "delta", m.delta_nbytes, first_reason if i == 0 else f"delta on {m.base_version}",
                     m.delta_objects)
            for i, m in enumerate(ms)
        )
        return UpdatePlan(self.version, target, path, steps, tuple(ms))

    def _walk(self, head: Manifest, held: int | None) -> tuple[list[Manifest], int, str, str]:
        """The chain walk of :meth:`plan`, from ``head`` back along ``base_version`` links.

        Args:
            head: the target version's manifest.
            held: the version to start a delta path from (``None``: anchors only).

        Returns:
            ``(chain, start, path, why)``: the manifests walked, newest first; the index in it of the
            cheapest start (the anchor whose anchor part is used, or the first version after
            ``held``); ``"delta"`` or ``"anchor"``; and, for an anchor path from a held version,
            why no delta path was taken.
        """
        held_run = self._held_runs.get(held) if held is not None else None
        chain: list[Manifest] = []
        best: tuple[int, int, str] | None = None  # (bytes, index in chain, path)
        why = f"anchor: version {held} is not on the chain of {head.version}"
        deltas = 0  # bytes of the delta parts of the versions walked so far
        m = head
        while True:
            chain.append(m)
            i = len(chain) - 1
            if m.kind == "anchor" and (best is None or deltas + m.anchor_nbytes < best[0]):
                best = (deltas + m.anchor_nbytes, i, "anchor")
            if not m.has_delta:
                break  # a run's first anchor (or one after a reshape): nothing older leads here
            deltas += m.delta_nbytes
            base = m.base_version
            if held is not None and base == held:
                if held_run is not None and held_run != m.run_id:
                    # The number was reused by another run (a wiped prefix): the held state is not
                    # this chain's version `held`. Anchors only from here.
                    why = (f"anchor: the held version {held} belongs to run {held_run!r}, version "
                           f"{head.version} to run {m.run_id!r}")
                    held = None
                else:
                    if best is None or deltas <= best[0]:
                        best = (deltas, i, "delta")
                    else:
                        why = f"anchor: cheaper than the delta chain from {held}"
                    break  # anything older costs these deltas and more
            if best is not None and held is not None and base > held and deltas >= best[0]:
                why = f"anchor: cheaper than any delta chain from {held}"
                break
            if best is not None and (held is None or base < held or deltas >= best[0]):
                break  # no cheaper candidate can follow: older anchors cost as much plus more deltas
            try:
                older = self.manifest(base)
                if older.run_id != m.run_id:  # a cached copy may predate a wiped prefix: read it again
                    older = self.manifest(base, fresh=True)
            except CorruptObjectError as e:
                if best is not None:  # an anchor above the bad manifest is the way past it
                    why = f"anchor: the manifest of version {base} on the delta chain is unreadable ({e})"
                    break
                raise
            except VersionNotFoundError:
                if best is not None:
                    break  # retention removed the older chain; the candidates found suffice
                raise VersionNotFoundError(
                    f"{self.store.describe()}: version {head.version} needs version {base}, which is not "
                    "retained; update to the newest version instead"
                ) from None
            if older.run_id != m.run_id:
                if best is not None:
                    break
                raise CorruptObjectError(
                    f"{self.store.describe()}: version {m.version} (run {m.run_id!r}) is a delta on version "
                    f"{base} of another run ({older.run_id!r}), and no anchor of run {m.run_id!r} leads to "
                    f"version {head.version}: two writers shared this prefix. Receivers never cross runs "
                    "without an anchor; give every writer its own prefix"
                )
            m = older
        assert best is not None  # the walk ends at an anchor (Manifest: every delta has a base)
        return chain, best[1], best[2], why

    # --- update ----------------------------------------------------------------------------------

    def update(self, version: int | None = None) -> int:
        """Bring the target to ``version`` (the newest visible one when ``None``), all or nothing:
        :meth:`prepare`, then :meth:`commit`.

        Returns:
            The version now held.

        Raises:
            VersionNotFoundError: nothing published, or the version is not visible / retained.
            CorruptObjectError: an object or manifest is corrupt or malicious (sha256, sizes,
                indices, names, shapes, dtypes), and no anchor path recovers. Target unchanged.
            ChecksumMismatchError: the state would not match the manifest's checksums, even from
                the anchor. Target unchanged.
            IncompatibleTargetError: the published tensors do not fit the target. Target unchanged.
            StoreError: the store failed. Target unchanged.
        """
        with self._lock:  # nothing may commit between this prepare and its commit
            return self.commit(self.prepare(version))

    def prepare(self, version: int | None = None) -> StagedUpdate:
        """Download, decode, validate and verify ``version`` (the newest visible when ``None``)
        against the state the target holds now, writing nothing.

        Reads live weights (old values at changed positions, for relative steps and checksums), so
        it may run in a background thread while an engine generates; only :meth:`commit` writes.
        Verification costs ``O(changed elements)`` on a delta path. A delta path that fails
        (corrupt object, checksum mismatch) is retried once from the anchor.

        Returns:
            A :class:`StagedUpdate` (``plan.path == "noop"`` when the target already holds
            ``version``). Staged positions and values stay in host memory until committed or
            dropped: about 10 bytes per changed element on a delta path, the whole model on an
            anchor path.

        Raises:
            The same errors as :meth:`update`; nothing is written in any case.
        """
        # Following the newest version, the chain being planned or downloaded can vanish under us:
        # a new anchor appears and retention deletes the older chain. The newest version's chain is
        # always retained, so plan again from it (a receiver behind the retained range thus
        # recovers from the newest anchor). An explicit version that is gone stays an error.
        attempts = 1 if version is not None else _REPLAN_ATTEMPTS
        for attempt in range(attempts):
            try:
                return self._prepare(version)
            except (VersionNotFoundError, ObjectNotFoundError) as e:
                if attempt + 1 == attempts or self.newest_version() is None:
                    raise
                log.info("%s: the chain being applied is no longer retained (%s); planning again "
                         "from the newest version", self.store.describe(), e)
        raise AssertionError("unreachable")  # pragma: no cover

    def is_current(self, staged: StagedUpdate) -> bool:
        """Whether ``staged`` was prepared on the state the target holds now (so :meth:`commit`
        would accept it)."""
        return staged._generation == self._generation

    def commit(self, staged: StagedUpdate) -> int:
        """Write a :meth:`prepare`'d version into the target: ``index_copy_`` of the staged
        positions (delta path) or ``copy_`` of whole tensors (anchor path), then the target's
        :meth:`~torch_deltasync.targets.Target.finish` (e.g. re-packing changed vLLM modules).

        Returns:
            The version now held.

        Raises:
            StaleUpdateError: the target no longer holds ``staged.base_version`` (another update,
                :meth:`assume` or a failure came in between), or another receiver prepared
                ``staged``; nothing is written. Prepare again.
            Exception: whatever a write raises (e.g. out of memory); the held state is then
                unknown (``version`` is ``None``) and the next update takes the anchor path.
        """
        with self._lock:
            if not self.is_current(staged):
                raise StaleUpdateError(
                    f"{self.store.describe()}: version {staged.version} was staged on version "
                    f"{staged.base_version}, but the target now holds {self.version} (or another receiver "
                    "staged it); prepare it again with this receiver"
                )
            if staged.plan.path == "noop":
                return self.version  # type: ignore[return-value]
            t = time.perf_counter()
            self.version = None  # unknown until every write landed (and stages nothing else)
            changed = 0
            if staged._dense is not None:
                for name, full in staged._dense.items():
                    self.target.assign(name, full)
                    changed += full.numel()
            else:
                for name, (pos, val) in staged._sparse.items():  # type: ignore[union-attr]
                    if pos.numel():
                        self.target.write(name, pos, val)
                        changed += pos.numel()
            self.target.finish(staged.written)
            self._checksums = staged._checksums or {}
            self.version = staged.version
            stats = staged.stats
            assert stats is not None
            stats.changed = changed
            stats.apply_ms = (time.perf_counter() - t) * 1e3
            stats.total_ms += stats.apply_ms
            self.last_stats = stats
            if self.metrics_path is not None:
                self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.metrics_path, "a") as f:
                    f.write(json.dumps({"event": "update", **stats.to_dict()}) + "\n")
            return self.version

    def _prepare(self, version: int | None) -> StagedUpdate:
        """One planning and staging pass of :meth:`prepare`."""
        t0 = time.perf_counter()
        with self._lock:  # a consistent base: what the target holds, its checksums, the plan from it
            generation, checksums = self._generation, dict(self._checksums)
            plan = self.plan(version)
        if plan.path == "noop":
            return StagedUpdate(plan, plan.from_version, None, _generation=generation)
        plan_ms = (time.perf_counter() - t0) * 1e3
        # A target that cannot hold the version (shapes, dtype, a LoRA config) fails the same way
        # on every path: check it here, outside the anchor recovery below.
        self._check_target(plan.manifests[-1])
        recovered = False
        try:
            staged = self._stage(plan, checksums)
        except (CorruptObjectError, ObjectNotFoundError) as e:
            if generation != self._generation:
                # A commit landed while this was staged (a background prepare racing an update):
                # the old values it read may be the new ones. Not a reason to rebuild from an anchor.
                raise StaleUpdateError(f"{self.store.describe()}: the target changed while version "
                                       f"{plan.to_version} was being staged; prepare it again") from e
            # Recover once from the anchor, with every cached manifest read again (a cached
            # chain may belong to an earlier run on a wiped prefix). A second failure is final.
            log.warning("%s path to version %d failed (%s); recovering from the anchor",
                        plan.path, plan.to_version, e)
            self._manifests.clear()
            plan = self.plan(plan.to_version, force_anchor=True)
            self._check_target(plan.manifests[-1])
            staged = self._stage(plan, checksums)
            recovered = True
        staged._generation = generation
        assert staged.stats is not None
        staged.stats.plan_ms = plan_ms
        staged.stats.recovered = recovered
        staged.stats.total_ms = (time.perf_counter() - t0) * 1e3
        return staged

    def assume(self, version: int) -> None:
        """Declare that the target already holds ``version`` bit-exactly, so the next update takes
        the delta path from it instead of downloading an anchor.

        Typical use: a vLLM engine loaded the same checkpoint the trainer published as its first
        anchor. A target that holds everything is verified here against the manifest
        (``O(model size)``); a partial target (one TP rank) cannot see whole tensors, so combine
        its :meth:`partial_checksums` across ranks (:func:`torch_deltasync.checksum.check_partials`)
        before trusting the claim.

        Raises:
            VersionNotFoundError: ``version`` is not visible.
            IncompatibleTargetError: the published tensors do not fit the target.
            ChecksumMismatchError: (``holds_all`` targets) the target's weights are not ``version``;
                nothing changes.
        """
        with self._lock:
            m = self.manifest(version)  # validates the version number
            self._check_target(m)
            sums: dict[str, int] = {}
            if self.target.holds_all:
                sums = {t.name: self.target.checksum(t.name, m.inference_dtype) for t in m.tensors}
                bad = [t.name for t in m.tensors if sums[t.name] != t.checksum]
                if bad:
                    raise ChecksumMismatchError(
                        f"the target does not hold version {version}: {len(bad)} tensors differ, e.g. {bad[:3]}"
                    )
            self._checksums = sums
            self.version = version

    def verify(self) -> None:
        """Recompute every tensor's checksum from the target and compare with the held version's
        manifest (``O(model size)``; updates themselves only verify what changed).

        Raises:
            VersionNotFoundError: nothing is held.
            ChecksumMismatchError: the target's weights differ from the published version.
            NotImplementedError: the target holds only part of each tensor (combine
                :meth:`partial_checksums` across ranks instead).
        """
        if self.version is None:
            raise VersionNotFoundError("nothing is held yet; call update() first")
        if not self.target.holds_all:
            raise NotImplementedError("this target holds part of each tensor; combine partial_checksums() across ranks")
        m = self.manifest(self.version)
        bad = [t.name for t in m.tensors if self.target.checksum(t.name, m.inference_dtype) != t.checksum]
        if bad:
            raise ChecksumMismatchError(
                f"version {self.version}: {len(bad)} tensors differ from the published checksums, e.g. {bad[:3]}"
            )

    def partial_checksums(self) -> dict[str, int]:
        """This target's partial checksum per tensor (each element it holds counted once); partials
        of targets that partition the elements (TP ranks) add up to the manifest's checksums."""
        m = self.manifest(self.version) if self.version is not None else None
        if m is None:
            raise VersionNotFoundError("nothing is held yet; call update() first")
        return {t.name: self.target.checksum(t.name, m.inference_dtype) for t in m.tensors}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # --- internals -------------------------------------------------------------------------------

    def _check_target(self, m: Manifest) -> None:
        # Targets keep per-layout state (e.g. which untied aliases to mirror), so check again
        # whenever the layout differs from the one checked last, not only when it is new.
        key = (tuple((t.name, t.shape) for t in m.tensors), tuple(sorted(m.aliases.items())), m.inference_dtype)
        if key != self._checked:
            self._checked = None
            self.target.check({t.name: t.shape for t in m.tensors}, dict(m.aliases), m.inference_dtype)
            self._checked = key

    def _download(self, plan: UpdatePlan) -> dict[str, bytes]:
        entries = [(m, o) for m, step in zip(plan.manifests, plan.steps) for o in step.objects]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="deltasync-fetch")

        def read(m, o):
            # at most one byte more than declared: an oversized object is refused unread
            data = self.store.get(o.key, start=0, end=o.nbytes + 1)
            verify_bytes(data, o, f"version {m.version}")
            return o.key, data

        return dict(self._pool.map(lambda mo: self._reread(lambda: read(*mo)), entries))

    def _reread(self, read: Callable[[], T]) -> T:
        """``read()``, called again (up to ``_REREAD_ATTEMPTS`` times in all) while it raises
        :class:`CorruptObjectError`: a truncated or garbled transfer fails the size/sha256 or JSON
        check, and a store that lost bytes once usually delivers them next time."""
        for attempt in range(_REREAD_ATTEMPTS):
            try:
                return read()
            except CorruptObjectError as e:
                if attempt + 1 == _REREAD_ATTEMPTS:
                    raise
                log.debug("%s: %s; reading it again", self.store.describe(), e)
        raise AssertionError("unreachable")  # pragma: no cover

    def _stage(self, plan: UpdatePlan, checksums: dict[str, int]) -> StagedUpdate:
        """Download, decode and verify ``plan`` on top of the held state whose checksums are
        ``checksums``; the caller has checked the target. Writes nothing."""
        final = plan.manifests[-1]
        shapes = {t.name: t.shape for t in final.tensors}
        for m in plan.manifests:
            if {t.name: t.shape for t in m.tensors} != shapes or m.inference_dtype != final.inference_dtype:
                raise CorruptObjectError(
                    f"version {m.version} lists other tensors or dtype than version {final.version} on the same chain"
                )
        dtype = final.inference_dtype

        t = time.perf_counter()
        blobs = self._download(plan)
        download_ms = (time.perf_counter() - t) * 1e3

        t = time.perf_counter()
        if plan.path == "anchor":
            dense = self._stage_anchor(plan, blobs, shapes)
            sparse = None
        else:
            sparse = self._stage_deltas(plan.manifests, blobs, dtype)
            dense = None
        del blobs
        decode_ms = (time.perf_counter() - t) * 1e3

        t = time.perf_counter()
        new_checksums = self._verify(final, dense, sparse, checksums)
        verify_ms = (time.perf_counter() - t) * 1e3
        stats = UpdateStats(final.version, plan.from_version, plan.path, len(plan.manifests), plan.nbytes, 0,
                            download_ms=download_ms, decode_ms=decode_ms, verify_ms=verify_ms)
        return StagedUpdate(plan, plan.from_version, stats, dense, sparse, new_checksums)

    def _decode_version(self, m: Manifest, blobs: dict[str, bytes]) -> dict[str, TensorDelta]:
        """Decode every delta object of ``m`` and check the counts against the manifest."""
        per_tensor: dict[str, list[TensorDelta]] = {}
        for o in m.delta_objects:
            for name, d in decode_delta(blobs[o.key], m, o).items():
                per_tensor.setdefault(name, []).append(d)
        out = {}
        for entry in m.tensors:
            parts = per_tensor.get(entry.name, [])
            n = sum(p.numel for p in parts)
            if n != entry.changed:
                raise CorruptObjectError(
                    f"version {m.version}: tensor {entry.name!r} has {n} changes in its objects, manifest says {entry.changed}"
                )
            if parts:
                out[entry.name] = _concat(parts, f"version {m.version} tensor {entry.name!r}")
        return out

    def _stage_deltas(self, manifests: tuple[Manifest, ...], blobs: dict[str, bytes], dtype: torch.dtype):
        """Compose a delta chain into ``{name: (positions, final values)}`` without touching the target."""
        staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        target = self.target
        for m in manifests:
            for name, d in self._decode_version(m, blobs).items():
                if not target.holds_all:
                    d = d.select(target.owned(name, d.positions))
                if d.needs_base:
                    d_old = self._lookup(name, staged.get(name), d.positions, dtype)
                    new = d.resolve(d_old)
                else:
                    new = d.values
                if name in staged:
                    staged[name] = _merge(*staged[name], d.positions, new)
                else:
                    staged[name] = (d.positions, new)
        return staged

    def _lookup(self, name: str, staged: tuple[torch.Tensor, torch.Tensor] | None, pos: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """Values at ``pos`` as of the staged state: staged values where present, else the target's."""
        if staged is None:
            return self.target.read(name, pos, dtype)
        spos, sval = staged
        out = torch.empty(pos.shape, dtype=dtype)
        if spos.numel():
            i = torch.searchsorted(spos, pos).clamp_(max=spos.numel() - 1)
            hit = spos[i] == pos
        else:
            i = torch.zeros_like(pos)
            hit = torch.zeros_like(pos, dtype=torch.bool)
        out[hit] = sval[i[hit]]
        miss = ~hit
        if bool(miss.any()):
            out[miss] = self.target.read(name, pos[miss], dtype)
        return out

    def _stage_anchor(self, plan: UpdatePlan, blobs: dict[str, bytes], shapes: dict[str, tuple[int, ...]]):
        """Rebuild full tensors from the anchor's blocks, then apply the chain's deltas to them."""
        anchor = plan.manifests[0]
        blocks: dict[str, list] = {}
        for o in anchor.anchor_objects:
            for name, sb in decode_anchor(blobs[o.key], anchor, o).items():
                blocks.setdefault(name, []).append(sb)
        dense: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            parts = blocks.get(name)
            if not parts:
                raise CorruptObjectError(f"version {anchor.version}: anchor has no data for tensor {name!r}")
            if len(parts) == 1 and parts[0][0].is_full:
                dense[name] = parts[0][1].reshape(shape)
                continue
            full = torch.empty(shape, dtype=anchor.inference_dtype)
            cover = torch.zeros(shape, dtype=torch.bool)  # every element exactly once
            for s, block in parts:
                idx = tuple(slice(off, off + n) for off, n in zip(s.offsets, s.shape))
                if bool(cover[idx].any()):
                    raise CorruptObjectError(f"version {anchor.version}: anchor blocks of {name!r} overlap")
                full[idx] = block
                cover[idx] = True
            if not bool(cover.all()):
                raise CorruptObjectError(f"version {anchor.version}: anchor blocks of {name!r} overlap or leave gaps")
            dense[name] = full
        for m in plan.manifests[1:]:
            for name, d in self._decode_version(m, blobs).items():
                flat = dense[name].view(-1)
                new = d.resolve(flat[d.positions]) if d.needs_base else d.values
                flat.index_copy_(0, d.positions, new)
        return dense

    def _verify(self, final: Manifest, dense, staged, checksums: dict[str, int]) -> dict[str, int]:
        """Checksums of the staged state, from the held state's ``checksums`` and the changes;
        raise if they differ from ``final``'s manifest."""
        if not self.target.holds_all:
            return {}  # partial holders cannot see whole tensors; sha256 protected the bytes
        new: dict[str, int] = {}
        bad = []
        for entry in final.tensors:
            if dense is not None:
                c = tensor_checksum(dense[entry.name])
            else:
                c = checksums.get(entry.name)
                if c is None:
                    raise CorruptObjectError(f"no checksum held for {entry.name!r}")
                if entry.name in staged:
                    pos, val = staged[entry.name]
                    old = self.target.read(entry.name, pos, final.inference_dtype)
                    c = combine(c, checksum_change(pos, old, val))
            if c != entry.checksum:
                bad.append(entry.name)
            new[entry.name] = c
        if bad:
            raise ChecksumMismatchError(
                f"version {final.version}: the staged state differs from the published checksums for "
                f"{len(bad)} tensors, e.g. {bad[:3]}; nothing was applied"
            )
        return new
