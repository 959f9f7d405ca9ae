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
   corrupt object or mismatch on a delta path falls back to the anchor path; one in an anchor's
   objects to the delta path or an older anchor (crossing it by its delta part); a damaged delta
   part that every path needs, or a third failure, is raised.
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

import functools
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Collection, Mapping

import torch
from torch import nn

from .._config import with_options
from .._metrics import append_metrics
from ..errors import (
    ChecksumMismatchError, CorruptObjectError, DeltaSyncError, IncompatibleTargetError, ObjectNotFoundError,
    StaleUpdateError, VersionNotFoundError,
)
from ..keys import check_version
from ..manifest import Manifest
from ..store import Store, open_store
from ..targets import ModuleTarget, Target
from ._config import ReceiverConfig
from ._discover import (check_not_behind, check_still_published, newest_version, not_visible, nothing_visible,
                        object_lost, republished, wait_for)
from ._plan import UpdatePlan, plan_steps, walk_chain
from ._stage import StagedUpdate, UpdateStats, failed_part, read_manifest, stage, write_staged

log = logging.getLogger("torch_deltasync.receiver")

#: Paths tried again after a failed update, each avoiding what failed before (``_prepare``).
_MAX_RECOVERIES = 2
#: Plans of one ``update()`` toward the newest version when retention removes the chain meanwhile.
_REPLAN_ATTEMPTS = 3


_GENERATIONS = itertools.count()  # generations of every receiver's held state (DeltaReceiver._generation)


