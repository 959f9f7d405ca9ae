"""torchrl integration: a ``WeightSyncScheme`` for collectors and a weight sender for the LLM stack.

Importing this module imports torchrl and registers the weight-sync backend ``"delta"``
(``WeightSyncScheme.from_backend("delta", store=...)``); ``import torch_deltasync`` alone does not.

Architecture (collectors)::

    trainer process                         object store                 collector workers
    ───────────────                         ────────────                 ─────────────────
    collector.update_policy_weights_()                                   background thread per worker:
      └ DeltaWeightSyncScheme.send()  ──▶  <prefix>/versions, objects ──▶  poll newest version, then
          DeltaSender.publish()                                            DeltaReceiver.update() (download,
          (anchor or sparse delta)                                         validate, stage, verify) ──▶
          [sync] wait for acks  ◀──────── ack queue (MultiCollector)       apply in place between two
                                          or <prefix>/acks/ (others) ◀──   policy calls, stamp version

* **Sender** (``init_on_sender`` / ``connect`` / ``send``): a :class:`~torch_deltasync.DeltaSender`
  over the live policy (``collector.policy``, or the weights passed to
  ``update_policy_weights_``). ``connect`` publishes the first version (an anchor); every ``send``
  publishes the next one, an anchor or a sparse delta, and with ``sync=True`` waits until every
  worker has applied it (or failed, or died, or timed out: never hangs).
* **Receiver** (``init_on_receiver`` / ``connect`` / ``receive``): a
  :class:`~torch_deltasync.DeltaReceiver` over the worker's policy. ``connect`` materialises a
  policy that arrived without weights (torchrl sends workers a meta-device copy), waits for the
  first version and applies it; a daemon thread then follows the store. Downloading, decoding and
  verifying run on that thread while the policy keeps acting; the in-place write
  (``index_copy_`` of the changed elements) waits for the current policy call to finish, so a
  policy call never sees a mix of two versions and no second dense copy of the weights exists.
* **Versions**: the store's version numbers are torchrl's policy versions. After each apply the
  worker sets its collector's ``PolicyVersion`` tracker to the version, and every policy call
  overwrites the root ``"policy_version"`` entry of its output with the version whose weights
  computed that action, so collected frames name the weights that produced them exactly (the
  transform alone stamps the version current at the previous env step).

Architecture (LLM stack): :class:`DeltaVLLMWeightSender` has the shape of torchrl's vLLM senders
(``register_model``, ``register_collector``, ``update_weights``), so ``GRPOTrainer(weight_sync_sender=...)``
and ``UpdateWeights(sender=...)`` drive it; it publishes a version and has every vLLM worker commit
it through vLLM's weight-transfer calls with the ``deltasync`` backend
(:func:`torch_deltasync.integrations.vllm.update_llm`).

``docs/torchrl.md`` has the configuration guide; ``research/torchrl-weight-sync.md`` the torchrl
0.14.1 API this module follows (``weight_update/weight_sync_schemes.py`` line numbers cited there).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import queue
import re
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from tensordict import TensorDictBase
from torchrl._utils import logger as torchrl_logger
from torchrl.weight_update.utils import _resolve_model
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme, register_weight_sync_backend

from .._dtypes import as_dtype, bits
from ..errors import DeltaSyncError, IncompatibleTargetError, SyncTimeoutError, WorkerError
from ..receiver import DeltaReceiver, UpdateStats
from ..retention import RetentionPolicy
from ..sender import AnchorPolicy, DeltaSender
from ..store import Store, open_store
from ..store.base import check_key
from ..targets import ModuleTarget, Target

__all__ = ["DeltaWeightSyncScheme", "DeltaVLLMWeightSender", "named_tensors"]

OnWorkerFailure = Literal["raise", "skip"]

_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9._=+@,-]+")


# --- helpers ---------------------------------------------------------------------------------------


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by its ``state_dict`` name, tied names included.

    This is the naming both sides of the scheme use: the same names as
    ``TensorDict.from_module(module).flatten_keys(".")`` (non-persistent buffers included, unlike
    ``state_dict``), and the live tensors themselves (no copies). Tied tensors appear under every
    name; the sender ships them once (see :func:`torch_deltasync.sender.collect_sources`).
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = p
    for name, b in module.named_buffers(remove_duplicate=False):
        out[name] = b
    return out


def _flat_tensors(weights: TensorDictBase | Mapping) -> dict[str, torch.Tensor]:
    """A TensorDict or (nested) mapping of weights as ``{dotted name: tensor}``; non-tensors dropped
    (``WeightStrategy`` adds ``"__extra_state__"``, which is not a weight)."""
    if isinstance(weights, TensorDictBase):
        weights = weights.flatten_keys(".")
    out: dict[str, torch.Tensor] = {}
    for k, v in weights.items():
        if k.startswith("__extra_state__"):
            continue
        if isinstance(v, (Mapping, TensorDictBase)):
            out.update({f"{k}.{kk}": vv for kk, vv in _flat_tensors(v).items()})
        elif isinstance(v, torch.Tensor):
            out[k] = v
    return out


def _materialize(module: nn.Module, *, device: torch.device | str, dtype: torch.dtype | None) -> None:
    """Give every meta-device tensor of ``module`` real (uninitialised) storage on ``device``, and
    cast floating tensors to ``dtype`` (when given), in place of the module's entries.

    torchrl's multi-process collectors send workers a copy of the policy whose parameters live on
    the meta device (``collectors/utils.py:_make_meta_policy``); the scheme fills them from an
    anchor right after. Tied tensors stay tied (one new tensor per original object).

    Raises:
        IncompatibleTargetError: a non-floating tensor is on the meta device (the scheme syncs
            floating tensors only; build such policies in the worker with ``policy_factory``).
    """
    memo: dict[int, torch.Tensor] = {}
    for mod_name, mod in module.named_modules():
        for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) in memo:
                    table[name] = memo[id(t)]
                    continue
                floating = t.is_floating_point()
                want = dtype if (dtype is not None and floating) else t.dtype
                new = t
                if t.is_meta:
                    if not floating:
                        full = f"{mod_name}.{name}" if mod_name else name
                        raise IncompatibleTargetError(
                            f"{full!r} is a {t.dtype} tensor without data (meta device); the delta scheme only "
                            "syncs floating tensors: build the policy inside the worker with policy_factory"
                        )
                    new = torch.empty(t.shape, dtype=want, device=device)
                elif t.dtype != want:
                    new = t.detach().to(want)
                if new is not t:
                    new = nn.Parameter(new, requires_grad=False) if is_param else new
                    table[name] = new
                memo[id(t)] = new


class _DeferredTarget(Target):
    """A :class:`ModuleTarget` whose writes are recorded instead of done.

    :class:`~torch_deltasync.DeltaReceiver` calls ``write``/``assign`` only after everything was
    downloaded, decoded and verified; recording them lets the scheme do that expensive part on its
    background thread while the policy keeps acting, then replay the (already staged) writes under
    the policy lock in one short critical section. Reads and checksums go to the live tensors.
    """

    holds_all = True

    def __init__(self, inner: ModuleTarget) -> None:
        self.inner = inner
        self._ops: list[tuple[str, torch.Tensor | None, torch.Tensor]] = []

    def check(self, shapes, aliases, dtype) -> None:
        self.inner.check(shapes, aliases, dtype)

    def read(self, name, positions, dtype):
        return self.inner.read(name, positions, dtype)

    def owned(self, name, positions):
        return self.inner.owned(name, positions)

    def write(self, name, positions, values) -> None:
        self._ops.append((name, positions, values))

    def assign(self, name, full) -> None:
        self._ops.append((name, None, full))

    def checksum(self, name, dtype) -> int:
        return self.inner.checksum(name, dtype)

    def take(self) -> list[tuple[str, torch.Tensor | None, torch.Tensor]]:
        ops, self._ops = self._ops, []
        return ops

    @torch.no_grad()
    def replay(self, ops) -> int:
        """Do the recorded writes in place; returns the number of elements written."""
        n = 0
        for name, positions, values in ops:
            if positions is None:
                self.inner.assign(name, values)
            else:
                self.inner.write(name, positions, values)
            n += values.numel()
        return n


class _CallGate:
    """Keeps writes to the policy's weights out of policy calls, without starving either side.

    Policy calls (forward hooks, :meth:`enter` / :meth:`exit`) never overlap a write
    (:meth:`exclusive`): a write waits for the call in progress, and a call that starts while a
    write waits waits for the write. The preference for the waiting write bounds an update's wait
    to the call in progress even in a rollout loop that calls the policy without pause (a plain
    lock held across each call is free only between two calls, and Python's locks are not fair).
    The underlying lock is held only for a few instructions per call.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._calls = 0
        self._writers = 0
        self._local = threading.local()

    def enter(self) -> None:
        with self._cond:
            while self._writers:
                self._cond.wait()
            self._calls += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def exit(self) -> None:
        if getattr(self._local, "depth", 0) == 0:  # enter() never ran (an earlier pre-hook raised)
            return
        self._local.depth -= 1
        with self._cond:
            self._calls -= 1
            if not self._calls:
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        """No policy call runs inside this block (calls in progress finish first)."""
        with self._cond:
            self._writers += 1
            try:
                while self._calls:
                    self._cond.wait()
                yield
            finally:
                self._writers -= 1
                self._cond.notify_all()


# --- acknowledgements ------------------------------------------------------------------------------


class _QueueAcks:
    """Acknowledgements over multiprocessing queues, one per worker (a MultiCollector's workers).

    The queues are created by the sender with the collector's multiprocessing context and travel to
    the workers inside the pickled scheme, at process start (the only time multiprocessing allows).
    One queue per worker, not one shared queue: a queue's writers share a lock that its feeder
    thread holds while writing, and a worker killed in that moment (right after its last
    acknowledgement, say) would keep it forever and silence every other worker.
    """

    def __init__(self, ctx: Any, num_workers: int) -> None:
        self.queues = [ctx.Queue() for _ in range(num_workers)]

    def post(self, store: Store | None, msg: dict[str, Any]) -> None:
        worker = msg["worker"]
        if not 0 <= worker < len(self.queues):
            raise ValueError(f"worker index {worker} outside the {len(self.queues)} acknowledgement queues")
        self.queues[worker].put(msg)

    def poll(self, store: Store | None, workers: set[int], wait_s: float) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + wait_s
        while True:
            for w in sorted(workers):
                if 0 <= w < len(self.queues):
                    try:
                        while True:
                            out.append(self.queues[w].get_nowait())
                    except queue.Empty:
                        pass
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(min(0.005, wait_s))


class _StoreAcks:
    """Acknowledgements as small JSON objects ``<prefix>/acks/<model>/worker-<i>.json`` (receivers
    that share no process tree with the sender: standalone collectors, other hosts). Receivers need
    write access to the store; the objects are read as untrusted JSON."""

    def __init__(self, model_key: str) -> None:
        self.model_key = model_key

    def key(self, worker: int) -> str:
        return f"acks/{self.model_key}/worker-{worker:05d}.json"

    def post(self, store: Store | None, msg: dict[str, Any]) -> None:
        store.put(self.key(msg["worker"]), json.dumps(msg).encode())

    def poll(self, store: Store | None, workers: set[int], wait_s: float) -> list[dict[str, Any]]:
        out = []
        for w in sorted(workers):
            try:
                raw = json.loads(store.get(self.key(w)).decode())
            except Exception:  # noqa: BLE001 - not written yet, or garbage: no acknowledgement
                continue
            if isinstance(raw, dict):
                out.append(raw)
        if not out:
            time.sleep(wait_s)
        return out


def _parse_ack(msg: Any) -> tuple[int, int | None, str | None] | None:
    """``(worker, version, error)`` from an acknowledgement, or ``None`` if it is malformed."""
    if not isinstance(msg, dict):
        return None
    w, v, err = msg.get("worker"), msg.get("version"), msg.get("error")
    if not isinstance(w, int) or isinstance(w, bool) or (v is not None and (not isinstance(v, int) or isinstance(v, bool))):
        return None
    return w, v, err if isinstance(err, str) else None


def _is_leaf_collector(obj: Any) -> bool:
    try:
        from torchrl.collectors._single import Collector
    except ImportError:  # pragma: no cover - other torchrl layouts
        return False
    return isinstance(obj, Collector)


def _int_tracker(context: Any) -> Any:
    """The context's ``PolicyVersion`` tracker if it counts integers (not UUIDs), else ``None``."""
    tracker = getattr(context, "policy_version_tracker", None)
    if tracker is None or not hasattr(tracker, "version"):
        return None
    if getattr(tracker, "version_type", int) not in (int, "int"):
        return None
    return tracker


# --- the scheme ------------------------------------------------------------------------------------


@register_weight_sync_backend("delta")
class DeltaWeightSyncScheme(WeightSyncScheme):
    """Lossless sparse weight sync for torchrl collectors through an object store.

    One scheme per model id, as in every torchrl scheme: pass it as
    ``weight_sync_schemes={"policy": scheme}`` to ``Collector``, ``MultiSyncCollector`` or
    ``MultiAsyncCollector`` (the trainer side), or as ``weight_recv_schemes={"policy": scheme}`` to
    a ``Collector`` that runs elsewhere and only follows the store. The trainer and the workers
    share nothing but the store (a folder, ``s3://``, ``hf://buckets/...``), so workers may live on
    other hosts or in other datacenters, start late, or restart: a worker that joins catches up
    from the newest anchor plus the deltas after it.

    Each ``update_policy_weights_()`` publishes one version: the elements whose bits changed in the
    inference dtype since the last published version (typically ~1% in bf16 at RL learning rates),
    or every ``anchor_every`` versions a full anchor. Workers apply it bit-exactly in place.

    Args:
        store: a store URI or path (``"runs/x/bucket"``, ``"s3://bucket/run"``, ...), opened with
            :func:`~torch_deltasync.open_store` and ``store_options`` in every process, or a
            :class:`~torch_deltasync.Store` object (it is pickled to the workers: a
            :class:`~torch_deltasync.LocalStore` does that; pass remote stores as URIs).
        prefix: sub-path of the store for this model (default: the model id, e.g. ``"policy"``).
            Sender and receivers must agree.
        anchor_every: anchor cadence in versions (shorthand for ``AnchorPolicy(every=...)``).
        anchor_policy: full :class:`~torch_deltasync.AnchorPolicy`; overrides ``anchor_every``.
        inference_dtype: dtype the workers' weights are bit-identical to, as the trainer's weights
            cast to it (``torch.bfloat16`` default; ``torch.float32`` for full precision).
        receiver_dtype: dtype of the workers' floating tensors. ``None`` keeps the policy's own
            dtype (it must hold every ``inference_dtype`` value exactly: fp32 holds bf16);
            ``torch.bfloat16`` makes workers serve in bf16 (the policy must accept bf16 weights).
        device: where a worker materialises a policy that arrived without data (default CPU;
            torchrl moves it to the collector's ``policy_device`` afterwards).
        codec: delta codec name (:func:`~torch_deltasync.codec_names`); ``None``: the library's
            default (``DeltaSender``'s).
        snapshot_device: where the sender keeps the last published state (``None``: next to each
            weight; ``"cpu"``: host memory). Costs one element of ``inference_dtype`` per weight.
        background: publish in the background: ``send`` returns once the changes are detected,
            uploads overlap the next training step, and a send that finds the previous upload
            still running is coalesced into the next one (no version for it).
        retention: delete old versions after each anchor (:class:`~torch_deltasync.RetentionPolicy`).
        sync: ``send`` returns only once the workers have applied the new version (or failed,
            died or timed out; see ``on_worker_failure``). Needs an acknowledgement channel: a
            MultiCollector's workers get a queue; other receivers write ``<prefix>/acks/...``
            objects when ``num_workers`` is set.
        num_workers: for senders without worker processes of their own (a standalone sender, a
            single ``Collector``): how many receivers (worker ids ``0..num_workers-1``) ``send``
            waits for. Receivers configured with it write their acknowledgements to the store.
        ack_timeout_s: seconds ``send`` waits for acknowledgements before giving up on a worker.
        on_worker_failure: what ``send`` does when a worker died, reported an error, or timed out:
            ``"raise"`` (:class:`~torch_deltasync.WorkerError` /
            :class:`~torch_deltasync.SyncTimeoutError`) or ``"skip"`` (log a warning, stop waiting
            for that worker until it acknowledges again, carry on with the others).
        poll_interval_s: how often receivers look for a new version (seconds). Each poll reads
            ``LATEST`` and checks one manifest: raise it for remote stores (e.g. 1-5 s on S3).
        connect_timeout_s: how long a receiver's ``connect`` waits for the first version.
        background_receive: receivers follow the store on a daemon thread; with ``False`` call
            :meth:`receive` yourself (e.g. between rollouts).
        version_key: root key of the collected data that each policy call overwrites with the
            version whose weights computed the action (``None``: leave torchrl's stamps alone).
        max_workers: parallel downloads per receiver.
        metrics_path: append publish/update stats as JSON lines (``{worker}`` is replaced by the
            worker index, ``sender`` on the trainer).
        store_options: options for :func:`~torch_deltasync.open_store` (endpoint, credentials, ...).
        strategy: torchrl ``WeightStrategy`` name, used only by :attr:`weights`.

    Raises:
        ValueError: an invalid option.

    Example:
        >>> scheme = DeltaWeightSyncScheme("runs/x/bucket", inference_dtype=torch.bfloat16,
        ...                                receiver_dtype=torch.bfloat16, anchor_every=50)
        >>> collector = MultiAsyncCollector([make_env] * 4, policy, frames_per_batch=1000,
        ...                                 total_frames=-1, track_policy_version=True,
        ...                                 weight_sync_schemes={"policy": scheme})
        >>> for data in collector:
        ...     train(data)
        ...     collector.update_policy_weights_()   # publishes version v, workers apply it
        ...     sampler.consumer_version = scheme.version
    """

    def __init__(
        self,
        store: str | Store | Any,
        *,
        prefix: str | None = None,
        anchor_every: int | None = 10,
        anchor_policy: AnchorPolicy | None = None,
        inference_dtype: torch.dtype | str = torch.bfloat16,
        receiver_dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        codec: str | None = None,
        snapshot_device: torch.device | str | None = None,
        background: bool = False,
        retention: RetentionPolicy | None = None,
        sync: bool = True,
        num_workers: int | None = None,
        ack_timeout_s: float = 120.0,
        on_worker_failure: OnWorkerFailure = "raise",
        poll_interval_s: float = 0.05,
        connect_timeout_s: float = 300.0,
        background_receive: bool = True,
        version_key: str | None = "policy_version",
        max_workers: int = 4,
        metrics_path: str | None = None,
        store_options: dict[str, Any] | None = None,
        strategy: Literal["tensordict", "state_dict"] = "tensordict",
    ) -> None:
        super().__init__(strategy)
        if on_worker_failure not in ("raise", "skip"):
            raise ValueError(f"on_worker_failure must be 'raise' or 'skip', got {on_worker_failure!r}")
        for name, value in (("ack_timeout_s", ack_timeout_s), ("poll_interval_s", poll_interval_s),
                            ("connect_timeout_s", connect_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 or None, got {num_workers}")
        if prefix is not None:
            check_key(prefix, allow_empty=True)
        self.store_spec = store
        self.store_options = dict(store_options or {})
        self.prefix = prefix
        self.anchor_policy = anchor_policy or AnchorPolicy(every=anchor_every)
        self.inference_dtype = as_dtype(inference_dtype)
        self.receiver_dtype = None if receiver_dtype is None else as_dtype(receiver_dtype)
        self.device = device
        self.codec = codec
        self.snapshot_device = snapshot_device
        self.background = background
        self.retention = retention
        self.sync = sync
        self.num_workers = num_workers
        self.ack_timeout_s = float(ack_timeout_s)
        self.on_worker_failure = on_worker_failure
        self.poll_interval_s = float(poll_interval_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.background_receive = background_receive
        self.version_key = version_key
        self.max_workers = max_workers
        self.metrics_path = metrics_path
        self._acks: _QueueAcks | _StoreAcks | None = None  # a channel, travels to the workers
        self._expected: list[int] = []
        self._reset_runtime()

    # --- state that never leaves the process ---------------------------------------------------------

    def _reset_runtime(self) -> None:
        self._store: Store | None = None
        self._sender: DeltaSender | None = None
        self._receiver: DeltaReceiver | None = None
        self._deferred: _DeferredTarget | None = None
        self._hooks: list[Any] = []
        self._gate = _CallGate()  # policy calls vs writes of the weights
        self._update_lock = threading.Lock()  # one update at a time (thread vs explicit receive())
        self._published: int | None = None  # sender: newest version this scheme published
        self._applied: int | None = None  # receiver: version the policy's weights hold
        self._acked: dict[int, int] = {}
        self._ack_errors: dict[int, tuple[int | None, str]] = {}
        self._lost: set[int] = set()
        self._failed: tuple[int, float] | None = None  # receiver: (version, retry time) after an error
        self._last_update: dict[str, Any] | None = None
        self._is_shutdown = False

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # Live clients, snapshots, threads, locks, hooks and staged weights stay in this process;
        # the receiving process opens its own store client (torchrl's rule for schemes,
        # weight_sync_schemes.py:1313). The acknowledgement channel travels on purpose.
        for key in ("_store", "_sender", "_receiver", "_deferred", "_hooks", "_gate", "_update_lock",
                    "_published", "_applied", "_acked", "_ack_errors", "_lost", "_failed",
                    "_last_update", "_is_shutdown", "_weights"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._reset_runtime()

    # --- configuration helpers ---------------------------------------------------------------------

    @property
    def run_prefix(self) -> str:
        """The store prefix of this model's run (``prefix``, or the model id made key-safe)."""
        return self.prefix if self.prefix is not None else self.model_key

    @property
    def model_key(self) -> str:
        """The model id as a store-key segment (``"env.transform[0].module"`` -> ``"env.transform_0_.module"``)."""
        return _KEY_UNSAFE.sub("_", self._model_id or "policy").strip("_") or "policy"

    @property
    def version(self) -> int | None:
        """Sender: the newest version published. Receiver: the version the policy holds."""
        return self._published if self.initialized_on_sender else self._applied

    def _open_store(self) -> Store:
        if self._store is None:
            if isinstance(self.store_spec, Store):
                if self.store_options:
                    raise ValueError("store_options cannot be applied to an already opened store")
                self._store = self.store_spec
            else:
                self._store = open_store(self.store_spec, **self.store_options)
        return self._store

    def _metrics_path(self, who: str) -> str | None:
        return self.metrics_path.replace("{worker}", who) if self.metrics_path else None

    # --- context and model (overridden to keep trackers and targets in step) ----------------------

    @property
    def context(self) -> Any | None:
        return WeightSyncScheme.context.fget(self)

    @context.setter
    def context(self, value: Any) -> None:
        WeightSyncScheme.context.fset(self, value)
        # A worker's inner collector is attached after connect() applied the first version
        # (collectors/_runner.py:181-191): bring its PolicyVersion tracker to that version.
        if value is not None and self._applied is not None:
            with self._gate.exclusive():
                self._set_tracker(self._applied)

    @property
    def model(self) -> Any | None:
        return WeightSyncScheme.model.fget(self)

    @model.setter
    def model(self, value: Any) -> None:
        old = self._model_ref() if self._model_ref is not None else None
        WeightSyncScheme.model.fset(self, value)
        if value is not None and old is not None and value is not old and self._receiver is not None:
            # The worker's collector moved the policy to its device (a copy) and repointed us
            # (collectors/_runner.py:183-191): follow the copy, check it holds our version.
            self._retarget(old, value)

    # --- sender --------------------------------------------------------------------------------------

    def _init_on_sender_impl(self, *, model_id: str = "policy", context: Any = None, model: Any = None,
                             weights: Any = None, ctx: Any = None, num_workers: int | None = None,
                             **kwargs: Any) -> None:
        """Local set-up on the trainer; no communication (MultiCollector pickles the scheme to its
        workers right after this call, ``collectors/_multi_base.py:1320-1326``)."""
        if kwargs:
            torchrl_logger.debug(f"DeltaWeightSyncScheme: ignoring init_on_sender arguments {sorted(kwargs)}")
        self.model_id = model_id
        if context is not None:
            self.context = context
        if model is not None:
            self.model = model
        if weights is not None:
            self._weights = weights
        # Acknowledgements only when send() waits for them (nobody would drain the channel otherwise).
        n = num_workers or self.num_workers
        if self.sync and ctx is not None and getattr(context, "num_workers", None):
            n = int(context.num_workers)
            self._acks = _QueueAcks(ctx, n)
        elif self.sync and n:
            self._acks = _StoreAcks(self.model_key)
        else:
            self._acks = None
        self._expected = list(range(n)) if n and self._acks is not None else []

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: int | None = None,
                                                    weights: Any = None) -> None:
        """Publish the first version (always an anchor) so that receivers can connect."""
        if weights is not None:
            self._weights = weights
        self._sender = DeltaSender(
            self._source(None), self._open_store(), prefix=self.run_prefix, anchor_policy=self.anchor_policy,
            inference_dtype=self.inference_dtype, snapshot_device=self.snapshot_device,
            background=self.background, retention=self.retention, metrics_path=self._metrics_path("sender"),
            **({} if self.codec is None else {"codec": self.codec}),
        )
        v = self._sender.publish(background=False)
        self._published = v
        self._align_sender_tracker(bump_follows=False)
        st = self._sender.last_stats
        torchrl_logger.info(
            f"DeltaWeightSyncScheme: published anchor version {v} of {self._model_id!r} to "
            f"{self._store.describe()}/{self.run_prefix} ({st.nbytes:,} bytes)"
        )

    def _source_model(self) -> nn.Module:
        model = self._model_ref() if self._model_ref is not None else None
        if model is None:
            ctx = self.context
            get_model = getattr(ctx, "get_model", None)
            model = get_model(self._model_id) if callable(get_model) else _resolve_model(ctx, self._model_id)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"DeltaWeightSyncScheme: model {self._model_id!r} is a {type(model).__name__}, not an nn.Module; "
                "pass weights to update_policy_weights_(...) or init_on_sender(model=...)"
            )
        return model

    def _source(self, weights: Any) -> Any:
        """What the sender reads: a callable returning the live tensors by name."""
        if weights is None:
            weights = getattr(self, "_weights", None)
        if weights is None:
            module = self._source_model()
            return lambda: named_tensors(module)
        if isinstance(weights, nn.Module):
            return lambda: named_tensors(weights)
        if isinstance(weights, str):
            module = _resolve_model(self.context, weights)
            return lambda: named_tensors(module)
        if isinstance(weights, (TensorDictBase, Mapping)):
            flat = _flat_tensors(weights)
            return lambda: flat
        raise TypeError(
            f"DeltaWeightSyncScheme cannot send weights of type {type(weights).__name__}; pass None, an "
            "nn.Module, a TensorDict or a state dict"
        )

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Publish the current weights as the next version; with ``sync``, wait for the workers.

        Args:
            weights: ``None`` (the collector's policy, or the model / weights given at init), an
                ``nn.Module``, a ``TensorDict`` (e.g. ``TensorDict.from_module(train_policy)``) or a
                state dict, with the same names as the workers' policy.
            worker_ids: workers to wait for (default: all). Every worker follows the newest
                version regardless: the store is shared.

        Raises:
            RuntimeError: not initialised or connected on the sender.
            PublishError: the store failed; nothing partial is visible.
            WorkerError: (``sync``, ``on_worker_failure="raise"``) a worker died or could not
                apply the version.
            SyncTimeoutError: (same) a worker did not confirm within ``ack_timeout_s``.
        """
        if not self.initialized_on_sender:
            raise RuntimeError("Must be initialized on sender before sending weights")
        if not self.synchronized_on_sender:
            raise RuntimeError("Must be synchronized on sender before sending weights")
        self._sender.model = self._source(weights)
        v = self._sender.publish()
        if v is None:
            torchrl_logger.debug("DeltaWeightSyncScheme: previous upload still running; coalesced into the next send")
            self._align_sender_tracker(bump_follows=True)
            return
        self._published = v
        self._align_sender_tracker(bump_follows=True)
        if self.sync and self._acks is not None:
            self._wait_for_ack(worker_ids)

    def _align_sender_tracker(self, *, bump_follows: bool) -> None:
        """Make the context's ``PolicyVersion`` tracker read the published version.

        A leaf ``Collector`` bumps its tracker by one right after ``send`` returns
        (``collectors/_single.py:1680-1706``), so it is set one below; a MultiCollector's parent
        tracker is only advisory (workers stamp the data) and is set to the version itself.
        """
        tracker = _int_tracker(self.context)
        if tracker is None or self._published is None:
            return
        leaf = bump_follows and _is_leaf_collector(self.context)
        tracker.version = self._published - 1 if leaf else self._published

    def _target_workers(self, worker_ids: Any) -> list[int]:
        if worker_ids is None:
            return list(self._expected)
        ids = [worker_ids] if not isinstance(worker_ids, (list, tuple)) else list(worker_ids)
        if not all(isinstance(w, int) for w in ids):  # torchrl also allows devices: wait for all
            return list(self._expected)
        return [w for w in ids if w in self._expected]

    def _worker_process(self, worker: int) -> Any:
        procs = getattr(self.context, "procs", None)
        if procs is not None and 0 <= worker < len(procs):
            return procs[worker]
        return None

    def _wait_for_ack(self, worker_ids: int | list[int] | None = None, timeout: float | None = None) -> None:
        """Block until the target workers acknowledged the newest published version.

        Never waits forever (the failure mode of NCCL-based weight sync, research/anchors.md #18):
        a dead worker process is noticed within ``poll_interval_s``, a silent one after ``timeout``
        (default ``ack_timeout_s``).
        """
        v = self._published
        if v is None or self._acks is None:
            return
        store = self._open_store().sub(self.run_prefix) if isinstance(self._acks, _StoreAcks) else None
        wait_s = self.ack_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait_s
        # Read what arrived since the last send first: a skipped worker that acknowledged since is
        # waited for again, even when every target worker had been skipped.
        self._read_acks(store, 0.0)
        pending = {w for w in self._target_workers(worker_ids) if w not in self._lost}
        failures: list[tuple[int, str, type]] = []
        while True:
            pending = {w for w in pending if self._acked.get(w, -1) < v}
            for w in list(pending):
                err = self._ack_errors.get(w)
                if err is not None and (err[0] is None or err[0] >= v):
                    del self._ack_errors[w]
                    failures.append((w, f"could not apply version {err[0]}: {err[1]}", WorkerError))
                    pending.discard(w)
                    continue
                proc = self._worker_process(w)
                if proc is not None and not proc.is_alive():
                    failures.append((w, f"(pid {proc.pid}) exited with code {proc.exitcode} before applying "
                                        f"version {v}", WorkerError))
                    pending.discard(w)
            if not pending or (failures and self.on_worker_failure == "raise"):
                break  # "raise" fails fast: no waiting for the other workers first
            if time.monotonic() >= deadline:
                for w in sorted(pending):
                    failures.append((w, f"did not confirm version {v} within {wait_s:g} s "
                                        f"(it holds version {self._acked.get(w)})", SyncTimeoutError))
                break
            self._read_acks(store, min(self.poll_interval_s, 0.05))
        if failures:
            self._handle_failures(failures)

    def _read_acks(self, store: Store | None, wait_s: float) -> None:
        """Read the acknowledgements of every expected worker (waiting up to ``wait_s`` seconds for
        one), not just the pending ones: nothing piles up unread, and a skipped worker that
        acknowledges a newer version than it had is back (waited for from then on)."""
        for msg in self._acks.poll(store, set(self._expected), wait_s):
            parsed = _parse_ack(msg)
            if parsed is None:
                continue
            w, ver, err = parsed
            if err is not None:
                self._ack_errors[w] = (ver, err)
            elif ver is not None:
                newer = ver > self._acked.get(w, -1)
                self._acked[w] = max(self._acked.get(w, -1), ver)
                if newer and w in self._lost:
                    torchrl_logger.info(f"DeltaWeightSyncScheme: worker {w} is back at version {ver}")
                    self._lost.discard(w)

    def _handle_failures(self, failures: list[tuple[int, str, type]]) -> None:
        text = "; ".join(f"worker {w} {msg}" for w, msg, _ in failures)
        if self.on_worker_failure == "raise":
            cls = WorkerError if any(c is WorkerError for _, _, c in failures) else SyncTimeoutError
            raise cls(f"DeltaWeightSyncScheme ({self._model_id!r}): {text}. Pass on_worker_failure='skip' to carry "
                      "on with the other workers")
        for w, _, _ in failures:
            self._lost.add(w)
        torchrl_logger.warning(f"DeltaWeightSyncScheme ({self._model_id!r}): {text}; carrying on without "
                               f"worker(s) {sorted(w for w, _, _ in failures)} until they acknowledge again")

    def worker_versions(self) -> dict[int, int]:
        """Sender: the newest version each worker acknowledged (workers never heard from are absent)."""
        return dict(self._acked)

    @property
    def last_publish(self):
        """Sender: :class:`~torch_deltasync.PublishStats` of the newest publish (``None`` before)."""
        return None if self._sender is None else self._sender.last_stats

    # --- receiver ------------------------------------------------------------------------------------

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
        _materialize(model, device=self.device or "cpu", dtype=self.receiver_dtype)
        store = self._open_store()
        self._deferred = _DeferredTarget(ModuleTarget(named_tensors(model)))
        self._receiver = DeltaReceiver(self._deferred, store, prefix=self.run_prefix, max_workers=self.max_workers,
                                       metrics_path=self._metrics_path(str(self._worker_idx)))
        if self._acks is None and self.sync and self.num_workers:
            self._acks = _StoreAcks(self.model_key)
        try:
            self._receiver.wait_for(None, timeout_s=self.connect_timeout_s, poll_s=self.poll_interval_s)
        except TimeoutError:
            raise SyncTimeoutError(
                f"DeltaWeightSyncScheme worker {self._worker_idx}: no version of {self._model_id!r} appeared in "
                f"{store.describe()}/{self.run_prefix} within {self.connect_timeout_s:.0f} s; is the sender "
                "connected, and do both sides use the same store and prefix?"
            ) from None
        self._update_and_apply()
        self._install_hooks(model)
        torchrl_logger.debug(
            f"DeltaWeightSyncScheme worker {self._worker_idx}: holds version {self._applied} of {self._model_id!r}"
        )
        if self.background_receive:
            self._start_background_receiver()

    def _install_hooks(self, model: nn.Module) -> None:
        """Hooks that bracket every policy call: keep writes out of the call (:class:`_CallGate`), and
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
        tracker = _int_tracker(self.context)
        if tracker is not None:
            tracker.version = int(version)

    def _retarget(self, old: nn.Module, new: nn.Module) -> None:
        with self._update_lock, self._gate.exclusive():
            _materialize(new, device=self.device or "cpu", dtype=self.receiver_dtype)
            inner = ModuleTarget(named_tensors(new))
            r = self._receiver
            if r.version is not None:
                m = r.manifest(r.version)
                inner.check({t.name: t.shape for t in m.tensors}, dict(m.aliases), m.inference_dtype)
            self._deferred.inner = inner
            if self._hooks:
                self._install_hooks(new)
            if r.version is not None:
                try:
                    r.verify()
                except DeltaSyncError as e:
                    torchrl_logger.warning(f"DeltaWeightSyncScheme worker {self._worker_idx}: the relocated policy "
                                           f"does not hold version {r.version} ({e}); rebuilding from an anchor")
                    r.version = None
        if r.version is None:
            self._update_and_apply()

    def _update_and_apply(self) -> int | None:
        """Bring the policy to the newest version. Returns the version applied, or ``None`` when
        the policy already held the newest one. The expensive part runs outside the policy lock."""
        with self._update_lock:
            r = self._receiver
            t0 = time.perf_counter()
            try:
                v = r.update()
            finally:
                ops = self._deferred.take()  # nothing is recorded unless the update succeeded
            if not ops and v == self._applied:
                return None
            t1 = time.perf_counter()
            with self._gate.exclusive():  # waits for the policy call in progress, if any
                try:
                    n = self._deferred.replay(ops)
                except BaseException:
                    r.version = None  # state unknown: the next update rebuilds from an anchor
                    raise
                self._applied = v
                self._set_tracker(v)
            t2 = time.perf_counter()
            stats: UpdateStats | None = r.last_stats
            self._last_update = {"version": v, "path": stats.path if stats else None,
                                 "nbytes": stats.nbytes if stats else 0, "written": n,
                                 "update_ms": (t1 - t0) * 1e3, "apply_ms": (t2 - t1) * 1e3}
            self._failed = None
        self._post_ack(v, None)
        return v

    def _post_ack(self, version: int | None, error: str | None) -> None:
        if self._acks is None:
            return
        msg = {"worker": self._worker_idx, "version": version, "error": error, "time": time.time()}
        try:
            self._acks.post(self._receiver.store if isinstance(self._acks, _StoreAcks) else None, msg)
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
        deadline = None if timeout is None else time.monotonic() + timeout
        newest = None
        while True:
            newest = self._receiver.newest_version()
            if newest is not None and newest != self._receiver.version:
                break
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if self._stop_event is not None and self._stop_event.is_set():
                return None
            time.sleep(self.poll_interval_s if deadline is None else
                       max(0.0, min(self.poll_interval_s, deadline - time.monotonic())))
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
        back-off, not in a tight loop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        warned = 0.0
        while not self._stop_event.is_set():
            try:
                newest = self._receiver.newest_version()
            except Exception as e:  # noqa: BLE001 - a flaky store: keep polling
                newest = None
                if time.monotonic() - warned > 60:
                    torchrl_logger.warning(f"DeltaWeightSyncScheme worker {self._worker_idx}: cannot poll the store: {e}")
                    warned = time.monotonic()
            if newest is not None and newest != self._receiver.version:
                failed = self._failed
                if failed is None or newest != failed[0] or time.monotonic() >= failed[1]:
                    return "receive"
            if deadline is not None and time.monotonic() >= deadline:
                return None
            self._stop_event.wait(self.poll_interval_s)
        return None

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

    # --- common --------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the receiver thread, remove the hooks, flush a background publish. Idempotent;
        torchrl also calls it from ``__del__`` on every copy, where there is nothing to do."""
        if getattr(self, "_is_shutdown", True):
            return
        self._is_shutdown = True
        super().shutdown()
        self._remove_hooks()
        sender, self._sender = self._sender, None
        receiver, self._receiver = self._receiver, None
        if sender is not None:
            try:
                sender.close()
            except Exception as e:  # noqa: BLE001 - shutting down: report, do not raise from __del__
                torchrl_logger.warning(f"DeltaWeightSyncScheme: last background publish failed: {e}")
        if receiver is not None:
            receiver.close()


# --- torchrl's LLM / GRPO stack -------------------------------------------------------------------


def _resolve(result: Any) -> Any:
    """Wait for one ``collective_rpc`` result: a Ray future, a ``concurrent.futures.Future``, an
    awaitable, or already a value."""
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    if type(result).__name__ == "ObjectRef":  # Ray, imported only when one is seen
        import ray

        return ray.get(result)
    if callable(getattr(result, "result", None)) and callable(getattr(result, "done", None)):
        return result.result()
    return result


async def _await(x: Any) -> Any:
    return await x


class _ReplicatedEngine:
    """``vllm.LLM``'s weight-transfer surface (what :func:`torch_deltasync.integrations.vllm.update_llm`
    drives) over an engine whose ``collective_rpc`` returns one future per replica: torchrl's
    ``AsyncVLLM`` (Ray actors, one per replica, ``modules/llm/backends/vllm/vllm_async.py``) or
    anything shaped like it.

    Each call is vLLM's own worker method of the same name (``vllm/v1/worker/gpu_worker.py``), run by
    every worker of every replica through its ``deltasync`` backend. There is no engine-wide pause:
    vLLM runs ``collective_rpc`` between engine steps, and torchrl's own storage-based path
    (``VLLMDoubleBufferWeightReceiver``) does not pause either. The weight version is not set on
    the replicas (no worker method does that).
    """

    def __init__(self, engine: Any, timeout: float | None) -> None:
        self.engine, self.timeout = engine, timeout

    def _all(self, method: str, kwargs: dict | None = None) -> list[Any]:
        """``method`` on every worker of every replica; waits for every replica, then raises the
        first error (so no replica is left in the middle of a call)."""
        call: dict[str, Any] = {"args": (), "kwargs": dict(kwargs or {})}
        if self.timeout is not None:
            call["timeout"] = self.timeout
        result = self.engine.collective_rpc(method, **call)
        items = list(result) if isinstance(result, (list, tuple)) else [result]
        out, errors = [], []
        for r in items:
            try:
                out.append(_resolve(r))
            except Exception as e:  # noqa: BLE001 (raised below, after every replica answered)
                errors.append(e)
        if errors:
            raise errors[0]
        return out

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        try:
            self._all("init_weight_transfer_engine", {"init_info": request["init_info"]})
        except Exception as e:
            if "Invalid init_info for" in str(e) and "DeltaSync" not in str(e):
                raise DeltaSyncError(
                    f"the engine's workers do not run the deltasync weight-transfer backend ({e}): launch them "
                    "with weight_transfer_config={'backend': 'deltasync'}; torchrl 0.14's AsyncVLLM actor sets "
                    "'nccl' itself (docs/torchrl.md)") from e
            raise

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, request: dict[str, Any]) -> None:
        self._all("update_weights", {"update_info": request["update_info"]})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool | None:
        # Prefix caches are keyed by prompt content, not by weights: entries computed with the old
        # weights would be reused. Retried once, as torchrl's double-buffer receiver does.
        reset = getattr(self.engine, "reset_prefix_cache", None)
        if not callable(reset):
            return None
        ok = _resolve(reset())
        if ok is False:
            ok = _resolve(reset())
        if ok is False:
            torchrl_logger.warning("DeltaVLLMWeightSender: reset_prefix_cache could not clear the prefix cache")
        return ok


def _is_offline_llm(engine: Any) -> bool:
    """A ``vllm.LLM`` (or its shape): one engine with vLLM's weight-transfer methods."""
    return all(callable(getattr(engine, m, None)) for m in ("init_weight_transfer_engine", "start_weight_update",
                                                            "update_weights", "finish_weight_update")) and \
        hasattr(engine, "llm_engine")


class DeltaVLLMWeightSender:
    """Weight sender for torchrl's LLM stack: publish a version, have every vLLM worker commit it.

    Duck-typed like torchrl's ``VLLMWeightSender`` / ``VLLMDoubleBufferWeightSender``
    (``weight_update/llm/``): ``GRPOTrainer(weight_sync_sender=sender)`` and
    ``UpdateWeights(sender=sender)`` call :meth:`update_weights` after optimizer steps. The vLLM
    engine must run the ``deltasync`` weight-transfer backend
    (``weight_transfer_config={"backend": "deltasync"}``, :mod:`torch_deltasync.integrations.vllm_transfer`).

    Per :meth:`update_weights`:

    1. publish the trainer's weights (``state_dict`` names = HF names, cast to ``inference_dtype``)
       as version ``v``;
    2. commit ``v`` on the engine with :func:`torch_deltasync.integrations.vllm.update_llm`
       (``start_weight_update`` → ``update_weights({"version": v})`` → ``finish_weight_update(str(v))``
       → prefix-cache reset; the first call attaches the workers with ``init_weight_transfer_engine``).
       Every TP worker of every replica stages each version in the background and verifies it
       against the manifest's checksums before anything is written; a ``vllm.LLM`` also waits until
       its workers have staged ``v`` (readiness files) before the commit. torchrl's ``AsyncVLLM``
       (one Ray future per replica) is driven through the same worker methods with
       ``collective_rpc`` (its replicas share worker ranks, so they do not keep readiness files);
    3. set every registered collector's policy version to ``v``.

    Only small JSON-able control messages go to the engine; the weights travel through the store,
    so trainer and engines need no NCCL group and no rendezvous (torchrl's NCCL path deadlocks when
    ranks join in the wrong order, pytorch/rl #3574).

    Args:
        store: where versions go (URI or :class:`~torch_deltasync.Store`).
        engine: the vLLM engine (``vllm.LLM``, torchrl's ``AsyncVLLM``, or anything with
            ``collective_rpc(method, timeout=, args=, kwargs=)`` returning one result per replica);
            can be given later with :meth:`register_engine` or ``init_all_workers_group(...,
            vllm_engine=engine)``.
        prefix: the run's sub-path in the store.
        worker_store: the store URI as the vLLM workers must open it (default: ``store`` if it is
            a string, else its ``describe()``).
        init_info: extra fields of the backend's ``init_info`` (``assume_version``: the engine
            loaded that version's checkpoint, so the first update is a delta; ``in_place``,
            ``max_workers``, ``metrics_path``, ...; see ``DeltaSyncInitInfo``).
        rpc_timeout_s: timeout for each ``collective_rpc`` of an ``AsyncVLLM`` (seconds; ``None``:
            the engine's).
        anchor_every, anchor_policy, inference_dtype, codec, snapshot_device, background, retention,
            metrics_path: as for :class:`~torch_deltasync.DeltaSender` (``codec=None``: its default).

    Example:
        >>> sender = DeltaVLLMWeightSender("s3://bucket/grpo", engine, prefix="run1")
        >>> sender.register_model(policy_training.model)      # the HF model: names match vLLM's
        >>> sender.register_collector(collector)
        >>> trainer = GRPOTrainer(..., weight_sync_sender=sender, weight_update_frequency=1)
    """

    def __init__(
        self,
        store: str | Store,
        engine: Any = None,
        *,
        prefix: str = "",
        worker_store: str | None = None,
        init_info: dict[str, Any] | None = None,
        rpc_timeout_s: float | None = None,
        anchor_every: int | None = 10,
        anchor_policy: AnchorPolicy | None = None,
        inference_dtype: torch.dtype | str = torch.bfloat16,
        codec: str | None = None,
        snapshot_device: torch.device | str | None = None,
        background: bool = False,
        retention: RetentionPolicy | None = None,
        metrics_path: str | None = None,
    ) -> None:
        self.store = open_store(store)
        self.prefix = prefix
        self.worker_store = worker_store or (store if isinstance(store, str) else self.store.describe())
        self.init_info = dict(init_info or {})
        self.rpc_timeout_s = rpc_timeout_s
        self._sender_kwargs = dict(anchor_every=anchor_every, anchor_policy=anchor_policy,
                                   inference_dtype=inference_dtype, snapshot_device=snapshot_device,
                                   background=background, retention=retention, metrics_path=metrics_path,
                                   **({} if codec is None else {"codec": codec}))
        self._engine = None
        self._llm: Any = None  # what update_llm drives: the engine, or _ReplicatedEngine over it
        self._model_ref: weakref.ReferenceType | None = None
        self._sender: DeltaSender | None = None
        self._attached = False
        self._collectors: list[Any] = []
        self.version: int | None = None
        self.last_update = None  # EngineUpdate of the newest update
        if engine is not None:
            self.register_engine(engine)

    def register_model(self, model: Any) -> None:
        """The model whose weights are published: an HF ``nn.Module`` (its names are the ones
        vLLM's ``load_weights`` expects), or a torchrl ``TransformersWrapper`` (its ``.model``)."""
        if not isinstance(model, nn.Module) and isinstance(getattr(model, "model", None), nn.Module):
            model = model.model
        if not isinstance(model, nn.Module):
            raise TypeError(f"register_model expects an nn.Module, got {type(model).__name__}")
        self._model_ref = weakref.ref(model)

    def register_engine(self, engine: Any) -> None:
        """The vLLM engine the workers belong to (replaces any previous one; workers re-attach)."""
        self._engine = engine
        self._llm = engine if _is_offline_llm(engine) else _ReplicatedEngine(engine, self.rpc_timeout_s)
        self._attached = False

    def init_all_workers_group(self, model_metadata: Any = None, vllm_engine: Any = None) -> None:
        """Compatibility with torchrl's ``VLLMWeightSender`` wiring: there is no collective group
        to build (weights go through the store); only ``vllm_engine`` is used."""
        if vllm_engine is not None:
            self.register_engine(vllm_engine)

    def register_collector(self, collector: Any) -> None:
        """A collector whose policy version follows the published version after every update."""
        self._collectors.append(collector)

    def update_weights(self, weights: Any = None) -> int | None:
        """Publish the weights as the next version and commit it on every worker of the engine.

        Args:
            weights: ``None`` (the registered model), an ``nn.Module``, a ``TensorDict`` or a state
                dict with HF names.

        Returns:
            The version every worker now holds (``None`` when ``background`` coalesced this call).

        Raises:
            RuntimeError: no model registered and no ``weights`` given.
            PublishError: the store failed.
            DeltaSyncError (``VersionNotFoundError``, ``CorruptObjectError``, ...): a worker could
                not commit the version; it keeps serving the one it had, and neither
                :attr:`version` nor the collectors' versions move.
        """
        # Modules are read through state_dict (HF checkpoint names, persistent tensors only): the
        # names vLLM's load_weights and the backend expect.
        if weights is None:
            source: Any = self._model_ref() if self._model_ref is not None else None
            if source is None:
                raise RuntimeError("no model: call register_model(model) or pass weights")
        elif isinstance(weights, nn.Module):
            source = weights
        else:
            source = _flat_tensors(weights)
        if self._sender is None:
            self._sender = DeltaSender(source, self.store, prefix=self.prefix, **self._sender_kwargs)
        else:
            self._sender.model = source
        v = self._sender.publish()
        if v is None:
            return None
        if self._sender.background:
            self._sender.flush()  # the workers read it right away
        if self._llm is not None:
            self.last_update = self._update_engine(v)
        self.version = v
        for c in self._collectors:
            tracker = _int_tracker(c)
            try:
                if tracker is not None:
                    tracker.version = v
                else:
                    c.increment_version()
            except Exception as e:  # noqa: BLE001 - as torchrl's senders: a collector must not stop training
                torchrl_logger.warning(f"DeltaVLLMWeightSender: cannot set the version of {type(c).__name__}: {e}")
        return v

    def _update_engine(self, version: int):
        from .vllm import attach_llm, update_llm

        if not self._attached:
            # Replicas of a torchrl AsyncVLLM share worker ranks: their readiness files would collide.
            status = None if self._llm is self._engine else False
            attach_llm(self._llm, str(self.worker_store), self.prefix, status_dir=status, **self.init_info)
            self._attached = True
        return update_llm(self._llm, version)

    def shutdown(self) -> None:
        """Flush a background publish and forget engine and collectors. Idempotent."""
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()
        self._collectors.clear()
        self._engine = self._llm = None
