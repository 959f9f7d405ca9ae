"""Retention (``retention.py``), the ``deltasync gc`` command, the sender's ``retention=`` option,
and receivers that lag behind the retained range (``DeltaReceiver.update`` plans again)."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore, RetentionPolicy, collect_garbage
from torch_deltasync.errors import PublishError, StoreError, VersionNotFoundError
from torch_deltasync.cli import main as cli_main
from torch_deltasync.keys import list_versions, manifest_key
from torch_deltasync.manifest import load_manifest, seal_manifest
from torch_deltasync.retention import apply_retention, plan_retention
from torch_deltasync.store import Store

from helpers import PassThroughStore
from remote_helpers import StepModel, assert_holds, empty_target


class Recording(PassThroughStore):
    """Passes through to ``inner``; logs deletes; ``on_put``/``on_get`` hooks may fail or act."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.deleted: list[str] = []
        self.on_put = None
        self.on_get = None

    def put(self, key, data):
        if self.on_put is not None:
            self.on_put(key, data)
        self.inner.put(key, data)

    def get(self, key, *, start=None, end=None):
        if self.on_get is not None:
            self.on_get(key)
        return self.inner.get(key, start=start, end=end)

    def delete(self, key):
        self.deleted.append(key)
        self.inner.delete(key)


def publish(store, steps, *, anchor_every=5, model=None, tolerate=(), **kw):
    """Publish ``model`` at each of ``steps``; a publish raising one of ``tolerate`` burns its version."""
    model = model or StepModel(seed=1)
    sender = DeltaSender(model.tensors, store, anchor_every=anchor_every, **kw)
    for step in steps:
        model.set_step(step)
        try:
            sender.publish()
        except tolerate:
            pass
    return sender, model


def folders(store) -> list[int]:
    return sorted({int(k.split("/")[1]) for k in store.list("objects")})


def set_created_at(store, version, t):
    doc = json.loads(store.get(manifest_key(version)))
    doc["created_at"] = t
    store.put(manifest_key(version), seal_manifest(doc))


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "bucket", fsync=False)


def test_keeps_newest_anchor_and_every_version_after_it(store):
    _, model = publish(store, range(22))  # anchors 0, 5, 10, 15, 20
    plan = collect_garbage(store)
    assert (plan.cut, plan.keep, plan.delete) == (20, (20, 21), tuple(range(20)))
    assert list_versions(store) == [20, 21] and folders(store) == [20, 21]
    assert store.exists("LATEST")
    target = empty_target()
    DeltaReceiver(target, store).update()
    assert_holds(target, model, 21)
    assert collect_garbage(store).empty  # idempotent


def test_a_runs_prefix_is_an_argument_as_for_the_sender(store, tmp_path):
    """``collect_garbage(path, policy, prefix=...)`` raised TypeError; the documented way to name a
    run in a shared store is its prefix, as for the sender, the receivers and ``deltasync gc``."""
    _, model = publish(store.sub("run-a"), range(12))  # anchors 0, 5, 10
    plan = collect_garbage(str(store.root), RetentionPolicy(), prefix="run-a")
    assert (plan.cut, plan.keep) == (10, (10, 11))
    assert list_versions(store.sub("run-a")) == [10, 11]
    target = empty_target()
    DeltaReceiver(target, store, prefix="run-a").update()
    assert_holds(target, model, 11)


def test_keep_older_anchors(store):
    _, model = publish(store, range(22))
    plan = collect_garbage(store, RetentionPolicy(keep_anchors=2))
    assert plan.keep == (10, 15, 20, 21)
    target = empty_target()
    receiver = DeltaReceiver(target, store)
    for v in (10, 15, 21):
        receiver.update(v)
        assert_holds(target, model, v)
    with pytest.raises(VersionNotFoundError):
        receiver.update(12)  # a delta after an older anchor is gone: an explicit request fails