def _checks_again_after_refusal(method):
    """A method that uses the target: when the target refuses (``IncompatibleTargetError``, e.g. a
    tensor replaced by one that no longer fits), the next call checks the whole target again
    (``Target.check``) instead of trusting the layout it was last checked for."""
    @functools.wraps(method)
    def wrapper(self: "DeltaReceiver", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except IncompatibleTargetError:
            self._checked = None
            raise
    return wrapper


class DeltaReceiver:
    """Follows a run in a store and applies its versions to a model, bit-exactly.

    Args:
        target: an ``nn.Module`` or state dict (wrapped in :class:`ModuleTarget`), or any
            :class:`~torch_deltasync.targets.Target` (e.g. ``VLLMTarget``).
        store: a :class:`~torch_deltasync.store.Store` or anything :func:`open_store` accepts.
        prefix: the run's sub-path in the store (as given to the sender).
        config: the receiver's options (:class:`~torch_deltasync.receiver.ReceiverConfig`, which
            documents each field): ``max_workers`` (parallel downloads, 8), ``threads`` (tensors
            decoded and staged at once, one per core shared among local ranks, at most 8),
            ``recover`` (another path after a damaged object, True), ``metrics_path``.
            ``None``: ``ReceiverConfig()``.
        options: ``ReceiverConfig`` fields given as keywords (``max_workers=4``); they override
            ``config``'s (``dataclasses.replace``).

    Attributes:
        version: the version the target holds (``None`` before the first update, or after a
            failure that left the target's state unknown).
        receiver_config: the options in force (``config`` with ``options`` applied). Not named
            ``config``: :class:`~torch_deltasync.integrations.peft.AdapterReceiver` has a
            ``config`` property of its own (the run's ``LoraConfig``).

    Raises:
        TypeError: an option that is not a ``ReceiverConfig`` field (the message lists the fields),
            or an option of the wrong type.
        ValueError: an option out of range (``max_workers < 1``, ``threads < 1``).

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
        config: ReceiverConfig | None = None,
        **options: Any,
    ) -> None:
        config = with_options(config, ReceiverConfig, options, type(self).__name__,
                              takes="its options are ReceiverConfig's fields")
        self.receiver_config = config
        self.target = target if isinstance(target, Target) else ModuleTarget(target)
        self.store = open_store(store).sub(prefix)
        self.max_workers = config.max_workers
        self.metrics_path = Path(config.metrics_path) if config.metrics_path else None
        # A new value whenever the held state changes; a staged update records it. Drawn from one
        # counter for every receiver, so an update staged by another receiver is never current here.
        self._generation = next(_GENERATIONS)
        self._version: int | None = None
        self.last_stats: UpdateStats | None = None
        self._checksums: dict[str, int] = {}  # full checksums of the held state (holds_all targets)
        self._manifests: dict[int, Manifest] = {}
        self._held_runs: dict[int, str] = {}  # version -> run id of the manifest planned for it
        self._held: Manifest | None = None  # the manifest of the version the target received
        self._seen: tuple[int | None, str | None | bool] | None = None  # newest_version()'s last (version, digest)
        self._checked: tuple | None = None  # the manifest layout the target was last checked for
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def version(self) -> int | None:
        """The version the target holds (``None``: nothing, or unknown after a failed write). Set to
        ``None``, the next update rebuilds from an anchor; an int is a claim taken unchecked
        (:meth:`assume` checks it). Setting it drops every staged update; a value neither ``None``
        nor an int in ``[0, MAX_VERSION]`` raises ``TypeError`` or ``ValueError``."""
        return self._version

    @version.setter
    def version(self, value: int | None) -> None:
        self._version = None if value is None else check_version(value)
        if self._held is not None and self._held.version != value:
            self._held = None  # the manifest of the held version, or None
        self._generation = next(_GENERATIONS)

    # --- discovery -------------------------------------------------------------------------------

    def manifest(self, version: int, *, fresh: bool = False) -> Manifest:
        """The validated manifest of ``version`` (cached; manifests are immutable).

        Args:
            fresh: read it from the store even if cached. If it differs from the cached copy (the
                bucket was wiped and a new run reused the number), the whole cache is dropped.

        Raises:
            TypeError, ValueError: ``version`` is not an int in ``[0, MAX_VERSION]``.
            VersionNotFoundError: no such version is visible (never published, or not retained).
            CorruptObjectError: the manifest is malformed.
        """
        return read_manifest(self.store, self._manifests, check_version(version), fresh)

    def newest_version(self) -> int | None:
        """The newest visible version (``LATEST`` if it is current, else a listing), or ``None``."""
        newest, digest = newest_version(self.store, held=self.version)
        self._seen = (newest, digest)
        return newest

    def wait_for(self, version: int | None = None, *, timeout_s: float = 60.0, poll_s: float = 0.05) -> int:
        """Block until a version ``>= version`` (any version when ``None``) is visible; return the newest.

        Raises:
            SyncTimeoutError: (a ``TimeoutError``) nothing new appeared within ``timeout_s`` seconds.
            TypeError, ValueError: ``version``, ``timeout_s`` or ``poll_s`` out of type or range.
        """
        return wait_for(self.newest_version, self.store.describe(), version, timeout_s, poll_s)

    def needs_update(self, version: int | None = None) -> bool:
        """Whether :meth:`update` of ``version`` (the newest visible one when ``None``) would change
        the target: it holds another version, or the store's manifest of the held version is no
        longer the one it received (a new run on a wiped prefix reused the number; the update then
        rebuilds from an anchor). Cheap to poll: after :meth:`newest_version` confirmed ``LATEST``
        it costs no request, else at most one ranged read of the manifest's digest.

        Raises:
            TypeError, ValueError: ``version`` is not an int in ``[0, MAX_VERSION]``.
            StoreError: the store failed.
        """
        target = self.newest_version() if version is None else check_version(version)
        if target is None or target != self.version:
            return target is not None
        seen = self._seen[1] if self._seen is not None and self._seen[0] == target else False
        return republished(self.store, self._held, target, seen=seen, fresh=self._fresh)

    # --- planning --------------------------------------------------------------------------------

    def plan(self, version: int | None = None, *, force_anchor: bool = False,
             exclude_anchors: Collection[int] = ()) -> UpdatePlan:
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
            exclude_anchors: anchors not to start from (recovery after their objects failed to
                load): the walk goes on to older anchors, crossing these by their delta parts.

        Returns:
            The plan: its steps oldest first; ``path`` is ``"noop"`` when ``T`` is held already.

        Raises:
            TypeError, ValueError: ``version`` is not an int in ``[0, MAX_VERSION]``.
            VersionNotFoundError: no version at all, the target version is not visible, or its
                chain needs a version that is no longer retained.
            CorruptObjectError: ``T``'s chain crosses into another run before any anchor, so
                nothing can rebuild it (two writers shared the prefix), or every anchor on it is
                in ``exclude_anchors``.
        """
        target = self.newest_version() if version is None else check_version(version)
        if target is None:
            raise nothing_visible(self.store, self.version)
        again = target == self.version and not force_anchor and republished(
            self.store, self._held, target, fresh=self._fresh)
        if target == self.version and not force_anchor and not again:
            return UpdatePlan(self.version, target, "noop", ())
        if version is None:
            check_not_behind(self.store.describe(), target, self._held, self._fresh)
        try:
            head = self.manifest(target, fresh=True)  # the head of the walk is never a stale cached copy
        except VersionNotFoundError as e:
            if version is None:
                raise
            raise not_visible(e, target, self.newest_version()) from None
        self._held_runs[target] = head.run_id
        while len(self._held_runs) > 64:
            self._held_runs.pop(next(iter(self._held_runs)))
        held = None if force_anchor or again else self.version
        chain, start, path, why = walk_chain(
            head, held, held_run=self._held_runs.get(held) if held is not None else None,
            manifest=self.manifest, where=self.store.describe(), exclude_anchors=exclude_anchors)
        ms = chain[start::-1]
        held = self.version
        first_reason = (
            f"delta on {held}" if path == "delta"
            else "anchor: nothing held yet" if held is None
            else f"anchor: recovering from an older anchor (not {sorted(exclude_anchors)})" if exclude_anchors
            else "anchor: recovering from the anchor" if force_anchor
            else f"anchor: version {target} was published again (a new run on a wiped prefix?)" if again
            else why
        )
        held_run = self._held_runs.get(held) if held is not None else None
        if held_run is not None and held_run != head.run_id:
            log.info("%s: version %d belongs to run %r, the held version %s to run %r; crossing by an anchor",
                     self.store.describe(), target, head.run_id, held, held_run)
        return UpdatePlan(self.version, target, path, plan_steps(ms, path, first_reason), tuple(ms))

    # --- update ----------------------------------------------------------------------------------

    def update(self, version: int | None = None) -> int:
        """Bring the target to ``version`` (the newest visible one when ``None``), all or nothing:
        :meth:`prepare`, then :meth:`commit`.

        Returns:
            The version now held.

        Raises:
            TypeError, ValueError: ``version`` is not an int in ``[0, MAX_VERSION]``.
            VersionNotFoundError: nothing published, or the version is not visible / retained.
            CorruptObjectError: an object or manifest is corrupt or malicious (sha256, sizes,
                indices, names, shapes, dtypes), and no anchor path recovers. Target unchanged.
            ChecksumMismatchError: the state would not match the manifest's checksums, even from
                the anchor. Target unchanged.
            IncompatibleTargetError: the published tensors do not fit the target. Target unchanged.
            StoreError: the store failed. Target unchanged.
        """
        with self._lock:  # nothing may commit between this prepare and its commit
            return self.commit(self.prepare(version, ahead=False))

    @_checks_again_after_refusal
    def prepare(self, version: int | None = None, *, ahead: bool = True) -> StagedUpdate:
        """Download, decode, validate and verify ``version`` (the newest visible when ``None``)
        against the state the target holds now, writing nothing. With ``ahead``, the target also
        prepares its part of the commit where it can (``Target.prepare_commit``, e.g. re-packing
        vLLM modules on copies); pass ``False`` when the commit follows at once (that work would
        only move, and cost memory).

        Reads live weights (old values at changed positions, for relative steps and checksums), so
        it may run in a background thread while an engine generates; only :meth:`commit` writes.
        Verification costs ``O(changed elements)`` on a delta path. A delta path that fails
        (corrupt object, checksum mismatch) is retried from the anchor, and an anchor path that
        fails along the delta path or from an older anchor, at most twice in all.

        Returns:
            A :class:`StagedUpdate` (``plan.path == "noop"`` when the target already holds
            ``version``). Staged positions and values stay in host memory until committed or
            dropped: about 10 bytes per changed element on a delta path, the whole model on an
            anchor path; plus whatever the target prepared ahead of the commit
            (``StagedUpdate.prepared``, e.g. :class:`~torch_deltasync.targets.VLLMEngineTarget`'s
            re-packed modules; :meth:`StagedUpdate.release_prepared` frees it).

        Raises:
            The same errors as :meth:`update`; nothing is written in any case.
        """
        # Following the newest version, the chain being planned or downloaded can vanish under us:
        # a new anchor appears and retention deletes the older chain. The newest version's chain is
        # always retained, so plan again from it (a receiver behind the retained range thus
        # recovers from the newest anchor). An explicit version that is gone stays an error.
        attempts = 1 if version is not None else _REPLAN_ATTEMPTS
        for attempt in range(attempts):
            target = version if version is not None else self.newest_version()
            try:
                if version is None:
                    check_not_behind(self.store.describe(), target, self._held, self._fresh)
                return self._prepare(target, ahead)
            except (VersionNotFoundError, ObjectNotFoundError) as e:
                # planned again only when a newer version has replaced the chain's head meanwhile
                if attempt + 1 == attempts or self.newest_version() in (None, target):
                    raise object_lost(e, target, version is not None) if isinstance(e, ObjectNotFoundError) else e
                log.info("%s: the chain being applied is no longer retained (%s); planning again "
                         "from the newest version", self.store.describe(), e)
        raise AssertionError("unreachable")  # pragma: no cover

    def _fresh(self, version: int) -> Manifest:
        return self.manifest(version, fresh=True)

    def is_current(self, staged: StagedUpdate) -> bool:
        """Whether ``staged`` was prepared on the state the target holds now (so :meth:`commit`
        would accept it)."""
        if not isinstance(staged, StagedUpdate):
            raise TypeError(f"expected the StagedUpdate that prepare() returned, got {type(staged).__name__}")
        return staged._generation == self._generation

    @_checks_again_after_refusal
    def commit(self, staged: StagedUpdate) -> int:
        """Write a :meth:`prepare`'d version into the target: ``index_copy_`` of the staged
        positions (delta path; different tensors on ``ReceiverConfig.threads`` threads where the
        target declares ``concurrent_writes``) or ``copy_`` of whole tensors (anchor path), then
        the target's :meth:`~torch_deltasync.targets.Target.finish` (e.g. re-packing changed vLLM
        modules); or, where the target prepared the commit ahead (``StagedUpdate.prepared``),
        what it prepared (e.g. swapping in vLLM modules re-packed during :meth:`prepare`).

        Returns:
            The version now held.

        Raises:
            TypeError: ``staged`` is not a :class:`StagedUpdate`.
            StaleUpdateError: the target no longer holds ``staged.base_version`` (another update,
                :meth:`assume` or a failure came in between), or another receiver prepared
                ``staged``; nothing is written. Prepare again.
            Exception: whatever a write raises (e.g. out of memory; the first in the order of the
                staged tensors when writes on several threads fail); the held state is then
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
            self._check_target(staged.plan.manifests[-1])  # its layout again (a verify() may have checked the held one)
            t, held = time.perf_counter(), self._held
            self.version = None  # unknown until every write landed (and stages nothing else)
            try:
                changed = write_staged(self.target, staged, self.receiver_config.threads)
            except IncompatibleTargetError:
                if not staged.touched:  # refused before any write: the target still holds its version
                    self.version, self._held = staged.base_version, held
                raise
            self._checksums = staged._checksums or {}
            self.version, self._held = staged.version, staged.plan.manifests[-1]
            stats = staged.stats
            assert stats is not None
            stats.changed = changed
            stats.apply_ms = (time.perf_counter() - t) * 1e3
            stats.total_ms += stats.apply_ms
            self.last_stats = stats
            if self.metrics_path is not None:
                append_metrics(self.metrics_path, {"event": "update", **stats.to_dict()})
            return self.version

    def _prepare(self, version: int | None, ahead: bool) -> StagedUpdate:
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
        recoveries, failed_anchors, damaged_deltas, force, first_error = 0, set(), set(), False, ""
        self._pool = self._pool or ThreadPoolExecutor(self.max_workers, thread_name_prefix="deltasync-fetch")
        while True:
            try:
                staged = stage(self.store, self.target, plan, checksums, ahead, self._pool, self.receiver_config.threads)
                break
            except (CorruptObjectError, ObjectNotFoundError) as e:
                if generation != self._generation:
                    # A commit landed while this was staged (a background prepare racing an update):
                    # the old values it read may be the new ones. Not a reason to rebuild from an anchor.
                    raise StaleUpdateError(f"{self.store.describe()}: the target changed while version "
                                           f"{plan.to_version} was being staged; prepare it again") from e
                if recoveries >= _MAX_RECOVERIES or not self.receiver_config.recover:  # (naming what failed first)
                    raise type(e)(f"{e}; recovering from the first failure: {first_error}") if first_error else e
                # Recover, avoiding what failed: a failed anchor part (or anchor path naming no object)
                # is crossed by its delta part, a failed delta path not taken again (the held state
                # may be wrong), no path needing a damaged delta part tried. Cached manifests are
                # read again (a cached chain may belong to an earlier run on a wiped prefix).
                first_error = first_error or f"{type(e).__name__}: {e}"
                part = failed_part(plan, e)
                if part is not None and part[1] == "delta":
                    damaged_deltas.add(part[0])
                elif part is not None or plan.path == "anchor":
                    failed_anchors.add(part[0] if part is not None else plan.steps[0].version)
                force = force or plan.path == "delta"
                self._manifests.clear()
                failed = plan
                try:
                    plan = self.plan(plan.to_version, force_anchor=force, exclude_anchors=failed_anchors)
                except (CorruptObjectError, VersionNotFoundError) as no_other:
                    raise e from no_other  # what failed first is what to fix
                if plan.path == "noop":  # what failed was the doubt (a digest read cut short): it holds it
                    return StagedUpdate(plan, plan.from_version, None, _generation=generation)
                if any(s.kind == "delta" and s.version in damaged_deltas for s in plan.steps):
                    raise e  # every way to the version needs the damaged delta part
                log.warning("%s path to version %d failed (%s); recovering from %s", failed.path, failed.to_version, e,
                            f"anchor {plan.steps[0].version}" if plan.path == "anchor" else f"version {plan.from_version}")
                self._check_target(plan.manifests[-1])
                recoveries += 1
        staged._generation = generation
        assert staged.stats is not None
        staged.stats.plan_ms = plan_ms
        staged.stats.recovered, staged.stats.recovered_from = recoveries > 0, first_error
        staged.stats.total_ms = (time.perf_counter() - t0) * 1e3
        return staged

    @_checks_again_after_refusal
    def assume(self, version: int) -> None:
        """Declare that the target already holds ``version`` bit-exactly, so the next update takes
        the delta path from it instead of downloading an anchor.

        Typical use: a vLLM engine loaded the same checkpoint the trainer published as its first
        anchor. A target that holds everything is verified here against the manifest
        (``O(model size)``); a partial target (one TP rank) cannot see whole tensors, so combine
        its :meth:`partial_checksums` across ranks (:func:`torch_deltasync.checksum.check_partials`)
        before trusting the claim.

        Raises:
            TypeError, ValueError: ``version`` is not an int in ``[0, MAX_VERSION]``.
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
            self.version, self._held = version, m
            self._held_runs[version] = m.run_id  # as an update records it: never a delta base of another run

    @_checks_again_after_refusal
    def verify(self) -> None:
        """Recompute every tensor's checksum from the target and compare with the held version's
        manifest (``O(model size)``; updates themselves only verify what changed).

        Raises:
            VersionNotFoundError: nothing is held.
            IncompatibleTargetError: the target no longer fits the held version (a tensor replaced).
            ChecksumMismatchError: the target's weights differ from the published version.
            NotImplementedError: the target holds only part of each tensor (combine
                :meth:`partial_checksums` across ranks instead).
        """
        with self._lock:  # one held version throughout (an update on another thread waits)
            version = self.version
            if version is None:
                raise VersionNotFoundError("nothing is held yet; call update() first")
            if not self.target.holds_all:
                raise NotImplementedError("this target holds part of each tensor; combine partial_checksums() across ranks")
            check_still_published(self.store, self._held, version, self._fresh)
            m = self._held or self.manifest(version)
            self._check_target(m)  # again after a refusal: the model may have been put right
            bad = [t.name for t in m.tensors if self.target.checksum(t.name, m.inference_dtype) != t.checksum]
            if bad:
                raise ChecksumMismatchError(
                    f"{self.store.describe()}: version {version}: {len(bad)} tensors differ from the published "
                    f"checksums, e.g. {bad[:3]}: the weights changed behind the receiver (written in place, "
                    "load_state_dict, an optimizer step); verify_or_forget() then update() rebuilds them from an anchor"
                )

    def verify_or_forget(self) -> DeltaSyncError | None:
        """:meth:`verify` the held state; if it is not the held version, forget that version
        (``version = None``) so that the next update rebuilds from an anchor.

        For a target whose weights may have been replaced behind the receiver's back (a policy
        copied to another device, an engine that reloaded); nothing is written here.

        Returns:
            ``None`` when nothing is held or the target holds the version bit-exactly, else the
            error that made the receiver forget it (e.g. a ``ChecksumMismatchError``).

        Raises:
            NotImplementedError: the target holds only part of each tensor (verify across ranks
                with :meth:`partial_checksums` instead).
        """
        with self._lock:
            if self.version is None:
                return None
            try:
                self.verify()
            except DeltaSyncError as e:
                self.version = None
                return e
            return None

    @_checks_again_after_refusal
    def partial_checksums(self) -> dict[str, int]:
        """This target's partial checksum per tensor (each element it holds counted once); partials
        of targets that partition the elements (TP ranks) add up to the manifest's checksums."""
        with self._lock:
            m = self.manifest(self.version) if self.version is not None else None
            if m is None:
                raise VersionNotFoundError("nothing is held yet; call update() first")
            self._check_target(m)
            return {t.name: self.target.checksum(t.name, m.inference_dtype) for t in m.tensors}

    def close(self) -> None:
        """Stop the download threads (a later update starts them again). Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # --- internals -------------------------------------------------------------------------------

    def _check_target(self, m: Manifest) -> None:
        # Targets keep per-layout state (e.g. which untied aliases to mirror), so check again
        # whenever the layout (or the run: an adapter's config) differs from the one checked last.
        key = (m.run_id, tuple((t.name, t.shape) for t in m.tensors), tuple(sorted(m.aliases.items())), m.inference_dtype)
        if key != self._checked:
            self._checked = None
            try:
                self.target.check({t.name: t.shape for t in m.tensors}, dict(m.aliases), m.inference_dtype)
            except IncompatibleTargetError as e:
                raise IncompatibleTargetError(f"{self.store.describe()}: version {m.version} does not fit the "
                                              f"receiving model: {e}") from None
            self._checked = key
