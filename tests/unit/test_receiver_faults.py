"""Corrupt, malicious and failing stores: clear errors, weights untouched, chains never broken."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import PassThroughStore, make_mlp, train_step
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from torch_deltasync import DeltaReceiver, DeltaSender
from torch_deltasync.errors import ChecksumMismatchError, CorruptObjectError, IncompatibleTargetError, PublishError, StoreError, VersionNotFoundError
from torch_deltasync.format import read_header, sha256_hex
from torch_deltasync.keys import manifest_key
from torch_deltasync.manifest import seal_manifest
from torch_deltasync.testing import first_difference, state_bits


def publish_steps(store, n, *, anchor_every=100, lr=1e-4, codec="raw"):
    # raw by default: the forgeries below edit raw parts (idx/val); tests/unit/test_codecs_packed.py tampers
    # with packed blobs.
    trainer = make_mlp(0)
    opt = torch.optim.Adam(trainer.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, store, anchor_every=anchor_every, codec=codec)
    for _ in range(n):
        train_step(trainer, opt, gen)
        sender.publish()
    return trainer, sender, opt, gen


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rewrite(store, version, *, tensors=None, meta=None, raw=None, manifest=None, fix_sha=True):
    """Tamper with the single object of ``version`` like an attacker who also controls the manifest."""
    mdoc = json.loads(store.get(manifest_key(version)))
    key = mdoc["objects"][0]["key"]
    data = store.get(key)
    if raw is not None:
        data = raw(data)
    if tensors is not None or meta is not None:
        _, md = read_header(data)
        ts = st_load(data)
        if tensors is not None:
            tensors(ts)
        if meta is not None:
            meta(md)
        data = st_save(ts, metadata=md)
    store.put(key, data)
    if fix_sha:
        mdoc["objects"][0]["nbytes"] = len(data)
        mdoc["objects"][0]["sha256"] = sha256_hex(data)
    if manifest is not None:
        manifest(mdoc)
    store.put(manifest_key(version), seal_manifest(mdoc))


def first_changed(ts):
    return next(k for k in ts if k.endswith(":idx")).rpartition(":")[0]


def set_idx(ts, fn):
    name = first_changed(ts)
    ts[f"{name}:idx"] = fn(ts[f"{name}:idx"])


MALICIOUS = [
    ("index out of range", dict(tensors=lambda ts: set_idx(ts, lambda i: torch.cat([i[:-1], i.new_tensor([10**6])]))),
     CorruptObjectError, "outside"),
    ("duplicate indices", dict(tensors=lambda ts: set_idx(ts, lambda i: torch.cat([i[:1], i[:-1]]))),
     CorruptObjectError, "strictly increasing"),
    ("unsorted indices", dict(tensors=lambda ts: set_idx(ts, lambda i: i.flip(0))), CorruptObjectError, "strictly increasing"),
    ("wrong value dtype", dict(tensors=lambda ts: ts.__setitem__(f"{first_changed(ts)}:val", ts[f"{first_changed(ts)}:val"].float())),
     CorruptObjectError, "values must be"),
    ("unknown tensor name", dict(tensors=lambda ts: ts.__setitem__("evil.weight:idx", ts.pop(f"{first_changed(ts)}:idx"))),
     CorruptObjectError, "names no tensor"),
    ("count metadata lies", dict(meta=lambda md: md.__setitem__("counts", json.dumps({k: 1 for k in json.loads(md["counts"])}))),
     CorruptObjectError, "changes in its objects, manifest says"),
    ("object of another version", dict(meta=lambda md: md.__setitem__("version", "1")), CorruptObjectError, "metadata version"),
    ("manifest key with ..", dict(manifest=lambda m: m["objects"][0].__setitem__("key", "../../outside.safetensors")),
     CorruptObjectError, "invalid store key"),
    ("manifest absolute key", dict(manifest=lambda m: m["objects"][0].__setitem__("key", "/etc/passwd")),
     CorruptObjectError, "invalid store key"),
    ("oversized safetensors header", dict(raw=lambda d: struct.pack("<Q", 1 << 40) + d[8:]), CorruptObjectError, "header"),
    ("truncated object, sha fixed", dict(raw=lambda d: d[: len(d) // 2]), CorruptObjectError, "header|unreadable|safetensors"),
    ("shape of a tensor changed in the manifest",
     dict(manifest=lambda m: m["tensors"][0].__setitem__("shape", [99, 32])), IncompatibleTargetError, "shape"),
    ("unknown codec", dict(manifest=lambda m: m.__setitem__("codec", "evil")), CorruptObjectError, "unknown codec"),
]


@pytest.mark.parametrize("why,tamper,error,match", MALICIOUS, ids=[m[0] for m in MALICIOUS])
def test_malicious_delta_is_refused_and_weights_unchanged(store, why, tamper, error, match):
    publish_steps(store, 3)  # versions 0 (anchor), 1, 2
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    receiver.update(1)
    rewrite(store, 2, **tamper)
    before = state_bits(replica)
    with pytest.raises(error, match=match):
        receiver.update(2)
    assert same(before, state_bits(replica)), why
    assert receiver.version == 1
    receiver.verify()  # still exactly version 1


def test_flipped_byte_is_detected_by_sha256(store):
    publish_steps(store, 3)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    receiver.update(1)
    rewrite(store, 2, raw=lambda d: d[:-5] + bytes([d[-5] ^ 0x01]) + d[-4:], fix_sha=False)
    before = state_bits(replica)
    with pytest.raises(CorruptObjectError, match="sha256"):
        receiver.update(2)
    assert same(before, state_bits(replica)) and receiver.version == 1


def test_flipped_value_bit_with_forged_sha256_fails_the_checksum(store):
    publish_steps(store, 3)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    receiver.update(1)

    def flip(ts):
        name = first_changed(ts)
        v = ts[f"{name}:val"].clone()
        v.view(torch.int16)[0] ^= 1
        ts[f"{name}:val"] = v

    rewrite(store, 2, tensors=flip)
    before = state_bits(replica)
    with pytest.raises(ChecksumMismatchError, match="version 2"):
        receiver.update(2)
    assert same(before, state_bits(replica))


@pytest.mark.parametrize("codec", ["raw", "packed"])
def test_receiver_drift_is_repaired_from_the_anchor(store, codec):
    """A replica whose own weights were damaged recovers: the O(nnz) check sees the wrong old value
    (packed: the steps' base checksum does)."""
    trainer, sender, opt, gen = publish_steps(store, 2, codec=codec)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    receiver.update()
    train_step(trainer, opt, gen)
    sender.publish()
    d = receiver.plan()
    # damage exactly an element the next delta changes
    m = receiver.manifest(2)
    name = next(t.name for t in m.tensors if t.changed)
    from torch_deltasync.format import decode_delta
    delta = decode_delta(store.get(m.objects[0].key), m, m.objects[0])[name]
    with torch.no_grad():
        replica.state_dict()[name].view(-1)[delta.positions[0]] += 1.0
    assert d.path == "delta"
    receiver.update()
    assert receiver.last_stats.recovered and receiver.last_stats.path == "anchor"
    assert first_difference(trainer, replica) is None
    # damage elsewhere is invisible to O(nnz) updates but verify() finds it
    with torch.no_grad():
        replica.state_dict()["0.bias"][0] += 1.0
    with pytest.raises(ChecksumMismatchError, match=rf"{store.describe()}: version {receiver.version}: 1 tensors differ "
                                                    r"from the published checksums, e.g. \['0.bias'\]: the weights "
                                                    r"changed behind the receiver .*verify_or_forget\(\) then update\(\)"):
        receiver.verify()


def _truncate_anchor(store, version):
    key = next(o["key"] for o in json.loads(store.get(manifest_key(version)))["objects"] if "/anchor-" in o["key"])
    store.put(key, store.get(key)[:10])
    return key


@pytest.mark.parametrize("held", [None, 1], ids=["fresh receiver", "receiver far behind"])
def test_a_damaged_newest_anchor_is_crossed_from_an_older_one(store, held):
    """Anchors at 0, 3 and 6; anchor 6's object is truncated. Anchor 3, then the delta parts of 4-8
    (6's included), rebuild version 8: the recovery must not retry anchor 6."""
    trainer, *_ = publish_steps(store, 9, anchor_every=3)
    assert [json.loads(store.get(manifest_key(v)))["kind"] for v in (0, 3, 6)] == ["anchor"] * 3
    _truncate_anchor(store, 6)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    if held is not None:
        receiver.update(held)
    plan = receiver.plan()
    assert (plan.path, plan.steps[0].version) == ("anchor", 6)  # 1 -> 8: anchor 6 downloads less
    assert receiver.update() == 8
    st = receiver.last_stats
    assert st.recovered and st.path == "anchor" and st.versions_applied == 6  # anchor 3, deltas 4-8
    assert first_difference(trainer, replica) is None


class CountingStore(PassThroughStore):
    """Counts the reads of each object (manifests and pointers are not counted)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.reads = {}

    def get(self, key, *, start=None, end=None):
        if key.startswith("objects/"):
            self.reads[key] = self.reads.get(key, 0) + 1
        return self.inner.get(key, start=start, end=end)


def test_recovery_avoids_what_failed_and_never_retries_a_damaged_delta_part(store):
    """Anchors at 0, 3, 6. (a) Anchor 6 damaged, the receiver holding 6's predecessor chain at 4:
    the recovery takes the delta path from 4, not another anchor. (b) Delta 7 damaged: every path to
    8 needs it, so the error comes after one attempt, without downloading anchors 3 or 0."""
    trainer, *_ = publish_steps(store, 9, anchor_every=3)
    counting = CountingStore(store)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, counting)
    receiver.update(5)
    anchor6 = next(o.key for o in receiver.manifest(6).anchor_objects)
    intact = store.get(anchor6)
    _truncate_anchor(store, 6)
    assert receiver.plan(7).steps[0].version == 6  # anchor 6 downloads less than the deltas 6-7 from 5
    counting.reads.clear()
    assert receiver.update(7) == 7
    st = receiver.last_stats
    assert st.recovered and st.path == "delta" and st.from_version == 5
    assert set(counting.reads) == {anchor6} | {o.key for v in (6, 7) for o in receiver.manifest(v).delta_objects}

    store.put(anchor6, intact)
    delta7 = next(o.key for o in receiver.manifest(7).delta_objects)
    store.put(delta7, store.get(delta7)[:10])
    fresh = DeltaReceiver(make_mlp(1, torch.bfloat16), counting)
    counting.reads.clear()
    with pytest.raises(CorruptObjectError, match=f"version 7: {delta7} is 10 bytes"):
        fresh.update(8)
    # one attempt (anchor 6, deltas 7 and 8; a bad read is read 3 times): anchors 3 and 0 never read.
    # Delta 8 is downloaded in parallel and may be cancelled by delta 7's failure before it is read.
    assert {anchor6, delta7} <= set(counting.reads) <= {anchor6, delta7, next(o.key for o in receiver.manifest(8).delta_objects)}
    assert counting.reads[anchor6] == 1


SEALED_DAMAGE = [  # delta 7's object rewritten and the manifest resealed: the sha256 checks pass
    ("oversized header", dict(raw=lambda d: struct.pack("<Q", 1 << 63) + d[8:]), "header"),
    ("count metadata lies", dict(meta=lambda md: md.__setitem__("counts", json.dumps({k: 1 for k in json.loads(md["counts"])}))),
     "changes in its objects, manifest says"),
    ("index out of range", dict(tensors=lambda ts: set_idx(ts, lambda i: torch.cat([i[:-1], i.new_tensor([10**6])]))),
     "outside"),
]


@pytest.mark.parametrize("tamper,match", [d[1:] for d in SEALED_DAMAGE], ids=[d[0] for d in SEALED_DAMAGE])
def test_a_sealed_delta_part_that_does_not_decode_ends_the_update_at_once(store, tamper, match):
    """A delta object whose bytes match its manifest but do not read or decode is as damaged as a
    truncated one: every path to 8 needs delta 7, so anchors 3 and 0 are never downloaded."""
    publish_steps(store, 9, anchor_every=3)
    rewrite(store, 7, **tamper)
    counting = CountingStore(store)
    replica = make_mlp(1, torch.bfloat16)
    before = state_bits(replica)
    receiver = DeltaReceiver(replica, counting)
    with pytest.raises(CorruptObjectError, match=f"version 7.*{match}"):
        receiver.update(8)
    anchors = {o.key for v in (0, 3, 6) for o in receiver.manifest(v).anchor_objects}
    assert set(counting.reads) & anchors == {o.key for o in receiver.manifest(6).anchor_objects}
    assert same(before, state_bits(replica)) and receiver.version is None


def test_without_recovery_the_first_failure_is_raised(store):
    publish_steps(store, 9, anchor_every=3)
    key = _truncate_anchor(store, 6)
    replica = make_mlp(1, torch.bfloat16)
    before = state_bits(replica)
    with pytest.raises(CorruptObjectError, match=f"version 6: {key} is 10 bytes"):
        DeltaReceiver(replica, store, recover=False).update()
    assert same(before, state_bits(replica))


def test_damaged_anchor_values_are_blamed_on_the_anchor_path_not_the_held_weights(store):
    """Every value of one tensor in anchor 0 off by one ULP, the object and manifest resealed: the
    first delta's base checksum fails on the anchor path, and the error says the base came from
    the anchor (no weights were held)."""
    trainer, *_ = publish_steps(store, 3, codec="packed")

    def off_by_one(ts):
        name = next(k for k in ts if k.endswith("weight"))
        ts[name] = (ts[name].view(torch.int16) ^ 1).view(ts[name].dtype)

    rewrite(store, 0, tensors=off_by_one)
    replica = make_mlp(1, torch.bfloat16)
    before = state_bits(replica)
    with pytest.raises(ChecksumMismatchError, match=r"version 1 tensor .*on this anchor path the base is anchor "
                                                    r"version 0 .*not weights held here"):
        DeltaReceiver(replica, store).update()
    assert same(before, state_bits(replica))


def test_a_damaged_only_anchor_raises_its_own_error(store):
    publish_steps(store, 3)
    key = _truncate_anchor(store, 0)
    replica = make_mlp(1, torch.bfloat16)
    before = state_bits(replica)
    with pytest.raises(CorruptObjectError, match=f"version 0: {key} is 10 bytes"):
        DeltaReceiver(replica, store).update()
    assert same(before, state_bits(replica))


class FailingStore(PassThroughStore):
    """Wraps a store; raises on puts whose key matches ``fail_on`` while ``armed``."""

    def __init__(self, inner, fail_on):
        super().__init__(inner)
        self.fail_on, self.armed = fail_on, False

    def put(self, key, data):
        if self.armed and self.fail_on(key):
            raise StoreError(f"injected failure writing {key}")
        self.inner.put(key, data)


@pytest.mark.parametrize("fail_on,what", [
    (lambda k: k.startswith("versions/"), "writer stopped after its objects, before the manifest"),
    (lambda k: k.startswith("objects/"), "object upload fails"),
])
def test_failed_publish_leaves_no_version_and_next_publish_recovers(store, fail_on, what):
    fs = FailingStore(store, fail_on)
    trainer = make_mlp(0)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, fs, anchor_every=100)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    for _ in range(2):
        train_step(trainer, opt, gen)
        sender.publish()
    receiver.update()
    train_step(trainer, opt, gen)
    fs.armed = True
    with pytest.raises(PublishError, match="not published"):
        sender.publish()  # burns version 2
    fs.armed = False
    assert receiver.newest_version() == 1, what
    with pytest.raises(VersionNotFoundError):
        receiver.update(2)
    for _ in range(3):  # later versions are deltas on the last *published* state
        train_step(trainer, opt, gen)
        v = sender.publish()
        assert receiver.update() == v
        assert first_difference(trainer, replica) is None, what
    assert receiver.manifest(3).base_version == 1
    fresh = make_mlp(3, torch.bfloat16)
    DeltaReceiver(fresh, store).update()
    assert first_difference(trainer, fresh) is None


def test_failed_background_publish_is_reported_and_recovered(store):
    fs = FailingStore(store, lambda k: k.startswith("objects/"))
    trainer = make_mlp(0)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, fs, background=True)
    sender.publish()
    sender.flush()
    fs.armed = True
    train_step(trainer, opt, gen)
    sender.publish()
    with pytest.raises(PublishError, match="injected"):
        sender.flush()
    fs.armed = False
    train_step(trainer, opt, gen)
    v = sender.publish()
    sender.flush()
    replica = make_mlp(1, torch.bfloat16)
    assert DeltaReceiver(replica, store).update() == v
    assert first_difference(trainer, replica) is None


def test_garbage_latest_is_ignored(store):
    publish_steps(store, 2)
    store.put("LATEST", b"\xff not a number")
    assert DeltaReceiver(make_mlp(1, torch.bfloat16), store).update() == 1
    store.put("LATEST", b"999")
    assert DeltaReceiver(make_mlp(1, torch.bfloat16), store).update() == 1


def test_an_oversized_latest_is_garbage_and_never_read_whole(store):
    """A ``LATEST`` of 1 MiB (a version number padded with spaces): only its first bytes are read,
    and it counts as garbage (a listing finds the newest version)."""
    publish_steps(store, 2)
    store.put("LATEST", b"0" + b" " * (1 << 20))
    reads = []

    class Recording(PassThroughStore):
        def get(self, key, *, start=None, end=None):
            data = super().get(key, start=start, end=end)
            reads.append((key, len(data)))
            return data

    assert DeltaReceiver(make_mlp(1, torch.bfloat16), Recording(store)).update() == 1
    assert [n for key, n in reads if key == "LATEST"] == [33]


def test_missing_chain_link_is_a_clear_error(store):
    publish_steps(store, 4)
    store.delete(manifest_key(0))  # the anchor is gone
    with pytest.raises(VersionNotFoundError, match="needs version 0, which is not in the store"):
        DeltaReceiver(make_mlp(1, torch.bfloat16), store).update()


@pytest.mark.parametrize("version", [2, None])
def test_an_object_gone_after_planning_names_the_version_and_what_to_do(store, version):
    # retention (or a hand) deleted an object of a manifest still visible: the receiver's plan
    # names it, the download finds it gone, every recovery path needs it
    publish_steps(store, 4)
    key = json.loads(store.get(manifest_key(2)))["objects"][0]["key"]
    store.delete(key)
    target = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(target, store)
    receiver.update(1)
    before = state_bits(target)
    hint = ("it was deleted after the update was planned.*or lost. update\\(\\) without a version plans again"
            if version is not None
            else "the store lost an object that a visible manifest names.*deltasync verify")
    with pytest.raises(StoreError, match=rf"no object '{key}', needed to reach version {2 if version else 3}: {hint}"):
        receiver.update(version)
    assert same(state_bits(target), before) and receiver.version == 1


def test_a_failed_recovery_still_names_what_failed_first(store):
    # The held weights drifted (the delta path from 3 fails its base checksum); recovery from anchor
    # 3 (damaged), then anchor 0, meets an old damaged delta (version 1). The error named only
    # version 1: the cause was in the warnings.
    publish_steps(store, 6, anchor_every=3)
    key = json.loads(store.get(manifest_key(1)))["objects"][0]["key"]
    store.put(key, store.get(key)[:100])
    target = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(target, store)
    assert receiver.update(3) == 3
    _truncate_anchor(store, 3)
    with torch.no_grad():
        target[0].weight.view(torch.int16).bitwise_xor_(1)  # every element one ULP off
    before = state_bits(target)
    with pytest.raises(CorruptObjectError, match=r"version 1: .* is 100 bytes.*; recovering from the first failure: "
                                                 r"ChecksumMismatchError: .*version 5: the staged state differs .*\['0.weight'\]"):
        receiver.update(5)
    assert same(state_bits(target), before) and receiver.version == 3


# --- writers that share a prefix, wiped buckets, stale pointers ----------------------------------------


def test_a_second_writer_cannot_replace_a_published_version(store):
    a, b = make_mlp(0), make_mlp(7)
    # Both start at version 0; B stops cleanly (freeing the prefix) before publishing, A publishes
    # and stops, then B comes back: the lease is free again, but version 0 is taken.
    writer_b = DeltaSender(b, store)
    writer_b.close()
    writer_a = DeltaSender(a, store)
    assert writer_a.publish() == 0
    writer_a.close()
    manifest_a = store.get(manifest_key(0))
    with pytest.raises(PublishError, match="another writer already uses version 0"):
        writer_b.publish()
    assert store.get(manifest_key(0)) == manifest_a  # immutable
    assert writer_b.publish() == 1 and writer_b.last_stats.kind == "anchor"  # continues after the newest
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    assert receiver.update(0) == 0 and first_difference(a, replica) is None
    assert receiver.update() == 1 and first_difference(b, replica) is None


def test_receiver_recovers_after_the_bucket_is_wiped_and_a_new_run_starts(store):
    publish_steps(store, 4)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    assert receiver.update() == 3
    for key in store.list():
        store.delete(key)
    trainer, sender, opt, gen = publish_steps(store, 2)  # versions 0, 1 of another run
    for _ in range(3):  # the numbers 2..4 now name other weights than the receiver cached
        train_step(trainer, opt, gen)
        sender.publish()
    assert receiver.update() == 4
    assert first_difference(trainer, replica) is None


def test_a_new_run_reusing_the_held_version_number_is_not_taken_for_it(store):
    """The prefix was wiped and a new run published up to exactly the version the receiver holds:
    update() returned it as held ("noop"), verify() passed against the cached manifest of the old
    run, and a follower never moved (it compared numbers only), while the replica held the old
    run's weights under the new run's number."""
    from torch_deltasync.follow import wait_for_newer

    old_trainer, _, _, _ = publish_steps(store, 4)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    assert receiver.update() == 3 and not receiver.needs_update()
    for key in store.list():
        store.delete(key)
    trainer = make_mlp(5)  # versions 0..3 of another run, other weights
    sender = DeltaSender(trainer, store, anchor_every=100)
    for _ in range(4):
        with torch.no_grad():
            next(trainer.parameters()).add_(1e-2)
        sender.publish()
    assert first_difference(old_trainer, replica) is None and first_difference(trainer, replica) is not None
    assert receiver.newest_version() == 3 and receiver.needs_update()
    assert wait_for_newer(receiver, poll_s=0.01, idle_timeout_s=0) == 3
    with pytest.raises(ChecksumMismatchError, match=r"version 3 was published again after the target received "
                                                    r"it .*verify_or_forget\(\) then update\(\)"):
        receiver.verify()
    plan = receiver.plan()
    assert plan.path == "anchor" and "published again" in plan.steps[0].reason
    assert receiver.update() == 3 and receiver.last_stats.path == "anchor"
    assert first_difference(trainer, replica) is None
    assert not receiver.needs_update() and receiver.plan().path == "noop"
    receiver.verify()


def test_a_version_not_visible_names_the_newest_and_a_wiped_store_the_held_one(store):
    """"version 7 is not visible" said neither what is there nor what to do; a receiver holding a
    version of a store whose versions were all deleted was told nothing had been published yet."""
    publish_steps(store, 3, anchor_every=2)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    with pytest.raises(VersionNotFoundError, match=r"version 7 is not visible; the newest visible version is 2 "
                                                   r"\(7 is not published yet: wait_for\(7\) waits for it\)"):
        receiver.update(7)
    assert receiver.update() == 2
    store.delete(manifest_key(0))
    with pytest.raises(VersionNotFoundError, match=r"version 0 is not visible; the newest visible version is 2 "
                                                   r"\(update\(\) without a version takes it\)"):
        receiver.update(0)
    before = state_bits(replica)
    for key in store.list():
        store.delete(key)
    with pytest.raises(VersionNotFoundError, match=r"no version is visible, yet the target holds version 2 from this "
                                                   r"store: its versions were deleted .*keeps its weights"):
        receiver.update()
    assert receiver.version == 2 and same(state_bits(replica), before)


def test_a_store_that_lost_versions_does_not_move_the_receiver_back(store):
    """A store restored from a backup taken at version 4 while the receiver held 7 (same run):
    update() silently went back to 4, and rollouts tagged with 7 were then sampled by 4."""
    trainer, sender, opt, gen = publish_steps(store, 8)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    assert receiver.update() == 7
    before = state_bits(replica)
    for v in (5, 6, 7):
        store.delete(manifest_key(v))
    store.put("LATEST", b"4")
    with pytest.raises(VersionNotFoundError, match=r"newest version is 4, older than the held version 7 of the same "
                                                   r"run .*the store lost versions.*update\(version=4\) goes back"):
        receiver.update()
    assert receiver.version == 7 and same(state_bits(replica), before)
    assert receiver.update(4) == 4  # on purpose
    sender._lease.release()
    sender = DeltaSender(trainer, store, anchor_every=100)  # a writer after the restore goes on from there
    train_step(trainer, opt, gen)
    assert sender.publish() == 8 and receiver.update() == 8 and first_difference(trainer, replica) is None


def test_a_failed_latest_write_does_not_hide_newer_versions(store):
    fs = FailingStore(store, lambda k: k == "LATEST" or k.startswith("versions/000000000003"))
    trainer, sender, opt, gen = publish_steps(fs, 3)  # 0, 1, 2 (LATEST = 2)
    fs.armed = True
    train_step(trainer, opt, gen)
    with pytest.raises(PublishError):
        sender.publish()  # version 3 burned
    train_step(trainer, opt, gen)
    assert sender.publish() == 4  # visible, but LATEST could not be written
    receiver = DeltaReceiver(make_mlp(1, torch.bfloat16), store)
    assert receiver.newest_version() == 4  # LATEST was removed rather than left at 2
    fs.armed = False
    sender.flush()  # writes the pending LATEST
    assert store.get("LATEST") == b"4"


def test_version_numbers_end_cleanly(store):
    from torch_deltasync.keys import MAX_VERSION

    store.put(manifest_key(MAX_VERSION), b"{}")  # a stray manifest with the largest number
    sender = DeltaSender(make_mlp(0), store)
    with pytest.raises(PublishError, match="new prefix"):
        sender.publish()
    assert store.list("objects") == []


def test_overlapping_anchor_blocks_are_refused(store):
    """Two anchor objects (ranks 0 and 1 of 2) that both claim the whole tensor."""
    from torch_deltasync import Manifest
    from torch_deltasync.checksum import tensor_checksum
    from torch_deltasync.format import encode_anchor
    from torch_deltasync.layout import TensorSlice
    from torch_deltasync.keys import object_key
    from torch_deltasync.manifest import ObjectEntry, TensorEntry

    w = torch.randn(4, 3).to(torch.bfloat16)
    objects = []
    for rank in (0, 1):
        data = encode_anchor({"w": (w, TensorSlice.full(w.shape))}, version=0, dtype=torch.bfloat16, rank=rank, world=2)
        key = object_key(0, "anchor", rank, 2)
        store.put(key, data)
        objects.append(ObjectEntry(key, len(data), sha256_hex(data), rank, 2))
    m = Manifest(version=0, kind="anchor", base_version=None, anchor_version=0, codec="raw",
                 inference_dtype=torch.bfloat16, run_id="x", tensors=(TensorEntry("w", (4, 3), tensor_checksum(w), 12),),
                 objects=tuple(objects))
    store.put(manifest_key(0), m.to_json())
    held = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    with pytest.raises(CorruptObjectError, match="overlap"):
        DeltaReceiver(held, store).update()
    assert not held["w"].any()


def test_oversized_objects_are_refused_without_reading_them_whole(store, monkeypatch):
    from torch_deltasync import manifest as manifest_mod

    publish_steps(store, 1)
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 1000)
    store.put(manifest_key(1), b" " * 100_000)
    reads = []
    original = store.get

    def counting_get(key, *, start=None, end=None):
        data = original(key, start=start, end=end)
        reads.append((key, len(data)))
        return data

    monkeypatch.setattr(store, "get", counting_get)
    with pytest.raises(CorruptObjectError, match=r"\(manifest of version 1\) is 100,000 bytes, above the 1,000-byte limit"):
        DeltaReceiver(make_mlp(1, torch.bfloat16), store).update(1)
    assert max(n for k, n in reads if k == manifest_key(1)) == 1001


def test_verify_or_forget_drops_a_held_state_that_no_longer_verifies(store):
    """Weights replaced behind the receiver's back: the held version is forgotten, and the next
    update rebuilds from an anchor (bit-exact again)."""
    trainer, sender, opt, gen = publish_steps(store, 2)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    assert receiver.verify_or_forget() is None  # nothing held: nothing to check
    receiver.update()
    assert receiver.verify_or_forget() is None and receiver.version == 1
    with torch.no_grad():
        replica.state_dict()["0.bias"][0] += 1.0
    err = receiver.verify_or_forget()
    assert isinstance(err, ChecksumMismatchError) and "version 1" in str(err) and receiver.version is None
    receiver.update()
    assert receiver.last_stats.path == "anchor" and receiver.version == 1
    assert first_difference(trainer, replica) is None


def test_verify_waits_for_an_update_in_progress(store):
    """``verify()`` on one thread while ``update()`` runs on another checks one held version: the
    update waits for the verify holding the receiver (no false mismatch, no "nothing is held")."""
    import threading

    from torch_deltasync import ModuleTarget

    inside, go = threading.Event(), threading.Event()

    class HeldChecksum(ModuleTarget):  # verify() stops inside its checksums until told to go on
        def checksum(self, name, dtype):
            if threading.current_thread() is not threading.main_thread():
                inside.set()
                assert go.wait(30)
            return super().checksum(name, dtype)

    trainer = make_mlp(0)
    sender = DeltaSender(trainer, store, anchor_every=100)
    gen = torch.Generator().manual_seed(0)
    assert sender.publish() == 0
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(HeldChecksum(replica), store)
    assert receiver.update() == 0
    train_step(trainer, torch.optim.SGD(trainer.parameters(), lr=1e-2), gen)
    assert sender.publish() == 1
    errors: list[BaseException] = []

    def verify():
        try:
            receiver.verify()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    checker = threading.Thread(target=verify)
    checker.start()
    assert inside.wait(30)
    updater = threading.Thread(target=receiver.update)
    updater.start()
    updater.join(0.3)
    assert updater.is_alive() and receiver.version == 0, "the update must wait for the verify"
    go.set()
    checker.join(30)
    updater.join(30)
    assert not errors and receiver.version == 1
    assert first_difference(replica, trainer) is None


def test_a_targets_own_corrupt_object_error_keeps_its_type_and_the_recovery(store):
    """A Target raising a CorruptObjectError subclass with a constructor of its own (the store's
    name cannot be put in front of it by rebuilding it): raised as it is, and the update still
    recovers from the anchor."""
    from torch_deltasync import ModuleTarget

    class PositionsError(CorruptObjectError):
        def __init__(self, name, lo, hi):
            super().__init__(f"{name!r}: positions [{lo}, {hi}] outside the shard")

    class Failing(ModuleTarget):
        fail = False

        def read(self, name, positions, dtype):
            if self.fail:
                raise PositionsError(name, 0, 9)
            return super().read(name, positions, dtype)

    trainer = make_mlp(0)
    sender = DeltaSender(trainer, store, anchor_every=100)
    assert sender.publish() == 0
    target = Failing(make_mlp(1, torch.bfloat16))
    receiver = DeltaReceiver(target, store)
    assert receiver.update() == 0
    train_step(trainer, torch.optim.SGD(trainer.parameters(), lr=1e-2), torch.Generator().manual_seed(0))
    assert sender.publish() == 1
    target.fail = True
    assert receiver.update() == 1
    st = receiver.last_stats
    assert st.recovered and st.path == "anchor" and st.recovered_from.startswith("PositionsError: ")
    assert first_difference(receiver.target.tensors, trainer) is None


def test_a_digest_read_cut_short_is_no_new_run(store):
    """The first bytes of the held version's manifest (its digest) come back short: the receiver
    reads the whole manifest to decide instead of taking the held version for republished (which
    would rebuild it from an anchor, or fail verify())."""
    from torch_deltasync.manifest import _DIGEST_NBYTES

    publish_steps(store, 2)
    cut, objects_read = [], []

    class CutShort(PassThroughStore):
        def get(self, key, *, start=None, end=None):
            data = super().get(key, start=start, end=end)
            objects_read.append(key.startswith("objects/"))
            if cut and key.startswith("versions/") and end == _DIGEST_NBYTES:
                cut.pop()
                return data[:40]
            return data

    receiver = DeltaReceiver(make_mlp(1, torch.bfloat16), CutShort(store))
    assert receiver.update() == 1
    objects_read.clear()
    cut.append(1)
    assert not receiver.needs_update() and not cut
    cut.append(1)
    assert receiver.update(1) == 1 and not cut
    cut.append(1)
    receiver.verify()
    assert not cut and not any(objects_read)  # nothing downloaded: the held version stands
