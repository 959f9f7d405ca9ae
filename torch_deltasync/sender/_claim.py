"""Claiming a prefix for a sender: rank 0 takes the writer lease, every rank checks it sees it."""

from __future__ import annotations

import os

from .._dtypes import as_dtype
from ..errors import PrefixInUseError, PublishError
from ..lease import PrefixLease, read_owner
from ..store import Store
from ._config import SenderConfig
from ._group import Group


def shaping_options(config: SenderConfig) -> dict[str, str]:
    """The options that decide what a version holds and when it is published, as strings: every
    rank of a sharded sender must have the same (a rank with another anchor cadence or codec
    writes objects that no manifest can combine; one with another ``background`` or delta-size
    limit issues other collectives and hangs the publish)."""
    return {"anchor policy": repr(config.effective_anchor_policy), "codec": config.codec_name,
            "link_gbps": repr(config.link_gbps), "inference_dtype": str(as_dtype(config.inference_dtype)),
            "background": repr(config.background)}


def claim_prefix(g: Group, store: Store, run_id: str, config: SenderConfig) -> tuple[PrefixLease | None, str]:
    """Rank 0 claims the prefix (:class:`PrefixLease`, ``config.lease_s`` and ``config.takeover``);
    with several ranks every rank then reads the owner record back from the store it opened, so
    ranks that address different stores or prefixes (a temporary folder per rank) are refused on
    every rank before anything is published, and so are ranks whose :func:`shaping_options`
    differ from rank 0's. Every rank adopts rank 0's ``run_id``.

    Returns:
        ``(lease, run_id)``: rank 0's lease (``None`` on other ranks) and rank 0's run id.

    Raises:
        PrefixInUseError: another writer's lease on the prefix is live (on every rank).
        ValueError: the ranks do not address the same store and prefix, or were built with
            different options (on every rank).
    """
    lease, claim = None, None
    if g.rank == 0:
        try:
            lease = PrefixLease(store, run_id, lease_s=config.lease_s, takeover=config.takeover)
            claim = {"ok": True, "session": lease.session, "run_id": run_id, "store": store.describe(),
                     "options": shaping_options(config)}
        except Exception as e:  # noqa: BLE001 - the other ranks must hear about it
            if g.world == 1 and isinstance(e, PrefixInUseError) and os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1"):
                raise PrefixInUseError(
                    f"{e}. Note: this process is rank {os.environ.get('RANK', '?')} of {os.environ['WORLD_SIZE']} "
                    "(torchrun) and its model holds no DTensor, so each rank publishes it alone: publish from one rank "
                    "(e.g. only where torch.distributed.get_rank() == 0), or shard the model (FSDP2)") from e
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
        mine = shaping_options(config)
        differ = [f"{k} {mine[k]} (rank 0: {v})" for k, v in claim["options"].items() if mine.get(k) != v]
        try:
            rec = read_owner(store)
            if rec is None or rec.session != claim["session"]:
                found = "no owner record" if rec is None else f"another writer's record (run {rec.run_id!r})"
                seen = {"ok": False, "why": f"rank {g.rank} opened {store.describe()} and finds {found} there"}
        except Exception as e:  # noqa: BLE001
            seen = {"ok": False, "why": f"rank {g.rank} cannot read {store.describe()}: {type(e).__name__}: {e}"}
        if differ and seen["ok"]:
            seen = {"ok": False, "options": f"rank {g.rank} has {', '.join(differ)}"}
    gathered = g.gather(seen)
    verdict = None
    if g.rank == 0:
        options = [r["options"] for r in gathered if "options" in r]
        bad = [r["why"] for r in gathered if "why" in r]
        verdict = {"ok": not bad and not options}
        if options and not bad:
            lease.release()
            verdict["error"] = (
                f"the ranks were built with different sender options: {'; '.join(options[:4])}"
                f"{' ...' if len(options) > 4 else ''}. Every rank must build its DeltaSender with the same "
                "options (they decide what each version holds and the collectives of every publish)")
        elif bad:
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
