"""One live writer per prefix (``torch_deltasync.lease``): a second sender is refused, a takeover stops
the first one, ``close()`` frees the prefix, a dead writer's lease expires; sharded senders whose
ranks opened different stores are refused on every rank."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest
import torch

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore
from torch_deltasync.errors import PrefixInUseError, PublishError, StoreError
from torch_deltasync._ranks import run_ranks
from torch_deltasync.lease import OWNER_KEY, PrefixLease, read_owner
from torch_deltasync.keys import list_versions
from torch_deltasync.manifest import load_manifest
from torch_deltasync.store.faults import FaultyStore

from remote_helpers import StepModel, bits_of, empty_target, same_bits


def publish(sender, model, step):
    model.set_step(step)
    return sender.publish()


def test_a_second_live_writer_is_refused_and_writes_nothing(tmp_path):
    store = LocalStore(tmp_path / "b", fsync=False)
    a, b = StepModel(seed=1), StepModel(seed=2)
    first = DeltaSender(a.tensors, store)
    assert publish(first, a, 0) == 0
    keys = store.list("")
    with pytest.raises(PrefixInUseError, match=rf"owned by a live writer: run '{first.run_id}' .*lease renewed "
                                               r"[0-9.]+ s ago for 60 s.*pass takeover=True"):
        DeltaSender(b.tensors, store)
    assert store.list("") == keys
    assert publish(first, a, 1) == 1  # the owner is undisturbed
    first.close()


def test_two_writers_never_interleave(tmp_path):
    """The issue's scenario: two training programs on one prefix. Without ownership their versions
    alternated and a receiver following the newest one switched models at every version. Now the
    second one can only start by taking over, after which the first cannot publish again: the runs
    form two blocks, and the receiver crosses from one to the other once, by an anchor."""
    store = LocalStore(tmp_path / "b", fsync=False)
    a, b = StepModel(seed=3), StepModel(seed=4)
    sa = DeltaSender(a.tensors, store, anchor_every=100)
    target = empty_target(a.shapes)
    receiver = DeltaReceiver(target, store)
    for step in range(3):
        publish(sa, a, step)
        receiver.update()
    sb = DeltaSender(b.tensors, store, anchor_every=100, takeover=True)
    for step in range(3, 8):
        publish(sb, b, step)
        with pytest.raises(PrefixInUseError, match=rf"taken over by run '{sb.run_id}'"):
            publish(sa, a, step)
        assert receiver.update() == step
        assert all(torch.equal(bits_of(target)[n], b.bits_at(step)[n]) for n in target)
    runs = [load_manifest(store, v).run_id for v in list_versions(store)]
    assert runs == [sa.run_id] * 3 + [sb.run_id] * 5
    kinds = [load_manifest(store, v).kind for v in list_versions(store)]
    assert kinds[3] == "anchor" and load_manifest(store, 3).base_version is None
    # The refused writer's only leftover is the object it uploaded for the version it had in flight
    # when it found out (v3, not named by any manifest); after that it uploads nothing.
    named = {o.key for v in list_versions(store) for o in load_manifest(store, v).objects}
    assert set(store.list("objects")) - named == {"objects/000000000003/delta-r00000-of00001.safetensors"}


def test_close_frees_the_prefix(tmp_path):
    store = LocalStore(tmp_path / "b", fsync=False)
    a = StepModel(seed=5)
    with DeltaSender(a.tensors, store) as first:
        publish(first, a, 0)
    assert read_owner(store) is None
    second = DeltaSender(a.tensors, store)
    assert publish(second, a, 1) == 1 and load_manifest(store, 1).run_id == second.run_id
    with pytest.raises(PrefixInUseError, match="owned by a live writer"):
        publish(first, a, 2)  # a closed sender claims again to publish, and is refused now
    second.close()


def test_a_deleted_record_is_claimed_again(tmp_path):
    """Someone deleted OWNER (no other writer claimed it): the owner writes it again and goes on."""
    store = LocalStore(tmp_path / "b", fsync=False)
    a = StepModel(seed=7)
    sender = DeltaSender(a.tensors, store)
    assert publish(sender, a, 0) == 0
    store.delete(OWNER_KEY)
    assert publish(sender, a, 1) == 1
    assert read_owner(store).session == sender._lease.session
    sender.close()


def test_a_writer_whose_lease_ran_out_does_not_claim_the_prefix_again(tmp_path):
    """A writer cut off from the store (a paused process, a partition) for longer than its lease:
    another writer claimed the expired prefix, published and closed (deleting OWNER). The first
    one, back, must not claim the prefix again: its versions would follow the other run's and
    receivers would switch back to the stale model."""
    inner = LocalStore(tmp_path / "b", fsync=False)
    cut = FaultyStore(inner, error_rate=0.0)  # the first writer's view of the store
    a, b = StepModel(seed=11), StepModel(seed=12)
    sa = DeltaSender(a.tensors, cut, lease_s=0.4)
    assert publish(sa, a, 0) == 0
    cut.error_rate = 1.0  # its renewals fail from here on: the record expires
    time.sleep(0.7)
    sb = DeltaSender(b.tensors, inner)  # an expired record: claimed without takeover
    assert [publish(sb, b, s) for s in (1, 2)] == [1, 2]
    sb.close()
    assert read_owner(inner) is None
    cut.error_rate = 0.0
    for step in (3, 4):
        with pytest.raises(PrefixInUseError, match=r"this writer's lease expired \([0-9.]+ s since its last renewal, "
                                                   r"lease 0.4 s.*OWNER record is gone.*takeover=True"):
            publish(sa, a, step)
    assert read_owner(inner) is None  # not claimed again
    assert [load_manifest(inner, v).run_id for v in list_versions(inner)] == [sa.run_id] + [sb.run_id] * 2
    sa.close()


@pytest.mark.parametrize("record, reason", [
    ({"run_id": "dead", "session": "x", "host": "h", "pid": 1, "renewed_at": 1000.0, "lease_s": 60.0},
     "expired long ago: the writer died without close()"),
    (b"\xff not json", "malformed: protects nothing"),
    ({"run_id": "dead", "session": "x", "host": "h", "pid": "1", "renewed_at": 1e12, "lease_s": 60.0},
     "pid of the wrong type: malformed"),
    ({"run_id": "dead", "session": "x", "host": "h", "pid": 1, "renewed_at": 10**400, "lease_s": 60},
     "a 400-digit renewal time: malformed (it raised OverflowError)"),
])
def test_a_dead_or_malformed_lease_is_claimed(tmp_path, record, reason):
    store = LocalStore(tmp_path / "b", fsync=False)
    store.put(OWNER_KEY, record if isinstance(record, bytes) else json.dumps(record).encode())
    a = StepModel(seed=6)
    sender = DeltaSender(a.tensors, store)
    assert read_owner(store).session == sender._lease.session and read_owner(store).run_id == sender.run_id
    assert publish(sender, a, 0) == 0
    sender.close()


def test_a_record_renewed_in_the_future_counts_as_live_and_says_so(tmp_path):
    """A record stamped ahead of this host's clock (another host's clock, or damage) is kept as live
    (taking it over could interleave two writers) and the refusal says the time is in the future."""
    store = LocalStore(tmp_path / "b", fsync=False)
    record = {"run_id": "x", "session": "s", "host": "h", "pid": 1, "renewed_at": time.time() + 3600, "lease_s": 60.0}
    store.put(OWNER_KEY, json.dumps(record).encode())
    with pytest.raises(PrefixInUseError, match=r"lease renewed 3[56]\d\d\.\d s in the future by this host's clock "
                                               r"\(the owner's clock runs ahead, or the record is damaged\)"):
        DeltaSender(StepModel(seed=6).tensors, store)
    assert json.loads(store.get(OWNER_KEY)) == record  # untouched
    # renewed by its owner while this host read it: "just now", not "0.0 s in the future"
    assert "lease renewed 0.0 s ago for 60 s" in read_owner(store).describe(record["renewed_at"] - 0.02)


def test_a_live_lease_is_renewed_while_the_sender_is_open(tmp_path):
    store = LocalStore(tmp_path / "b", fsync=False)
    lease = PrefixLease(store, "run-x", lease_s=0.2)  # renewed every 0.05 s
    first = read_owner(store).renewed_at
    deadline = time.monotonic() + 60
    while read_owner(store).renewed_at == first:  # waits for the renewal itself, not a duration
        assert time.monotonic() < deadline, "the lease was never renewed"
        threading.Event().wait(0.01)
    lease.release()
    assert read_owner(store) is None


@pytest.mark.parametrize("lease_s", [0, -1.0, float("nan"), "60"])
def test_bad_lease_durations_are_refused(tmp_path, lease_s):
    with pytest.raises(ValueError, match="lease_s must be a positive number of seconds"):
        DeltaSender({"w": torch.zeros(4)}, LocalStore(tmp_path / "b"), lease_s=lease_s)


# --- sharded senders: every rank must address the same store and prefix ---------------------------


def _construct_on_rank(rank: int, world: int, how: str, shared: str) -> dict:
    import tempfile

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from torch_deltasync import DeltaSender

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    fully_shard(model)
    options = {}
    if how == "mkdtemp":
        store, prefix = tempfile.mkdtemp(prefix=f"rank{rank}-"), ""
    elif how == "prefix":
        store, prefix = shared, f"run-{rank}"
    else:
        store, prefix = shared, "run"
        if how.startswith("option:") and rank == 1:  # e.g. "option:anchor_every=2"
            name, value = how[len("option:"):].split("=")
            options[name] = {"2": 2, "raw": "raw", "True": True, "float16": torch.float16}[value]
    try:
        sender = DeltaSender(model, store, prefix=prefix, **options)
    except ValueError as e:
        return {"error": str(e), "owner_left": LocalStore(store).sub(prefix).exists(OWNER_KEY)}
    v = sender.publish()
    sender.close()
    dist.barrier()
    return {"version": v}


@pytest.mark.parametrize("how", ["mkdtemp", "prefix"])
def test_ranks_on_different_stores_are_refused_on_every_rank(tmp_path, how):
    results = run_ranks(_construct_on_rank, 2, how, str(tmp_path / "shared"), timeout_s=300)
    for r, res in enumerate(results):
        assert "error" in res, (r, res)
        assert "do not address the same store and prefix" in res["error"]
        assert "rank 1 opened" in res["error"] and "finds no owner record there" in res["error"]
        assert res["owner_left"] is False  # rank 0 released what it claimed


def test_ranks_on_one_store_publish(tmp_path):
    results = run_ranks(_construct_on_rank, 2, "same", str(tmp_path / "shared"), timeout_s=300)
    assert results == [{"version": 0}, {"version": 0}]
    assert load_manifest(LocalStore(tmp_path / "shared").sub("run"), 0).kind == "anchor"


@pytest.mark.parametrize("option, shown", [
    ("anchor_every=2", "anchor policy AnchorPolicy(every=2"),  # objects no manifest combines
    ("codec=raw", "codec raw (rank 0: packed)"),  # every version unreadable
    ("inference_dtype=float16", "inference_dtype torch.float16 (rank 0: torch.bfloat16)"),
    ("background=True", "background True (rank 0: False)"),  # other collectives: the publish hung
])
def test_ranks_built_with_different_options_are_refused_on_every_rank(tmp_path, option, shown):
    """Rank 1 built its sender with another option than rank 0: every publish "succeeded" and no
    receiver could apply the versions (or the first publish hung). Now both ranks refuse at once."""
    results = run_ranks(_construct_on_rank, 2, f"option:{option}", str(tmp_path / "shared"), timeout_s=300)
    for r, res in enumerate(results):
        assert "error" in res, (r, res)
        assert "the ranks were built with different sender options: rank 1 has" in res["error"] and shown in res["error"]
        assert res["owner_left"] is False


def test_a_plain_model_published_by_every_torchrun_rank_is_told_apart(tmp_path, monkeypatch):
    """Under torchrun a model without DTensors is published by each rank on its own: the second
    rank's sender was told to take the prefix over, which would set the ranks fighting."""
    store = LocalStore(tmp_path / "b", fsync=False)
    first = DeltaSender({"w": torch.ones(4)}, store)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(PrefixInUseError, match=r"owned by a live writer.*Note: this process is rank 1 of 2 \(torchrun\) and "
                                               r"its model holds no DTensor.*publish from one rank"):
        DeltaSender({"w": torch.ones(4)}, store)
    first.close()