def test_grace_picks_the_newest_anchor_old_enough(store):
    publish(store, range(17))  # anchors 0, 5, 10, 15
    for v, t in [(0, 1000.0), (5, 1100.0), (10, 1200.0), (15, 1300.0)]:
        set_created_at(store, v, t)
    plan = plan_retention(store, RetentionPolicy(grace_s=200), now=1360.0)
    assert plan.cut == 5 and plan.delete == (0, 1, 2, 3, 4)  # 10 and 15 are younger than 200 s
    assert "(260.0 s)" in plan.reason
    assert plan_retention(store, RetentionPolicy(grace_s=150), now=1360.0).cut == 10
    young = plan_retention(store, RetentionPolicy(grace_s=1000), now=1360.0)
    assert young.cut is None and young.empty and young.keep == tuple(range(17))
    apply_retention(store, plan)
    assert list_versions(store) == list(range(5, 17))


class _DropManifest:
    """Make the manifest put of given versions fail (the publish burns the version); keep the bytes."""

    def __init__(self, rec: Recording, versions):
        self.versions = set(versions)
        self.held: dict[int, bytes] = {}
        rec.on_put = self

    def __call__(self, key, data):
        for v in self.versions:
            if key == manifest_key(v):
                self.held[v] = data
                raise StoreError(f"injected: manifest {v} lost")


def test_out_of_order_chain_is_kept_whole(store, tmp_path):
    """Keep the whole chain of every kept version, even when the newest anchor is not on it.

    Built by hand: version 3 (a delta) is burned, 4 is a delta on 2, and then an anchor manifest
    for version 3 lands late (a put that timed out on the client but finished on the server). The
    newest anchor (3) is then not under the newest version (4), whose chain 4 -> 2 -> 1 -> 0 must
    survive."""
    rec = Recording(store)
    _DropManifest(rec, {3})
    _, model = publish(rec, range(5), anchor_every=100, model=StepModel(seed=2), tolerate=PublishError)
    assert load_manifest(store, 4).base_version == 2
    # an anchor for version 3 of the same weights, made by a second writer on a copy of the run
    other = LocalStore(tmp_path / "other", fsync=False)
    for v in range(3):
        other.put(manifest_key(v), store.get(manifest_key(v)))
    model.set_step(3)
    DeltaSender(model.tensors, other).publish()  # a new writer starts with an anchor at newest + 1 = 3
    for key in other.list("objects/000000000003"):
        store.put(key, other.get(key))
    store.put(manifest_key(3), other.get(manifest_key(3)))  # ... and now it lands
    assert load_manifest(store, 3).kind == "anchor"

    plan = collect_garbage(store)
    assert plan.cut == 3 and plan.keep == (0, 1, 2, 3, 4) and plan.empty
    target = empty_target()
    receiver = DeltaReceiver(target, store)
    receiver.update()
    assert_holds(target, model, 4)
    receiver.update(3)
    assert_holds(target, model, 3)


def test_orphan_objects_below_the_cut_go_and_above_stay(store, monkeypatch):
    # Writers that died between their objects and their manifests (a live sender removes the objects
    # of a publish that failed: test_sender.py), and one still writing version 99.
    monkeypatch.setattr("torch_deltasync.sender._sender.remove_objects", lambda *args: None)
    rec = Recording(store)
    _DropManifest(rec, {2, 6})
    publish(rec, range(8), anchor_every=4, model=StepModel(seed=3), tolerate=PublishError)
    store.put("objects/000000000099/delta-r00000-of00001.safetensors", b"in flight")
    assert list_versions(store) == [0, 1, 3, 4, 5, 7] and 2 in folders(store) and 6 in folders(store)
    plan = collect_garbage(store)
    assert plan.cut == 4 and plan.orphans == (2,) and plan.delete == (0, 1, 3)
    assert folders(store) == [4, 5, 6, 7, 99]


def test_a_stray_file_that_is_no_store_key_does_not_stop_collection(store, caplog, capsys):
    """An editor's backup "...safetensors~" in an object folder: gc raised "invalid store key" after
    deleting the manifests, and every later gc (and the sender's retention) failed the same way, so
    the object folders stayed for good. The file is named in a warning and left alone."""
    publish(store, range(12))
    stray = "objects/000000000001/delta-r00000-of00001.safetensors~"
    (store.root / stray).write_bytes(b"backup")
    with caplog.at_level(logging.WARNING, logger="torch_deltasync"):
        assert cli_main(["gc", str(store.root), "--grace-s", "0"]) == 0
    assert list_versions(store) == [10, 11] and folders(store) == [1, 10, 11]
    assert store.list("objects/000000000001") == [stray] and (store.root / stray).read_bytes() == b"backup"
    assert any("safetensors~" in r.getMessage() and "remove it by hand" in r.getMessage() for r in caplog.records)
    assert cli_main(["gc", str(store.root), "--grace-s", "0"]) == 0  # and again


