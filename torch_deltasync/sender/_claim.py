"""Claiming a prefix for a sender: rank 0 takes the writer lease, every rank checks it sees it."""

from __future__ import annotations

from ..errors import PrefixInUseError, PublishError
from ..lease import PrefixLease, read_owner
from ..store import Store
from ._group import Group


def claim_prefix(g: Group, store: Store, run_id: str, *, lease_s: float, takeover: bool) -> tuple[PrefixLease | None, str]:
    """Rank 0 claims the prefix (:class:`PrefixLease`); with several ranks every rank then reads
    the owner record back from the store it opened, so ranks that address different stores or
    prefixes (a temporary folder per rank) are refused on every rank before anything is
    published. Every rank adopts rank 0's ``run_id``.

    Returns:
        ``(lease, run_id)``: rank 0's lease (``None`` on other ranks) and rank 0's run id.

    Raises:
        PrefixInUseError: another writer's lease on the prefix is live (on every rank).
        ValueError: the ranks do not address the same store and prefix (on every rank).
    """
    lease, claim = None, None
    if g.rank == 0:
        try:
            lease = PrefixLease(store, run_id, lease_s=lease_s, takeover=takeover)
            claim = {"ok": True, "session": lease.session, "run_id": run_id, "store": store.describe()}
        except Exception as e:  # noqa: BLE001 - the other ranks must hear about it
            if g.world == 1:
                raise
            claim = {"ok": False, "in_use": isinstance(e, PrefixInUseError), "error": f"{type(e).__name__}: {e}"}
    if g.world == 1:
        return lease, run_id
    claim = g.broadcast(claim)
    if not claim["ok"]:
        raise (PrefixInUseError if claim["in_use"] else PublishError)(f"rank 0: {claim['error']}")
    seen = {"ok": True}
    if g.rank != 0:
        try:
            rec = read_owner(store)
            if rec is None or rec.session != claim["session"]:
                found = "no owner record" if rec is None else f"another writer's record (run {rec.run_id!r})"
                seen = {"ok": False, "why": f"rank {g.rank} opened {store.describe()} and finds {found} there"}
        except Exception as e:  # noqa: BLE001
            seen = {"ok": False, "why": f"rank {g.rank} cannot read {store.describe()}: {type(e).__name__}: {e}"}
    gathered = g.gather(seen)
    verdict = None
    if g.rank == 0:
        bad = [r["why"] for r in gathered if not r["ok"]]
        verdict = {"ok": not bad}
        if bad:
            lease.release()
            verdict["error"] = (
                f"the ranks do not address the same store and prefix: rank 0 claimed {claim['store']} (wrote its "
                f"OWNER record), but {'; '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} ({len(bad)} of {g.world} "
                "ranks). Every rank must open the same store and prefix: a shared file system path or a remote "
                "URL such as s3://bucket/runs, not a folder per rank (e.g. tempfile.mkdtemp() on each rank)"
            )
    verdict = g.broadcast(verdict)
    if not verdict["ok"]:
        raise ValueError(verdict["error"])
    return lease, claim["run_id"]
