"""The ``"delta"`` weight-sync scheme for torchrl collectors: configuration, pickling and the
sending half (the receiving half is :mod:`._scheme_receiver`); the architecture is in the package
docstring (:mod:`torch_deltasync.integrations.torchrl`).
"""

from __future__ import annotations

import numbers
import os
import re
import threading
from collections.abc import Mapping
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from torch import nn
from torchrl._utils import logger as torchrl_logger
from torchrl.weight_update.utils import _resolve_model
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme, register_weight_sync_backend

from ..._dtypes import as_dtype
from ..._metrics import check_metrics_path
from ..._units import check_seconds
from ...acks import AckBook, StoreAcks
from ...receiver import DeltaReceiver, ReceiverConfig
from ...sender import AnchorPolicy, DeltaSender, SenderConfig
from ...store import Store, check_prefix, open_store
from ...targets._module import holds_exactly
from .._sender_options import receiver_config as _receiver_config
from .._sender_options import sender_config as _sender_config
from .._sender_options import split_options
from ._acks import OnWorkerFailure, QueueAcks, scheme_ack_book, target_workers
from ._collectors import int_tracker, is_leaf_collector
from ...gate import CallGate
from ._scheme_receiver import ReceiverSide
from ._tensors import flat_tensors, named_tensors

_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9._=+@,-]+")

#: The workers' receiver options unless the scheme is given others: 4 parallel downloads (a
#: standalone DeltaReceiver takes 8), as the scheme had before ReceiverConfig existed. A collector
#: usually runs several workers per host, each with a receiver of its own.
_SCHEME_RECEIVER_CONFIG = ReceiverConfig(max_workers=4)
#: Config fields the scheme declares itself: its metrics_path is a template for both sides.
_OWN_OPTIONS = frozenset({"metrics_path"})


_OWNER = "DeltaWeightSyncScheme"


