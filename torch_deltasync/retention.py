"""Retention: delete old versions of a run without ever breaking a reader that follows it.

What is kept (everything else below the cut is deleted):

* the **cut anchor**: the newest anchor whose manifest is at least ``grace_s`` seconds old
  (``created_at``, the writer's clock), and every version after it;
* the whole chain (``base_version`` links down to an anchor) of every kept version, so the newest
  version can always be rebuilt, even when an out-of-order chain reaches below the cut anchor;
* the ``keep_anchors`` newest anchors below the cut (their own manifest and objects; the deltas
  after them are not kept);
* anything that is not a manifest (``versions/<v>.json``) or an object (``objects/<v>/...``), e.g.
  ``LATEST`` or files another tool put under the prefix;
* object folders without a manifest at or above the cut (a publish that may still be in flight).

The cut anchor is the only way in for a receiver that holds none of the kept versions, so before
anything below it is deleted its anchor objects are read back and checked against the manifest
(size and sha256; :attr:`RetentionPolicy.verify_cut`). An anchor that fails is passed over: the
next older anchor that checks out becomes the cut, so the versions after the bad anchor stay
reachable through its delta part (when it has one); with no such anchor nothing is deleted.

Order of deletion: first the manifests of every deleted version, then their objects (and orphan
object folders below the cut: leftovers of crashed or failed publishes). A reader that still sees a
manifest can therefore always fetch its objects unless the version has just been collected, in which
case the read fails with :class:`~torch_deltasync.errors.ObjectNotFoundError` and the receiver
plans again from the newest version. ``grace_s`` gives readers that started on an old chain before
the cut anchor appeared that many seconds to finish.

Receivers that lag behind the retained range need no special handling: a plan from the newest
version walks back to the cut anchor at most, so they take the anchor path (newest anchor plus the
deltas after it).

Example:
    >>> plan = plan_retention(store, RetentionPolicy(keep_anchors=1, grace_s=60))
    >>> print(plan)            # what would go, and why
    >>> apply_retention(store, plan)
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

from .errors import CorruptObjectError, ObjectNotFoundError, VersionNotFoundError
from .keys import list_versions, manifest_key
from .manifest import Manifest, load_manifest
from ._units import check_seconds
from .store import Store, check_key, open_store

__all__ = ["RetentionPolicy", "RetentionPlan", "plan_retention", "apply_retention", "collect_garbage"]

log = logging.getLogger(__name__)

_OBJECT_DIR_RE = re.compile(r"objects/([0-9]{12})/[^/]+")


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """How much of a run's history to keep (see the module docstring for the rules).

    Raises:
        TypeError, ValueError: ``keep_anchors`` is not an int ``>= 0``, ``grace_s`` not a number of
            seconds ``>= 0`` (``inf``: never delete), ``verify_cut`` not a bool.
    """

    keep_anchors: int = 0
    """Anchors kept below the cut anchor, newest first (``0``: only the cut anchor and after)."""

    grace_s: float = 0.0
    """Seconds an anchor must have been visible before versions below it may be deleted."""

    verify_cut: bool = True
    """Read the cut anchor's objects back and check their sizes and sha256 before deleting anything
    below it (one anchor's bytes read per collection that deletes something); an anchor that fails
    is passed over for the next older one. ``False``: trust the store."""

    def __post_init__(self) -> None:
        if type(self.keep_anchors) is not int or self.keep_anchors < 0:
            raise ValueError(f"RetentionPolicy.keep_anchors must be an integer >= 0, got {self.keep_anchors!r}")
        grace = check_seconds(self.grace_s, "grace_s", "RetentionPolicy", positive=False, finite=False)
        object.__setattr__(self, "grace_s", float(grace) + 0.0)  # (+ 0.0: -0.0 reads as 0)
        if not isinstance(self.verify_cut, bool):
            raise TypeError(f"RetentionPolicy.verify_cut must be True or False, got {self.verify_cut!r}")


@dataclass(frozen=True)
class RetentionPlan:
    """What :func:`apply_retention` will delete, and why.

    Attributes:
        newest: the newest visible version (``None``: the run is empty).
        cut: the cut anchor (``None``: no anchor old enough, nothing is deleted).
        keep: every version whose manifest stays, ascending.
        delete: versions whose manifest and objects go, ascending.
        orphans: object folders without a manifest that go (crashed publishes below the cut).
        object_keys: object keys to delete (after the manifests).
        reason: one line on how the cut was chosen.
        rejected: newer anchors passed over as the cut because their objects failed the check,
            one line each (``"anchor 20: ... has sha256 ..., manifest says ..."``).
    """

    newest: int | None
    cut: int | None
    keep: tuple[int, ...]
    delete: tuple[int, ...]
    orphans: tuple[int, ...]
    object_keys: tuple[str, ...] = ()
    reason: str = ""
    rejected: tuple[str, ...] = ()

    @property
    def manifest_keys(self) -> tuple[str, ...]:
        """Manifest keys to delete (first, before :attr:`object_keys`): those of :attr:`delete`."""
        return tuple(manifest_key(v) for v in self.delete)

    @property
    def empty(self) -> bool:
        return not (self.manifest_keys or self.object_keys)

    def __str__(self) -> str:
        def span(vs: tuple[int, ...], what: str) -> str:
            noun = what if len(vs) == 1 else what + "s"
            runs: list[list[int]] = []  # consecutive versions as [first, last]
            for v in vs:
                if runs and v == runs[-1][1] + 1:
                    runs[-1][1] = v
                else:
                    runs.append([v, v])
            parts = [f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}..{b}" for a, b in runs]
            listed = ", ".join(parts[:4]) + (", ..." if len(parts) > 4 else "")
            return f"{len(vs)} {noun} ({listed})" if vs else f"no {what}s"

        head = (f"retention: newest version {self.newest}, cut anchor {self.cut}: {self.reason}"
                if self.cut is not None else
                f"retention: newest version {self.newest}, no cut anchor: {self.reason}")
        lines = [head, *(f"  passed over {r}" for r in self.rejected), f"  keep     {span(self.keep, 'version')}"]
        if self.empty:
            lines.append("  delete   nothing")
        else:
            what = " and ".join(
                [span(self.delete, "version")] * bool(self.delete) + [span(self.orphans, "orphan folder")] * bool(self.orphans))
            lines.append(f"  delete   {what}: {len(self.manifest_keys)} manifests, {len(self.object_keys)} objects")
        return "\n".join(lines)


def plan_retention(store: Store, policy: RetentionPolicy | None = None, *, now: float | None = None) -> RetentionPlan:
    """Work out what to delete from a run (``store`` is the run's prefix). Deletes nothing.

    Args:
        store: the run's store (after :meth:`Store.sub` with the run prefix).
        policy: what to keep (default :class:`RetentionPolicy`: the newest anchor and after).
        now: the current Unix time in seconds, for ``grace_s`` (default ``time.time()``).

    Returns:
        The plan. Manifests that cannot be parsed are kept at or above the cut (a reader cannot use
        them, so their links are not followed) and deleted below it.

    Raises:
        TypeError, ValueError: ``now`` is not a finite number of seconds ``>= 0``.
        StoreError: listing or reading the store failed.
    """
    policy = policy or RetentionPolicy()
    now = time.time() if now is None else check_seconds(now, "now (a Unix time)", "plan_retention", positive=False)
    versions = list_versions(store)
    if not versions:
        return RetentionPlan(None, None, (), (), (), reason="no versions")
    newest = versions[-1]
    visible = set(versions)
    manifests: dict[int, Manifest | None] = {}

    def get(v: int) -> Manifest | None:
        if v not in manifests:
            try:
                manifests[v] = load_manifest(store, v)
            except VersionNotFoundError:  # deleted meanwhile (another collector)
                manifests[v] = None
            except CorruptObjectError as e:
                log.warning("%s: manifest of version %d is unreadable (%s)", store.describe(), v, e)
                manifests[v] = None
        return manifests[v]

    folders: dict[int, list[str]] = {}
    for key in store.list("objects"):
        mo = _OBJECT_DIR_RE.fullmatch(key)
        if mo is None:
            continue
        try:
            folders.setdefault(int(mo.group(1)), []).append(check_key(key))
        except CorruptObjectError as e:  # e.g. an editor's backup "...safetensors~": not deletable by key
            log.warning("%s: no sender writes %s; retention leaves it alone: remove it by hand", store.describe(), e)
    oldest = min([versions[0], *folders])

    # 1. the cut: the newest anchor at least grace_s old whose objects check out
    cut = None
    reason = "no anchor is visible"
    rejected: list[str] = []
    for v in reversed(versions):
        m = get(v)
        if m is None or m.kind != "anchor":
            continue
        age = now - m.created_at
        if age < policy.grace_s:
            reason = f"anchor {v} is only {age:.1f} s old (grace {policy.grace_s:g} s); no older anchor"
            continue
        if policy.verify_cut and oldest < v:  # something below it would go: it must be a way in
            problem = _check_anchor(store, m)
            if problem is not None:
                log.warning("%s: anchor %d fails its check (%s); keeping the versions below it",
                            store.describe(), v, problem)
                rejected.append(f"anchor {v}: {problem}")
                reason = f"anchor {v} fails its check; no older anchor passes"
                continue
        cut = v
        reason = f"newest anchor at least {policy.grace_s:g} s old ({age:.1f} s)"
        if rejected:
            reason = f"newest anchor at least {policy.grace_s:g} s old ({age:.1f} s) whose objects check out"
        break
    if cut is None:
        return RetentionPlan(newest, None, tuple(versions), (), (), reason=reason, rejected=tuple(rejected))

    # 2. keep every version from the cut on, and the chain of each of them
    keep = {v for v in versions if v >= cut}
    for v in sorted(keep, reverse=True):
        m = get(v)
        while m is not None and m.kind == "delta":
            base = m.base_version
            if base in keep or base not in visible:
                break  # joined a kept chain, or the link is already gone (nothing to protect)
            keep.add(base)
            m = get(base)

    # 3. older anchors
    left = policy.keep_anchors
    for v in reversed(versions):
        if left == 0:
            break
        if v >= cut:
            continue
        m = get(v)
        if m is not None and m.kind == "anchor":
            keep.add(v)
            left -= 1

    delete = tuple(v for v in versions if v not in keep)
    object_keys: list[str] = []
    orphans = tuple(sorted(v for v in folders if v not in visible and v < cut))
    gone = set(delete) | set(orphans)
    for v in sorted(gone):
        object_keys += folders.get(v, [])
    return RetentionPlan(
        newest=newest, cut=cut, keep=tuple(sorted(keep)), delete=delete, orphans=orphans,
        object_keys=tuple(object_keys),
        reason=reason, rejected=tuple(rejected),
    )


def _check_anchor(store: Store, m: Manifest) -> str | None:
    """``None`` when every anchor object of ``m`` is in ``store`` with its manifest's size and
    sha256, else what is wrong. Store failures propagate (nothing is deleted on a guess)."""
    from .format import verify_stored

    for o in m.anchor_objects:
        try:
            verify_stored(store, o, f"version {m.version}")
        except (CorruptObjectError, ObjectNotFoundError) as e:
            return str(e)
    return None


def apply_retention(store: Store, plan: RetentionPlan) -> RetentionPlan:
    """Delete what ``plan`` names: every manifest first, then the objects.

    Returns:
        ``plan``, for chaining.

    Raises:
        StoreError: a delete failed; whatever was deleted stays deleted, and running the
            collection again finishes the job (manifests are gone before their objects, so no
            visible version ever lacks its objects).
    """
    if plan.manifest_keys:
        store.delete_many(list(plan.manifest_keys))
    if plan.object_keys:
        store.delete_many(list(plan.object_keys))
    if not plan.empty:
        log.info("%s: retention deleted %d versions and %d orphan folders (%d objects) below version %s",
                 store.describe(), len(plan.delete), len(plan.orphans), len(plan.object_keys), plan.cut)
    return plan


def collect_garbage(store: "Store | str | os.PathLike", policy: RetentionPolicy | None = None, *, prefix: str = "",
                    dry_run: bool = False, now: float | None = None) -> RetentionPlan:
    """:func:`plan_retention`, then :func:`apply_retention` unless ``dry_run``.

    Safe to run while a writer publishes and receivers read, and from several processes at once.

    Args:
        store: a :class:`Store` or anything :func:`open_store` accepts.
        policy: ``None``: ``RetentionPolicy()``.
        prefix: the run's prefix in ``store`` (as given to the sender and the receivers).

    Returns:
        The plan that was (or, with ``dry_run``, would be) carried out.

    Raises:
        TypeError: ``policy`` is not a :class:`RetentionPolicy`.
    """
    if policy is not None and not isinstance(policy, RetentionPolicy):
        raise TypeError(f"collect_garbage: policy must be a RetentionPolicy or None, got {type(policy).__name__} "
                        f"{policy!r}; e.g. RetentionPolicy(keep_anchors=1)")
    if not isinstance(store, Store):
        store = open_store(store)
    store = store.sub(prefix)
    plan = plan_retention(store, policy, now=now)
    if not dry_run:
        apply_retention(store, plan)
        # temporary files of crashed writers (local folders only); a live put is far younger. Only
        # in a run: a path that holds no versions may be any folder, whose files are not ours.
        if plan.newest is not None:
            store.sweep_temporaries(older_than_s=max(3600.0, (policy or RetentionPolicy()).grace_s))
    return plan
