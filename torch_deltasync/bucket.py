"""Local bucket folders that a run starts afresh (``deltasync demo``, the recipes' default buckets):
emptied only when they hold nothing but runs of this library, none of them with a live writer.

A bucket folder holds runs, each under a prefix (any folder path, the bucket itself included), and a
run holds what ``docs/format.md`` names: ``versions/``, ``objects/``, ``acks/``, ``LATEST``, the
``OWNER`` lease and its ``OWNER.claims/`` markers, an adapter run's ``adapter/``, and the temporary
files of ``LocalStore`` writes that did not finish (``<name>.tmp-<32 hex digits>``).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from .errors import PrefixInUseError
from .keys import LATEST_KEY, OBJECTS_DIR, VERSIONS_DIR
from .lease import CLAIMS_PREFIX, OWNER_KEY, read_owner

__all__ = ["clear_local_bucket"]

_RUN_ENTRIES = {VERSIONS_DIR, OBJECTS_DIR, "acks", "adapter", LATEST_KEY, OWNER_KEY, CLAIMS_PREFIX}
_TMP = re.compile(r"(.+)\.tmp-[0-9a-f]{32}")


def clear_local_bucket(path: str | os.PathLike) -> int:
    """Delete the local bucket folder ``path`` (nothing to do when it does not exist), so that a run
    starts a fresh chain in it. Checked first, and nothing is deleted when a check fails.

    Returns:
        The versions deleted, over all the runs it held.

    Raises:
        PrefixInUseError: a run in it has a live writer (an ``OWNER`` lease that is live, of a
            process that may still run), naming the run's folder and owner.
        FileExistsError: ``path`` is a file, or the folder holds a file no run writes (naming it;
            a folder that is not a run's own, e.g. ``notes/``, may be a prefix of runs and is
            looked into).
    """
    from .store import LocalStore

    root = Path(path)
    if not root.exists():
        return 0
    if not root.is_dir():
        raise FileExistsError(f"{root} is a file, not a bucket folder; give another path")
    versions, foreign, now = 0, [], time.time()
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        if any(_base(n) in _RUN_ENTRIES for n in [*dirs, *files]):  # a run's prefix
            owner = read_owner(LocalStore(here)) if (here / OWNER_KEY).is_file() else None
            if owner is not None and owner.live(now) and owner.may_be_running():
                raise PrefixInUseError(f"{here} is in use by a running writer: {owner.describe(now)}; nothing in "
                                       f"{root} was deleted: wait for it, or give this run another bucket")
            if (here / VERSIONS_DIR).is_dir():
                versions += sum(1 for f in (here / VERSIONS_DIR).iterdir() if f.name.endswith(".json"))
        foreign += [here / n for n in files if _base(n) not in _RUN_ENTRIES]
        # (the run's own folders hold only what it writes; any other folder may be a prefix of runs)
        dirs[:] = [d for d in dirs if _base(d) not in _RUN_ENTRIES]
    if foreign:
        shown = ", ".join(str(f.relative_to(root)) for f in foreign[:3]) + (" and more" if len(foreign) > 3 else "")
        raise FileExistsError(f"{root} holds {shown}, which no run writes; a fresh run empties this bucket, and "
                              "deletes nothing it did not write: move them, or give this run another bucket")
    shutil.rmtree(root)
    return versions


def _base(name: str) -> str:
    """``name`` without the suffix of an unfinished ``LocalStore`` write."""
    m = _TMP.fullmatch(name)
    return m.group(1) if m else name
