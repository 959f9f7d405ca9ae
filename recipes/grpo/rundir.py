"""The run folder ``<runs-dir>/<run-name>``: one live run at a time.

A run starts by removing an earlier run's outputs from its folder (metrics, summary, plots,
weights and the default bucket), so a second run started on the folder of a live one would destroy
that run. The controller therefore holds the folder while it runs, with the library's writer lease
(:class:`torch_deltasync.lease.PrefixLease`) on the folder as a local store: an ``OWNER`` record in
the folder names the run, its host and pid, is renewed in the background and is deleted at the
end. Another run refuses the folder while that record is live, before it deletes anything. A run
killed with SIGKILL leaves its record: the next run on the same host takes it over at once (the
pid is gone); from another host, once the lease expired (:data:`LEASE_S`).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

__all__ = ["RunFolderInUse", "claim_run_folder", "LEASE_S"]

#: Seconds the folder's owner record stays live without renewal (renewed every quarter of it).
LEASE_S = 60.0


class RunFolderInUse(RuntimeError):
    """Another live run holds the run folder; nothing in the folder was changed."""


def _in_use(run_dir: Path, owner, now: float) -> str:
    return (f"run folder {run_dir} is in use by a live run (pid {owner.pid} on {owner.host}, run {owner.run_id!r}, "
            f"lease renewed {max(0.0, now - owner.renewed_at):.0f} s ago); choose another --run-name (or --runs-dir), "
            "or stop that run")


def claim_run_folder(run_dir: str | os.PathLike, run_id: str):
    """Hold ``run_dir`` for this run (call before changing anything in it).

    Args:
        run_dir: the run folder (created if missing).
        run_id: names this run in the folder's ``OWNER`` record (the store prefix of the run).

    Returns:
        The :class:`~torch_deltasync.lease.PrefixLease`; ``release()`` it when the run ends (a
        process that exits releases it too; one that is killed leaves it to expire).

    Raises:
        RunFolderInUse: another run's record is live and its process may still be running (or
            another run claimed the folder at the same moment).
        StoreError: the folder cannot be read or written.
    """
    from torch_deltasync.errors import PrefixInUseError
    from torch_deltasync.lease import PrefixLease, read_owner
    from torch_deltasync.store import LocalStore

    run_dir = Path(run_dir)
    store = LocalStore(run_dir)
    now = time.time()
    owner = read_owner(store)
    takeover = False
    if owner is not None:
        # On this host the pid decides both ways: a run paused (Ctrl-Z) past its lease still owns the
        # folder, and a killed one's live record is taken over at once. Elsewhere the lease decides.
        here = owner.host == socket.gethostname()
        if (owner.live(now) or here) and owner.may_be_running():
            raise RunFolderInUse(_in_use(run_dir, owner, now))
        takeover = owner.live(now)  # killed without releasing the folder
    try:
        return PrefixLease(store, run_id, lease_s=LEASE_S, takeover=takeover)
    except PrefixInUseError as e:  # another run claimed it at the same moment (or a claim of a dead one)
        other = read_owner(store)
        if other is not None and other.live(time.time()) and other.may_be_running():
            raise RunFolderInUse(_in_use(run_dir, other, time.time())) from None
        raise RunFolderInUse(f"run folder {run_dir}: {e}") from None
