"""Discovery for ``DeltaReceiver``: the newest visible version, and whether the version a target
holds is still the one the store names so (``docs/format.md`` §2: ``LATEST``, digests)."""

from __future__ import annotations

import time
from typing import Callable

from .._units import check_seconds
from ..errors import ChecksumMismatchError, ObjectNotFoundError, SyncTimeoutError, VersionNotFoundError
from ..keys import LATEST_KEY, MAX_VERSION, check_version, list_versions, manifest_key
from ..manifest import Manifest, read_digest


#: The most bytes a ``LATEST`` is read for: a version number and white space; a longer one is garbage.
_LATEST_MAX_BYTES = 32


def newest_version(store, held: int | None = None) -> tuple[int | None, str | None | bool]:
    """The newest visible version of ``store`` (``LATEST`` if it is current, else a listing) and
    the digest of its manifest when ``LATEST`` was confirmed (``False``: not read, after a
    listing; ``None``: a manifest without one).

    ``LATEST`` is confirmed by its manifest (whose first bytes, read in one ranged request, give
    the digest) and the absence of the next one; writers remove it before a manifest that does not
    follow it, so a missing, stale, garbled or oversized ``LATEST`` (only its first bytes are
    read) leads to a listing. So does a ``LATEST`` older than ``held``, the version the caller
    holds: after a burned version number (a failed publish) the absent next manifest proves
    nothing, and a writer that lost the prefix to a takeover may have pointed ``LATEST`` back at
    its own last version (``docs/format.md`` §2).

    Raises:
        StoreError: the store failed.
    """
    try:
        head = store.get(LATEST_KEY, start=0, end=_LATEST_MAX_BYTES + 1)  # never a whole oversized object
        latest = int(head.decode().strip()) if len(head) <= _LATEST_MAX_BYTES else -1
        if 0 <= latest < MAX_VERSION and (held is None or latest >= held):
            digest = read_digest(store, latest)  # as cheap as asking whether it exists
            if not store.exists(manifest_key(latest + 1)):
                return latest, digest
    except (ObjectNotFoundError, VersionNotFoundError, ValueError, UnicodeDecodeError):
        pass  # LATEST is advisory: missing, stale or garbage -> list
    versions = list_versions(store)
    return (versions[-1] if versions else None), False


def wait_for(newest: Callable[[], int | None], where: str, version: int | None, timeout_s: float,
             poll_s: float) -> int:
    """``DeltaReceiver.wait_for``: poll ``newest()`` until it is at least ``version``."""
    if version is not None:
        check_version(version)
    check_seconds(poll_s, "poll_s", "DeltaReceiver.wait_for", positive=True)
    check_seconds(timeout_s, "timeout_s", "DeltaReceiver.wait_for", positive=False, finite=False)
    deadline = time.monotonic() + timeout_s
    while True:
        v = newest()
        if v is not None and (version is None or v >= version):
            return v
        if time.monotonic() >= deadline:
            if version is None:
                raise SyncTimeoutError(f"{where}: no version was published within {timeout_s} s; is the writer "
                                       "running, and publishing to this store and prefix?")
            raise SyncTimeoutError(f"{where}: no version >= {version} after {timeout_s} s (newest: {v})")
        time.sleep(poll_s)


def republished(store, held: Manifest | None, version: int, *, seen: str | None | bool = False,
                fresh: Callable[[int], Manifest]) -> bool:
    """Whether the store's manifest of ``version``, the held one, is no longer the manifest the
    target received (``held``): the prefix was wiped and a new run reused the number. Then the
    target holds another model than the store's ``version`` and only an anchor rebuilds it.

    Args:
        store: the receiver's store (run prefix).
        held: the manifest of the held version (``None``: unknown, nothing contradicts it).
        version: the version asked about.
        seen: the digest a read moments ago found (``DeltaReceiver.newest_version``); ``False``:
            none, read it (one ranged request, :func:`~torch_deltasync.manifest.read_digest`).
        fresh: reads a whole manifest from the store (for manifests written before digests).

    Raises:
        StoreError, CorruptObjectError: the store failed, or a manifest without a digest is corrupt.
    """
    if held is None or held.version != version:
        return False
    try:
        digest = read_digest(store, version) if seen is False else seen
        if digest is not None or held.digest is not None:
            return digest != held.digest
        return fresh(version) != held  # manifests written before digests: compare them whole
    except VersionNotFoundError:
        return False  # no longer retained: nothing contradicts the held state


