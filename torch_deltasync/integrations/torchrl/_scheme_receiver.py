"""The receiving half of :class:`~torch_deltasync.integrations.torchrl.DeltaWeightSyncScheme`: a
worker follows the store and applies each version between two policy calls."""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn
from torchrl._utils import logger as torchrl_logger
from torchrl.weight_update.utils import _resolve_model
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme

from ..._dtypes import bits
from ...acks import StoreAcks, ack_message
from ...errors import SyncTimeoutError
from ...follow import wait_for_newer
from ...receiver import DeltaReceiver, UpdateStats
from ...targets import ModuleTarget
from ._collectors import int_tracker
from ._tensors import materialize, named_tensors


class ReceiverSide:
    """Receiver methods of the scheme (a mixin of ``DeltaWeightSyncScheme``; its state is set up by
    the scheme's ``_reset_runtime``)."""

    def _init_on_receiver_impl(self, *, model_id: str, context: Any = None, model: Any = None,
                               worker_idx: int | None = None, **kwargs: Any) -> None:
        """Local set-up in the worker; the store is first touched in :meth:`connect`."""
        if kwargs:
            torchrl_logger.debug(f"DeltaWeightSyncScheme: ignoring init_on_receiver arguments {sorted(kwargs)}")
        self.model_id = model_id
        if context is not None:
            WeightSyncScheme.context.fset(self, context)
        if model is None and context is not None:
            get_model = getattr(context, "get_model", None)
            model = get_model(model_id) if callable(get_model) else _resolve_model(context, model_id)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"DeltaWeightSyncScheme needs the worker's {model_id!r} to be an nn.Module, got {type(model).__name__}"
            )
        WeightSyncScheme.model.fset(self, model)
        if worker_idx is None:
            worker_idx = getattr(context, "worker_idx", None)
        self._worker_idx = 0 if worker_idx is None else int(worker_idx)

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: int | None = None) -> None:
        """Materialise the policy, wait for the first version, apply it, start following the store.

        The sender needs no rendezvous: whichever side starts first, the receiver waits (at most
        ``connect_timeout_s``) for a version to appear in the store.
        """
        if worker_idx is not None:
            self._worker_idx = int(worker_idx)
        model = self.model
        if model is None:  # torchrl keeps models by weak reference
            raise RuntimeError(f"DeltaWeightSyncScheme: the {self._model_id!r} module was garbage-collected; keep a "
                               "reference to it (the collector does) while the scheme receives")
        materialize(model, device=self.device or "cpu", dtype=self.receiver_dtype)
        store = self._open_store()
        metrics = self._metrics_path(str(self._worker_idx), self.receiver_config.metrics_path)
        self._receiver = DeltaReceiver(self._target(model), store, prefix=self.run_prefix,
                                       config=self.receiver_config, metrics_path=metrics)
        if self._acks is None and self.sync and self.num_workers:
            self._acks = StoreAcks(self.model_key)
        try:
            first = self._receiver.wait_for(None, timeout_s=self.connect_timeout_s, poll_s=self.poll_interval_s)
        except TimeoutError:
            raise SyncTimeoutError(
                f"DeltaWeightSyncScheme worker {self._worker_idx}: no version of {self._model_id!r} appeared in "
                f"{store.describe()}/{self.run_prefix} within {self.connect_timeout_s:.0f} s; is the sender "
                "connected, and do both sides use the same store and prefix?"
            ) from None
        try:
            self._update_and_apply()
        except Exception as e:  # e.g. a policy that cannot hold the weights: the waiting sender hears why
            # no version: the worker holds none, and the error stands for every version the sender waits for
            self._post_ack(None, f"could not connect (applying version {first}): {type(e).__name__}: {e}")
            raise
        self._install_hooks(model)
        torchrl_logger.debug(
            f"DeltaWeightSyncScheme worker {self._worker_idx}: holds version {self._applied} of {self._model_id!r}"
        )
        if self.background_receive:
            self._start_background_receiver()

    def _install_hooks(self, model: nn.Module) -> None:
        """Hooks that bracket every policy call: keep writes out of the call (:class:`CallGate`), and
        stamp the output with the version of the weights that computed it.

        The hooks hold only a weak reference to the scheme, and are plain closures, so that
        ``copy.deepcopy`` of the policy (torchrl copies it to the policy device) does not copy the
        scheme along.
        """
        ref = weakref.ref(self)

        def pre_hook(module, args):
            s = ref()
            if s is not None:
                s._gate.enter()

        def post_hook(module, args, output):
            s = ref()
            if s is None:
                return None
            try:
                s._stamp(output)
            finally:
                s._gate.exit()
            return None

        self._remove_hooks()
        self._hooks = [
            model.register_forward_pre_hook(pre_hook, prepend=True),
            model.register_forward_hook(post_hook, always_call=True),
        ]

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _stamp(self, output: Any) -> None:
        key = self.version_key
        if key is None or self._applied is None or not isinstance(output, TensorDictBase):
            return
        cur = output.get(key, None)
        if not isinstance(cur, torch.Tensor) or cur.is_floating_point() or cur.dtype == torch.bool:
            return
        try:
            output.set(key, torch.full_like(cur, self._applied))
        except RuntimeError:  # a locked tensordict: leave torchrl's stamp
            pass

    def _set_tracker(self, version: int) -> None:
        tracker = int_tracker(self.context)
        if tracker is not None:
            tracker.version = int(version)

    def _target(self, model: nn.Module) -> ModuleTarget:
        """The target of ``model``'s floating tensors; its other tensors (BatchNorm's
        ``num_batches_tracked``: the sender publishes floating tensors only) stay the worker's own."""
        tensors = named_tensors(model)
        left = sorted(n for n, t in tensors.items() if not t.is_floating_point())
        if left:
            torchrl_logger.info(f"DeltaWeightSyncScheme worker {self._worker_idx}: not synced (not floating point): "
                                f"{left[:5]}{' ...' if len(left) > 5 else ''}")
        return ModuleTarget({n: t for n, t in tensors.items() if n not in left}, strict=self.strict)

    def _retarget(self, old: nn.Module, new: nn.Module) -> None:
        with self._update_lock, self._gate.exclusive():
            materialize(new, device=self.device or "cpu", dtype=self.receiver_dtype)
            inner = self._target(new)
            r = self._receiver
            if r.version is not None:
                m = r.manifest(r.version)
                inner.check({t.name: t.shape for t in m.tensors}, dict(m.aliases), m.inference_dtype)
            r.target = inner
            if self._hooks:
                self._install_hooks(new)
            held = r.version
            e = r.verify_or_forget()  # a mismatch forgets the version: the update below rebuilds
            if e is not None:
                torchrl_logger.warning(f"DeltaWeightSyncScheme worker {self._worker_idx}: the relocated policy "
                                       f"does not hold version {held} ({e}); rebuilding from an anchor")
        if r.version is None:
            self._update_and_apply()

    def _update_and_apply(self) -> int | None:
        """Bring the policy to the newest version. Returns the version applied, or ``None`` when
        the policy already held the newest one.

        The expensive part (:meth:`~torch_deltasync.DeltaReceiver.prepare`: download, decode,
        validate, verify) runs while the policy keeps acting; only the in-place writes
        (:meth:`~torch_deltasync.DeltaReceiver.commit`) wait for the policy call in progress.
        """
        with self._update_lock:  # nothing else commits between this prepare and its commit
            r = self._receiver
            t0 = time.perf_counter()
            staged = r.prepare()
            if staged.plan.path == "noop" and staged.version == self._applied:
                return None
            t1 = time.perf_counter()
            with self._gate.exclusive():  # waits for the policy call in progress, if any
                v = r.commit(staged)  # a failed write leaves r.version None: the next update rebuilds
                self._applied = v
                self._set_tracker(v)
            t2 = time.perf_counter()
            stats: UpdateStats | None = staged.stats
            self._last_update = {"version": v, "path": stats.path if stats else None,
                                 "nbytes": stats.nbytes if stats else 0, "written": stats.changed if stats else 0,
                                 "update_ms": (t1 - t0) * 1e3, "apply_ms": (t2 - t1) * 1e3}
            self._failed = None
        self._post_ack(v, None)
        return v

    def _post_ack(self, version: int | None, error: str | None) -> None:
        if self._acks is None:
            return
        try:
            self._acks.post(self._receiver.store if isinstance(self._acks, StoreAcks) else None,
                            ack_message(self._worker_idx, version, error))
        except Exception as e:  # noqa: BLE001 - an ack that cannot be sent must not stop the worker
            torchrl_logger.warning(f"DeltaWeightSyncScheme worker {self._worker_idx}: cannot acknowledge: {e}")

    def receive(self, timeout: float | None = None) -> TensorDictBase | None:
        """Apply the newest version if it is newer than the one held (the receiver's pull).

        Called by the background thread, or directly (``background_receive=False``, Ray's
        ``_receive_weights_scheme``, an inference server's poll). Cheap when nothing is new: one
        ``LATEST`` read. Unlike torchrl's default it does not cascade through
        ``update_policy_weights_`` (that would copy every weight again); it sets the collector's
        ``PolicyVersion`` to the applied version itself.

        Args:
            timeout: seconds to wait for a new version; ``0`` checks once, ``None`` waits until one
                appears (or the scheme shuts down).

        Returns:
            The policy's weights (live ``TensorDict``) after applying a version, else ``None``.

        Raises:
            RuntimeError: not initialised or connected on the receiver.
            DeltaSyncError: the version could not be applied (the policy keeps the one it held;
                the error is also acknowledged to a waiting sender).
        """
        if not self.initialized_on_receiver:
            raise RuntimeError("Must be initialized on receiver before receiving weights")
        if not self.synchronized_on_receiver:
            raise RuntimeError("Must be synchronized on receiver before receiving weights")
        newest = wait_for_newer(self._receiver, poll_s=self.poll_interval_s, idle_timeout_s=timeout,
                                stop=self._stop_event)
        if newest is None:
            return None
        try:
            v = self._update_and_apply()
        except Exception as e:
            self._failed = (newest, time.monotonic() + max(1.0, 20 * self.poll_interval_s))
            self._post_ack(newest, f"{type(e).__name__}: {e}")
            raise
        return self.weights if v is not None else None

    def _wait_for_instruction(self, timeout: float | None = None) -> str | None:
        """Poll the store until a version newer than the one held appears (``"receive"``), the
        scheme stops or ``timeout`` passes (``None``). A version that failed is retried after a
        back-off, not in a tight loop; a store that cannot be read is polled on (warned once a minute)."""
        warned = [0.0]

        def read() -> int | None:
            try:
                return self._receiver.newest_version()
            except Exception as e:  # noqa: BLE001 - a flaky store: keep polling
                if time.monotonic() - warned[0] > 60:
                    torchrl_logger.warning(f"DeltaWeightSyncScheme worker {self._worker_idx}: cannot poll the store: {e}")
                    warned[0] = time.monotonic()
                return None

        def backing_off(newest: int) -> bool:
            failed = self._failed
            return failed is not None and newest == failed[0] and time.monotonic() < failed[1]

        newest = wait_for_newer(self._receiver, poll_s=self.poll_interval_s, idle_timeout_s=timeout,
                                stop=self._stop_event, skip=backing_off, read=read)
        return None if newest is None or self._stop_event.is_set() else "receive"

    def _background_receive_loop(self) -> None:
        while not self._stop_event.is_set():
            if self._wait_for_instruction() is None:
                break
            try:
                self.receive(timeout=0)
            except Exception as e:  # noqa: BLE001 - reported to the sender, retried after a back-off
                if not self._stop_event.is_set():
                    torchrl_logger.warning(
                        f"DeltaWeightSyncScheme worker {self._worker_idx}: update failed, keeping version "
                        f"{self._applied}: {type(e).__name__}: {e}"
                    )

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """Not used by this scheme: versions are applied from the store (see :meth:`receive`)."""
        raise NotImplementedError(
            "DeltaWeightSyncScheme applies versions from the store; call receive() or let the background thread do it"
        )

    def create_transport(self, **kwargs: Any) -> Any:
        """Not used: the store is the transport (kept because torchrl declares it abstract)."""
        raise NotImplementedError("DeltaWeightSyncScheme uses its store instead of torchrl transports")

    def receiver_state(self, include_weights: bool = False) -> dict[str, Any]:
        """Receiver: what this worker holds, for checks and dashboards.

        Call it in a worker through torchrl, e.g.
        ``collector.map_fn("_receiver_schemes['policy'].receiver_state", list_of_kwargs=[{"include_weights": True}] * n)``.

        Args:
            include_weights: also return every floating tensor's bit pattern (integer view,
                ``int16`` for bf16, ``int32`` for fp32; a copy), read between two policy calls.

        Returns:
            ``{"worker", "model_id", "version", "last_update"}`` (+ ``"weights": {name: tensor}``).
        """
        with self._gate.exclusive():
            state = {"worker": self._worker_idx, "model_id": self._model_id, "version": self._applied,
                     "last_update": dict(self._last_update) if self._last_update else None}
            if include_weights:
                state["weights"] = {n: bits(t.detach().contiguous()).clone()
                                    for n, t in named_tensors(self.model).items() if t.is_floating_point()}
        return state