def _check_own_options(*, sync: Any, num_workers: Any, ack_timeout_s: Any, poll_interval_s: Any,
                       connect_timeout_s: Any, background_receive: Any, version_key: Any, metrics_path: Any,
                       store_options: Any, strict: Any) -> None:
    """Refuse the scheme's own options of the wrong type (``TypeError``) or out of range
    (``ValueError``) when it is built, not at connect or send time in another process."""
    for name, value, meaning in (
        ("sync", sync, "True: send waits for the workers' acknowledgements"),
        ("background_receive", background_receive, "True: receivers follow the store on a daemon thread"),
        ("strict", strict, "False: the workers leave their floating tensors that the trainer does not publish alone"),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{_OWNER}: {name} must be a bool ({meaning}), got {type(value).__name__} {value!r}")
    if num_workers is not None:
        if type(num_workers) is not int:
            raise TypeError(f"{_OWNER}: num_workers must be an int >= 1 (the number of receivers send waits for) "
                            f"or None, got {type(num_workers).__name__} {num_workers!r}")
        if num_workers < 1:
            raise ValueError(f"{_OWNER}: num_workers must be >= 1 or None, got {num_workers}")
    # send's wait never waits forever (AckBook.wait): ack_timeout_s is finite, as the poll interval
    check_seconds(ack_timeout_s, "ack_timeout_s", _OWNER, positive=True)
    check_seconds(poll_interval_s, "poll_interval_s", _OWNER, positive=True)
    if not isinstance(connect_timeout_s, numbers.Real) or isinstance(connect_timeout_s, bool):
        raise TypeError(f"{_OWNER}: connect_timeout_s must be a number of seconds > 0, got "
                        f"{type(connect_timeout_s).__name__} {connect_timeout_s!r}")
    if not connect_timeout_s > 0:
        raise ValueError(f"{_OWNER}: connect_timeout_s must be > 0 seconds, got {connect_timeout_s}")
    if version_key is not None and not isinstance(version_key, str):
        raise TypeError(f"{_OWNER}: version_key must be a str (the root key of the collected data stamped with "
                        f"the policy version) or None, got {type(version_key).__name__} {version_key!r}")
    if version_key == "":
        raise ValueError(f"{_OWNER}: version_key must be a non-empty str or None (None: leave torchrl's stamps "
                         "alone), got ''")
    if metrics_path is not None and not (isinstance(metrics_path, (str, os.PathLike))
                                         and isinstance(os.fspath(metrics_path), str)):
        raise TypeError(f"{_OWNER}: metrics_path must be a path (str or os.PathLike; '{{worker}}' is replaced by "
                        f"the worker index) or None, got {type(metrics_path).__name__} {metrics_path!r}")
    if metrics_path is not None and "{worker}" not in os.fspath(metrics_path):
        check_metrics_path(f"{_OWNER}: metrics_path", metrics_path)
    if store_options is not None:
        if not isinstance(store_options, Mapping):
            raise TypeError(f"{_OWNER}: store_options must be a dict of open_store options (endpoint, "
                            f"credentials, ...) or None, got {type(store_options).__name__} {store_options!r}")
        bad = sorted(repr(k) for k in store_options if not isinstance(k, str))
        if bad:
            raise TypeError(f"{_OWNER}: store_options keys must be open_store option names (str), got {bad}")


def _check_store_and_device(store: Any, store_options: Any, device: Any) -> None:
    """Refuse a store that is neither a URI, a path nor a :class:`Store`, ``store_options`` for a
    store already opened, and a device torch does not know, when the scheme is built."""
    if not isinstance(store, (str, os.PathLike, Store)):
        raise TypeError(f"{_OWNER}: store must be a store URI or path (str or os.PathLike) or a torch_deltasync "
                        f"Store, got {type(store).__name__} {store!r}")
    if isinstance(store, Store) and store_options:
        raise ValueError(f"{_OWNER}: store_options {sorted(store_options)} apply to a store URI, and the store given "
                         f"is already open ({store.describe()}); pass the URI, or open the store with those options")
    text = "" if isinstance(store, Store) else os.fsdecode(store)
    if not isinstance(store, Store) and not text.strip():
        raise ValueError(f"{_OWNER}: store {text!r} is empty; give a folder path or a URI such as s3://bucket/run")
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):/", text)  # (also s3:/b, a pathlib.Path("s3://b"))
    if scheme and scheme.group(1).lower() in ("s3", "hf"):  # opening them reads nothing: check now, not in a worker
        try:
            open_store(text, **(store_options or {}))
        except ValueError as e:
            raise ValueError(f"{_OWNER}: {e}") from None
    if device is not None:
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"{_OWNER}: device must be a torch.device, a device string such as 'cpu' or 'cuda:0', "
                            f"or None, got {type(device).__name__} {device!r}")
        try:
            torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"{_OWNER}: device {device!r} is no torch device ({e}); e.g. 'cpu' or 'cuda:0'") from None


def _receiver_dtype(receiver_dtype: Any, inference_dtype: Any) -> torch.dtype | None:
    """``receiver_dtype`` as a torch dtype, checked against the ``inference_dtype`` given to the
    scheme (``None``: not given here, the manifest's is checked at connect)."""
    if receiver_dtype is None:
        return None
    try:
        dtype = as_dtype(receiver_dtype)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{_OWNER}: receiver_dtype {receiver_dtype!r} is not a floating dtype the workers can "
                         f"hold the weights in ({e})") from None
    if inference_dtype is not None:
        inference = as_dtype(inference_dtype)
        if not holds_exactly(dtype, inference):
            also = " or torch.float32" if inference == torch.bfloat16 else ""
            raise ValueError(f"{_OWNER}: receiver_dtype {dtype} cannot hold every {inference} value (the "
                             f"inference_dtype) exactly; use {inference}{also}, or None to keep the policy's dtype")
    return dtype


