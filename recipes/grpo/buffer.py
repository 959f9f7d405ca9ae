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

__all__ = ["VersionedReplayBuffer", "advantage_transform", "group_advantages"]

VERSION_KEY = "policy_version"


def advantage_transform(group_size: int) -> MCAdvantage:
    """torchrl's GRPO advantage transform as both recipes use it: each complete group of
    ``group_size`` completions of one prompt (same ``group_id``) gets ``(R - mean) / std`` of its
    returns (``std`` unbiased, clamped at 1e-6; ``MCAdvantage(trajectory_return="sum")``)."""
    return MCAdvantage(grpo_size=group_size, prompt_key="group_id", trajectory_return="sum")


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group-normalised advantages of consecutive groups, computed by :func:`advantage_transform`
    (the transform :class:`VersionedReplayBuffer` applies as groups are written).

    Args:
        rewards: ``[N]`` float, ``N`` a multiple of ``group_size``; rows ``k * group_size ...
            (k + 1) * group_size - 1`` are the completions of prompt ``k``.
        group_size: completions per prompt (>= 2).

    Returns:
        ``[N]`` float32 advantages in the order of ``rewards``.

    Raises:
        ValueError: ``N`` is not a multiple of ``group_size``, or ``group_size < 2``.
    """
    n = rewards.shape[0]
    if group_size < 2 or n % group_size:
        raise ValueError(f"{n} rewards do not form whole groups of group_size {group_size} (>= 2)")
    group = torch.arange(n) // group_size
    td = TensorDict({"group_id": group, "next": TensorDict(reward=rewards.reshape(n, 1).float(),
                                                           done=torch.ones(n, 1, dtype=torch.bool), batch_size=[n])},
                    batch_size=[n])
    out = advantage_transform(group_size).inv(td)
    if not torch.equal(out.get("group_id"), group):  # the transform writes groups as they complete
        raise RuntimeError("torchrl's MCAdvantage reordered the rows; cannot map advantages back")
    return out.get("advantage").reshape(n).float()


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
            transform=advantage_transform(group_size),
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