def test_gc_of_a_prefix_without_versions_says_so(store, capsys):
    publish(store, range(3))
    assert cli_main(["gc", str(store.root), "--prefix", "no-such-run"]) == 1
    assert ("no versions here; this store holds runs under the store's root (no --prefix): give one as --prefix; "
            "nothing to delete") in capsys.readouterr().out


def test_gc_of_a_folder_without_versions_deletes_nothing(tmp_path, capsys):
    """A path that holds no run may be any folder: not even an old file with a temporary's name
    goes (it once did, anywhere below the path)."""
    import os
    import time

    folder = tmp_path / "not-a-store" / "deep"
    folder.mkdir(parents=True)
    files = [folder / "report.tmp-final", folder / f"x.tmp-{'a' * 32}"]
    for f in files:
        f.write_bytes(b"precious")
        os.utime(f, (time.time() - 7200, time.time() - 7200))
    assert cli_main(["gc", str(tmp_path / "not-a-store")]) == 1
    assert "nothing to delete" in capsys.readouterr().out
    assert all(f.read_bytes() == b"precious" for f in files)


def test_gc_of_a_run_sweeps_its_crashed_writers_temporaries(store):
    import os
    import time

    publish(store, range(3))
    leftover = store.root / "versions" / f"000000000009.json.tmp-{'b' * 32}"
    leftover.write_bytes(b"half a manifest")
    os.utime(leftover, (time.time() - 7200, time.time() - 7200))
    collect_garbage(store)
    assert not leftover.exists() and list_versions(store) == [0, 1, 2]


def test_manifests_are_deleted_before_objects(store):
    publish(store, range(12))
    rec = Recording(store)
    plan = collect_garbage(rec)
    assert sorted(rec.deleted) == sorted(plan.manifest_keys + plan.object_keys) and plan.delete == tuple(range(10))
    last_manifest = max(i for i, k in enumerate(rec.deleted) if k.startswith("versions/"))
    first_object = min(i for i, k in enumerate(rec.deleted) if k.startswith("objects/"))
    assert last_manifest < first_object


def test_unreadable_manifests(store, caplog):
    publish(store, range(13))  # anchors 0, 5, 10
    store.put(manifest_key(3), b"{not json")
    store.put(manifest_key(12), b"{not json")
    with caplog.at_level(logging.WARNING):
        plan = collect_garbage(store)
    assert plan.cut == 10 and 3 in plan.delete and 12 in plan.keep  # kept at/above the cut
    assert "unreadable" in caplog.text


def _corrupt(store, version, kind="anchor"):
    key = next(o.key for o in load_manifest(store, version).objects if o.kind == kind)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x10
    store.put(key, bytes(data))
    return key


def test_the_cut_anchor_is_checked_before_anything_below_it_goes(store):
    """A corrupt cut anchor would be the only way in for new receivers once the versions below it
    are gone: the cut moves to the next older anchor whose objects check out."""
    _, model = publish(store, range(22))  # anchors 0, 5, 10, 15, 20
    key = _corrupt(store, 20)
    trusting = plan_retention(store, RetentionPolicy(verify_cut=False))
    assert trusting.cut == 20  # what retention did before: 0..19 would go
    plan = collect_garbage(store)
    assert (plan.cut, plan.keep, plan.delete) == (15, tuple(range(15, 22)), tuple(range(15)))
    assert len(plan.rejected) == 1 and plan.rejected[0].startswith(f"anchor 20: version 20: {key} has sha256 ")
    assert "passed over anchor 20: version 20:" in str(plan) and "cut anchor 15" in str(plan)
    target = empty_target()  # a new receiver: anchor 15, then the deltas, through 20's delta part
    receiver = DeltaReceiver(target, store)
    receiver.update(19)
    assert receiver.update() == 21
    assert_holds(target, model, 21)


