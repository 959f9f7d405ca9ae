"""The sender changes made for sharded publishing, checked in one process (fast):

* a foreground ``publish()`` first waits for a background one (one publish's collectives at a time);
* a failure while reading the weights (before anything is uploaded) burns the version, shows no
  version, and is reported like any other failure: raised at once in the foreground, by the next
  ``publish()``/``flush()`` in the background; the next publish recovers.

The multi-rank behaviour (every rank failing together, no hang) is in test_fsdp2.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore
from torch_deltasync.errors import ObjectExistsError, PublishError, StoreError, TransientStoreError
from torch_deltasync.keys import list_versions, manifest_key
from torch_deltasync.testing import first_difference


class SlowStore(LocalStore):
    """Holds every object ``put`` until ``release`` is set (the manifest goes through)."""

    def __init__(self, root):
        super().__init__(root)
        self.release = threading.Event()
        self.entered = threading.Event()

    def _hold(self, key):
        if key.startswith("objects/"):
            self.entered.set()
            assert self.release.wait(30)

    def put(self, key, data):
        self._hold(key)
        super().put(key, data)

    def put_new(self, key, data):  # objects and manifests are created, never replaced
        self._hold(key)
        super().put_new(key, data)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 7, generator=g) * 0.02, "b": torch.randn(5, generator=g) * 0.02}


def _nudge(state, k):
    with torch.no_grad():
        state["w"].view(-1)[k::11] += 1e-2


def test_foreground_publish_waits_for_background(tmp_path):
    store = SlowStore(tmp_path)
    state = _state()
    sender = DeltaSender(state, store, anchor_every=100)
    assert sender.publish(background=True) == 0
    assert store.entered.wait(30)  # version 0 is stuck in its upload
    _nudge(state, 0)
    # Record when the foreground publish starts waiting and when it reads the weights.
    waiting, order = threading.Event(), []
    wait_inflight, detect = sender._wait_inflight, sender.detector.detect

    def watched_wait():
        waiting.set()
        wait_inflight()

    def watched_detect(name, tensor):
        order.append(("detect", list_versions(store)))
        return detect(name, tensor)

    sender._wait_inflight, sender.detector.detect = watched_wait, watched_detect
    done = []
    t = threading.Thread(target=lambda: done.append(sender.publish(background=False)))
    t.start()
    assert waiting.wait(30)  # the foreground publish has begun, while version 0 is stuck
    assert not order and not done, "the foreground publish must wait for the background one"
    store.release.set()
    t.join(30)
    assert done == [1] and list_versions(store) == [0, 1]
    assert order and all(seen == [0] for _, seen in order)  # weights read only once version 0 was visible
    # it read the weights only after version 0 was committed, so it is a delta on it
    assert (sender.last_stats.kind, sender.last_stats.base_version) == ("delta", 0)
    receiver = DeltaReceiver(_state(seed=1), store)
    assert receiver.update() == 1
    assert first_difference(receiver.target.state_dict(), state) is None
    sender.close()


def test_publish_from_two_threads_runs_one_after_the_other(tmp_path):
    """Two threads publishing on one sender: the second waits for the first to finish (it must not
    read the weights against a publish state the first is still changing), and every version
    holds exactly the weights as they were when its publish read them."""
    store = SlowStore(tmp_path)
    store.release.set()
    state = _state()
    sender = DeltaSender(state, store, anchor_every=100)
    assert sender.publish() == 0
    store.release.clear()
    store.entered.clear()
    _nudge(state, 0)
    first = threading.Thread(target=sender.publish)
    first.start()
    assert store.entered.wait(30)  # version 1 is stuck in its upload
    expected_v1 = {k: v.clone() for k, v in state.items()}
    _nudge(state, 5)  # the trainer steps on
    done = []
    second = threading.Thread(target=lambda: done.append(sender.publish()))
    second.start()
    second.join(0.5)
    assert second.is_alive() and not done, "a second publish must wait for the one in progress"
    store.release.set()
    first.join(30)
    second.join(30)
    assert done == [2] and list_versions(store) == [0, 1, 2]
    assert (sender.last_stats.kind, sender.last_stats.base_version) == ("delta", 1)
    for version, weights in ((1, expected_v1), (2, state)):
        receiver = DeltaReceiver(_state(seed=1), store)
        assert receiver.update(version) == version
        assert first_difference(receiver.target.state_dict(), weights) is None
    sender.close()


@pytest.mark.parametrize("background", [False, True])
def test_failure_while_reading_weights(tmp_path, background):
    store = LocalStore(tmp_path)
    state = _state()
    sender = DeltaSender(state, store, anchor_every=100)
    assert sender.publish() == 0
    _nudge(state, 1)
    det = sender.detector
    original = det.detect

    def broken(name, tensor):
        det.detect = original
        raise RuntimeError("injected")

    det.detect = broken
    if background:
        assert sender.publish(background=True) == 1  # the failure is reported later
        with pytest.raises(PublishError, match=r"version 1 was not published \(rank 0: RuntimeError: injected\)"):
            sender.flush()
    else:
        with pytest.raises(PublishError, match=r"version 1 was not published \(rank 0: RuntimeError: injected\)"):
            sender.publish()
    assert list_versions(store) == [0]
    _nudge(state, 2)
    assert sender.publish(background=background) == 2
    assert sender.flush() == 2
    assert sender.last_stats.base_version == 0  # relative to what was published, covering both steps
    receiver = DeltaReceiver(_state(seed=1), store)
    assert receiver.update() == 2
    assert first_difference(receiver.target.state_dict(), state) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_changes_are_read_on_threads_bit_exactly(tmp_path, monkeypatch, threads):
    """``threads=2``: the tensors of a publish are read for changes (detected, positions mapped,
    checksum updated) on a helper thread as well as the calling one; ``threads=1`` reads them all on
    the calling thread. The versions are the same bits either way (the receiver's checksums agree)."""
    from torch_deltasync.sender import _sender

    monkeypatch.setattr(_sender, "DETECT_MIN_NUMEL", 1)  # the small model's tensors count as large
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32))
    replica = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32)).to(torch.bfloat16)
    sender = DeltaSender(model, LocalStore(tmp_path), threads=threads, anchor_every=100)
    seen: list[tuple[str, bool]] = []
    barrier = threading.Barrier(2, timeout=10)
    detect = sender.detector.detect

    def recording(name, tensor):  # the first two tensors wait for each other: a helper surely takes part
        seen.append((name, threading.current_thread() is threading.main_thread()))
        if threads > 1 and len(seen) <= 2:
            barrier.wait()
        return detect(name, tensor)

    monkeypatch.setattr(sender.detector, "detect", recording)
    receiver = DeltaReceiver(replica, LocalStore(tmp_path))
    sender.publish()
    receiver.update()
    for _ in range(3):
        seen.clear()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
        v = sender.publish()
        assert sender.last_stats.kind == "delta" and sender.last_stats.changed > 0
        assert sorted(n for n, _ in seen) == sorted(n for n, _ in model.named_parameters())
        assert any(not main for _, main in seen) == (threads > 1), seen
        assert receiver.update() == v and receiver.last_stats.path == "delta"
        assert first_difference(model, replica) is None
    receiver.verify()
    sender.close()


