"""Trainer side of the ``deltasync`` backend of vLLM's weight-transfer API: publish a version, then
drive ``start_weight_update`` → ``update_weights`` → ``finish_weight_update`` on the engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

#: The backend name: ``weight_transfer_config={"backend": BACKEND}``.
BACKEND = "deltasync"


@dataclass
class DeltaSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``deltasync`` backend.

    Attributes:
        store, prefix: where the trainer publishes (workers follow the same run).
        anchor_every: publish an anchor every N versions (``DeltaSender``'s ``anchor_every``).
        worker_init: extra :class:`DeltaSyncInitInfo` fields sent to the workers (``store`` and
            ``prefix`` are filled in; give ``worker_store`` there if workers reach the store under
            another URI).
        rank: this trainer process's rank (rank 0 drives the engines).
    """

    backend: ClassVar[str] = BACKEND

    store: str = ""
    prefix: str = ""
    anchor_every: int | None = 50
    worker_init: dict[str, Any] | None = None


class DeltaSyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[DeltaSyncTrainerInitInfo]):
    """Trainer side of the ``deltasync`` backend: :meth:`send_weights` publishes a version (a delta
    of the changed elements, or an anchor) and drives ``start_weight_update`` →
    ``update_weights({"version": v})`` → ``finish_weight_update(str(v))`` on the engines.

    Code written against vLLM's stateful trainer API switches to deltas by backend name::

        engine = WeightTransferTrainerFactory.trainer_init(  # picks the engine by init_info.backend
            DeltaSyncTrainerInitInfo(store="s3://bucket/runs", prefix="grpo-7", rank=0),
            client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"), source=ModuleSource(model))
        engine.send_weights()

    ``source`` may be vLLM's ``ModuleSource`` (its module is tracked) or an ``nn.Module``; FSDP2
    modules are detected and published shard by shard (every rank calls :meth:`send_weights`).
    """

    init_info_cls = DeltaSyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True, sender: Any = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender = sender
        self.last_version: int | None = None

    @classmethod
    def trainer_init(cls, init_info: DeltaSyncTrainerInitInfo, *, client: Any, source: Any = None):
        """Build the :class:`~torch_deltasync.DeltaSender` over ``source``'s module and, on rank 0,
        initialise the workers' backend through ``client``.

        Raises:
            TypeError: ``source`` is neither a ``ModuleSource`` nor an ``nn.Module``.
            ValueError: no ``store`` in ``init_info``.
        """
        from ...sender import DeltaSender

        if not init_info.store:
            raise ValueError("DeltaSyncTrainerInitInfo needs store= (the URI or path workers follow)")
        module = getattr(source, "_module", source)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"source must be vLLM's ModuleSource or an nn.Module, got {type(source).__name__}")
        sender = DeltaSender(module, init_info.store, prefix=init_info.prefix, anchor_every=init_info.anchor_every)
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, sender=sender)
        if engine.is_sender:
            worker = {"store": init_info.store, "prefix": init_info.prefix, **(init_info.worker_init or {})}
            client.init_weight_transfer_engine(worker)
        return engine

    def send_weights(self) -> int:
        """Publish the current weights as a new version and commit it on every engine.

        Returns:
            The version published (and, on rank 0, committed).
        """
        v = self.sender.publish()
        if self.is_sender:
            self.client.start_weight_update()
            self.client.update_weights({"version": int(v)})
            self.client.finish_weight_update(weight_version=str(v))
        self.last_version = int(v)
        return int(v)

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
