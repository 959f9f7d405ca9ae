"""The versioned replay buffer: torchrl ``ReplayBuffer`` with a staleness gate and use-once sampling.

Every sample carries the ``policy_version`` of the weights that generated it. The trainer samples
with its own version ``v`` (the newest it published); a sample with ``v - policy_version >
max_staleness`` is never trained on: it is dropped and counted (``dropped_stale``). Each sample is
used at most once (torchrl ``ConsumingSampler``: consumed slots are rewritten first), and
``MCAdvantage`` (torchrl's GRPO transform) turns each complete group of ``group_size`` completions
of one prompt into group-normalised advantages as the group is written.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import ConsumingSampler, LazyTensorStorage, ReplayBuffer
from torchrl.objectives.llm import MCAdvantage

__all__ = ["StalenessGatedSampler", "VersionedReplayBuffer"]

VERSION_KEY = "policy_version"


class StalenessGatedSampler(ConsumingSampler):
    """torchrl ``ConsumingSampler`` (each sample used once) that first drops stale samples.

    Args:
        max_staleness: samples with ``consumer_version - policy_version > max_staleness`` are
            consumed without being returned (counted in :attr:`dropped_stale`).
        order: ``"fifo"`` returns the oldest fresh samples first (ties in random order), so a
            sample is trained on before it goes stale whenever the trainer keeps up; ``"random"``
            is ``ConsumingSampler``'s uniform choice among fresh samples.

    Attributes:
        consumer_version: the trainer's version; set it before sampling.
        dropped_stale: samples dropped so far for staleness.
    """

    def __init__(self, max_staleness: int, *, order: str = "fifo") -> None:
        super().__init__(max_sample_count=1)
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if order not in ("fifo", "random"):
            raise ValueError(f"order must be 'fifo' or 'random', got {order!r}")
        self.max_staleness = int(max_staleness)
        self.order = order
        self.consumer_version = 0
        self.dropped_stale = 0

    def live_index(self, storage) -> torch.Tensor:
        """Storage indices of samples not used yet (int64 ``[k]``)."""
        self._ensure_state(storage)
        if self._live_mask is None:
            return torch.zeros(0, dtype=torch.long)
        return torch.nonzero(self._live_mask[: self._known_storage_len], as_tuple=False).flatten()

    def drop_stale(self, storage) -> int:
        """Consume every live sample older than the staleness bound; returns how many."""
        live = self.live_index(storage)
        if not live.numel():
            return 0
        versions = storage.get(live).get(VERSION_KEY).reshape(-1)
        stale = live[(self.consumer_version - versions) > self.max_staleness]
        if stale.numel():
            self._consume(stale)
            self.dropped_stale += int(stale.numel())
        return int(stale.numel())

    def _consume(self, index: torch.Tensor) -> None:
        # The bookkeeping ConsumingSampler.sample does for the indices it returns (with
        # max_sample_count == 1), so the replay buffer rewrites these slots first.
        self._sample_count[index] = self.max_sample_count
        self._live_mask[index] = False
        self._append_free_indices(index)

    def sample(self, storage, batch_size: int):
        self.drop_stale(storage)
        if self.order == "random":
            return super().sample(storage, batch_size)
        live = self.live_index(storage)
        if not live.numel():
            raise RuntimeError("Cannot sample from an empty storage.")
        live = live[torch.randperm(live.numel(), generator=self._rng)]  # random order among equals
        versions = storage.get(live).get(VERSION_KEY).reshape(-1)
        index = live[torch.sort(versions, stable=True).indices[:batch_size]]
        self._consume(index)
        self._update_remaining_batches(batch_size, storage)
        return index, {}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "max_staleness": self.max_staleness,
                "consumer_version": self.consumer_version, "dropped_stale": self.dropped_stale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.max_staleness = int(state_dict.pop("max_staleness"))
        self.consumer_version = int(state_dict.pop("consumer_version"))
        self.dropped_stale = int(state_dict.pop("dropped_stale"))
        super().load_state_dict(state_dict)


class VersionedReplayBuffer:
    """Rollout samples tagged with policy versions; staleness-bounded, use-once, group advantages.

    A sample is a row of a ``TensorDict`` with (``N`` rows, ``Lp`` prompt and ``T`` response tokens):
    ``prompt_ids`` / ``prompt_mask`` ``[N, Lp]`` int64, ``response_ids`` ``[N, T]`` int64,
    ``response_mask`` ``[N, T]`` bool, ``gen_logprobs`` ``[N, T]`` float32, ``policy_version``
    ``[N]`` int64, ``group_id`` ``[N]`` int64 and ``("next", "reward")`` / ``("next", "done")``
    ``[N, 1]``. :meth:`extend` adds ``advantage`` ``[N, 1]`` (float32) once a group is complete.

    Args:
        capacity: storage slots. When every slot holds an unused sample, the oldest slot is
            overwritten (counted in ``overflow``); size the producers' back-pressure below this.
        max_staleness: the staleness bound in versions.
        group_size: completions per prompt (``MCAdvantage(grpo_size=...)``).
        seed: seeds the sampler's choice among fresh samples.
        order: which fresh samples come first (:class:`StalenessGatedSampler`).
    """

    def __init__(self, capacity: int, *, max_staleness: int, group_size: int, seed: int = 0,
                 order: str = "fifo") -> None:
        self.sampler = StalenessGatedSampler(max_staleness, order=order)
        gen = torch.Generator().manual_seed(seed)
        self.rb = ReplayBuffer(
            storage=LazyTensorStorage(capacity),
            sampler=self.sampler,
            transform=MCAdvantage(grpo_size=group_size, prompt_key="group_id", trajectory_return="sum"),
            generator=gen,
        )
        self.capacity = capacity
        self.added = 0
        self.sampled = 0
        self.overflow = 0
        self.max_lag = 0

    @property
    def dropped_stale(self) -> int:
        return self.sampler.dropped_stale

    def num_fresh(self, consumer_version: int | None = None) -> int:
        """Unused samples within the staleness bound of ``consumer_version`` (default: the last one)."""
        if consumer_version is not None:
            self.sampler.consumer_version = int(consumer_version)
        if len(self.rb) == 0:
            return 0
        self.sampler.drop_stale(self.rb.storage)
        return int(self.sampler.live_index(self.rb.storage).numel())

    def extend(self, batch: TensorDictBase) -> int:
        """Add rollout samples; returns how many were written (complete groups only).

        Raises:
            KeyError: a required key is missing.
        """
        missing = [k for k in ("policy_version", "group_id", ("next", "reward"), ("next", "done")) if k not in batch.keys(True)]
        if missing:
            raise KeyError(f"rollout batch lacks {missing}")
        live_before = self.sampler.live_index(self.rb.storage).numel() if len(self.rb) else 0
        index = self.rb.extend(batch)
        written = int(index.shape[0])
        live_after = self.sampler.live_index(self.rb.storage).numel()
        self.overflow += live_before + written - live_after
        self.added += written
        return written

    def sample(self, batch_size: int, consumer_version: int) -> TensorDict | None:
        """``batch_size`` fresh samples, each used once, or ``None`` while too few are fresh.

        Stale samples are dropped first. The returned batch gets ``lag`` ``[N]`` (int64:
        ``consumer_version - policy_version``, always ``<= max_staleness``).
        """
        if self.num_fresh(consumer_version) < batch_size:
            return None
        batch = self.rb.sample(batch_size).clone()
        lag = consumer_version - batch.get(VERSION_KEY).reshape(-1)
        assert int(lag.max()) <= self.sampler.max_staleness, "staleness gate let a stale sample through"
        batch.set("lag", lag)
        self.sampled += batch_size
        self.max_lag = max(self.max_lag, int(lag.max()))
        return batch

    def stats(self) -> dict[str, int]:
        return {"added": self.added, "sampled": self.sampled, "dropped_stale": self.dropped_stale,
                "overflow": self.overflow, "max_lag": self.max_lag,
                "live": int(self.sampler.live_index(self.rb.storage).numel()) if len(self.rb) else 0}
