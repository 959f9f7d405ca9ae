"""Sender -> store -> receiver in one process: bit-exactness across dtypes, layouts and lifecycles."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from helpers import make_mlp, train_step

from torch_deltasync import AnchorPolicy, DeltaReceiver, DeltaSender, LocalStore, open_store
from torch_deltasync.errors import IncompatibleTargetError, VersionNotFoundError
from torch_deltasync.testing import adam_step, first_difference, state_bits, tiny_qwen3


def int_bits(t: torch.Tensor) -> torch.Tensor:
    """The integer view of ``t``'s storage (bit patterns, whatever the float dtype)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_synced(trainer, receiver_model, dtype=torch.bfloat16):
    diff = first_difference(trainer, receiver_model, dtype)
    assert diff is None, diff


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_version_bit_exact(store, dtype):
    trainer = make_mlp(0)
    replica = make_mlp(1, dtype)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, store, anchor_every=4, inference_dtype=dtype)
    receiver = DeltaReceiver(replica, store)
    assert receiver.version is None
    for step in range(10):
        train_step(trainer, opt, gen)
        v = sender.publish()
        assert v == step
        assert receiver.update() == v == receiver.version
        assert_synced(trainer, replica, dtype)
    kinds = [s.kind for s in sender.history]
    assert kinds == ["anchor", "delta", "delta", "delta", "anchor", "delta", "delta", "delta", "anchor", "delta"]
    receiver.verify()


def test_fp32_receiver_holds_bf16_values_exactly(store):
    trainer, replica = make_mlp(0), make_mlp(1, torch.float32)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, store)
    receiver = DeltaReceiver(replica, store)
    for _ in range(3):
        train_step(trainer, opt, gen)
        sender.publish()
        receiver.update()
    for (n, a), b in zip(trainer.state_dict().items(), replica.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float().view(torch.int32), b.view(torch.int32)), n


def test_late_receiver_catches_up_and_can_go_back(store):
    trainer = make_mlp(0)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, store, anchor_every=5)
    snapshots = {}
    for _ in range(12):
        train_step(trainer, opt, gen)
        v = sender.publish()
        snapshots[v] = state_bits(trainer)
    late = make_mlp(2, torch.bfloat16)
    receiver = DeltaReceiver(late, store)
    plan = receiver.plan()
    assert [s.version for s in plan.steps] == [10, 11] and plan.path == "anchor"
    assert receiver.update() == 11
    assert_synced(trainer, late)
    for target in (7, 3, 11):  # back to older versions, then forward again
        assert receiver.update(target) == target
        got = state_bits(late)
        assert all(torch.equal(got[n], snapshots[target][n]) for n in got)
    assert receiver.plan(11).path == "noop"
    with pytest.raises(VersionNotFoundError):
        receiver.update(99)


def test_delta_path_from_an_older_version(store):
    trainer = make_mlp(0)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, store, anchor_every=100)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    train_step(trainer, opt, gen)
    sender.publish()
    receiver.update()
    for _ in range(6):
        train_step(trainer, opt, gen)
        sender.publish()
    plan = receiver.plan()
    assert plan.path == "delta" and [s.version for s in plan.steps] == [1, 2, 3, 4, 5, 6]
    receiver.update()
    assert receiver.last_stats.path == "delta" and receiver.last_stats.versions_applied == 6
    assert_synced(trainer, replica)


def test_qwen3_tied_and_untied(store):
    trainer = tiny_qwen3("tiny", tie_word_embeddings=True)
    tied = tiny_qwen3("tiny", seed=5, tie_word_embeddings=True, dtype=torch.bfloat16)
    untied = tiny_qwen3("tiny", seed=6, tie_word_embeddings=False, dtype=torch.bfloat16)
    opt = torch.optim.Adam(trainer.parameters(), lr=3e-6)
    sender = DeltaSender(trainer, store)
    r_tied, r_untied = DeltaReceiver(tied, store), DeltaReceiver(untied, store)
    for _ in range(3):
        adam_step(trainer, opt)
        v = sender.publish()
        assert r_tied.update() == v and r_untied.update() == v
        assert_synced(trainer, tied)
        assert_synced(trainer, untied)  # the alias lm_head.weight is mirrored into the untied copy
    manifest = r_tied.manifest(v)
    assert manifest.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in manifest.tensor_map()