class _Scripted(LocalStore):
    """A LocalStore whose next put of each key in ``fail`` raises (a failed store call)."""

    def __init__(self, root, fail=()):
        super().__init__(root, fsync=False)
        self.fail = set(fail)

    def _maybe_fail(self, key):
        hit = next((f for f in self.fail if key.startswith(f)), None)
        if hit is not None:
            self.fail.discard(hit)
            raise StoreError(f"injected: put of {key} failed")

    def put(self, key, data):
        self._maybe_fail(key)
        return super().put(key, data)

    def put_new(self, key, data):
        self._maybe_fail(key)
        return super().put_new(key, data)


def test_a_writer_that_lost_the_prefix_never_points_latest_back(tmp_path):
    """Writer A's LATEST for version 1 failed (pending, retried at flush); writer B took the prefix
    over, burned version 2 (a failed publish) and published 3. A's close() used to write its pending
    LATEST = 1, which readers confirm (manifest 1 exists, manifest 2 does not): the newest version
    was hidden and a follower holding B's version 3 moved back to A's weights."""
    root = tmp_path / "b"
    a, b = StepModel(seed=10), StepModel(seed=11)
    store_a = _Scripted(root)
    sa = DeltaSender(a.tensors, store_a, anchor_every=100)
    publish(sa, a, 0)
    store_a.fail = {"LATEST"}
    assert publish(sa, a, 1) == 1 and sa._latest_pending == 1
    sb = DeltaSender(b.tensors, _Scripted(root, fail={"objects/000000000002/"}), anchor_every=100, takeover=True)
    with pytest.raises(PublishError):
        publish(sb, b, 2)
    assert publish(sb, b, 3) == 3
    target = empty_target(b.shapes)
    follower = DeltaReceiver(target, LocalStore(root))
    assert follower.update() == 3
    sa.close()
    assert LocalStore(root).get("LATEST") == b"3"
    assert follower.update() == 3 and same_bits(bits_of(target), b.bits_at(3))
    fresh = empty_target(b.shapes)
    assert DeltaReceiver(fresh, LocalStore(root)).update() == 3 and same_bits(bits_of(fresh), b.bits_at(3))


