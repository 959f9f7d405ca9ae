"""End to end through ``s3://`` against a real S3-protocol server (moto) on 127.0.0.1: a writer and
receivers with different lags stay bit-exact over 100 versions, with retention on; a new writer on an
existing prefix continues after the newest version and receivers follow it with no manual step."""

from __future__ import annotations


from torch_deltasync import DeltaReceiver, DeltaSender, RetentionPolicy, RetryPolicy, open_store
from torch_deltasync.keys import list_versions
from torch_deltasync.manifest import load_manifest

from remote_helpers import StepModel, assert_holds, empty_target
from s3_server import make_bucket

RETRY = RetryPolicy(attempts=4, base_delay_s=0.01, timeout_s=30)


def test_100_versions_bit_exact_through_s3(s3):
    url = f"s3://{make_bucket(s3)}/runs/grpo-1"
    model = StepModel(seed=21)
    sender = DeltaSender(model.tensors, open_store(url, endpoint_url=s3, retry=RETRY), anchor_every=10,
                         retention=RetentionPolicy(keep_anchors=1))
    every, lagging, late = empty_target(), empty_target(), empty_target()
    r_every = DeltaReceiver(every, open_store(url, endpoint_url=s3, retry=RETRY))
    r_lagging = DeltaReceiver(lagging, open_store(url, endpoint_url=s3, retry=RETRY))
    r_late = None
    paths = {"lagging": set(), "late": set()}
    for step in range(100):
        model.set_step(step)
        assert sender.publish() == step
        assert r_every.update() == step
        assert_holds(every, model, step)
        if step % 9 == 8:
            assert r_lagging.update() == step
            assert_holds(lagging, model, step)
            paths["lagging"].add(r_lagging.last_stats.path)
        if step == 50:
            r_late = DeltaReceiver(late, open_store(url, endpoint_url=s3, retry=RETRY))
        if r_late is not None and step % 4 == 0:
            assert r_late.update() == step
            assert_holds(late, model, step)
            paths["late"].add(r_late.last_stats.path)
    for receiver, target in ((r_lagging, lagging), (r_late, late)):
        assert receiver.update() == 99
        assert_holds(target, model, 99)
    assert r_every.last_stats.path == "delta" and paths["lagging"] == {"delta", "anchor"}
    # retention ran through S3 batch deletes: the newest anchor, one older anchor, and after
    store = open_store(url, endpoint_url=s3)
    assert list_versions(store) == [80] + list(range(90, 100))
    assert {k.split("/")[1] for k in store.list("objects")} == {f"{v:012d}" for v in [80, *range(90, 100)]}
    sender.close()  # frees the prefix while the S3 server still runs


def test_new_writer_continues_after_the_newest_version(s3):
    url = f"s3://{make_bucket(s3)}/runs/restart"
    model = StepModel(seed=22)
    first = DeltaSender(model.tensors, open_store(url, endpoint_url=s3, retry=RETRY), anchor_every=100)
    target = empty_target()
    receiver = DeltaReceiver(target, open_store(url, endpoint_url=s3, retry=RETRY))
    for step in range(7):
        model.set_step(step)
        first.publish()
    receiver.update()
    assert receiver.version == 6
    del first  # the trainer dies; a new process starts from its own (restored) weights
    model = StepModel(seed=22)
    model.set_step(40)
    second = DeltaSender(model.tensors, open_store(url, endpoint_url=s3, retry=RETRY), anchor_every=100)
    assert second.publish() == 7
    store = open_store(url, endpoint_url=s3)
    m = load_manifest(store, 7)
    assert m.kind == "anchor" and m.run_id == second.run_id
    for step in (41, 42):
        model.set_step(step)
        second.publish()
    assert receiver.update() == 9  # no manual step: the receiver sees 7 is not on its chain
    assert (receiver.last_stats.from_version, receiver.last_stats.path) == (6, "anchor")
    assert_holds(target, model, 42)
    second.close()