@register_weight_sync_backend("delta")
class DeltaWeightSyncScheme(ReceiverSide, WeightSyncScheme):
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
    or every ``anchor_every`` versions a full anchor. Workers apply it bit-exactly in place. Only
    floating tensors are synced: a worker keeps its own integer buffers (BatchNorm's
    ``num_batches_tracked``).

    Args:
        store: a store URI or path (``"runs/x/bucket"``, ``"s3://bucket/run"``, ...), opened with
            :func:`~torch_deltasync.open_store` and ``store_options`` in every process, or a
            :class:`~torch_deltasync.Store` object (it is pickled to the workers: a
            :class:`~torch_deltasync.LocalStore` does that; pass remote stores as URIs).
        prefix: sub-path of the store for this model (default: the model id, e.g. ``"policy"``).
            Sender and receivers must agree.
        receiver_dtype: dtype of the workers' floating tensors. ``None`` keeps the policy's own
            dtype (it must hold every ``inference_dtype`` value exactly: fp32 holds bf16);
            ``torch.bfloat16`` makes workers serve in bf16 (the policy must accept bf16 weights).
        device: where a worker materialises a policy that arrived without data (default CPU;
            torchrl moves it to the collector's ``policy_device`` afterwards).
        sync: (bool) ``send`` returns only once the workers have applied the new version (or failed,
            died or timed out; see ``on_worker_failure``). Needs an acknowledgement channel: a
            MultiCollector's workers get a queue; other receivers write ``<prefix>/acks/...``
            objects when ``num_workers`` is set.
        num_workers: (int ``>= 1`` or ``None``) for senders without worker processes of their own
            (a standalone sender, a single ``Collector``): how many receivers (worker ids
            ``0..num_workers-1``) ``send`` waits for. Receivers configured with it write their
            acknowledgements to the store.
        ack_timeout_s: seconds ``send`` waits for acknowledgements before giving up on a worker
            (finite, ``> 0``).
        on_worker_failure: what ``send`` does when a worker died, reported an error, or timed out:
            ``"raise"`` (:class:`~torch_deltasync.errors.WorkerError` /
            :class:`~torch_deltasync.errors.SyncTimeoutError`) or ``"skip"`` (log a warning, stop waiting
            for that worker until it acknowledges again, carry on with the others).
        poll_interval_s: how often receivers look for a new version (seconds; finite, ``> 0``). Each
            poll reads ``LATEST`` and checks one manifest: raise it for remote stores (e.g. 1-5 s on S3).
        connect_timeout_s: how long a receiver's ``connect`` waits for the first version (seconds, ``> 0``).
        background_receive: (bool) receivers follow the store on a daemon thread; with ``False`` call
            :meth:`receive` yourself (e.g. between rollouts).
        version_key: (str) root key of the collected data that each policy call overwrites with the
            version whose weights computed the action (``None``: leave torchrl's stamps alone).
        metrics_path: (str or ``os.PathLike``) append publish/update stats as JSON lines
            (``{worker}`` is replaced by the worker index, ``sender`` on the trainer). Applies to both
            sides and overrides the configs' own ``metrics_path`` (where ``{worker}`` is replaced too).
        store_options: options for :func:`~torch_deltasync.open_store` (a dict: endpoint, credentials, ...).
        strategy: torchrl ``WeightStrategy`` name, used only by :attr:`weights`.
        strict: (bool) a worker's policy must hold exactly the floating tensors the trainer
            publishes (:class:`~torch_deltasync.ModuleTarget`'s ``strict``); ``False`` leaves the
            worker's own extra floating tensors alone (neither synced nor verified).
        sender_config: the trainer's :class:`~torch_deltasync.sender.SenderConfig` (default
            ``SenderConfig()``): ``anchor_every`` (anchor cadence in versions, default 10),
            ``anchor_policy`` (a full :class:`~torch_deltasync.AnchorPolicy`; overrides
            ``anchor_every``), ``inference_dtype`` (dtype the workers' weights are bit-identical
            to, as the trainer's weights cast to it; default ``torch.bfloat16``), ``codec``,
            ``snapshot_device``, ``background`` (``send`` returns once the changes are detected;
            a send that finds the previous upload still running is coalesced into the next one),
            ``retention`` (:class:`~torch_deltasync.RetentionPolicy`), ...
        receiver_config: the workers' :class:`~torch_deltasync.receiver.ReceiverConfig`. Default
            ``ReceiverConfig(max_workers=4)``: 4 parallel downloads per worker where a standalone
            ``DeltaReceiver`` takes 8, the scheme's default from before the config existed (a
            collector usually runs several workers, each with its own receiver, on one host).
        options: ``SenderConfig`` and ``ReceiverConfig`` fields as keywords (``anchor_every=50``,
            ``codec="raw"``, ``max_workers=8``, ...); they override the fields of
            ``sender_config`` / ``receiver_config``. The resulting configs travel to the workers
            with the scheme (pickled), so their values must pickle.

    Raises:
        ValueError: an invalid option (the scheme's, or one the configs refuse).
        TypeError: a keyword that is neither the scheme's nor a ``SenderConfig`` / ``ReceiverConfig``
            field (the message lists the valid names), or an option of the wrong type.

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
        receiver_dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        sync: bool = True,
        num_workers: int | None = None,
        ack_timeout_s: float = 120.0,
        on_worker_failure: OnWorkerFailure = "raise",
        poll_interval_s: float = 0.05,
        connect_timeout_s: float = 300.0,
        background_receive: bool = True,
        version_key: str | None = "policy_version",
        metrics_path: str | os.PathLike | None = None,
        store_options: dict[str, Any] | None = None,
        strategy: Literal["tensordict", "state_dict"] = "tensordict",
        sender_config: SenderConfig | None = None,
        receiver_config: ReceiverConfig | None = None,
        strict: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(strategy)
        if on_worker_failure not in ("raise", "skip"):
            raise ValueError(f"on_worker_failure must be 'raise' or 'skip', got {on_worker_failure!r}")
        _check_own_options(sync=sync, num_workers=num_workers, ack_timeout_s=ack_timeout_s,
                           poll_interval_s=poll_interval_s, connect_timeout_s=connect_timeout_s,
                           background_receive=background_receive, version_key=version_key,
                           metrics_path=metrics_path, store_options=store_options, strict=strict)
        if prefix is not None:
            check_prefix(prefix, "DeltaWeightSyncScheme(prefix=...)")
        _check_store_and_device(store, store_options, device)
        self.store_spec = store
        self.store_options = dict(store_options or {})
        self.prefix = prefix
        owner = "DeltaWeightSyncScheme"
        sender_options, receiver_options = split_options(options, owner, exclude=_OWN_OPTIONS)
        #: The SenderConfig fields given as keywords (the rest of the trainer's options are sender_config's).
        self.sender_options = sender_options
        self.sender_config = _sender_config(sender_options, owner, config=sender_config)
        self.receiver_config = _receiver_config(receiver_options, owner,
                                                config=receiver_config or _SCHEME_RECEIVER_CONFIG)
        self.receiver_dtype = _receiver_dtype(receiver_dtype, self.sender_config.inference_dtype
                                              if "inference_dtype" in sender_options or sender_config else None)
        self.device = device
        self.sync = sync
        self.num_workers = num_workers
        self.ack_timeout_s = float(ack_timeout_s)
        self.on_worker_failure = on_worker_failure
        self.poll_interval_s = float(poll_interval_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.background_receive = background_receive
        self.version_key = version_key
        self.strict = strict
        self.metrics_path = None if metrics_path is None else os.fspath(metrics_path)
        self._acks: QueueAcks | StoreAcks | None = None  # a channel, travels to the workers
        self._expected: list[int] = []
        self._reset_runtime()

    # --- state that never leaves the process ---------------------------------------------------------

    def _reset_runtime(self) -> None:
        self._store: Store | None = None
        self._sender: DeltaSender | None = None
        self._receiver: DeltaReceiver | None = None
        self._hooks: list[Any] = []
        self._gate = CallGate()  # policy calls vs writes of the weights
        self._update_lock = threading.Lock()  # one update at a time (thread vs explicit receive())
        self._published: int | None = None  # sender: newest version this scheme published
        self._applied: int | None = None  # receiver: version the policy's weights hold
        self._book: AckBook | None = None  # sender: the workers' acknowledgements
        self._failed: tuple[int, float] | None = None  # receiver: (version, retry time) after an error
        self._last_update: dict[str, Any] | None = None
        self._is_shutdown = False

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # Live clients, snapshots, threads, locks, hooks and staged weights stay in this process;
        # the receiving process opens its own store client (torchrl's rule for schemes,
        # weight_sync_schemes.py:1313). The acknowledgement channel travels on purpose.
        for key in ("_store", "_sender", "_receiver", "_hooks", "_gate", "_update_lock",
                    "_published", "_applied", "_book", "_failed",
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
    def anchor_policy(self) -> AnchorPolicy:
        """The sender's anchor policy (``anchor_policy``, else ``AnchorPolicy(every=anchor_every)``)."""
        return self.sender_config.effective_anchor_policy

    @property
    def max_workers(self) -> int:
        """Parallel downloads per receiver (``receiver_config.max_workers``)."""
        return self.receiver_config.max_workers

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

    def _metrics_path(self, who: str, configured: str | os.PathLike | None) -> str | None:
        """The metrics file of ``who`` (a worker index or ``"sender"``): the scheme's
        ``metrics_path``, else the config's ``configured`` one, with ``{worker}`` replaced."""
        path = self.metrics_path or (os.fspath(configured) if configured else None)
        return path.replace("{worker}", who) if path else None

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
        where = self.store_spec.describe() if isinstance(self.store_spec, Store) else os.fsdecode(self.store_spec)
        if ctx is not None and where.startswith("memory://"):  # the workers would wait for versions forever
            raise ValueError(f"{_OWNER}: store {where!r} lives in this process's memory, and the collector's workers "
                             "are other processes, which cannot read it; use a folder, s3://... or hf://buckets/...")
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
            self._acks = QueueAcks(ctx, n)
        elif self.sync and n:
            self._acks = StoreAcks(self.model_key)
        else:
            self._acks = None
        self._expected = list(range(n)) if n and self._acks is not None else []
        self._book = None if self._acks is None else scheme_ack_book(self._acks, self._expected, self._model_id,
                                                                     self.on_worker_failure)

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: int | None = None,
                                                    weights: Any = None) -> None:
        """Publish the first version (always an anchor) so that receivers can connect."""
        if weights is not None:
            self._weights = weights
        self._sender = DeltaSender(self._source(None), self._open_store(), prefix=self.run_prefix,
                                   config=self.sender_config,
                                   metrics_path=self._metrics_path("sender", self.sender_config.metrics_path))
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
            flat = flat_tensors(weights)
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
        tracker = int_tracker(self.context)
        if tracker is None or self._published is None:
            return
        leaf = bump_follows and is_leaf_collector(self.context)
        tracker.version = self._published - 1 if leaf else self._published

    def _worker_process(self, worker: int) -> Any:
        procs = getattr(self.context, "procs", None)
        if procs is not None and 0 <= worker < len(procs):
            return procs[worker]
        return None

    def _wait_for_ack(self, worker_ids: int | list[int] | None = None, timeout: float | None = None) -> None:
        """Block until the target workers acknowledged the newest published version
        (:meth:`torch_deltasync.acks.AckBook.wait`; at most ``timeout``, default ``ack_timeout_s``)."""
        v = self._published
        if v is None or self._book is None:
            return
        store = self._open_store().sub(self.run_prefix) if isinstance(self._acks, StoreAcks) else None
        self._book.wait(v, store, workers=target_workers(worker_ids),
                        timeout_s=self.ack_timeout_s if timeout is None else timeout,
                        poll_s=self.poll_interval_s, process_of=self._worker_process)

    def worker_versions(self) -> dict[int, int]:
        """Sender: the newest version each worker acknowledged (workers never heard from are absent)."""
        return {} if self._book is None else dict(self._book.acked)

    @property
    def last_publish(self):
        """Sender: :class:`~torch_deltasync.PublishStats` of the newest publish (``None`` before)."""
        return None if self._sender is None else self._sender.last_stats

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