class LostManifestReply(LocalStore):
    """Writes a manifest, then raises as if the reply were lost (``lose``); ``unreadable``: reading
    a manifest back fails once too."""

    lose = unreadable = False

    def put_new(self, key, data):
        super().put_new(key, data)
        if self.lose and key.startswith("versions/"):
            self.lose = False
            raise TransientStoreError(f"lost reply for {key}")

    def get(self, key, *args, **kwargs):
        if self.unreadable and key.startswith("versions/"):
            self.unreadable = False
            raise TransientStoreError(f"no answer for {key}")
        return super().get(key, *args, **kwargs)


def test_a_manifest_that_landed_although_its_write_raised_is_published(tmp_path):
    """The write of a manifest raised after it landed: publish() said "not published, no partial
    version is visible" while receivers applied it, and based the next version on the one before,
    so every receiver holding it had to download an anchor."""
    store = LostManifestReply(tmp_path / "b", fsync=False)
    torch.manual_seed(0)
    weights = {"a": torch.randn(256)}
    sender = DeltaSender(weights, store, anchor_every=100)
    replica = {"a": torch.zeros(256, dtype=torch.bfloat16)}
    receiver = DeltaReceiver(replica, LocalStore(tmp_path / "b"))
    sender.publish()
    receiver.update()
    weights["a"][:5] += 1
    store.lose = True
    assert sender.publish() == 1 and sender.version == 1
    weights["a"][10:12] += 1
    assert sender.publish() == 2 and sender.last_stats.base_version == 1
    assert receiver.update() == 2 and receiver.last_stats.path == "delta"
    # Neither the write nor the read-back answers: the caller is told it may be visible.
    weights["a"][20:22] += 1
    store.lose = store.unreadable = True
    with pytest.raises(PublishError, match=r"version 3 may or may not be visible \(.*lost reply.*reading "
                                           r"versions/000000000003\.json back failed too .*based on version 2"):
        sender.publish()
    weights["a"][30:32] += 1
    assert sender.publish() == 4 and sender.last_stats.base_version == 2
    assert receiver.update() == 4
    assert torch.equal(replica["a"].view(torch.int16), weights["a"].to(torch.bfloat16).view(torch.int16))


