"""The ``deltasync`` backend of vLLM's weight-transfer API (vLLM 0.28+): worker and trainer side.

vLLM lets an out-of-tree backend plug into its RL weight-sync calls
(``vllm/distributed/weight_transfer/base.py``): a worker-side :class:`WeightTransferEngine` and a
trainer-side :class:`TrainerWeightTransferEngine`, registered by name in
``WeightTransferEngineFactory`` / ``WeightTransferTrainerFactory`` and chosen with
``weight_transfer_config={"backend": "deltasync"}``. Both are registered from the
``vllm.general_plugins`` entry point ``deltasync`` (``pyproject.toml``, :mod:`torch_deltasync_vllm`),
so every vLLM process (engine core and workers) knows the backend without an extra flag.

Data path::

    trainer ─ DeltaSender.publish() ─▶ store ◀─ each vLLM worker: DeltaReceiver(VLLMEngineTarget)
                                                  background: prepare(newest)  (engine generates)
    driver: start_weight_update ─ [pause] ─ update_weights({"version": v}) ─ finish_weight_update(str(v)) ─ [resume]
                                                  in the RPC: commit(staged v)  (the only stall)

* ``init_weight_transfer_engine({"init_info": {"store": URI, "prefix": "", ...}})`` builds the
  worker's receiver (:class:`DeltaSyncInitInfo`); nothing is installed unless it succeeds. From then
  on a background thread on every worker stages the newest visible version (download, decode,
  validate, checksum check in ``O(changed elements)``) while the engine keeps generating.
* ``update_weights({"update_info": {"version": v}})`` commits version ``v``: the staged update when
  it is ready, else it is prepared inside the call (counted in the stall, reported in the stats).
  Only writes happen here: ``index_copy_`` into in-place parameters and a layerwise reload of the
  vLLM modules whose live weights are derived copies (:mod:`torch_deltasync.targets._vllm_engine`).
* ``finish_weight_update(weight_version=str(v))`` lets ``get_weight_version`` / ``/weight_info``
  report it. Pausing (``pause_generation(mode=..., clear_cache=True)``, which also drops every
  cached KV block of the old weights) and resuming stay the caller's, as for every vLLM backend;
  :mod:`torch_deltasync.integrations.vllm` has helpers that do the whole round.

A failure anywhere (bad object, unknown version, bad config) raises with the reason; the worker
keeps serving the version it had, and vLLM resets its weight-update session.

Readiness: with ``status_dir`` set, every worker keeps ``<status_dir>/rank-<r>.json`` =
``{"held": int|null, "staged": int|null, "kept": int|null, "newest": int|null, "error": str|null}``
current (written atomically; ``kept``: the staged version that ``staged`` replaced, still committable
without staging), so a driver on the same host can pause only once every worker has staged the
version (:func:`torch_deltasync.integrations.vllm.wait_staged`).

This module holds the worker engine and its init/update info; the background stager and the
readiness file are :mod:`._stager`, the trainer engine :mod:`._trainer` (re-exported here, because
:mod:`torch_deltasync_vllm` registers both engines by this module's path).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ... import _native_apply
from ...errors import DeltaSyncError
from ...keys import MAX_VERSION
from ._init_info import InitInfo
from ._stager import Stager, Status

# The trainer side lives in ._trainer; vLLM's factory imports the worker engine and the trainer
# engine from this module, by the path torch_deltasync_vllm registers.
from ._trainer import BACKEND, DeltaSyncTrainerInitInfo, DeltaSyncTrainerWeightTransferEngine  # noqa: F401

log = logging.getLogger(__name__)


def register() -> None:
    """Register the ``deltasync`` engines with vLLM (idempotent); the entry point vLLM calls is
    :func:`torch_deltasync_vllm.register`, which does the same without importing this package."""
    from torch_deltasync_vllm import register as _register

    _register()


# --- worker side -------------------------------------------------------------------------------------

@dataclass
class DeltaSyncInitInfo(InitInfo, WeightTransferInitInfo):
    """``init_info`` of the ``deltasync`` backend: the fields and checks of :class:`._init_info.InitInfo`
    (declared there, without vLLM, so drivers check options before sending), as vLLM's
    ``WeightTransferInitInfo``."""


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of the ``deltasync`` backend: the version to commit (published in the store)."""

    version: int

    def __post_init__(self) -> None:
        if type(self.version) is not int or self.version < 0:
            raise ValueError(f"update_info 'version' must be a published version (int >= 0), got {self.version!r}")
        if self.version > MAX_VERSION:
            raise ValueError(f"update_info 'version' {self.version} is beyond the largest version {MAX_VERSION}")