def test_untied_sender_cannot_feed_tied_receiver(store):
    trainer = tiny_qwen3("tiny", tie_word_embeddings=False)
    tied = tiny_qwen3("tiny", seed=5, tie_word_embeddings=True, dtype=torch.bfloat16)
    DeltaSender(trainer, store).publish()
    before = state_bits(tied)
    with pytest.raises(IncompatibleTargetError, match="ties"):
        DeltaReceiver(tied, store).update()
    after = state_bits(tied)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("change,match", [
    (lambda sd: sd.pop("2.bias"), "not published|unknown"),
    (lambda sd: sd.__setitem__("extra", torch.zeros(3)), "not published"),
    (lambda sd: sd.__setitem__("2.bias", torch.zeros(17)), "shape"),
    (lambda sd: sd.__setitem__("2.bias", torch.zeros(16, dtype=torch.float16)), "cannot hold"),
])
def test_incompatible_receiver_is_refused_untouched(store, change, match):
    DeltaSender(make_mlp(0), store).publish()
    sd = {k: v.clone() for k, v in make_mlp(1, torch.bfloat16).state_dict().items()}
    change(sd)
    before = {k: int_bits(v).clone() for k, v in sd.items()}
    with pytest.raises(IncompatibleTargetError, match=match):
        DeltaReceiver(sd, store).update()
    assert all(torch.equal(before[k], int_bits(sd[k])) for k in sd)  # bits: -0.0 == 0.0 as floats


def test_restarted_writer_continues_with_an_anchor(store):
    trainer = make_mlp(0)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    s1 = DeltaSender(trainer, store)
    for _ in range(3):
        train_step(trainer, opt, gen)
        s1.publish()
    receiver.update()
    # Right after a crash the dead writer's lease is still live: the restart takes the prefix over.
    s2 = DeltaSender(trainer, store, takeover=True)
    train_step(trainer, opt, gen)
    assert s2.publish() == 3 and s2.last_stats.kind == "anchor"
    train_step(trainer, opt, gen)
    assert s2.publish() == 4 and s2.last_stats.kind == "delta"
    assert receiver.update() == 4
    assert_synced(trainer, replica)
    assert s2.run_id != s1.run_id


def test_prefixes_keep_runs_apart(tmp_path):
    store = open_store(tmp_path / "shared")
    a, b = make_mlp(0), make_mlp(7)
    DeltaSender(a, store, prefix="runs/a").publish()
    DeltaSender(b, store, prefix="runs/b").publish()
    ra, rb = make_mlp(1, torch.bfloat16), make_mlp(2, torch.bfloat16)
    DeltaReceiver(ra, store, prefix="runs/a").update()
    DeltaReceiver(rb, store, prefix="runs/b").update()
    assert_synced(a, ra)
    assert_synced(b, rb)


def test_background_publish_and_coalescing(store):
    trainer = make_mlp(0)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, store, background=True)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    published = []
    for _ in range(20):
        train_step(trainer, opt, gen)
        v = sender.publish()
        if v is not None:
            published.append(v)
    sender.flush()  # waits, and publishes what coalesced publishes left pending
    assert published == list(range(len(published)))
    flushed = int(v is None)  # the last publish() was coalesced: flush() must publish its weights
    assert sender.version == published[-1] + flushed
    assert receiver.update() == sender.version
    assert_synced(trainer, replica)  # the weights of the last publish() call, coalesced or not
    coalesced = sum(s.coalesced for s in sender.history)
    assert coalesced + len(sender.history) - flushed == 20
    sender.close()
    sender.close()  # idempotent