def test_a_follower_never_trusts_a_latest_older_than_what_it_holds(tmp_path):
    # A writer paused inside its LATEST put past a takeover (the check before it passed) can still
    # point LATEST back at its own version; a number burned after it makes that look current.
    store = LocalStore(tmp_path / "b", fsync=False)
    a = StepModel(seed=12)
    sender = DeltaSender(a.tensors, store, anchor_every=100)
    for step in (0, 1):
        publish(sender, a, step)
    sender._next_version += 1  # version 2 burned (as a failed publish does)
    assert publish(sender, a, 2) == 3
    target = empty_target(a.shapes)
    follower = DeltaReceiver(target, store)
    assert follower.update() == 3
    store.put("LATEST", b"1")  # the paused writer's late put
    assert follower.newest_version() == 3 and not follower.needs_update()
    assert follower.update() == 3 and same_bits(bits_of(target), a.bits_at(2))
    sender.close()


def test_two_writers_replacing_the_same_expired_record_one_is_refused(tmp_path):
    """Claiming an expired (or malformed) record is a read and a write: two writers starting at
    once both read the dead writer's record. Both used to claim the prefix; then the winner's first
    publish failed on the loser's objects ("another writer already uses version 0")."""
    store = LocalStore(tmp_path / "b", fsync=False)
    dead = json.dumps({"run_id": "dead", "session": "x", "host": "h", "pid": 1, "renewed_at": 1000.0,
                       "lease_s": 60.0}).encode()
    store.put(OWNER_KEY, dead)

    class ReadsBeforeTheWinnerWrote(LocalStore):  # the second writer's read of OWNER came first
        def get(self, key, *, start=None, end=None):
            return dead if key == OWNER_KEY else super().get(key, start=start, end=end)

    first = PrefixLease(store, "first")
    with pytest.raises(PrefixInUseError, match=r"another writer is replacing the same owner record \(run 'dead' "
                                               r"\(host h, pid 1\).*\) right now: its claim OWNER.claims/[0-9a-f]{32} "
                                               r"is [0-9.]+ s old.*try again after its claim expires \(60 s\)"):
        PrefixLease(ReadsBeforeTheWinnerWrote(tmp_path / "b", fsync=False), "second")
    assert read_owner(store).session == first.session  # the winner keeps the prefix
    a = StepModel(seed=13)
    first.release()
    sender = DeltaSender(a.tensors, store)  # and a later claim of a released prefix works as before
    assert publish(sender, a, 0) == 0
    sender.close()


