"""The rollout service's state: a torchrl replay buffer of episodes with exact accounting."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from ...errors import EpisodeError, ServiceClosedError
from ._config import RolloutServiceConfig
from ._episodes import is_int

#: Worker names ``/stats`` counts one by one; episodes of further names count as ``(others)``.
MAX_WORKERS_COUNTED = 1024


class BufferFull(Exception):
    """No room for a batch (``on_full="reject"``). ``retry_after_s`` says when to try again."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class AddResult:
    """What one accepted batch did.

    Attributes:
        accepted: episodes accepted (the whole batch).
        stored: of those, buffered for sampling.
        dropped_stale: of those, already stale on arrival (dropped and counted).
        evicted: buffered episodes evicted to make room (``on_full="evict"``).
        trainer_version: the service's trainer version when the batch arrived (``None``: not known yet).
    """

    accepted: int
    stored: int
    dropped_stale: int
    evicted: int
    trainer_version: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EpisodeBuffer:
    """The service's state: a torchrl ``ReplayBuffer`` of episodes with exact accounting.

    Storage is ``torchrl.data.ListStorage(capacity)`` holding one ``TensorDict`` per episode
    (``prompt`` int64 ``[P]``, ``completion`` int64 ``[T]``, ``logprobs`` float32 ``[T]``,
    ``reward`` / ``advantage`` float64 ``[]`` (JSON numbers, kept exactly), ``policy_version`` int64 ``[]``; ``group`` and
    ``worker`` as non-tensor data), ragged across episodes. Use-once, oldest-version-first sampling,
    stale drops and evictions are :class:`~torch_deltasync.integrations.torchrl.StalenessGatedSampler`
    (versions kept in a side tensor by slot, ties in arrival order). Thread-safe: every method holds
    one lock.

    Args:
        config: limits and policies (:class:`RolloutServiceConfig`).

    Example:
        >>> buf = EpisodeBuffer(RolloutServiceConfig(capacity=8, max_lag=1))
        >>> buf.add(validate_episodes({"episodes": [ep]}, buf.config))
        >>> buf.sample(1, trainer_version=0)          # [episode dict] or None
    """

    def __init__(self, config: RolloutServiceConfig) -> None:
        from torchrl.data import ListStorage, ReplayBuffer

        from ..torchrl import StalenessGatedSampler

        self.config = config
        cap = config.capacity
        # Versions by storage slot: a ListStorage of ragged episodes cannot be read column-wise, so
        # the sampler reads them here (written right after each ReplayBuffer.extend).
        self._versions = torch.zeros(cap, dtype=torch.int64)
        # Oldest version first, then arrival order; the sampler's consumer_version is the trainer's.
        self.sampler = StalenessGatedSampler(config.max_lag, versions=self._versions, order="fifo", ties="arrival")
        self.rb = ReplayBuffer(storage=ListStorage(cap), sampler=self.sampler, collate_fn=lambda x: x)
        self._lock = threading.Lock()
        self.closed = False
        self.started = time.time()
        self.counts: Counter[str] = Counter()  # accepted, sampled, dropped_stale_on_arrival, ...
        self.lag_sampled: Counter[int] = Counter()
        self.workers: Counter[str] = Counter()

    @property
    def trainer_version(self) -> int | None:
        """The trainer's version (``None`` until told): the sampler's ``consumer_version``."""
        return self.sampler.consumer_version

    @trainer_version.setter
    def trainer_version(self, version: int | None) -> None:
        self.sampler.consumer_version = version

    # --- internals (lock held) -------------------------------------------------------------------

    def _live(self) -> torch.Tensor:
        return self.sampler.live_index(self.rb.storage)

    def _dropped_stale(self) -> int:
        """Stale drops: on arrival (never stored) plus those the sampler consumed."""
        return self.counts["dropped_stale_on_arrival"] + self.sampler.dropped_stale

    @staticmethod
    def _to_td(ep: dict[str, Any]):
        from tensordict import TensorDict

        td = TensorDict({
            "prompt": torch.tensor(ep["prompt"], dtype=torch.int64),
            "completion": torch.tensor(ep["completion"], dtype=torch.int64),
            "logprobs": torch.tensor(ep["logprobs"], dtype=torch.float32),
            "reward": torch.tensor(float(ep["reward"]), dtype=torch.float64),
            "advantage": torch.tensor(float(ep.get("advantage", math.nan)), dtype=torch.float64),
            "policy_version": torch.tensor(ep["policy_version"], dtype=torch.int64),
        }, batch_size=[])
        td.set_non_tensor("group", ep.get("group"))
        td.set_non_tensor("worker", ep.get("worker"))
        return td

    @staticmethod
    def _from_td(td, lag: int) -> dict[str, Any]:
        adv = float(td["advantage"])
        out = {
            "prompt": td["prompt"].tolist(), "completion": td["completion"].tolist(),
            "logprobs": td["logprobs"].tolist(), "reward": float(td["reward"]),
            "policy_version": int(td["policy_version"]), "lag": lag,
        }
        if not math.isnan(adv):
            out["advantage"] = adv
        for k in ("group", "worker"):
            v = td.get_non_tensor(k)
            if v is not None:
                out[k] = v
        return out

    # --- API -------------------------------------------------------------------------------------

    def add(self, episodes: Sequence[dict[str, Any]]) -> AddResult:
        """Accept a validated batch (:func:`validate_episodes`), all or nothing.

        Raises:
            BufferFull: ``on_full="reject"`` and fewer than ``len(episodes)`` free slots after
                dropping stale episodes (counted in ``rejected_full``; nothing accepted).
            ServiceClosedError: the service was closed.
        """
        with self._lock:
            if self.closed:
                self.counts["rejected_closed"] += len(episodes)
                raise ServiceClosedError("the rollout service is closed (the trainer finished)")
            versions = torch.tensor([ep["policy_version"] for ep in episodes], dtype=torch.int64)
            stale = self.sampler.stale_mask(versions)
            fresh = [ep for ep, s in zip(episodes, stale.tolist()) if not s]
            evicted = 0
            cap = self.config.capacity
            live = self._live()
            if live.numel() + len(fresh) > cap:
                self.sampler.drop_stale(self.rb.storage)
                live = self._live()
            if len(fresh) > cap:
                raise EpisodeError(f"a batch of {len(fresh)} fresh episodes can never fit a ring of {cap}; post fewer")
            if live.numel() + len(fresh) > cap:
                if self.config.on_full == "reject":
                    self.counts["rejected_full"] += len(episodes)
                    raise BufferFull(
                        f"the ring is full: {live.numel()} of {cap} episodes buffered and {len(fresh)} more "
                        f"posted; retry after {self.config.retry_after_s:g} s",
                        self.config.retry_after_s,
                    )
                victims = self.sampler.oldest(self.rb.storage, live.numel() + len(fresh) - cap)
                self.sampler.consume(victims)
                evicted = victims.numel()
                self.counts["evicted"] += evicted
            if fresh:
                n_live = self._live().numel()  # after any eviction above
                index = self.rb.extend([self._to_td(ep) for ep in fresh]).reshape(-1)
                # torchrl writes consumed slots first, then its cursor; both must be free here: then
                # every written slot is distinct and adds one live episode.
                assert index.unique().numel() == index.numel() and self._live().numel() == n_live + len(fresh), \
                    "overwrote a live episode"
                self._versions[index] = versions[~stale]
            n_stale = len(episodes) - len(fresh)
            self.counts["accepted"] += len(episodes)
            self.counts["stored"] += len(fresh)
            self.counts["dropped_stale_on_arrival"] += n_stale
            for ep in episodes:  # at most MAX_WORKERS_COUNTED names: /stats stays small whatever workers send
                name = str(ep.get("worker", "?"))
                if name not in self.workers and len(self.workers) >= MAX_WORKERS_COUNTED:
                    name = "(others)"
                self.workers[name] += 1
            return AddResult(len(episodes), len(fresh), n_stale, evicted, self.trainer_version)

    def set_version(self, version: int) -> int:
        """Record the trainer's version (never goes back) and drop what became stale; returns it."""
        if not is_int(version) or not 0 <= version < 10**12:
            raise EpisodeError(f"trainer version must be an integer in [0, 10**12), got {version!r:.40}")
        with self._lock:
            if self.trainer_version is None or version > self.trainer_version:
                self.trainer_version = version
            self.sampler.drop_stale(self.rb.storage)
            return self.trainer_version

    def sample(self, batch_size: int, trainer_version: int | None = None) -> list[dict[str, Any]] | None:
        """Hand out ``batch_size`` fresh episodes (each once), oldest policy version first.

        Args:
            batch_size: episodes wanted.
            trainer_version: the trainer's version (recorded as by :meth:`set_version`).

        Returns:
            ``batch_size`` episode dicts (the posted fields plus ``lag`` = trainer version minus
            ``policy_version``, always ``<= max_lag``), or ``None`` while fewer are fresh (nothing
            is consumed then).

        Raises:
            EpisodeError: ``batch_size`` is not an integer in ``[1, max_sample]``, or larger than
                the ring (``capacity``).
        """
        if not is_int(batch_size) or not 1 <= batch_size <= self.config.max_sample:
            raise EpisodeError(f"batch_size must be an integer in [1, {self.config.max_sample}], got {batch_size!r:.40}")
        if batch_size > self.config.capacity:  # it would wait out every wait_s, and return nothing
            raise EpisodeError(f"batch_size {batch_size} can never be filled from a ring of {self.config.capacity}; "
                               "sample fewer")
        if trainer_version is not None:
            self.set_version(trainer_version)
        with self._lock:
            self.sampler.drop_stale(self.rb.storage)
            if self._live().numel() < batch_size:
                return None
            tds = self.rb.sample(batch_size)
            tv = self.trainer_version
            out = []
            for td in tds:
                lag = 0 if tv is None else tv - int(td["policy_version"])
                assert lag <= self.config.max_lag, "the staleness gate let a stale episode through"
                self.lag_sampled[lag] += 1
                out.append(self._from_td(td, lag))
            self.counts["sampled"] += len(out)
            return out

    def close(self) -> None:
        """Refuse further episodes (HTTP 410); buffered ones can still be sampled."""
        with self._lock:
            self.closed = True

    def stats(self) -> dict[str, Any]:
        """Counts, state and the accounting check (``unaccounted`` is always 0)."""
        with self._lock:
            size = int(self._live().numel())
            c = self.counts
            return {
                "accepted": c["accepted"], "stored": c["stored"], "sampled": c["sampled"],
                "dropped_stale": self._dropped_stale(), "dropped_stale_on_arrival": c["dropped_stale_on_arrival"],
                "evicted": c["evicted"], "size": size, "capacity": self.config.capacity,
                "unaccounted": c["accepted"] - (c["sampled"] + self._dropped_stale() + c["evicted"] + size),
                "rejected_full": c["rejected_full"], "rejected_closed": c["rejected_closed"],
                "trainer_version": self.trainer_version, "max_lag": self.config.max_lag,
                "on_full": self.config.on_full, "closed": self.closed,
                "lag_sampled": {str(k): v for k, v in sorted(self.lag_sampled.items())},
                "workers": dict(self.workers), "uptime_s": time.time() - self.started,
            }
