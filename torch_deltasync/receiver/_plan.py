"""Planning an update: which versions to download, along which path (delta or anchor).

``DeltaReceiver.plan`` reads the target version's manifest; :func:`walk_chain` walks back along
``base_version`` links and picks the smallest download (``docs/design.md``, "Receiver").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection

from ..errors import CorruptObjectError, VersionNotFoundError
from ..manifest import Manifest


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


def plan_steps(ms: list[Manifest], path: str, first_reason: str) -> tuple[PlanStep, ...]:
    """The steps through ``ms`` (oldest first): the first the anchor of an ``"anchor"`` path,
    every other one a delta on the version before, each with the objects it downloads."""
    return tuple(
        PlanStep(m.version, "anchor", m.anchor_nbytes, first_reason, m.anchor_objects)
        if i == 0 and path == "anchor" else
        PlanStep(m.version, "delta", m.delta_nbytes, first_reason if i == 0 else f"delta on {m.base_version}",
                 m.delta_objects)
        for i, m in enumerate(ms)
    )


def walk_chain(head: Manifest, held: int | None, *, held_run: str | None, manifest: Callable[..., Manifest],
               where: str, exclude_anchors: Collection[int] = ()) -> tuple[list[Manifest], int, str, str]:
    """The chain walk of :meth:`plan`, from ``head`` back along ``base_version`` links.

    Args:
        head: the target version's manifest.
        held: the version to start a delta path from (``None``: anchors only).
        held_run: the run id of the held version's manifest, if known.
        manifest: ``manifest(version, fresh=False)``, the receiver's cached manifest reader.
        where: the store, for messages.
        exclude_anchors: versions whose anchor part is not a candidate (it failed to load); the
            walk goes on past them to older anchors, crossing them by their delta parts.

    Returns:
        ``(chain, start, path, why)``: the manifests walked, newest first; the index in it of the
        cheapest start (the anchor whose anchor part is used, or the first version after
        ``held``); ``"delta"`` or ``"anchor"``; and, for an anchor path from a held version,
        why no delta path was taken.

    Raises:
        VersionNotFoundError: the chain needs a version that is not retained.
        CorruptObjectError: the chain crosses into another run before an anchor, or every anchor
            on it is in ``exclude_anchors``.
    """
    chain: list[Manifest] = []
    best: tuple[int, int, str] | None = None  # (bytes, index in chain, path)
    why = f"anchor: version {held} is not on the chain of {head.version}"
    deltas = 0  # bytes of the delta parts of the versions walked so far
    m = head
    while True:
        chain.append(m)
        i = len(chain) - 1
        if m.kind == "anchor" and m.version not in exclude_anchors and (best is None or deltas + m.anchor_nbytes < best[0]):
            best = (deltas + m.anchor_nbytes, i, "anchor")
        if not m.has_delta:
            if best is None:  # every anchor on the way here failed to load
                raise _no_other_anchor(where, head, exclude_anchors, f"version {m.version} is the first of its chain")
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
            older = manifest(base)
            if older.run_id != m.run_id:  # a cached copy may predate a wiped prefix: read it again
                older = manifest(base, fresh=True)
        except CorruptObjectError as e:
            if best is not None:  # an anchor above the bad manifest is the way past it
                why = f"anchor: the manifest of version {base} on the delta chain is unreadable ({e})"
                break
            raise
        except VersionNotFoundError:
            if best is not None:
                break  # retention removed the older chain; the candidates found suffice
            if exclude_anchors:
                raise _no_other_anchor(where, head, exclude_anchors, f"version {base}, older, is not retained") from None
            raise VersionNotFoundError(
                f"{where}: version {head.version} needs version {base}, which is not in the store "
                "(retention removed it, or it was deleted); update to a newer version, or, if "
                f"{head.version} is the newest, the store has lost version {base} and the writer must "
                "publish an anchor"
            ) from None
        if older.run_id != m.run_id:
            if best is not None:
                break
            raise CorruptObjectError(
                f"{where}: version {m.version} (run {m.run_id!r}) is a delta on version "
                f"{base} of another run ({older.run_id!r}), and no anchor of run {m.run_id!r} leads to "
                f"version {head.version}: two writers shared this prefix. Receivers never cross runs "
                "without an anchor; give every writer its own prefix"
            )
        m = older
    assert best is not None  # the walk ends at an anchor (Manifest: every delta has a base)
    return chain, best[1], best[2], why


def _no_other_anchor(where: str, head: Manifest, excluded: Collection[int], end: str) -> CorruptObjectError:
    """The error of a walk that finds no anchor but the ones excluded (they failed to load), and
    ends where ``end`` says."""
    return CorruptObjectError(f"{where}: no other anchor leads to version {head.version}: the chain's anchors "
                              f"{sorted(excluded)} failed to load and {end}")