class DeltaSyncWeightTransferEngine(WeightTransferEngine[DeltaSyncInitInfo, DeltaSyncUpdateInfo]):
    """Worker side of the ``deltasync`` backend: one per vLLM worker (TP rank); see the module doc.

    vLLM calls :meth:`init_transfer_engine` (``init_weight_transfer_engine``),
    :meth:`start_weight_update`, :meth:`receive_weights` (``update_weights``) and
    :meth:`finish_weight_update` from the worker's RPC loop, between forward passes.

    Attributes:
        last_commit: stats of the last commit (``UpdateStats`` as a dict, times in ms, plus
            ``staged_ahead``: whether it had been staged before the call, and ``reload``: the
            modules re-packed and their time).
    """

    init_info_cls = DeltaSyncInitInfo
    update_info_cls = DeltaSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: Any = None
        self.last_commit: dict[str, Any] | None = None
        self._stager: Stager | None = None
        self._status: Status | None = None
        self._metrics: Path | None = None
        self._worker: Any = None  # weakref to the vLLM worker that owns this engine

    def parse_init_info(self, init_dict: dict[str, Any]) -> DeltaSyncInitInfo | None:  # type: ignore[override]
        """vLLM's parse (``DeltaSyncInitInfo(**init_dict)``), agreed across the engine's workers: a
        bad field is raised by one worker only (:func:`_on_every_worker`), the others get ``None``
        and :meth:`init_transfer_engine` does nothing with it, so vLLM's executor stays in step.

        Raises:
            ValueError: a missing, unknown or bad field (the message names it).
        """
        parse = super().parse_init_info
        return _on_every_worker(lambda: parse(init_dict), "init_weight_transfer_engine (init_info)")

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo | None) -> None:
        """Follow the run ``init_info.store`` / ``prefix``: build the receiver (and, with
        ``assume_version``, the host copy of that version), then start staging in the background.
        On any error nothing is installed and a receiver from an earlier init stays.

        Raises:
            ValueError: bad ``init_info``.
            DeltaSyncError: the store, a version or the model does not fit (the message says which).
        """
        from ...receiver import DeltaReceiver
        from ...targets import VLLMEngineTarget

        if init_info is None:
            return  # the init_info was refused; another worker raised the reason (parse_init_info)
        rank = _worker_rank()

        def build():
            target = VLLMEngineTarget(self.model, self.model_config, in_place=init_info.in_place,  # type: ignore[arg-type]
                                      reload_ahead=init_info.reload_ahead, strict=init_info.strict)  # type: ignore[arg-type]
            receiver = DeltaReceiver(target, init_info.store, prefix=init_info.prefix,
                                     max_workers=init_info.max_workers, threads=init_info.threads)
            try:
                if init_info.assume_version is not None:
                    target.engine_writes = False  # the engine serves it already: build the host copy only
                    try:
                        receiver.update(init_info.assume_version)
                    finally:
                        target.engine_writes = True
                elif receiver.newest_version() is None:  # the store answers (a bad URI or bucket fails here)
                    why = receiver.store.absent()
                    if why:
                        log.warning("deltasync: %s: %s; nothing is staged until a version is published there "
                                    "(is the path right?)", receiver.store.describe(), why)
                # The readiness file and the metrics file are written from now on: a path that
                # cannot be written is refused here, with nothing installed.
                try:
                    status = Status(init_info.status_dir, rank)
                except OSError as e:
                    raise ValueError(f"init_info 'status_dir' {init_info.status_dir!r} cannot be written: {e}") from e
                metrics = Path(init_info.metrics_path.replace("{rank}", str(rank))) if init_info.metrics_path else None
                if metrics is not None:
                    try:
                        metrics.parent.mkdir(parents=True, exist_ok=True)
                        with open(metrics, "a"):
                            pass
                    except OSError as e:
                        raise ValueError(f"init_info 'metrics_path' {str(metrics)!r} cannot be written: {e}") from e
            except BaseException:
                receiver.close()
                raise
            return receiver, status, metrics

        self._worker = _calling_worker(self)
        built = _on_every_worker(build, "init_weight_transfer_engine")
        if built is None:
            return  # another worker failed and raised for the engine: nothing is installed anywhere
        self.shutdown()
        self.receiver, self._status, self._metrics = built
        _native_apply.warm()  # a cold kernel compiles here, not inside the first commit's pause
        self._status.update(held=self.receiver.version)
        receiver = self.receiver
        if init_info.stage_ahead:
            self._stager = Stager(receiver, init_info.poll_s, self._status)
            self._stager.start()

    def start_weight_update(self) -> None:
        """Nothing to set up (writes are in place or per-module reloads inside the update). An
        engine that was never initialised is refused by ``update_weights``, where the workers agree
        on the failure (raising here on every worker would put vLLM's executor out of step)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's entry point: parse ``update_info`` and commit it (:meth:`receive_weights`). The
        parse and the check that the backend is initialised are agreed across the workers, so a bad
        ``update_info`` is raised by one worker only and the others end their session, as vLLM does
        on the worker that raises (:func:`_on_every_worker`).

        Raises:
            ValueError: a missing, unknown or bad field of ``update_info`` (the message names it).
            DeltaSyncError: the backend is not initialised on this engine.
        """
        def parse():
            self._require()
            return self.parse_update_info(update_info)

        if self._worker is None:  # never initialised: find the worker whose session to end
            self._worker = _calling_worker(self)
        typed = _on_every_worker(parse, "update_weights")
        if typed is None:
            self._end_session()
            return
        self.receive_weights(typed)
        torch.accelerator.synchronize()  # as vLLM's base update_weights does

    @torch.no_grad()
    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        """Commit ``update_info.version``: the staged update if ready, else prepare it now.

        Raises:
            VersionNotFoundError, CorruptObjectError, ChecksumMismatchError, IncompatibleTargetError,
            StoreError: nothing was written; the engine serves the version it had.
        """
        receiver = self._require()
        t0 = time.perf_counter()
        v = update_info.version
        staged = None
        try:
            staged = self._stager.take(v) if self._stager is not None else None
            staged_ahead = staged is not None

            def stage():
                if staged is not None and receiver.is_current(staged):
                    return staged
                return receiver.prepare(v, ahead=False)  # inside the pause: the commit follows at once

            # Every worker stages first; only if all succeeded does any of them write (all or nothing
            # across the engine's workers).
            ready = _on_every_worker(stage, f"update_weights (version {v})")
            if ready is None:
                self._end_session()
                return
            staged_ahead = staged_ahead and ready is staged

            def commit():
                receiver.commit(ready)
                if receiver.version != v:
                    raise DeltaSyncError(f"asked for version {v}, the receiver holds {receiver.version}")

            if _on_every_worker(commit, f"update_weights (version {v}, commit)", result=True) is None:
                self._end_session()
                return
            stats = receiver.last_stats.to_dict() if receiver.last_stats is not None else {}
            stats.update(staged_ahead=staged_ahead, rpc_ms=(time.perf_counter() - t0) * 1e3,
                         reload=dict(receiver.target.last_reload))
            self.last_commit = stats
            if self._status is not None:
                self._status.update(held=v)
            if self._metrics is not None:
                try:
                    with open(self._metrics, "a") as f:
                        f.write(json.dumps({"event": "commit", **stats}) + "\n")
                except OSError as e:  # the commit landed on every worker: a lost stats line is no failure
                    log.warning("deltasync: cannot append to %s: %s", self._metrics, e)
        finally:
            if self._stager is not None:
                self._stager.release()  # staging goes on (the commit landed or failed)

    def finish_weight_update(self) -> None:
        """Wake the stager: the next version may already be visible (nothing to do before init)."""
        if self._stager is not None:
            self._stager.wake()

    def shutdown(self) -> None:
        """Stop staging and close the receiver (the weights stay as they are)."""
        if self._stager is not None:
            self._stager.stop()
            self._stager.join(timeout=60)
            self._stager = None
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def _end_session(self) -> None:
        """End the worker's weight-update session after a failure another worker reported, as vLLM
        does itself on the worker that raises (``Worker.update_weights``), so the next
        ``start_weight_update`` is accepted on every worker."""
        worker = self._worker() if self._worker is not None else None
        if worker is not None and getattr(worker, "_weight_update_active", False):
            worker._weight_update_active = False

    def _require(self) -> Any:
        if self.receiver is None:
            raise DeltaSyncError(
                "the deltasync backend is not initialised on this worker: call "
                "init_weight_transfer_engine({'init_info': {'store': ..., 'prefix': ...}}) first")
        return self.receiver