def test_adaptive_anchor_policy(store):
    trainer = make_mlp(0)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, store, anchor_policy=AnchorPolicy(every=None, chain_ratio=1.0))
    for _ in range(12):
        train_step(trainer, opt, gen)
        sender.publish()
    receiver = DeltaReceiver(make_mlp(1, torch.bfloat16), store)
    manifests = [receiver.manifest(v) for v in range(12)]
    assert manifests[0].kind == "anchor"
    anchor_bytes, chain = manifests[0].anchor_nbytes, 0
    for m in manifests[1:]:
        if m.kind == "anchor":
            assert chain >= anchor_bytes  # only once the chain reached one anchor's bytes
            anchor_bytes, chain = m.anchor_nbytes, 0
        else:
            assert chain < anchor_bytes
            chain += m.delta_nbytes
    assert sum(m.kind == "anchor" for m in manifests[1:]) >= 1


def test_metrics_jsonl(store, tmp_path):
    trainer = make_mlp(0)
    path = tmp_path / "m.jsonl"
    sender = DeltaSender(trainer, store, metrics_path=path)
    receiver = DeltaReceiver(make_mlp(1, torch.bfloat16), store, metrics_path=path)
    sender.publish()
    receiver.update()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in rows] == ["publish", "update"]
    assert rows[0]["kind"] == "anchor" and rows[0]["changed"] == rows[0]["numel"] == sum(p.numel() for p in trainer.parameters())
    assert rows[1]["version"] == 0 and rows[1]["path"] == "anchor"


def test_state_dict_source_and_nothing_published(store):
    sd = {"a": torch.randn(10), "b": torch.randn(3, 3), "step": torch.tensor(3)}  # int buffer is not synced
    replica = {"a": torch.zeros(10, dtype=torch.bfloat16), "b": torch.zeros(3, 3, dtype=torch.bfloat16)}
    receiver = DeltaReceiver(replica, store)
    with pytest.raises(VersionNotFoundError, match="no version"):
        receiver.update()
    DeltaSender(sd, store).publish()
    receiver.update()
    assert torch.equal(replica["b"].view(torch.int16), sd["b"].to(torch.bfloat16).view(torch.int16))


# --- lifecycle edge cases found in review ----------------------------------------------------------


class _GatedStore(LocalStore):
    """Holds object puts until ``release`` is set, so background publishes stay in flight."""

    def __init__(self, root):
        super().__init__(root)
        self.release = threading.Event()

    def put_new(self, key, data):  # objects are created with put_new (never replaced)
        if key.startswith("objects/"):
            assert self.release.wait(30)
        super().put_new(key, data)


def test_close_publishes_the_weights_of_a_coalesced_last_publish(tmp_path):
    store = _GatedStore(tmp_path / "b")
    trainer = make_mlp(0)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, store, background=True)
    assert sender.publish() == 0  # in flight until released
    train_step(trainer, opt, gen)
    assert sender.publish() is None  # coalesced: the upload of version 0 is still running
    store.release.set()
    sender.close()  # waits for version 0, then publishes the pending weights
    assert sender.version == 1
    replica = make_mlp(1, torch.bfloat16)
    assert DeltaReceiver(replica, store).update() == 1
    assert_synced(trainer, replica)


def test_bf16_nan_payloads_survive_fp32_storage_and_fp16_is_refused(store):
    w = torch.zeros(6, dtype=torch.bfloat16)
    w.view(torch.int16)[1] = -127  # 0xFF81: a NaN with a payload (a float cast would canonicalise it)
    w[2] = -0.0
    DeltaSender({"w": w}, store).publish()
    held = {"w": torch.full((6,), 7.0)}
    DeltaReceiver(held, store).update()
    assert torch.equal((held["w"].view(torch.int32) >> 16).to(torch.int16), w.view(torch.int16))
    fp16 = open_store(store.root.parent / "fp16")
    DeltaSender({"w": torch.randn(6)}, fp16, inference_dtype=torch.float16).publish()
    with pytest.raises(IncompatibleTargetError, match="store it as torch.float16"):
        DeltaReceiver({"w": torch.zeros(6)}, fp16).update()


def test_fp8_inference_dtype(store):
    trainer, replica = make_mlp(0), make_mlp(1, torch.float8_e4m3fn)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, store, inference_dtype=torch.float8_e4m3fn)
    receiver = DeltaReceiver(replica, store)
    for _ in range(3):
        train_step(trainer, opt, gen)
        sender.publish()
        receiver.update()
        assert_synced(trainer, replica, torch.float8_e4m3fn)
    receiver.verify()