def object_lost(e: ObjectNotFoundError, version: int, explicit: bool) -> ObjectNotFoundError:
    """``e`` (an object a manifest names is gone) saying which version needed it and what to do."""
    if explicit:  # retention deleted the chain to a version asked for by number (planning again cannot help)
        hint = ("it was deleted after the update was planned (retention, another process) or lost. update() "
                "without a version plans again from the newest version; `deltasync verify` checks the run")
    else:
        hint = ("the store lost an object that a visible manifest names (deleted by hand, or by a collector "
                "with another retention policy): `deltasync verify` checks the run")
    lost = ObjectNotFoundError(f"{e}, needed to reach version {version}: {hint}")
    lost.object_key = getattr(e, "object_key", None)
    return lost


def check_still_published(store, held: Manifest | None, version: int, fresh: Callable[[int], Manifest]) -> None:
    """``DeltaReceiver.verify``'s first check: the store's manifest of the held ``version`` is
    still the one the target received (:func:`republished`).

    Raises:
        ChecksumMismatchError: it was published again (a new run on a wiped prefix).
    """
    if republished(store, held, version, fresh=fresh):
        raise ChecksumMismatchError(
            f"{store.describe()}: version {version} was published again after the target received it (a new "
            "run on a wiped prefix reused the number): the target holds the earlier one. verify_or_forget() "
            "then update() rebuilds it from an anchor")


def check_not_behind(where: str, newest: int | None, held: Manifest | None, manifest: Callable[[int], Manifest]) -> None:
    """Refuse to move a target back to an older version of the run it holds when the store's
    newest version is older than the held one: the store lost versions (restored from a backup,
    manifests deleted by hand). Versions of a run only grow (docs/design.md), so rollouts tagged
    with the older number would be mislabelled; a new run (another ``run_id``) is crossed to by an
    anchor as usual.

    Args:
        where: the store, for the message.
        newest: the newest visible version.
        held: the manifest of the version the target holds (``None``: nothing held).
        manifest: reads a manifest fresh from the store (only when ``newest`` is the older one).

    Raises:
        VersionNotFoundError: ``newest`` is older than the held version, of the same run.
    """
    if held is None or newest is None or newest >= held.version:
        return
    head = manifest(newest)
    if head.run_id == held.run_id:
        raise VersionNotFoundError(
            f"{where}: the newest version is {newest}, older than the held version {held.version} of the "
            f"same run ({held.run_id!r}): the store lost versions (restored from a backup, or manifests were "
            f"deleted). The target keeps version {held.version}; update(version={newest}) goes back on "
            "purpose, and the writer's next version is applied as usual")


def nothing_visible(store, held: int | None) -> VersionNotFoundError:
    """The error when ``store`` shows no version: none published yet, or (``held``: the version
    the target holds from it) all deleted since; either says why the store's root is absent."""
    why = store.absent()  # a mistyped path reads differently from a run not started yet
    why = f": {why}" if why else ""
    if held is None:
        return VersionNotFoundError(f"{store.describe()}: no version has been published yet{why}")
    return VersionNotFoundError(
        f"{store.describe()}: no version is visible, yet the target holds version {held} from this store: its "
        f"versions were deleted (a wiped prefix, another path?){why}; the target keeps its weights until a writer "
        "publishes again")


def not_visible(e: VersionNotFoundError, version: int, newest: int | None) -> VersionNotFoundError:
    """``e`` (``version``, asked for by number, is not visible) with the newest visible version and
    what to do: update to it, or wait for ``version``."""
    if newest is None or newest == version:
        return e
    return VersionNotFoundError(f"{e}; the newest visible version is {newest} " + (
        "(update() without a version takes it)" if newest > version
        else f"({version} is not published yet: wait_for({version}) waits for it)"))
