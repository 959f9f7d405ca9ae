"""``integrations/torchrl/_replay.py``: the shared use-once, oldest-version-first sampler with a staleness gate
(``StalenessGatedSampler``), through real torchrl replay buffers. Each behaviour runs on the three
ways versions reach the sampler: a ``TensorStorage`` column (the async GRPO recipe), a side tensor
and a callable over a ``ListStorage`` of ragged episodes (the rollout service)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import ConsumingSampler, LazyTensorStorage, ListStorage, ReplayBuffer

from torch_deltasync.integrations.torchrl import StalenessGatedSampler

KINDS = ["tensor_storage", "list_tensor", "list_callable"]


class Buf:
    """A replay buffer over one of ``KINDS``. Sample ``uid`` ``i`` is the ``i``-th one written."""

    def __init__(self, kind: str, capacity: int = 16, *, seed: int = 0, **kw) -> None:
        self.kind = kind
        gen = torch.Generator().manual_seed(seed)
        if kind == "tensor_storage":
            self.sampler = StalenessGatedSampler(**kw)
            self.rb = ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=self.sampler, generator=gen)
        else:
            self.versions = torch.full((capacity,), -1, dtype=torch.int64)
            source = self.versions if kind == "list_tensor" else (lambda index: self.versions[index])
            self.sampler = StalenessGatedSampler(versions=source, **kw)
            self.rb = ReplayBuffer(storage=ListStorage(capacity), sampler=self.sampler, collate_fn=lambda x: x,
                                   generator=gen)
        self.uids = 0
        self.slot: dict[int, int] = {}  # uid -> storage index
        self.uid_at: dict[int, int] = {}  # storage index -> the uid written there last

    def extend(self, versions: list[int]) -> list[int]:
        """Write samples of these versions; returns the storage slots written."""
        n = len(versions)
        uids = list(range(self.uids, self.uids + n))
        self.uids += n
        if self.kind == "tensor_storage":
            index = self.rb.extend(TensorDict(policy_version=torch.tensor(versions), uid=torch.tensor(uids),
                                              batch_size=[n]))
        else:  # ragged episodes, as in the rollout service; the caller keeps the versions by slot
            index = self.rb.extend([TensorDict(uid=torch.tensor(u), tokens=torch.zeros(1 + u % 3), batch_size=[])
                                    for u in uids])
            self.versions[index] = torch.tensor(versions)
        slots = index.reshape(-1).tolist()
        self.slot.update(zip(uids, slots))
        self.uid_at.update(zip(slots, uids))
        return slots

    def sample(self, n: int) -> list[int]:
        """uids of the samples the buffer hands out."""
        got = self.rb.sample(n)
        if self.kind == "tensor_storage":
            return got["uid"].tolist()
        return [int(td["uid"]) for td in got]

    def live_uids(self) -> list[int]:
        return sorted(self.uid_at[s] for s in self.sampler.live_index(self.rb.storage).tolist())

    def drain(self, n: int) -> list[int]:
        out = []
        while self.sampler.live_index(self.rb.storage).numel():
            out += self.sample(n)
        return out


# --- staleness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_drop_stale_consumes_exactly_the_samples_beyond_the_bound_and_counts_each_once(kind):
    b = Buf(kind, max_staleness=1)
    b.extend([0, 1, 2, 3, 4])  # uid == version
    assert b.sampler.consumer_version is None
    assert b.sampler.drop_stale(b.rb.storage) == 0  # consumer version unknown: nothing is stale
    b.sampler.consumer_version = 4  # lags 4, 3, 2, 1, 0: versions 0, 1, 2 exceed the bound 1
    assert b.sampler.drop_stale(b.rb.storage) == 3
    assert b.sampler.dropped_stale == 3 and b.live_uids() == [3, 4]
    assert b.sampler.drop_stale(b.rb.storage) == 0 and b.sampler.dropped_stale == 3  # counted once
    b.sampler.consumer_version = 5  # version 3 now lags 2
    assert b.sample(5) == [4]  # the gate runs before every sample
    assert b.sampler.dropped_stale == 4 and b.live_uids() == []


@pytest.mark.parametrize("kind", KINDS)
def test_bound_zero_hands_out_only_the_consumer_version(kind):
    b = Buf(kind, max_staleness=0, consumer_version=7)
    b.extend([6, 7, 6, 7, 8])  # 8 is ahead of the consumer: lag -1, fresh
    assert b.sample(5) == [1, 3, 4]
    assert b.sampler.dropped_stale == 2


def test_stale_mask():
    s = StalenessGatedSampler(2)
    v = torch.tensor([2, 3, 4, 5, 6])
    assert s.stale_mask(v).tolist() == [False] * 5  # consumer_version None
    s.consumer_version = 5
    assert s.stale_mask(v).tolist() == [True, False, False, False, False]  # only 5 - 2 = 3 > 2


# --- use once ------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["fifo", "random"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_sample_is_handed_out_once(kind, order):
    b = Buf(kind, max_staleness=10, order=order)
    b.extend([3, 0, 2, 1, 3, 0, 2, 1])
    sizes, seen = [], []
    while b.live_uids():
        got = b.sample(3)
        sizes.append(len(got))
        seen += got
    assert sizes == [3, 3, 2] and sorted(seen) == list(range(8))
    with pytest.raises(RuntimeError, match="empty"):
        b.sample(1)
    assert b.sampler.dropped_stale == 0


@pytest.mark.parametrize("kind", KINDS)
def test_consumed_slots_are_written_first(kind):
    b = Buf(kind, capacity=6, max_staleness=0)
    b.extend([0, 0, 0, 0])  # slots 0-3; the cursor is at 4
    b.sample(2)  # uids 0, 1: slots 0, 1 consumed
    assert sorted(b.extend([0, 0])) == [0, 1]  # the consumed slots, not the cursor's 4, 5
    assert b.live_uids() == [2, 3, 4, 5]


# --- order ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_oldest_version_first_then_arrival(kind):
    b = Buf(kind, max_staleness=10)
    b.extend([2, 0, 1, 0])  # uids 0-3
    b.extend([1, 0])  # uids 4, 5
    # version 0: uids 1, 3, 5 (arrival order); version 1: 2, 4; version 2: 0
    assert b.sample(2) + b.sample(3) + b.sample(9) == [1, 3, 5, 2, 4, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_arrival_order_is_write_order_not_slot_order(kind):
    b = Buf(kind, capacity=4, max_staleness=10)
    b.extend([0, 0, 0, 0])
    assert b.sample(2) == [0, 1]
    assert b.extend([0, 0]) == [0, 1]  # uids 4, 5 reuse slots 0, 1: lower slots, later arrival
    assert b.sample(4) == [2, 3, 4, 5]


def test_random_ties_follow_the_seeded_generator():
    def order(seed):
        b = Buf("tensor_storage", max_staleness=10, ties="random", seed=seed)
        b.extend([1, 1, 1, 1, 0, 0, 0, 0])
        return b.drain(3)

    orders = [order(seed) for seed in range(6)]
    for got in orders:
        assert sorted(got[:4]) == [4, 5, 6, 7] and sorted(got[4:]) == [0, 1, 2, 3]  # versions still first
    assert orders[0] == order(0)  # same seed, same order
    assert len({tuple(o) for o in orders}) > 1  # ties are not in arrival order for every seed


def test_order_random_is_uniform_among_the_fresh():
    firsts = set()
    for seed in range(8):
        b = Buf("tensor_storage", max_staleness=1, order="random", seed=seed, consumer_version=3)
        b.extend([0, 2, 3, 2, 3, 1])  # uid 0 (lag 3) and uid 5 (lag 2) are stale
        got = b.drain(2)
        assert sorted(got) == [1, 2, 3, 4] and b.sampler.dropped_stale == 2
        firsts.add(got[0])
    assert len(firsts) > 1  # not oldest first


@pytest.mark.parametrize("ties", ["arrival", "random"])
def test_oldest_is_a_query_in_version_then_arrival_order(ties):
    b = Buf("list_tensor", max_staleness=10, ties=ties)
    b.extend([2, 0, 1, 0, 1])
    slots = b.sampler.oldest(b.rb.storage, 3).tolist()
    assert slots == [b.slot[1], b.slot[3], b.slot[2]]
    assert b.live_uids() == [0, 1, 2, 3, 4]  # nothing consumed
    assert b.sampler.oldest(b.rb.storage, 99).numel() == 5


# --- consume -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_consume_removes_without_returning_or_counting_a_drop(kind):
    b = Buf(kind, capacity=4, max_staleness=10)
    b.extend([0, 1, 2, 3])
    b.sampler.consume(torch.tensor([b.slot[0], b.slot[2]]))
    b.sampler.consume(torch.zeros(0, dtype=torch.long))  # no-op
    assert b.live_uids() == [1, 3] and b.sampler.dropped_stale == 0
    assert sorted(b.extend([5, 5])) == sorted([b.slot[0], b.slot[2]])  # the freed slots are reused first
    assert b.drain(8) == [1, 3, 4, 5]


BAD_CONSUME = [
    ([0], "already sampled"),
    ([9], "beyond the written slots"),
    ([-1], "negative"),
    ([2, 2], "repeated: would be put on torchrl's free list twice"),
]


@pytest.mark.parametrize("index, reason", BAD_CONSUME, ids=[r for _, r in BAD_CONSUME])
def test_consume_rejects_what_is_not_live(index, reason):
    b = Buf("tensor_storage", capacity=8, max_staleness=10)
    b.extend([0, 0, 0, 0])
    b.sample(1)  # uid 0, slot 0
    with pytest.raises(ValueError, match="consume"):
        b.sampler.consume(torch.tensor(index))
    assert b.live_uids() == [1, 2, 3]  # nothing changed


def test_consume_before_any_write_is_rejected():
    with pytest.raises(ValueError, match="nothing has been written"):
        StalenessGatedSampler(1).consume(torch.tensor([0]))


# --- state_dict ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tensor_storage", "list_tensor"])
def test_state_dict_round_trip_continues_identically(kind, tmp_path):
    def scenario():
        b = Buf(kind, capacity=8, max_staleness=1)
        b.extend([2, 2, 3, 3, 3, 3])  # uids 0-5 in slots 0-5
        assert b.sample(2) == [0, 1]
        b.extend([3, 3])  # uids 6, 7 into slots 0, 1: arrival order is no longer slot order
        b.sampler.consumer_version = 4
        b.extend([2])  # uid 8, slot 6
        assert b.sampler.drop_stale(b.rb.storage) == 1  # uid 8 lags 2: slot 6 is free again
        return b

    a = scenario()
    b = Buf(kind, capacity=8, max_staleness=0)  # loading restores the bound
    b.rb.load_state_dict(a.rb.state_dict())
    if kind == "list_tensor":
        b.versions.copy_(a.versions)  # caller-kept versions travel with the caller's checkpoint
    b.slot, b.uid_at, b.uids = dict(a.slot), dict(a.uid_at), a.uids
    c = Buf(kind, capacity=8, max_staleness=0)  # the sampler alone, through a file (torch.save/load)
    a.sampler.dumps(tmp_path)
    c.sampler.loads(tmp_path)
    assert (c.sampler.max_staleness, c.sampler.consumer_version, c.sampler.dropped_stale) == (1, 4, 1)
    assert torch.equal(c.sampler._arrival, a.sampler._arrival)
    for buf in (b, c):
        assert (buf.sampler.max_staleness, buf.sampler.consumer_version, buf.sampler.dropped_stale) == (1, 4, 1)
    assert b.live_uids() == a.live_uids() == [2, 3, 4, 5, 6, 7]
    # The same writes land in the same slots and the same samples come out in the same order.
    assert a.extend([4, 4]) == b.extend([4, 4])
    assert a.drain(2) == b.drain(2) == [2, 3, 4, 5, 6, 7, 9, 10]


def test_state_dict_without_arrival_stamps_loads():
    b = Buf("tensor_storage", max_staleness=1)
    b.extend([1, 0, 1])
    state = {k: v for k, v in b.sampler.state_dict().items() if k not in ("_arrival", "_next_arrival")}
    c = Buf("tensor_storage", max_staleness=1)
    c.rb.storage.load_state_dict(b.rb.storage.state_dict())
    c.sampler.load_state_dict(state)
    assert c.sample(3)[0] == 1  # version order still holds


# --- arguments and the torchrl contract -------------------------------------------------------------


BAD_ARGS = [
    (dict(max_staleness=-1), ValueError, "negative bound"),
    (dict(max_staleness=1.5), TypeError, "fractional bound"),
    (dict(max_staleness=True), TypeError, "bool is not a bound"),
    (dict(max_staleness=1, order="lifo"), ValueError, "unknown order"),
    (dict(max_staleness=1, ties="slot"), ValueError, "unknown tie rule"),
    (dict(max_staleness=1, version_key="v", versions=torch.zeros(4, dtype=torch.long)), ValueError,
     "two version sources"),
]


@pytest.mark.parametrize("kwargs, error, reason", BAD_ARGS, ids=[r for *_, r in BAD_ARGS])
def test_rejects_bad_arguments(kwargs, error, reason):
    with pytest.raises(error):
        StalenessGatedSampler(**kwargs)


def test_list_storage_without_versions_is_a_clear_error():
    s = StalenessGatedSampler(1, consumer_version=3)
    rb = ReplayBuffer(storage=ListStorage(4), sampler=s, collate_fn=lambda x: x)
    rb.extend([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(TypeError, match="versions="):
        rb.sample(1)


def test_custom_version_key():
    s = StalenessGatedSampler(0, version_key=("meta", "v"), consumer_version=2)
    rb = ReplayBuffer(storage=LazyTensorStorage(4), sampler=s)
    rb.extend(TensorDict(meta=TensorDict(v=torch.tensor([2, 1, 2]), batch_size=[3]), x=torch.arange(3),
                         batch_size=[3]))
    assert rb.sample(3)["x"].tolist() == [0, 2]


@pytest.mark.parametrize("missing", ["_append_free_indices", "_live_mask"])
def test_missing_torchrl_internals_name_the_supported_version(monkeypatch, missing):
    if missing.endswith("_indices"):
        monkeypatch.delattr(ConsumingSampler, missing)
    else:
        init = ConsumingSampler.__init__

        def init_without(self, *a, **kw):
            init(self, *a, **kw)
            delattr(self, missing)

        monkeypatch.setattr(ConsumingSampler, "__init__", init_without)
    with pytest.raises(RuntimeError, match=rf"lacks \['{missing}'\].*torchrl 0\.14\.x"):
        StalenessGatedSampler(1)