_DEAD = json.dumps({"run_id": "dead", "session": "x", "host": "h", "pid": 1, "renewed_at": 1000.0,
                    "lease_s": 60.0}).encode()


def test_a_claim_never_locks_the_prefix(tmp_path):
    """The claim marker must not outlive a failed claim: (1) the record's put failed after the
    marker was made, (2) the claimant died between the two (its marker is older than lease_s),
    (3) the marker's put landed but its reply was lost and the retry found it. Each used to leave
    every later claimant, takeover=True included, refused for good."""
    from torch_deltasync.errors import ObjectExistsError

    class Failing(LocalStore):
        def __init__(self, root, fail_owner=False, lost_reply=False):
            super().__init__(root, fsync=False)
            self.fail_owner, self.lost_reply = fail_owner, lost_reply

        def put(self, key, data):
            if key == OWNER_KEY and self.fail_owner:
                raise StoreError("injected: put of OWNER failed")
            return super().put(key, data)

        def put_new(self, key, data):
            super().put_new(key, data)
            if key.startswith("OWNER.claims/") and self.lost_reply:  # landed; the retry finds it
                raise ObjectExistsError(f"{key} already exists")

    # (1) the record's put failed: the marker goes with the failure, the next claim goes on
    store = LocalStore(tmp_path / "1", fsync=False)
    store.put(OWNER_KEY, _DEAD)
    with pytest.raises(StoreError, match="injected"):
        PrefixLease(Failing(tmp_path / "1", fail_owner=True), "a")
    assert store.list("OWNER.claims") == [] and store.get(OWNER_KEY) == _DEAD
    lease = PrefixLease(store, "b")
    assert read_owner(store).session == lease.session
    lease.release()
    # (2) an abandoned claim (older than lease_s, the record still the dead one's): the next generation
    store = LocalStore(tmp_path / "2", fsync=False)
    store.put(OWNER_KEY, _DEAD)
    marker = f"OWNER.claims/{hashlib.sha256(_DEAD).hexdigest()[:32]}"
    store.put(marker, json.dumps({"session": "killed", "at": time.time() - 61}).encode())
    lease = PrefixLease(store, "c", takeover=True)
    assert read_owner(store).session == lease.session and store.exists(marker + ".1")
    lease.release()
    # (3) a lost reply: our own marker is found, and the claim goes on
    store = LocalStore(tmp_path / "3", fsync=False)
    store.put(OWNER_KEY, _DEAD)
    lease = PrefixLease(Failing(tmp_path / "3", lost_reply=True), "d")
    assert read_owner(store).session == lease.session
    lease.release()
