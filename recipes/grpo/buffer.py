"""The versioned replay buffer: torchrl ``ReplayBuffer`` with a staleness gate and use-once sampling.

Every sample carries the ``policy_version`` of the weights that generated it. The trainer samples
with its own version ``v`` (the newest it published); a sample with ``v - policy_version >
max_staleness`` is never trained on: it is dropped and counted (``dropped_stale``). Each sample is
used at most once (torchrl ``ConsumingSampler``: consumed slots are rewritten first). Both come from
:class:`torch_deltasync.integrations.torchrl.StalenessGatedSampler`, the sampler
the rollout service uses too; this buffer reads the versions from its ``LazyTensorStorage`` and
breaks ties among equal versions at random (seeded). ``MCAdvantage`` (torchrl's GRPO transform)
turns each complete group of ``group_size`` completions of one prompt into group-normalised
advantages as the group is written.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.objectives.llm import MCAdvantage

from torch_deltasync.integrations.torchrl import StalenessGatedSampler

__all__ = ["VersionedReplayBuffer"]

VERSION_KEY = "policy_version"


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
        order: which fresh samples come first: ``"fifo"`` the oldest versions (ties in seeded
            random order), ``"random"`` uniform (:class:`StalenessGatedSampler`).
    """

    def __init__(self, capacity: int, *, max_staleness: int, group_size: int, seed: int = 0,
                 order: str = "fifo") -> None:
        self.sampler = StalenessGatedSampler(max_staleness, version_key=VERSION_KEY, order=order, ties="random")
        gen = torch.Generator().manual_seed(seed)
        self.rb = ReplayBuffer(
            storage=LazyTensorStorage(capacity),
            sampler=self.sampler,
            transform=MCAdvantage(grpo_size=group_size, prompt_key="group_id", trajectory_return="sum"),
            generator=gen,
        )
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
        missing = [k for k in (VERSION_KEY, "group_id", ("next", "reward"), ("next", "done")) if k not in batch.keys(True)]
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
        batch = self.rb.sample(batch_size)  # LazyTensorStorage indexing returns a copy
        lag = consumer_version - batch.get(VERSION_KEY).reshape(-1)
        assert int(lag.max()) <= self.sampler.max_staleness, "staleness gate let a stale sample through"
        batch.set("lag", lag)
        self.sampled += batch_size
        self.max_lag = max(self.max_lag, int(lag.max()))
        return batch

    def stats(self) -> dict[str, int]:
        return {"added": self.added, "sampled": self.sampled, "dropped_stale": self.dropped_stale,
                "overflow": self.overflow, "max_lag": self.max_lag}