def _world() -> tuple[Any, int, int]:
    """vLLM's world group of this engine's workers: ``(cpu group or None, rank, size)``."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        g = get_world_group()
        return g.cpu_group, int(g.rank_in_group), int(g.world_size)
    except Exception:  # noqa: BLE001 (not initialised: a single worker, or a test without vLLM's groups)
        return None, 0, 1


def _on_every_worker(fn: Any, what: str, *, result: bool = False) -> Any:
    """Run ``fn`` on this worker and agree with the engine's other workers on the outcome.

    vLLM's multiprocessing executor returns the first failing worker's error from a
    ``collective_rpc`` and leaves the other workers' answers queued, so when every worker raises,
    the next RPC receives a stale error (vLLM 0.32, ``MultiprocExecutor.collective_rpc``). So the
    workers exchange their outcome over vLLM's CPU world group (the RPC runs on all of them in
    lockstep) and only the last worker raises, with every worker's reason; the others return
    ``None`` and the caller does nothing more. One worker: ``fn()`` as is.

    Returns:
        ``fn()``'s value (``True`` when ``result`` and ``fn`` returned ``None``), or ``None`` when
        some worker failed and this one is not the one to raise.
    """
    group, rank, size = _world()
    if group is None or size == 1:
        try:
            out = fn()
        except DeltaSyncError as e:  # vLLM hands the driver the message only: name the type in it
            if str(e).startswith(f"{type(e).__name__}: "):
                raise
            raise type(e)(f"{type(e).__name__}: {e}") from e
        return True if result and out is None else out
    out, err = None, None
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 (reported below by the last worker)
        err = f"{type(e).__name__}: {e}"
    errors: list[Any] = [None] * size
    torch.distributed.all_gather_object(errors, err, group=group)
    failed = [(r, m) for r, m in enumerate(errors) if m is not None]
    if not failed:
        return True if result and out is None else out
    if rank == size - 1:
        raise DeltaSyncError(f"{what} failed on {len(failed)} of {size} workers; nothing was changed on any: "
                             + "; ".join(f"worker {r}: {m}" for r, m in failed))
    return None


def _calling_worker(engine: Any) -> Any:
    """A weak reference to the vLLM worker whose ``weight_transfer_engine`` is ``engine``, found on
    the call stack of ``init_weight_transfer_engine`` (vLLM gives an engine no reference to its
    worker), or ``None``."""
    import weakref

    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None and getattr(owner, "weight_transfer_engine", None) is engine:
            return weakref.ref(owner)
        frame = frame.f_back
    return None


def _worker_rank() -> int:
    """This worker's global rank (``0`` when torch.distributed is not initialised)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0