def test_shape_change_starts_over_with_an_anchor(store):
    state = {"emb": torch.randn(10, 4), "b": torch.randn(3)}
    sender = DeltaSender(lambda: state, store)
    sender.publish()
    state["emb"] = torch.randn(4, 10)  # same element count, other shape
    assert sender.publish() == 1
    m = DeltaReceiver({"emb": torch.zeros(4, 10, dtype=torch.bfloat16), "b": torch.zeros(3, dtype=torch.bfloat16)}, store)
    assert m.manifest(1).kind == "anchor" and m.manifest(1).base_version is None
    assert m.update() == 1
    assert torch.equal(m.target.tensors["emb"].view(torch.int16), state["emb"].to(torch.bfloat16).view(torch.int16))
    state["emb"] = torch.randn(6, 10)  # another element count
    assert sender.publish() == 2 and sender.last_stats.kind == "anchor"
    state["emb"].add_(1.0)
    assert sender.publish() == 3 and sender.last_stats.kind == "delta"


def test_alias_mirrors_follow_the_layout_of_each_version(tmp_path):
    store = open_store(tmp_path / "b")
    tied = tiny_qwen3("tiny", seed=0, tie_word_embeddings=True)
    untied = tiny_qwen3("tiny", seed=1, tie_word_embeddings=False)
    DeltaSender(tied, store).publish()  # version 0: lm_head is an alias
    DeltaSender(untied, store).publish()  # version 1 (a restarted writer): lm_head shipped
    replica = tiny_qwen3("tiny", seed=2, tie_word_embeddings=False, dtype=torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    for v, source in ((0, tied), (1, untied), (0, tied)):
        assert receiver.update(v) == v
        assert_synced(source, replica)


def test_long_tensor_names_are_refused_before_publishing(store):
    with pytest.raises(ValueError, match="1-1024 characters"):
        DeltaSender({"x" * 1025: torch.zeros(2)}, store)
    with pytest.raises(ValueError, match=r"tensor '__metadata__': safetensors reserves that name"):
        DeltaSender({"__metadata__": torch.zeros(2), "w": torch.zeros(2)}, store)
    with pytest.raises(TypeError, match="the model callable must return a state dict .*got NoneType"):
        DeltaSender(lambda: None, store)
    assert store.list() == []


@pytest.mark.parametrize("bad", [True, "3", 2.0, [3]])
def test_versions_must_be_ints(store, bad):
    DeltaSender(make_mlp(0), store).publish()
    with pytest.raises(TypeError, match="version is an int"):
        DeltaReceiver(make_mlp(1, torch.bfloat16), store).update(bad)


def test_wait_for_times_out_with_a_library_error(store):
    from torch_deltasync import DeltaSyncError

    with pytest.raises(DeltaSyncError) as info:
        DeltaReceiver(make_mlp(1, torch.bfloat16), store).wait_for(timeout_s=0.1)
    assert isinstance(info.value, TimeoutError)


@pytest.mark.parametrize("overlapping", [
    lambda: torch.zeros(1, 3, dtype=torch.bfloat16).expand(4, 3),  # stride 0
    lambda: torch.zeros(12, dtype=torch.bfloat16).as_strided((4, 3), (2, 1)),  # rows overlap by one element
    lambda: torch.zeros(12, dtype=torch.bfloat16).as_strided((4, 3), (1, 2)),  # strides out of order, overlapping
], ids=["expand", "as_strided", "as_strided-transposed"])
def test_receiver_tensors_with_overlapping_elements_are_refused(store, overlapping):
    DeltaSender({"w": torch.randn(4, 3)}, store).publish()
    held = {"w": overlapping()}
    before = held["w"].view(torch.int16).clone()
    with pytest.raises(IncompatibleTargetError, match=r"tensor 'w' has overlapping memory \(shape \(4, 3\)"):
        DeltaReceiver(held, store).update()
    assert torch.equal(held["w"].view(torch.int16), before)


def test_receiver_tensors_sharing_memory_through_other_storages_are_refused(store):
    """Two tensors over one numpy buffer (two storage objects, 20 shared elements): addresses are
    compared, not storages."""
    import numpy as np

    DeltaSender({"a": torch.randn(60), "b": torch.randn(60)}, store).publish()
    buf = np.zeros(100, dtype=np.float32)
    held = {"a": torch.from_numpy(buf[0:60]), "b": torch.from_numpy(buf[40:100])}
    assert held["a"].untyped_storage().data_ptr() != held["b"].untyped_storage().data_ptr()
    with pytest.raises(IncompatibleTargetError, match=r"tensors 'a' and 'b' share memory"):
        DeltaReceiver(held, store).update()
    assert not buf.any()


def test_receiver_column_slices_of_one_weight_are_fine(store):
    """Column slices of one row-major weight (their byte ranges overlap, their elements do not):
    accepted, each slice bit-exact; compared row by row (one run per row), not byte by byte."""
    published = {f"c{i}": torch.randn(512, 64) for i in range(8)}
    DeltaSender(published, store).publish()
    weight = torch.zeros(512, 8 * 64, dtype=torch.bfloat16)
    held = {f"c{i}": weight[:, i * 64:(i + 1) * 64] for i in range(8)}
    assert DeltaReceiver(held, store).update() == 0
    for name, values in published.items():
        assert torch.equal(held[name].view(torch.int16), values.to(torch.bfloat16).view(torch.int16)), name


def test_receiver_views_with_interleaved_elements_are_fine(store):
    """Views of one storage that share no element (here interleaved; also a transposed layout
    whose strides are out of order) each get their own tensor's values, bit for bit."""
    published = {"p": torch.randn(4, 3), "q": torch.randn(4, 3), "t": torch.randn(3, 4)}
    DeltaSender(published, store).publish()
    flat = torch.zeros(24, dtype=torch.bfloat16)
    held = {"p": flat[0::2].view(4, 3), "q": flat[1::2].view(4, 3),
            "t": torch.zeros(12, dtype=torch.bfloat16).as_strided((3, 4), (1, 3))}
    assert DeltaReceiver(held, store).update() == 0
    for name, values in published.items():
        assert torch.equal(held[name].view(torch.int16), values.to(torch.bfloat16).view(torch.int16)), name


@pytest.mark.parametrize("link_gbps,expected", [(1.0, "packed"), (3.9, "packed"), (4.0, "raw"), (100, "raw")])
def test_auto_codec_by_link_speed(tmp_path, link_gbps, expected):
    from torch_deltasync.manifest import load_manifest

    trainer, replica = make_mlp(0), make_mlp(1, torch.bfloat16)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    store = LocalStore(tmp_path / "bucket")
    sender = DeltaSender(trainer, store, codec="auto", link_gbps=link_gbps)
    receiver = DeltaReceiver(replica, store)
    receiver.update(sender.publish())
    train_step(trainer, opt, gen)
    v = sender.publish()
    sender.close()
    assert load_manifest(store, v).codec == expected
    assert receiver.update() == v and receiver.last_stats.path == "delta"
    assert_synced(trainer, replica)


def test_auto_codec_needs_a_link_speed(tmp_path):
    trainer = make_mlp(0)
    with pytest.raises(ValueError, match=r'codec="auto" chooses by link speed: pass link_gbps='):
        DeltaSender(trainer, LocalStore(tmp_path / "a"), codec="auto")
    with pytest.raises(ValueError, match=r"link_gbps must be a positive number of Gbit/s \(e.g. 10.0\), got -1"):
        DeltaSender(trainer, LocalStore(tmp_path / "b"), codec="auto", link_gbps=-1)
    with pytest.raises(ValueError, match=r"link_gbps must be a positive number of Gbit/s \(e.g. 10.0\), got nan"):
        DeltaSender(trainer, LocalStore(tmp_path / "c"), codec="auto", link_gbps=float("nan"))
    with pytest.raises(ValueError, match=r"link_gbps is only used by codec=\"auto\"; this sender uses codec='raw'"):
        DeltaSender(trainer, LocalStore(tmp_path / "d"), codec="raw", link_gbps=10)
