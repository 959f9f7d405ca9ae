"""``DeltaSender``: detect -> encode -> upload -> publish, one version at a time.

A publish of version ``v``:

1. every rank compares its tensors (or local FSDP2 shards) with the snapshot of the last published
   state (:class:`~torch_deltasync.detect.ChangeDetector`);
2. encodes the changes with the codec (a delta) or casts every tensor (an anchor), writes its own
   object ``objects/<v>/<kind>-r<rank>-of<world>.safetensors``;
3. rank 0 gathers the small per-rank metadata (object sizes, sha256, partial checksums, counts) and
   writes the manifest ``versions/<v>.json`` **last**, then the advisory ``LATEST`` pointer;
4. only once the manifest is visible do the snapshots advance.

If anything fails, no manifest is written, the snapshots stay at the last published state and the
version number is burned: the next publish is a delta against the last *published* version
(docs/design.md, invariant 4), so the chain that receivers follow is never broken. A new sender on a prefix that
holds versions continues after the newest with an anchor (warning when that one is of another model).

With ``background=True`` the detection (which must read the live weights before the next optimizer
step changes them) runs in ``publish()``; encoding the object, uploading and writing the manifest run
on a worker thread. If the previous upload is still running, ``publish()`` coalesces: it returns
``None`` and the next publish covers both steps, so uploads never queue up without bound.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .._config import with_options
from .._dtypes import as_dtype
from .._metrics import append_metrics
from .._pool import map_largest_first
from ..checksum import checksum_change, combine
from ..codecs import get_codec
from ..detect import Changes, ChangeDetector
from ..errors import PrefixInUseError, PublishError, TransientStoreError, UnsupportedLayoutError
from ..layout import Source, TensorBlock
from ..lease import PrefixLease
from ..keys import MAX_VERSION, next_free_version, object_key
from ..retention import collect_garbage
from ..store import Store, open_store
from ._claim import claim_prefix
from ._config import SenderConfig
from ._commit import remove_objects, upload_objects, write_latest, write_manifest
from ._encode import cast_anchors, delta_parts, encode_objects
from ._group import Group, SingleProcess
from ._job import Job
from ._sources import _collect, check_publishable, warn_if_another_model, warn_not_synced, warn_unchanged
from ._stats import PublishStats

log = logging.getLogger(__name__)

#: Tensors of fewer elements are read for changes on the calling thread: detection costs ~0.5-0.9
#: ns per element here (one thread), so at 64K elements the kernel (~30-60 us) is no longer
#: outweighed by the ~20-30 us of Python around each call (which holds the GIL); below it two
#: threads would mostly take turns.
DETECT_MIN_NUMEL = 1 << 16


# --- the sender --------------------------------------------------------------------------------


class DeltaSender:
    """Publishes versions of a model's weights to a store, as anchors and sparse deltas.

    Args:
        model: an ``nn.Module`` (its ``state_dict`` names, i.e. HF names for transformers models),
            a state dict ``{name: tensor}`` of live tensors, or a callable returning one. Floating
            tensors are synced; tied tensors (one storage under two names) are shipped once and
            recorded as aliases. FSDP2 modules (``DTensor`` parameters) publish rank by rank.
        store: a :class:`~torch_deltasync.store.Store` or anything :func:`open_store` accepts.
        prefix: sub-path of the store for this run (several runs can share one store).
        group: collectives for sharded senders; by default a single process, or the default
            ``torch.distributed`` group when the model holds DTensors.
        config: the publish options (:class:`~torch_deltasync.sender.SenderConfig`, which documents
            each field with its unit and default): anchors, inference dtype, snapshot device,
            codec, threads for reading and encoding, background upload, run id, metrics, retention
            and the prefix lease. ``None``:
            ``SenderConfig()``.
        options: ``SenderConfig`` fields given as keywords (``anchor_every=10``, ``codec="raw"``,
            ...); they override ``config``'s (``dataclasses.replace``). The result is
            :attr:`config`.

    A sender owns its prefix while it is open (:mod:`torch_deltasync.lease`): a second sender on the
    same prefix is refused while the first one's lease is live, so two runs never interleave their
    versions. After a crash, a new sender claims the prefix once the dead one's lease has expired
    (``lease_s``), or at once with ``takeover=True``; the old sender, should it still be running,
    then fails its next publish with :class:`~torch_deltasync.errors.PrefixInUseError`.

    Raises:
        TypeError: an option that is not a ``SenderConfig`` field (the message lists the fields), or
            an option of the wrong type.
        UnsupportedLayoutError: a tensor layout that cannot be published (e.g. ``Partial``).
        PrefixInUseError: another writer's lease on the prefix is live (on every rank).
        ValueError: the ranks of a sharded sender do not address the same store and prefix (e.g.
            each opened its own temporary folder), checked on every rank; an option out of range,
            e.g. ``codec``/``link_gbps`` that do not fit (:class:`SenderConfig`).

    Example:
        >>> sender = DeltaSender(model, LocalStore("runs/x/bucket"), anchor_every=10)
        >>> for step in range(100):
        ...     train_step(model)
        ...     v = sender.publish()          # blocks until version v is visible
        >>> sender.close()                    # frees the prefix for the next writer
        >>> # the options as a config, shared by several senders (keywords override its fields):
        >>> config = SenderConfig(anchor_every=10, codec="raw")
        >>> sender = DeltaSender(model, "runs/x/bucket", prefix="run-2", config=config, background=True)
    """

    def __init__(
        self,
        model: Any,
        store: Store | str,
        *,
        prefix: str = "",
        group: Group | None = None,
        config: SenderConfig | None = None,
        **options: Any,
    ) -> None:
        config = with_options(config, SenderConfig, options, type(self).__name__,
                              takes="its options are SenderConfig's fields")
        self.config = config
        self.model = model
        self.store = open_store(store).sub(prefix)
        self.policy = config.effective_anchor_policy
        self.dtype = as_dtype(config.inference_dtype)
        self.codec = get_codec(config.codec_name)
        self.background = config.background
        self.run_id = config.run_id or uuid.uuid4().hex[:12]
        self.metrics_path = Path(config.metrics_path) if config.metrics_path else None
        self.retention = config.retention
        self.run_files: dict[str, bytes] = {}  # rank 0: run-level objects every manifest vouches for (_commit.py)
        self.detector = ChangeDetector(inference_dtype=self.dtype, snapshot_device=config.snapshot_device)

        sources, _, skipped = _collect(model)
        check_publishable(sources, skipped)
        warn_not_synced(skipped)
        if group is None and any(s.distributed for s in sources):
            from ..dtensor import default_group

            group = default_group()
        self.group: Group = group or SingleProcess()
        # Several ranks: decide once which rank ships which block (replicas outside a DTensor's mesh
        # and plain tensors are held by several ranks; exactly one of them uploads each block).
        self._uploads: dict[str, bool] | None = None
        self._layout: dict[str, TensorBlock] = {}
        self._slots = 1  # object slots per rank (dtensor.UploadPlan.slots)
        if self.group.world > 1:
            from ..dtensor import plan_uploads

            plan = plan_uploads(self.group, sources)
            self._uploads, self._slots = plan.uploads, plan.slots
            self._layout = {s.name: s.slice for s in sources}
        self._lease_s = config.lease_s
        self._lease: PrefixLease | None
        self._lease, self.run_id = claim_prefix(self.group, self.store, self.run_id, config)
        self._in_use: str | None = None  # set on every rank once another writer took the prefix over
        self._warned_unchanged = False  # a mapping published a delta without changes (warn_unchanged)

        # Publish state. Identical on every rank: it only changes on outcomes rank 0 broadcasts.
        # After the newest version, and after objects a crashed writer left without a manifest:
        # object keys are never reused, so no writer can overwrite objects a manifest names. Counted
        # after the claim: a writer that took the prefix over continues after all the previous one wrote.
        try:
            self._next_version = self.group.broadcast(next_free_version(self.store) if self.group.rank == 0 else None)
            if self.group.rank == 0 and self._next_version:  # (a restart, or another model on the prefix)
                warn_if_another_model(self.store, sources, self.dtype, self._next_version)
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise
        self.version: int | None = None  # last version this sender published
        self._last_anchor: int | None = None
        self._anchor_nbytes = 0
        self._chain_nbytes = 0
        self._partials: dict[str, int] = {}  # name -> local partial checksum of the published state
        self._shapes: dict[str, TensorBlock] = {}  # name -> block at the last published version
        self._aliases: dict[str, str] = {}  # alias -> tensor at the last published version
        self._force_anchor = False  # after another writer took a version number
        self._latest_pending: int | None = None  # rank 0: LATEST could not be written for this version
        self._latest_at: int | None = None  # rank 0: the version this sender last pointed LATEST at
        self._coalesced = 0
        self.last_stats: PublishStats | None = None
        self.history: deque[PublishStats] = deque(maxlen=100_000)

        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self._lock = threading.Lock()  # guards _error (the worker thread sets it)
        # One publish, flush or close at a time: each reads and advances the publish state above,
        # so two threads publishing at once would base a version on a state the other is changing.
        self._api_lock = threading.RLock()  # re-entered by flush() -> publish()
        self._error: BaseException | None = None

    # --- public API ------------------------------------------------------------------------------

    def publish(self, *, background: bool | None = None) -> int | None:
        """Publish the current weights as the next version.

        With a sharded model every rank calls it (it runs collectives); a foreground publish
        first waits for a background one still in flight.

        Args:
            background: return as soon as the weights are read, and upload on a worker thread
                (default: the constructor's ``background``). Call :meth:`flush` to wait.

        Returns:
            The version number. With ``background=True`` it is visible once :meth:`flush`
            returns; ``None`` means an upload was still in flight (on any rank) and this publish
            was coalesced into the next one.

        Raises:
            PublishError: the store failed or a rank failed while reading its weights (foreground;
                raised on every rank), or the previous background publish failed. Nothing partial
                is visible; the next publish recovers.
            TypeError: ``background`` is not a bool or ``None``.

        Thread-safe: calls from several threads run one after the other, each reading the weights
        as they are when its turn comes.
        """
        with self._api_lock:
            return self._publish(background)

    def _publish(self, background: bool | None) -> int | None:
        if background is not None and not isinstance(background, bool):
            raise TypeError(f"publish(background=...) must be True, False or None (the default), got {background!r}")
        background = self.background if background is None else background
        if self._in_use is not None:
            raise PrefixInUseError(self._in_use)
        # Sharded senders: every rank must take the same branch here and issue the same collectives
        # in the same order. So the in-flight check is agreed on (``any``) before a background error
        # is raised (a rank whose worker has not yet stored the error must not go on alone), and a
        # foreground publish first waits for a background one (one publish's collectives at a time).
        if background:
            if self._busy():
                self._coalesced += 1
                return None
        else:
            self._wait_inflight()
        self._raise_background_error()
        t0 = time.perf_counter()
        version = self._next_version
        if version > MAX_VERSION:
            raise PublishError(
                f"{self.store.describe()}: version {version} exceeds the largest version number {MAX_VERSION} (the "
                f"store holds {object_key(version - 1, 'delta', 0, 1).rsplit('/', 1)[0]}/ or its manifest: remove "
                "them if they are strays); else publish this run under a new prefix"
            )
        self._next_version += 1  # burned whatever happens
        job, error, too_large = None, None, False
        try:
            job = self._prepare(version)
            too_large = self.policy.max_delta_ratio is not None and self._delta_too_large(job)
        except Exception as e:  # noqa: BLE001 - the other ranks must still hear about it
            error = e
        if self.policy.max_delta_ratio is not None:
            # One collective per publish on every rank, also on a rank whose _prepare failed, so the
            # collectives of _abort / _finish that follow still line up.
            if self.group.any(too_large) and job is not None:
                try:
                    self._convert_to_anchor(job)
                except Exception as e:  # noqa: BLE001
                    error = e
        if error is not None:
            err = self._abort(version, error)
            if not background:
                raise err from error
            with self._lock:
                self._error = err  # reported by the next publish()/flush(), as on the other ranks
            return version
        job.stats.detect_ms = (time.perf_counter() - t0) * 1e3
        if not background:
            self._finish(job, t0)
            return job.version
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="deltasync-publish")
        self._inflight = self._executor.submit(self._finish_background, job, t0)
        return job.version

    def flush(self) -> int | None:
        """Wait for a background publish and publish what is still pending; returns the newest
        published version.

        If the last ``publish(background=True)`` calls were coalesced (returned ``None``), their
        weights are published now, in the foreground, so that after ``flush()`` (and ``close()``)
        receivers can reach the weights of the last ``publish()`` call.

        Raises:
            PublishError: the background publish failed.
        """
        with self._api_lock:
            return self._flush()

    def _flush(self) -> int | None:
        self._wait_inflight()
        self._raise_background_error()
        if self._coalesced:
            self._publish(False)
        if self._latest_pending is not None and self.group.rank == 0:
            self._write_latest(self._latest_pending)
        return self.version

    def close(self) -> None:
        """Flush, stop the worker thread and release the prefix (another sender may then claim it
        at once; a later ``publish`` on this one claims it again). Idempotent."""
        with self._api_lock:
            try:
                self._flush()
            finally:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                    self._executor = None
                if self._lease is not None:
                    self._lease.release()
                    self._lease = None

    def __enter__(self) -> "DeltaSender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------------

    def _check_owner(self) -> None:
        """Rank 0, before a manifest: the prefix is still ours (claimed again after ``close()``).

        Raises:
            PrefixInUseError: another writer owns it now.
        """
        if self._lease is None:
            self._lease = PrefixLease(self.store, self.run_id, lease_s=self._lease_s)
        else:
            self._lease.check()

    def _wait_inflight(self) -> None:
        fut = self._inflight
        if fut is not None:
            fut.result()
            self._inflight = None

    def _abort(self, version: int, error: BaseException) -> PublishError:
        """This rank failed before encoding ``version``: take part in the publish collectives with a
        failure record, so rank 0 writes no manifest and every rank fails the version together."""
        g = self.group
        msg = f"rank {g.rank}: {type(error).__name__}: {error}"
        log.warning("publish of version %d failed on rank %d: %s", version, g.rank, error)
        if g.world > 1:
            gathered = g.gather({"ok": False, "error": msg})
            outcome = None
            if g.rank == 0:
                outcome = {"ok": False, "error": "; ".join(r["error"] for r in gathered if not r["ok"])}
            msg = g.broadcast(outcome)["error"]
        return PublishError(
            f"version {version} was not published ({msg}); no partial version is visible and the next "
            f"publish is based on version {self.version}"
        )

    def _busy(self) -> bool:
        busy = self._inflight is not None and not self._inflight.done()
        return self.group.any(busy)  # every rank must take the same branch

    def _raise_background_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise PublishError(f"background publish failed: {err}") from err

    def _wants_anchor(self, version: int) -> bool:
        if self.version is None or self._last_anchor is None or self._force_anchor:
            return True
        return self.policy.wants_anchor(version, self._last_anchor, self._chain_nbytes, self._anchor_nbytes)

    def _prepare(self, version: int) -> Job:
        """Read the live weights: detect changes (and cast anchors). Called on the caller's thread;
        the tensors are read on the helper threads too (:meth:`_detect`)."""
        sources, aliases, _ = _collect(self.model)
        for src in sources:
            if src.problem:
                raise UnsupportedLayoutError(src.problem)
        if self._uploads is not None:
            for src in sources:
                if self._layout.get(src.name) != src.slice:
                    raise PublishError(
                        f"tensor {src.name!r} is not laid out as when the sender was created "
                        f"({self._layout.get(src.name)} -> {src.slice}); create a new sender after resharding"
                    )
                src.upload = self._uploads[src.name]
        det = self.detector
        # Tensors appeared, vanished or changed shape or block, or an alias names another tensor:
        # start over with an anchor that carries no delta (a delta cannot describe a tensor of
        # another shape, nor a receiver's untied copy of an alias that now mirrors another tensor).
        reshaped = self._shapes != {src.name: src.slice for src in sources} or self._aliases != aliases
        if reshaped:
            for name in det.names():
                det.drop(name)
        kind = "anchor" if reshaped or self._wants_anchor(version) else "delta"
        # An anchor after a published version also carries the delta against it, so receivers that
        # hold that version never download the anchor.
        base = None if reshaped else self.version
        job = Job(version, kind, base, version if kind == "anchor" else self._last_anchor, sources, aliases)
        numel = sum(src.slice.global_numel for src in sources)
        changed = 0
        tracked = [src for src in sources if src.name in det]
        for src, (ch, gpos, diff) in zip(tracked, self._detect(tracked)):
            if src.upload:
                job.partials[src.name] = combine(self._partials[src.name], diff)
                job.global_positions[src.name] = gpos
                job.counts[src.name] = ch.numel
                changed += ch.numel
            job.changes[src.name] = ch
        if kind == "anchor":
            changed += cast_anchors(job, self.detector)
        job.stats = PublishStats(
            version=version, kind=kind, base_version=job.base_version, changed=changed, numel=numel,
            nbytes=0, full_nbytes=numel * self.dtype.itemsize,
            coalesced=self._coalesced,
        )
        self._coalesced = 0
        return job

    def _detect(self, sources: list[Source]) -> list[tuple[Changes, torch.Tensor | None, int]]:
        """The changes of each of ``sources`` (all with a snapshot), in order, as ``(changes,
        global positions, checksum difference)``: the positions int64 ``(k,)`` global flat
        indices, the difference an int in ``[0, 2**64)`` (:func:`~torch_deltasync.checksum.
        checksum_change`); both only for blocks this rank uploads (else ``None``, 0).

        Tensors in host memory of at least :data:`DETECT_MIN_NUMEL` elements are read on the
        helper threads, largest first (``SenderConfig.threads``; detection reads ~6 bytes per
        element in a kernel that releases the GIL); the others, and every tensor on an
        accelerator (its kernels are queued on the device's stream by one thread), on the calling
        thread.

        Raises:
            The first error of ``detect`` / ``to_global`` / ``checksum_change`` in ``sources``
            order (the other tensors are still read).
        """
        det = self.detector

        def one(src: Source) -> tuple[Changes, torch.Tensor | None, int]:
            ch = det.detect(src.name, src.local)
            if not src.upload:
                return ch, None, 0
            gpos = src.slice.to_global(ch.positions)
            return ch, gpos, checksum_change(gpos, ch.old_values, ch.values)

        sizes = [s.local.numel() if s.local.device.type == "cpu" else -1 for s in sources]  # -1: here
        return map_largest_first(one, sources, sizes, self.config.threads, min_size=DETECT_MIN_NUMEL)

    def _delta_too_large(self, job: Job) -> bool:
        """Whether this rank's encoded delta of ``job`` (a delta, or an anchor that would carry one)
        reaches ``max_delta_ratio`` x the bytes of its blocks in the inference dtype. Encodes the
        delta now (on the caller's thread); the upload reuses it."""
        if job.base_version is None:
            return False
        full = sum(s.slice.numel * self.dtype.itemsize for s in job.sources if s.upload)
        if not full:
            return False
        parts = delta_parts(job, self.codec, self.config.threads)
        delta = sum(t.numel() * t.element_size() for tensors in parts.values() for t in tensors.values())
        return delta >= self.policy.max_delta_ratio * full

    def _convert_to_anchor(self, job: Job) -> None:
        """Publish ``job`` as an anchor without a delta (``AnchorPolicy.max_delta_ratio``): a delta
        becomes an anchor, an anchor drops the delta it would carry. The live weights are still
        those detection read, so the cast blocks are exactly that state, whose checksums the
        detection already computed (``job.partials`` stays)."""
        if job.kind == "delta":
            job.kind, job.anchor_version = "anchor", job.version
            job.stats.kind = "anchor"
            cast_anchors(job, self.detector, whole=True)  # every uploaded block counts whole
        else:
            job.counts.update({s.name: s.slice.numel for s in job.sources if s.upload})
        job.base_version, job.changes, job.global_positions, job.delta_parts = None, {}, {}, None
        job.stats.base_version = None
        job.stats.changed = sum(job.counts.values())

    def _slot(self, part: int = 0) -> tuple[int, int]:
        """``(rank, world)`` of this rank's object ``part`` (``dtensor.UploadPlan.slots``)."""
        return self.group.rank * self._slots + part, self.group.world * self._slots

    def _finish_background(self, job: Job, t0: float) -> None:
        try:
            self._finish(job, t0)
        except BaseException as e:  # noqa: BLE001 - reported on the next publish()/flush()
            with self._lock:
                self._error = e

    def _finish(self, job: Job, t0: float) -> None:
        """Encode, upload this rank's object, let rank 0 write the manifest, then commit."""
        g = self.group
        stats = job.stats
        written: list[str] = []  # this rank's objects of the version (removed if the publish fails)
        try:
            t = time.perf_counter()
            blobs = encode_objects(job, self.codec, self.dtype, self._slot, self.config.threads)
            stats.encode_ms = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            local = upload_objects(self.store, job, blobs, g.rank, written)
            stats.upload_ms = (time.perf_counter() - t) * 1e3
        except Exception as e:  # noqa: BLE001 - every failure is reported through the gather
            local = {"ok": False, "error": f"rank {g.rank}: {type(e).__name__}: {e}",
                     "transient": isinstance(e, TransientStoreError)}
            log.warning("publish of version %d failed on rank %d: %s", job.version, g.rank, e)

        gathered = g.gather(local)
        outcome: dict[str, Any] | None = None
        if g.rank == 0:
            outcome = self._write_manifest(job, gathered)
        outcome = g.broadcast(outcome)
        if not outcome["ok"]:
            self._force_anchor = self._force_anchor or bool(outcome.get("anchor_next"))
            if outcome.get("in_use"):  # another writer owns the prefix now: never publish here again
                self._in_use = outcome["error"]
                raise PrefixInUseError(f"version {job.version} was not published: {outcome['error']}")
            if "next_version" in outcome:  # another writer took this number: skip past its versions
                self._next_version = max(self._next_version, outcome["next_version"])
                raise PublishError(f"version {job.version} was not published: {outcome['error']}")
            if outcome.get("unknown"):  # version numbers are never reused: receivers are right either way
                raise PublishError(outcome["error"])
            if not outcome.get("transient"):  # (deletes on an unreachable store only delay the error)
                remove_objects(self.store, job.version, written)
            raise PublishError(
                f"version {job.version} was not published ({outcome['error']}); no partial version is visible"
                + ("" if self._force_anchor else f" and the next publish is based on version {self.version}"))
        self._commit(job, outcome)
        stats.nbytes = outcome["nbytes"]
        stats.changed = outcome["changed"]
        if job.kind == "delta" and not stats.changed and g.rank == 0 and not self._warned_unchanged:
            self._warned_unchanged = warn_unchanged(self.model, job.version, job.base_version)
        stats.publish_ms = (time.perf_counter() - t0) * 1e3
        self.last_stats = stats
        self.history.append(stats)
        if self.metrics_path is not None and g.rank == 0:
            append_metrics(self.metrics_path, {"event": "publish", **stats.to_dict()})
        if self.retention is not None and job.kind == "anchor" and g.rank == 0:
            self._collect_garbage()

    def _collect_garbage(self) -> None:
        """Rank 0, after an anchor is visible: apply the retention policy (see retention.py)."""
        try:
            collect_garbage(self.store, self.retention)
        except Exception as e:  # noqa: BLE001 - old versions are only garbage; never fail a publish
            log.warning("retention after version %s failed (%s); retrying after the next anchor", self.version, e)

    def _write_manifest(self, job: Job, gathered: list[dict]) -> dict[str, Any]:
        """Rank 0: combine per-rank metadata, write the manifest last and ``LATEST``."""
        try:  # first: a version number taken by the writer that took the prefix over is no collision
            self._check_owner()
        except PrefixInUseError as e:
            return {"ok": False, "in_use": True, "error": str(e)}
        except Exception as e:  # noqa: BLE001 - the store failed: an ordinary failed publish
            return {"ok": False, "error": f"rank 0 owner record: {type(e).__name__}: {e}"}
        outcome = write_manifest(self.store, job, gathered, codec=self.codec.name, dtype=self.dtype, run_id=self.run_id,
                                 world=self.group.world, latest_at=self._latest_at, run_files=self.run_files)
        if outcome["ok"]:
            self._write_latest(job.version, checked=True)
        return outcome

    def _write_latest(self, version: int, checked: bool = False) -> None:
        """Rank 0: point ``LATEST`` at ``version`` (or retry at the next publish or ``flush()``) while
        the prefix is ours (``checked``: read just before the manifest): a stale one could look current."""
        try:
            ours = self._lease is not None and (checked or self._lease.holds())
        except Exception as e:  # noqa: BLE001 - the store failed: try again later
            log.warning("could not read the owner record before pointing LATEST at %d: %s", version, e)
            self._latest_pending, self._latest_at = version, None
            return
        ok = ours and write_latest(self.store, version)
        self._latest_pending, self._latest_at = (None, version) if ok else (version if ours else None, None)

    def _commit(self, job: Job, outcome: dict[str, Any]) -> None:
        """The version is visible: advance snapshots, checksums and the anchor policy state."""
        self._shapes = {s.name: s.slice for s in job.sources}
        self._aliases = dict(job.aliases)
        det = self.detector
        for s in job.sources:
            if not s.upload:
                pass  # another rank ships this block and keeps its snapshot
            elif job.kind == "anchor":
                det.reset(s.name, cast=job.anchors[s.name])
            else:
                det.commit(s.name, job.changes[s.name])
            if s.name in job.partials:
                self._partials[s.name] = job.partials[s.name]
        self.version = job.version
        if job.kind == "anchor":
            self._force_anchor = False
            self._last_anchor = job.version
            self._anchor_nbytes = outcome["anchor_nbytes"]
            self._chain_nbytes = 0
        else:
            self._chain_nbytes += outcome["delta_nbytes"]