def test_a_missing_anchor_object_and_no_sound_anchor_delete_nothing(store):
    publish(store, range(12))  # anchors 0, 5, 10
    store.delete(load_manifest(store, 10).anchor_objects[0].key)
    _corrupt(store, 5)
    plan = collect_garbage(store)
    assert plan.cut == 0 and plan.delete == () and plan.empty  # anchor 0 has nothing below it: not read
    assert [r.split(":")[0] for r in plan.rejected] == ["anchor 10", "anchor 5"]
    assert "no object 'objects/000000000010/anchor-r00000-of00001.safetensors'" in plan.rejected[0]
    assert list_versions(store) == list(range(12))


def test_the_cut_anchor_is_read_only_when_something_would_go(store):
    publish(store, range(12))
    rec = Recording(store)
    reads = []
    rec.on_get = reads.append
    collect_garbage(rec)
    anchor_key = load_manifest(store, 10).anchor_objects[0].key
    assert reads.count(anchor_key) >= 1 and list_versions(store) == [10, 11]
    reads.clear()
    assert collect_garbage(rec).empty and anchor_key not in reads  # nothing below the cut: no read


def test_dry_run_and_cli(store, capsys):
    publish(store, range(12))
    plan = collect_garbage(store, dry_run=True)
    assert not plan.empty and list_versions(store) == list(range(12))
    assert cli_main(["gc", str(store.root), "--grace-s", "0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "cut anchor 10" in out and "dry run: nothing deleted" in out and list_versions(store) == list(range(12))
    assert cli_main(["gc", str(store.root), "--grace-s", "0", "--keep-anchors", "1"]) == 0
    assert list_versions(store) == [5, 10, 11]
    assert "deleted 9 manifests" in capsys.readouterr().out


def test_policy_validation():
    for bad in (dict(keep_anchors=-1), dict(keep_anchors=1.0), dict(grace_s=-1.0), dict(grace_s=float("nan")),
                dict(grace_s=-10**400)):
        with pytest.raises(ValueError):
            RetentionPolicy(**bad)
    with pytest.raises(TypeError, match=r"RetentionPolicy: grace_s must be a number of seconds >= 0, got str '60'"):
        RetentionPolicy(grace_s="60")
    assert RetentionPolicy(grace_s=10**400).grace_s == float("inf")  # an int past a float's range: forever
    assert str(RetentionPolicy(grace_s=-0.0).grace_s) == "0.0"


def test_plan_refuses_a_clock_that_is_no_time(store):
    """``now=nan`` ignored the grace (every age compared false) and cut at the newest anchor."""
    publish(store, range(7))
    for now in (float("nan"), float("inf"), 10**400):
        with pytest.raises(ValueError, match=r"plan_retention: now \(a Unix time\) must be a finite number of seconds"):
            collect_garbage(store, RetentionPolicy(grace_s=3600), now=now)
    assert list_versions(store) == list(range(7))


def test_sender_option_collects_after_each_anchor(store):
    sender, model = publish(store, range(23), retention=RetentionPolicy(keep_anchors=1))
    assert list_versions(store) == [15, 20, 21, 22] and folders(store) == [15, 20, 21, 22]


def test_sender_retention_failure_never_fails_a_publish(store, caplog):
    rec = Recording(store)

    def broken(keys):
        raise StoreError("delete refused")

    rec.delete_many = broken
    with caplog.at_level(logging.WARNING):
        sender, model = publish(rec, range(12), retention=RetentionPolicy())
    assert sender.version == 11 and list_versions(store) == list(range(12))
    assert "retention after version" in caplog.text


def test_lagging_receiver_recovers_from_the_newest_anchor(store):
    model = StepModel(seed=4)
    sender = DeltaSender(model.tensors, store, anchor_every=5)
    target = empty_target()
    receiver = DeltaReceiver(target, store)
    for step in range(4):
        model.set_step(step)
        sender.publish()
    receiver.update()
    assert receiver.version == 3
    for step in range(4, 23):
        model.set_step(step)
        sender.publish()
    collect_garbage(store)  # deletes 0..19, including everything the receiver's chain had
    assert receiver.update() == 22
    assert (receiver.last_stats.from_version, receiver.last_stats.path) == (3, "anchor")
    assert_holds(target, model, 22)


def test_chain_deleted_during_an_update_is_replanned(store):
    """The receiver plans a delta chain, then a new anchor appears and retention deletes that chain
    before the download: ``update()`` plans again from the newest version and lands there."""
    model = StepModel(seed=6)
    sender = DeltaSender(model.tensors, store, anchor_every=5)
    for step in range(17):
        model.set_step(step)
        sender.publish()
    rec = Recording(store)
    target = empty_target()
    receiver = DeltaReceiver(target, rec)
    receiver.update(16)
    for step in range(17, 20):
        model.set_step(step)
        sender.publish()
    fired = []

    def race(key):
        if key.startswith("objects/") and not fired:
            fired.append(key)
            for step in (20, 21):  # anchor 20, delta 21
                model.set_step(step)
                sender.publish()
            collect_garbage(store)  # drops 0..19

    rec.on_get = race
    assert receiver.update() == 21
    # the race fired on the first object read of the planned chain 17..19 (read in parallel)
    assert fired and fired[0].split("/")[1] in ("000000000017", "000000000018", "000000000019")
    assert receiver.last_stats.path == "anchor"
    assert_holds(target, model, 21)
    rec.on_get = None
    with pytest.raises(FileNotFoundError):  # VersionNotFoundError, or ObjectNotFoundError if planned from cache
        receiver.update(18)  # an explicit version that is gone stays an error


@pytest.mark.timeout(300)
def test_retention_while_receivers_read(store):
    """A writer publishes 60 versions and collects garbage after every anchor while 4 receivers
    follow it at different lags (counted in versions, not seconds); every version any receiver
    holds is bit-exact. Receivers wait on the writer's progress, never on the clock: the slowest
    one holds version 3, then waits until retention has deleted that chain (anchor 30 collected)
    and must recover from the newest anchor."""
    model = StepModel(seed=7)
    progress = threading.Condition()
    published = [-1]  # newest version whose publish() returned (retention included)
    failures: list[str] = []
    lags = [1, 2, 7, 7]  # versions a receiver lets pass before updating again
    targets = [empty_target() for _ in lags]
    recovered = [0] * len(lags)
    checked = [0] * len(lags)
    last = 59

    def reached(v):
        with progress:
            progress.wait_for(lambda: published[0] >= v)

    holds_3 = threading.Event()  # the slowest receiver holds version 3; the writer may publish anchor 5

    def follow(i):
        receiver = DeltaReceiver(targets[i], LocalStore(store.root, fsync=False))
        check = StepModel(seed=7)
        try:
            want = 0
            if i == len(lags) - 1:
                reached(3)
                receiver.update(3)
                assert_holds(targets[i], check, 3)
                holds_3.set()
                want = 30  # fall behind the retained range: anchors 5..30 are collected meanwhile
            while True:
                reached(want)
                v = receiver.update()
                assert_holds(targets[i], check, v)  # version v == step v in this run
                checked[i] += 1
                st = receiver.last_stats
                if (st and st.path == "anchor" and st.from_version is not None
                        and not store.exists(manifest_key(st.from_version))):
                    recovered[i] += 1  # held a version retention had deleted
                if v == last:
                    return
                want = min(last, v + lags[i])
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(f"receiver {i}: {type(e).__name__}: {e}")
        finally:
            holds_3.set()

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(len(lags))]
    for t in threads:
        t.start()
    sender = DeltaSender(model.tensors, store, anchor_every=5, retention=RetentionPolicy())
    try:
        for step in range(last + 1):
            if step == 5:
                holds_3.wait()
            model.set_step(step)
            v = sender.publish()
            with progress:
                published[0] = v
                progress.notify_all()
    finally:
        with progress:
            published[0] = max(published[0], last)  # release the receivers even if a publish failed
            progress.notify_all()
        for t in threads:
            t.join()
    assert not failures, failures
    for t in targets:
        assert_holds(t, model, last)
    assert list_versions(store) == [55, 56, 57, 58, 59]
    assert recovered[-1] >= 1 and checked[-1] >= 3  # the slowest receiver recovered from the newest anchor
    assert all(c >= 2 for c in checked)
