"""A weight sender for torchrl's LLM stack (``GRPOTrainer``, ``UpdateWeights``): publish a version
through the store, then commit it on every vLLM worker with the ``deltasync`` backend."""

from __future__ import annotations

import os
import weakref
from typing import Any

from torch import nn
from torchrl._utils import logger as torchrl_logger

from ..._units import check_seconds
from ...sender import DeltaSender, SenderConfig
from ...store import Store, open_store
from .._sender_options import sender_config as _sender_config
from ..vllm import as_llm, attach_llm, check_init_info, update_llm
from ._collectors import int_tracker
from ._tensors import flat_tensors


class DeltaVLLMWeightSender:
    """Weight sender for torchrl's LLM stack: publish a version, have every vLLM worker commit it.

    Duck-typed like torchrl's ``VLLMWeightSender`` / ``VLLMDoubleBufferWeightSender``
    (``weight_update/llm/``): ``GRPOTrainer(weight_sync_sender=sender)`` and
    ``UpdateWeights(sender=sender)`` call :meth:`update_weights` after optimizer steps. The vLLM
    engine must run the ``deltasync`` weight-transfer backend
    (``weight_transfer_config={"backend": "deltasync"}``, :mod:`torch_deltasync.integrations.vllm`).

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
        rpc_timeout_s: timeout for each ``collective_rpc`` of an ``AsyncVLLM`` (seconds, finite and
            ``> 0``; ``None``: the engine's).
        sender_config: the options of the :class:`~torch_deltasync.DeltaSender` built on the first
            update (:class:`~torch_deltasync.sender.SenderConfig`; default ``SenderConfig()``).
        sender_options: ``SenderConfig`` fields as keywords (``anchor_every``, ``anchor_policy``,
            ``inference_dtype``, ``codec``, ``snapshot_device``, ``background``, ``retention``,
            ``metrics_path``, ...); they override ``sender_config``'s.

    Raises:
        TypeError: a keyword that is neither this sender's nor a ``SenderConfig`` field (the
            message lists the valid names), or an option of the wrong type.
        ValueError: an option ``SenderConfig`` refuses (e.g. an unknown ``codec``), a bad
            ``init_info`` value, or an ``rpc_timeout_s`` that is not finite and ``> 0``.

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
        worker_store: str | os.PathLike | None = None,
        init_info: dict[str, Any] | None = None,
        rpc_timeout_s: float | None = None,
        sender_config: SenderConfig | None = None,
        **sender_options: Any,
    ) -> None:
        check_seconds(rpc_timeout_s, "rpc_timeout_s", "DeltaVLLMWeightSender", positive=True, none_ok=True,
                      none_means="to use the engine's own timeout")
        self.sender_options = dict(sender_options)
        self.sender_config = _sender_config(sender_options, "DeltaVLLMWeightSender", config=sender_config)
        self.store = open_store(store)
        self.prefix = prefix
        self.worker_store = os.fspath(worker_store) if worker_store else \
            (os.fspath(store) if isinstance(store, (str, os.PathLike)) else self.store.describe())
        given = sorted({"store", "prefix", "status_dir"} & set(init_info or {}))
        if given:
            raise TypeError(f"DeltaVLLMWeightSender: init_info {given} are set by the sender itself (its store, "
                            "worker_store and prefix arguments; readiness files per engine)")
        # checked when the sender is built, as attach_llm and the workers will check it
        self.init_info = check_init_info({"store": self.worker_store, "prefix": prefix, **(init_info or {})},
                                         "DeltaVLLMWeightSender(init_info=...)")
        del self.init_info["store"], self.init_info["prefix"]
        self.rpc_timeout_s = rpc_timeout_s
        self._engine = None
        self._llm: Any = None  # what update_llm drives: the engine, or a ReplicatedEngine over it
        self._readiness = True  # whether the engine's workers keep readiness files
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
        self._llm, self._readiness = as_llm(engine, self.rpc_timeout_s)
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
            source = flat_tensors(weights)
        if self._sender is None:
            self._sender = DeltaSender(source, self.store, prefix=self.prefix, config=self.sender_config)
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
            tracker = int_tracker(c)
            try:
                if tracker is not None:
                    tracker.version = v
                else:
                    c.increment_version()
            except Exception as e:  # noqa: BLE001 - as torchrl's senders: a collector must not stop training
                torchrl_logger.warning(f"DeltaVLLMWeightSender: cannot set the version of {type(c).__name__}: {e}")
        return v

    def _update_engine(self, version: int):
        if not self._attached:
            status = None if self._readiness else False  # replicas share worker ranks (as_llm)
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
