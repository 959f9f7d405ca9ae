"""Writing a version: each rank's objects (and their removal when the publish fails), then rank
0's half, the manifest, written last, and the advisory ``LATEST`` pointer.

Objects and manifests are immutable (:func:`put_once`); the manifest names every object with its
size and sha256, so a version is visible exactly when its manifest is (``docs/design.md``,
invariants 1-3). A version number another writer already used is never overwritten: the outcome
says where to continue.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..checksum import combine
from ..errors import ObjectExistsError, ObjectNotFoundError, TransientStoreError
from ..format import sha256_hex
from ..keys import LATEST_KEY, manifest_key, next_free_version, object_key
from ..manifest import Manifest, ObjectEntry, TensorEntry
from ..store import Store
from ._job import Job

log = logging.getLogger("torch_deltasync.sender")


def upload_objects(store: Store, job: Job, blobs: list[tuple[str, int, int, bytes]], rank: int,
                   written: list[str]) -> dict[str, Any]:
    """Write this rank's objects of ``job`` (``blobs``: ``(kind, slot, slots, bytes)`` from
    :func:`~._encode.encode_objects`), appending to ``written`` each key this rank created (its
    put returned). A key that already held exactly these bytes stays out, as does one whose put
    failed: it may be a retry of our own put whose first reply was lost, or another writer's
    identical object that its manifest names; only the clean-up of a failed publish reads
    ``written``, and an object left behind is garbage that
    :func:`~torch_deltasync.retention.collect_garbage` removes, where one deleted could break a
    visible version.

    Returns:
        This rank's record for :func:`write_manifest`: ``{"ok": True, "objects", "partials",
        "counts"}``, or ``{"ok": False, "taken": True, "error"}`` when another writer's object holds
        a key.

    Raises:
        Exception: what the store raised for a failed put, or for reading back a key that already
            held an object (the caller reports it to every rank).
    """
    objects = []
    for kind, slot, slots, data in blobs:
        key = object_key(job.version, kind, slot, slots)
        try:
            created = put_once(store, key, data)
        except ObjectExistsError as e:  # another writer uses this version number
            return {"ok": False, "taken": True, "error": f"rank {rank}: {e}"}
        if created:
            written.append(key)
        objects.append(ObjectEntry(key, len(data), sha256_hex(data), slot, slots).to_json())
    return {"ok": True, "objects": objects, "partials": job.partials, "counts": job.counts}


def remove_objects(store: Store, version: int, keys: list[str]) -> None:
    """After a failed publish that left nothing visible: delete this rank's objects ``keys`` of
    ``version`` (no manifest names them; a later publish numbers past them or, from a new
    sender, may write the same keys afresh), so that a full disk gets its space back now, not at
    a later garbage collection. Best effort: what stays is garbage that
    :func:`~torch_deltasync.retention.collect_garbage` removes."""
    try:
        store.delete_many(keys)
    except Exception as e:  # noqa: BLE001 - never hides the publish's own error
        log.warning("could not remove the objects of the failed version %d (%s: %s); garbage collection will",
                    version, type(e).__name__, e)


def write_manifest(store: Store, job: Job, gathered: list[dict], *, codec: str, dtype: torch.dtype,
                   run_id: str, world: int, latest_at: int | None, run_files: dict[str, bytes] | None = None) -> dict[str, Any]:
    """Combine the per-rank metadata ``gathered`` of ``job`` and create its manifest (never replacing one).

    Args:
        store: the sender's store (prefix applied).
        job: the publish, as rank 0 sees it (sources, version, kind, stats).
        gathered: one record per rank: ``{"ok": True, "objects": [ObjectEntry json], "partials":
            {name: partial checksum}, "counts": {name: changed elements}}`` or ``{"ok": False,
            "error": str, "taken"?: True, "transient"?: bool}``.
        codec, dtype, run_id, world: recorded in the manifest.
        run_files: run-level objects, ``{key: bytes}`` (an adapter run's config): the manifest records
            their sha256 (``Manifest.run_files``); every version first reads them back (one small
            read each) and writes any of them that is gone or differs (emptied or edited in the store),
            so no manifest vouches for a file readers cannot match.
        latest_at: the version this sender last pointed ``LATEST`` at. Unless it is the one before
            ``job.version``, ``LATEST`` is removed before the manifest is written: readers confirm
            ``LATEST`` by "its manifest exists and the next one does not", sound only while the
            writer's next manifest is ``LATEST + 1``; after a burned number or on a sender's first
            version a crash before ``LATEST`` is written again would leave readers stopping at a
            stale version instead of listing (docs/format.md §2).

    Returns:
        The outcome rank 0 broadcasts: ``{"ok": True, "nbytes", "changed", "anchor_nbytes",
        "delta_nbytes"}``, or ``{"ok": False, "error"}`` (plus ``"next_version"`` when another writer
        already uses this version number: continue after it, with an anchor; ``"unknown": True``
        when the manifest's write failed but it may be visible, see :func:`landed`; ``"anchor_next":
        True`` when the next version must be an anchor: another writer's versions, or a delta whose
        base version is gone). Never raises.
    """
    if any(r.get("taken") for r in gathered):
        return taken(store, job.version)
    errors = [r["error"] for r in gathered if not r["ok"]]
    if errors:  # ("transient": some rank's store call failed on the transport: no clean-up then)
        return {"ok": False, "error": "; ".join(errors), "transient": any(r.get("transient") for r in gathered)}
    try:  # a delta on a base no reader can find would make the run unreadable from here on
        base_gone = job.kind == "delta" and not store.exists(manifest_key(job.base_version))
    except Exception as e:  # noqa: BLE001 - the store failed: an ordinary failed publish
        return {"ok": False, "error": f"rank 0 could not check the base version: {type(e).__name__}: {e}", "transient": True}
    if base_gone:
        return {"ok": False, "anchor_next": True,
                "error": f"the manifest of its base version {job.base_version} is gone from {store.describe()} (the "
                         "prefix was emptied under this sender?): no reader could apply it. The next publish is an anchor"}
    run_files = dict(run_files or {})
    try:  # the run's files as every manifest vouches for them (gone or changed in the store: again)
        for key, data in run_files.items():
            stored = _stored(store, key)
            if stored != data:
                if stored is not None:
                    log.warning("%s: %s differs from this run's (edited or damaged in the store); written again "
                                "before version %d", store.describe(), key, job.version)
                store.put(key, data)
    except Exception as e:  # noqa: BLE001 - the store failed: an ordinary failed publish
        return {"ok": False, "error": f"rank 0 could not write the run's objects: {type(e).__name__}: {e}",
                "transient": True}
    if latest_at != job.version - 1:
        try:
            store.delete(LATEST_KEY)
        except Exception as e:  # noqa: BLE001 - an ordinary failed publish
            return {"ok": False, "error": f"rank 0 could not remove {LATEST_KEY} before writing the manifest of "
                                          f"version {job.version}: {type(e).__name__}: {e}"}
    try:
        objects = [ObjectEntry(**o) for r in gathered for o in r["objects"]]
        partials: dict[str, list[int]] = {}
        counts: dict[str, int] = {}
        for r in gathered:
            for name, p in r["partials"].items():
                partials.setdefault(name, []).append(p)
            for name, c in r["counts"].items():
                counts[name] = counts.get(name, 0) + c
        tensors = tuple(
            TensorEntry(s.name, s.slice.global_shape, combine(*partials[s.name]), counts.get(s.name, 0))
            for s in job.sources
        )
        manifest = Manifest(
            version=job.version, kind=job.kind, base_version=job.base_version,
            anchor_version=job.anchor_version, codec=codec, inference_dtype=dtype,
            run_id=run_id, tensors=tensors, objects=tuple(objects), aliases=dict(job.aliases),
            stats={"changed": sum(counts.values()), "numel": job.stats.numel,
                   "objects_nbytes": sum(o.nbytes for o in objects), "world": world},
            created_at=time.time(), run_files={key: sha256_hex(data) for key, data in run_files.items()},
        )
        data = manifest.to_json()
        try:
            put_once(store, manifest_key(job.version), data)  # manifests are immutable
        except ObjectExistsError:
            return taken(store, job.version)
        except Exception as put_error:  # noqa: BLE001 - the put may have landed all the same
            unknown = landed(store, manifest_key(job.version), data, put_error, job.version, job.base_version)
            if unknown is not None:
                return unknown
    except Exception as e:  # noqa: BLE001 - reported to every rank through the outcome
        return {"ok": False, "error": f"rank 0 manifest: {type(e).__name__}: {e}"}
    return {"ok": True, "nbytes": manifest.nbytes + len(data), "changed": sum(counts.values()),
            "anchor_nbytes": manifest.anchor_nbytes, "delta_nbytes": manifest.delta_nbytes}


def put_once(store: Store, key: str, data: bytes) -> bool:
    """Create ``key``; never replace an existing object (a retry of our own put that succeeded
    before its reply was lost finds our own bytes there, which is fine).

    Returns:
        ``True`` when this call created ``key``; ``False`` when it already held exactly ``data``
        (our own earlier put, or another writer's identical object: the caller cannot tell).

    Raises:
        ObjectExistsError: another writer's object, with other bytes, holds the key.
    """
    try:
        store.put_new(key, data)
        return True
    except ObjectExistsError:
        if store.get(key) != data:
            raise
        return False


def landed(store: Store, key: str, data: bytes, put_error: Exception, version: int,
           base: int | None) -> dict[str, Any] | None:
    """After the put of ``version``'s manifest raised ``put_error``: read the key back. ``None``
    when it holds ``data`` (the reply was lost, not the write: the version is published); else
    re-raise ``put_error`` when the key holds nothing and the put failed for good (nothing is
    visible), or return the outcome of a version that may be visible: the read failed too, or the
    put failed transiently (past its deadline, it may still be under way and land later). Either
    way the next version is based on the last one known to be published; its number is never
    used again."""
    try:
        back = store.get(key)
    except ObjectNotFoundError:
        if not isinstance(put_error, TransientStoreError):
            raise put_error from None
        why = f"{key} is not there yet"
    except Exception as read_error:  # noqa: BLE001 - neither write nor read answered
        why = f"reading {key} back failed too ({type(read_error).__name__}: {read_error})"
    else:
        if back != data:
            raise put_error
        log.warning("writing the manifest of version %d raised %s: %s, but it is in the store: published",
                    version, type(put_error).__name__, put_error)
        return None
    return {"ok": False, "unknown": True,
            "error": f"version {version} may or may not be visible (rank 0 manifest: {type(put_error).__name__}: "
                     f"{put_error}; {why}); the next publish is based on version {base} (a receiver that applied "
                     f"version {version} reaches it through an anchor)"}


def _stored(store: Store, key: str) -> bytes | None:
    try:
        return store.get(key)
    except ObjectNotFoundError:
        return None


def taken(store: Store, version: int) -> dict[str, Any]:
    """The outcome when another writer uses ``version``: skip past everything it wrote."""
    return {"ok": False, "next_version": next_free_version(store), "anchor_next": True,
            "error": f"another writer already uses version {version} on {store.describe()}; "
                     "two writers must not share a prefix. This sender's next publish goes after the "
                     "newest version, with an anchor (and is refused if the other writer took the "
                     "prefix over: then publish under another prefix)"}


def write_latest(store: Store, version: int) -> bool:
    """Point ``LATEST`` at ``version``; ``False`` if it could not be written.

    ``LATEST`` is advisory: if it cannot be written it is removed, so that readers list
    ``versions/`` rather than trust a stale pointer; the caller tries again later.
    """
    try:
        store.put(LATEST_KEY, str(version).encode())
        return True
    except Exception as e:  # noqa: BLE001 - receivers fall back to listing
        log.warning("could not update LATEST to %d: %s", version, e)
        try:
            store.delete(LATEST_KEY)
        except Exception:  # noqa: BLE001
            pass
        return False