def test_metrics_that_cannot_be_written_never_fail_a_publish_or_update(tmp_path, caplog):
    """A metrics_path naming a folder raised IsADirectoryError from publish() and update() after the
    version was published or applied (the caller was told it failed; retention was skipped)."""
    from torch_deltasync.follow import follow

    weights = {"a": torch.arange(8, dtype=torch.float32)}
    with pytest.raises(ValueError, match=r"SenderConfig\.metrics_path '.*' is a folder; give a file in it"):
        DeltaSender(weights, tmp_path / "b", metrics_path=tmp_path)
    with pytest.raises(ValueError, match=r"ReceiverConfig\.metrics_path '.*' is a folder"):
        DeltaReceiver({"a": torch.zeros(8, dtype=torch.bfloat16)}, tmp_path / "b", metrics_path=tmp_path)
    with pytest.raises(ValueError, match=r"follow: metrics_path '.*' is a folder"):
        follow(str(tmp_path / "b"), metrics_path=tmp_path)
    metrics = tmp_path / "m" / "metrics.jsonl"
    sender = DeltaSender(weights, tmp_path / "b", metrics_path=metrics)
    replica = {"a": torch.zeros(8, dtype=torch.bfloat16)}
    receiver = DeltaReceiver(replica, tmp_path / "b", metrics_path=metrics)
    assert sender.publish() == 0 and receiver.update() == 0
    assert [line.split('"event": "')[1][:6] for line in metrics.read_text().splitlines()] == ["publis", "update"]
    metrics.unlink()
    metrics.mkdir()  # the file became a folder
    weights["a"][3] += 1
    with caplog.at_level("WARNING", logger="torch_deltasync"):
        assert sender.publish() == 1 and receiver.update() == 1
    assert torch.equal(replica["a"].view(torch.int16), weights["a"].to(torch.bfloat16).view(torch.int16))
    warnings = [r.getMessage() for r in caplog.records if "cannot write metrics" in r.getMessage()]
    assert len(warnings) == 1 and str(metrics) in warnings[0]  # once per path


