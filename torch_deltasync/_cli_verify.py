"""The object checks of ``deltasync verify`` (:mod:`torch_deltasync.cli`) beyond its replay: the
parts of a version the replay did not read, and the own objects of a version it could not reach."""

from __future__ import annotations

from ._cli_types import printable


def failure(e: Exception) -> str:
    """Why a version failed, for the report: an object lost by the store named by its key (the
    receiver's advice on planning again is for ``update()`` callers), else the error."""
    from .errors import ObjectNotFoundError

    key = getattr(e, "object_key", None)
    if isinstance(e, ObjectNotFoundError) and key:
        return f"ObjectNotFoundError: {key} is missing (deleted by hand, by a collector with another retention policy, or lost)"
    return f"{type(e).__name__}: {printable(e)}"


def own_objects(store, version: int) -> str:
    """A report line on the objects version ``version``'s manifest names, checked on their own
    (size and sha256; a delta object also read and decoded): a version that fails on what it
    builds on tells intact from damaged objects of its own. Empty when its manifest is unreadable
    (its failure says so) or names no object."""
    from .errors import CorruptObjectError, ObjectNotFoundError, VersionNotFoundError
    from .format import DAMAGED_HINT, decode_delta, verify_bytes
    from .manifest import load_manifest

    try:
        m = load_manifest(store, version)
    except (CorruptObjectError, VersionNotFoundError):
        return ""
    objects = [*m.anchor_objects, *m.delta_objects]
    if not objects:
        return ""
    damaged = []
    for o in objects:
        try:
            data = store.get(o.key, start=0, end=o.nbytes + 1)
            verify_bytes(data, o, f"version {m.version}")
            if o in m.delta_objects:
                decode_delta(data, m, o)
        except ObjectNotFoundError:
            damaged.append(f"{o.key} is missing")
        except CorruptObjectError as e:
            damaged.append(printable(str(e).replace(f" ({DAMAGED_HINT})", "").removeprefix(f"version {version}: ")))
    if not damaged:
        return f"its own {len(objects)} object(s) are intact: what fails is a version it builds on (above)"
    return f"its own objects: {len(damaged)} of {len(objects)} damaged: " + "; ".join(damaged)


def check_rest(target, store, m, path: str, run_files_seen: set) -> str:
    """Check the run files of version ``m`` and the parts an update along ``path`` did not read.
    Returns a note for the report line.

    The anchor part is rebuilt into ``target`` by a second receiver that holds nothing and does not
    recover (its failure is what is reported); it leaves the same version in ``target``, so the
    replay's receiver goes on from there. The delta part is read and decoded (bytes and structure:
    it applies to a version not held).

    Raises:
        DeltaSyncError: a part fails (``target`` keeps the version the replay gave it).
    """
    from .format import decode_delta, verify_bytes
    from .manifest import check_run_files
    from .receiver import DeltaReceiver

    n_files = check_run_files(store, m, run_files_seen)  # (an adapter run's config, read once)
    notes = [f"{n_files} run file(s) checked"] if n_files else []
    if m.kind == "anchor" and path == "delta":
        fresh = DeltaReceiver(target, store, recover=False)
        try:
            fresh.update(m.version)
        finally:
            fresh.close()
        notes.append(f"anchor objects rebuilt and checked, {m.anchor_nbytes:,} B")
    if m.kind == "anchor" and m.has_delta and path == "anchor":
        for o in m.delta_objects:
            data = store.get(o.key, start=0, end=o.nbytes + 1)
            verify_bytes(data, o, f"version {m.version}")
            decode_delta(data, m, o)
        notes.append(f"delta objects checked, {m.delta_nbytes:,} B")
    return "".join(f"; {n}" for n in notes)