def test_a_manifest_write_past_its_deadline_may_still_land(tmp_path):
    """A manifest put past its deadline goes on in the background and lands later: it was reported
    "not published, no partial version is visible" while receivers then applied it."""
    import time

    from torch_deltasync.store import DeadlineStore

    class SlowManifests(LocalStore):
        slow = False

        def put_new(self, key, data):
            if self.slow and key.startswith("versions/"):
                time.sleep(0.5)
            super().put_new(key, data)

    inner = SlowManifests(tmp_path / "b", fsync=False)
    weights = {"a": torch.arange(64, dtype=torch.float32)}
    sender = DeltaSender(weights, DeadlineStore(inner, 0.1))
    sender.publish()
    weights["a"][:3] += 1
    inner.slow = True
    with pytest.raises(PublishError, match=r"version 1 may or may not be visible \(.*no answer within 0\.1 s.*"
                                           r"versions/000000000001\.json is not there yet\); the next publish is "
                                           r"based on version 0"):
        sender.publish()
    inner.slow = False
    deadline = time.monotonic() + 10
    while list_versions(inner) != [0, 1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list_versions(inner) == [0, 1]  # it landed after all
    weights["a"][5] += 1
    assert sender.publish() == 2 and sender.last_stats.base_version == 0
    replica = {"a": torch.zeros(64, dtype=torch.bfloat16)}
    assert DeltaReceiver(replica, inner).update() == 2
    assert torch.equal(replica["a"].view(torch.int16), weights["a"].to(torch.bfloat16).view(torch.int16))


class _Killed(BaseException):
    """The writer process dies here (nothing after it runs)."""


class DiesBeforeLatest(LocalStore):
    """Fails the objects of version ``fail_objects`` (that publish burns its number); with
    ``die`` set, the writer dies right after a manifest put, before it points LATEST at it."""

    fail_objects, die = -1, False

    def put_new(self, key, data):
        if key.startswith(f"objects/{self.fail_objects:012d}/"):
            raise TransientStoreError(f"injected failure of {key}")
        super().put_new(key, data)

    def put(self, key, data):
        if key == "LATEST" and self.die:
            raise _Killed
        super().put(key, data)


@pytest.mark.parametrize("first", [False, True], ids=["after-a-burned-number", "a-restarted-writer"])
def test_a_writer_dying_before_latest_never_hides_its_version(tmp_path, first):
    """Readers confirm LATEST by "its manifest exists and the next one does not". Version numbers
    have gaps (a failed publish burns one; a restarted writer starts after a crashed one's
    leftovers), and a writer that died between the manifest and LATEST left LATEST = 3 with 4
    missing and 5 visible: receivers stopped at 3 for good. The writer now removes LATEST before a
    manifest that is not LATEST + 1."""
    store = DiesBeforeLatest(tmp_path / "b", fsync=False)
    torch.manual_seed(0)
    weights = {"a": torch.randn(256)}
    sender = DeltaSender(weights, store, anchor_every=100)
    for i in range(4):
        weights["a"][i] += 1
        sender.publish()
    if first:  # a new writer after a crashed one that left objects of version 4
        sender._lease.release()
        store.put_new("objects/000000000004/delta-r00000-of00001.safetensors", b"leftover")
        sender = DeltaSender(weights, store, anchor_every=100)
    else:
        store.fail_objects = 4
        weights["a"][10] += 1
        with pytest.raises(PublishError, match="injected failure"):
            sender.publish()
    weights["a"][11] += 1
    store.die = True
    with pytest.raises(_Killed):
        sender.publish()
    assert list_versions(store) == [0, 1, 2, 3, 5]
    replica = {"a": torch.zeros(256, dtype=torch.bfloat16)}
    receiver = DeltaReceiver(replica, LocalStore(tmp_path / "b"))
    assert receiver.newest_version() == 5 and receiver.update() == 5
    assert torch.equal(replica["a"].view(torch.int16), weights["a"].to(torch.bfloat16).view(torch.int16))


class Flaky(LocalStore):
    """Fails the put (or the read) of chosen keys once, with the given error; counts deletes."""

    def __init__(self, root):
        super().__init__(root)
        self.put_errors, self.get_errors, self.deleted = {}, {}, []  # deleted: every key, LATEST too

    def put_new(self, key, data):
        if key in self.put_errors:
            raise self.put_errors.pop(key)
        return super().put_new(key, data)

    def get(self, key, *, start=None, end=None):
        if key in self.get_errors:
            raise self.get_errors.pop(key)
        return super().get(key, start=start, end=end)

    def delete(self, key):
        self.deleted.append(key)
        return super().delete(key)


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_publish_removes_the_objects_it_wrote(tmp_path, background):
    # A version with two objects (an anchor and the delta it carries) whose second write fails: the
    # first must not stay behind taking space, and the run goes on with an anchor that applies exactly.
    store = Flaky(tmp_path)
    state = _state()
    sender = DeltaSender(state, store, anchor_every=2)
    assert [sender.publish(), _nudge(state, 1) or sender.publish()] == [0, 1]
    _nudge(state, 2)
    key = "objects/000000000002/delta-r00000-of00001.safetensors"  # written after the anchor
    store.put_errors[key] = OSError(28, "No space left on device", key)  # the disk filled up
    with pytest.raises(PublishError, match=r"version 2 was not published \(rank 0: OSError: \[Errno 28\] No space"):
        if sender.publish(background=background) is not None and background:
            sender.flush()
    assert store.list("objects/000000000002") == [] and list_versions(store) == [0, 1]
    _nudge(state, 3)
    assert sender.publish() == 3 and sender.last_stats.kind == "anchor"
    receiver = DeltaReceiver(_state(seed=1), store)
    assert receiver.update() == 3
    assert first_difference(receiver.target.state_dict(), state) is None
    sender.close()


def test_a_failed_publish_never_deletes_an_object_it_cannot_call_its_own(tmp_path):
    # Another writer's object holds the key of our anchor (a takeover), and reading it back to
    # compare fails: it may be theirs, so it stays, and so does the rest of the store.
    store = Flaky(tmp_path)
    state = _state()
    sender = DeltaSender(state, store, anchor_every=1)
    assert sender.publish() == 0
    key = "objects/000000000001/anchor-r00000-of00001.safetensors"
    store.put(key, b"another writer's anchor")
    store.get_errors[key] = StoreError("injected: GET failed")  # (not transient: the clean-up runs)
    _nudge(state, 1)
    with pytest.raises(PublishError, match="version 1 was not published .*StoreError: injected: GET failed"):
        sender.publish()
    assert store.get(key) == b"another writer's anchor"
    assert [k for k in store.deleted if k.startswith("objects/")] == []
    sender.close()


class LostReplies(Flaky):
    """Every object's put lands, then fails as if its reply were lost: the retry finds the bytes."""

    def put_new(self, key, data):
        if key.startswith("objects/") and not self.exists(key):
            super().put_new(key, data)
            raise ObjectExistsError(f"{key} exists")
        return super().put_new(key, data)


def test_a_failed_publish_keeps_identical_objects_it_did_not_create(tmp_path):
    # Each object key already holds exactly our bytes when we create it: a retry of our own put
    # whose reply was lost, or another writer's identical object (which its manifest may name): the
    # sender cannot tell, so when the publish then fails these objects stay, for garbage collection.
    store = LostReplies(tmp_path)
    state = _state()
    sender = DeltaSender(state, store, anchor_every=1)
    assert sender.publish() == 0
    store.put_errors[manifest_key(1)] = StoreError("injected: PUT failed")  # (not transient: the clean-up runs)
    _nudge(state, 1)
    with pytest.raises(PublishError, match=r"version 1 was not published \(rank 0 manifest: StoreError: injected"):
        sender.publish()
    assert len(store.list("objects/000000000001")) == 2  # the anchor and the delta it carries
    assert [k for k in store.deleted if k.startswith("objects/")] == []
    assert sender.publish() == 2  # and the run goes on
    receiver = DeltaReceiver(_state(seed=1), store)
    assert receiver.update() == 2
    assert first_difference(receiver.target.state_dict(), state) is None
    sender.close()


def test_no_clean_up_while_the_store_is_unreachable(tmp_path):
    # The second object's put times out: the clean-up would only wait out the same outage, so the
    # error comes at once and garbage collection removes the first object later.
    store = Flaky(tmp_path)
    state = _state()
    sender = DeltaSender(state, store, anchor_every=2)
    assert [sender.publish(), _nudge(state, 1) or sender.publish()] == [0, 1]
    store.put_errors["objects/000000000002/delta-r00000-of00001.safetensors"] = TransientStoreError("injected: timed out")
    _nudge(state, 2)
    with pytest.raises(PublishError, match="version 2 was not published .*TransientStoreError: injected: timed out"):
        sender.publish()
    assert [k for k in store.deleted if k.startswith("objects/")] == []
    assert store.list("objects/000000000002") == ["objects/000000000002/anchor-r00000-of00001.safetensors"]
    sender.close()


def test_a_nan_in_a_strided_weight_keeps_every_version_reachable(tmp_path):
    # The anchor used to cast the strided view (torch's scalar code: NaN -> 0x7FC0) while detection
    # and the checksums cast a contiguous copy (vector lanes: 0xFFFF): from the next delta on no
    # receiver, not even a new one, could reach any version.
    base = torch.randn(16)
    w = base[::2]
    store = LocalStore(tmp_path)
    sender = DeltaSender({"w": w}, store, anchor_every=2, codec="raw")
    held = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    follower = DeltaReceiver(held, store)
    for v in range(5):
        if v == 1:
            w.view(torch.int32)[3] = -1  # a NaN appears
        w[0] += 1
        assert sender.publish() == v
        assert follower.update() == v
        fresh = {"w": torch.zeros(8, dtype=torch.bfloat16)}
        assert DeltaReceiver(fresh, store).update() == v
        for got in (held, fresh):
            assert got["w"].view(torch.int16)[3].item() == (0x7FC0 if v else w[3].to(torch.bfloat16).view(torch.int16).item())
            assert torch.equal(got["w"].view(torch.int16)[:3], w[:3].to(torch.bfloat16).view(torch.int16))
    sender.close()


def test_a_prefix_emptied_under_the_sender_gets_an_anchor_not_deltas_on_missing_bases(tmp_path):
    """The bucket deleted mid-run: the sender went on publishing deltas on bases no reader could
    find, the run ended "ok", and no new receiver could ever read the store again."""
    store = LocalStore(tmp_path / "b")
    w = {"w": torch.zeros(64)}
    sender = DeltaSender(w, store, anchor_every=100)
    for step in range(2):
        w["w"][step] = 1.0
        sender.publish()
    for key in store.list():
        store.delete(key)
    w["w"][5] = 2.0
    with pytest.raises(PublishError, match=r"version 2 was not published \(the manifest of its base version 1 is "
                                           r"gone .*The next publish is an anchor\); no partial version is visible$"):
        sender.publish()
    assert store.list() == [] or all(not k.startswith(("objects/", "versions/")) for k in store.list())
    w["w"][6] = 3.0
    assert sender.publish() == 3
    assert store.get(manifest_key(3))  # an anchor a new receiver starts from
    target = {"w": torch.empty(64, dtype=torch.bfloat16)}
    assert DeltaReceiver(target, store).update() == 3
    assert first_difference(target, {"w": w["w"].to(torch.bfloat16)}) is None
    w["w"][7] = 4.0
    assert sender.publish() == 4  # and deltas again after it
    sender.close()
