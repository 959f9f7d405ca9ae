"""torchrl integration: ``DeltaWeightSyncScheme`` with real collectors on ``PendulumEnv``, and the LLM
stack sender against a fake vLLM engine.

Every correctness check compares integer bit views of the workers' weights with the trainer's
weights cast to the inference dtype, or checks a fingerprint of those bit views that the policy
itself computes while it acts (``weight_digest``, written into every collected frame), so a frame's
``policy_version`` tag is checked against the weights that actually produced its action.

Most collector tests start their workers with the ``forkserver`` start method (see ``fork_start``:
a spawn worker imports torch and torchrl again, ~30 s each on the shared 2-core machine);
``test_spawn_pickles_to_workers`` uses torchrl's default ``spawn``. Both pickle the scheme into the
workers.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import StalenessAwareSampler
from torchrl.envs.custom.pendulum import PendulumEnv
from torchrl.weight_update import WeightSyncScheme

from torch_deltasync import LocalStore
from torch_deltasync.errors import IncompatibleTargetError, SyncTimeoutError, WorkerError
from torch_deltasync.integrations.torchrl import DeltaVLLMWeightSender, DeltaWeightSyncScheme
from torch_deltasync._dtypes import bits
from torch_deltasync.store import Store
from torch_deltasync.testing import state_bits
from helpers import PassThroughStore

REPO = Path(__file__).resolve().parents[2]


# --- a policy that fingerprints the weights it acts with --------------------------------------------


def weight_digest(module: nn.Module) -> torch.Tensor:
    """int64 fingerprint of every tensor's bit pattern (position-weighted sum, wraps mod 2^64)."""
    acc = torch.zeros((), dtype=torch.int64)
    for i, (_, t) in enumerate(sorted(module.state_dict().items())):
        b = bits(t.detach().contiguous()).reshape(-1).to(torch.int64)
        acc = acc + (b * (torch.arange(1, b.numel() + 1) * 1000003 + (i + 1) * 7919)).sum()
    return acc


class PendulumNet(nn.Module):
    """Tiny actor for ``PendulumEnv`` (observations ``th``, ``thdot``); runs in its weights' dtype and
    returns the action and the fingerprint of the weights that computed it."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.l1 = nn.Linear(2, hidden)
        self.l2 = nn.Linear(hidden, 1)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor):
        x = torch.stack([th, thdot], -1).to(self.l1.weight.dtype)
        action = self.l2(torch.tanh(self.l1(x))).float().clamp(-2.0, 2.0)
        return action, weight_digest(self)


def make_policy(seed: int = 0) -> TensorDictModule:
    torch.manual_seed(seed)
    return TensorDictModule(PendulumNet(), in_keys=["th", "thdot"], out_keys=["action", "weight_digest"])


def make_env() -> PendulumEnv:
    return PendulumEnv()


def train_step(policy: TensorDictModule, opt: torch.optim.Optimizer) -> None:
    net = policy.module
    loss = (net(torch.randn(16), torch.randn(16))[0] - 1.0).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def expected_digest(policy: TensorDictModule, dtype: torch.dtype) -> int:
    return int(weight_digest(copy.deepcopy(policy.module).to(dtype)))


def assert_frames_match(data: TensorDict, digests: dict[int, int]) -> set[int]:
    """Every frame's weight fingerprint equals the trainer's cast at the version the frame is tagged
    with; returns the tags seen."""
    tags = data["policy_version"].reshape(-1).tolist()
    got = data["weight_digest"].reshape(-1).tolist()
    for i, (v, g) in enumerate(zip(tags, got)):
        assert v in digests, f"frame {i} tagged with version {v}, which was never published ({sorted(digests)})"
        assert g == digests[v], f"frame {i} tagged version {v} was produced by other weights"
    return set(tags)


def assert_workers_bitexact(states: list[dict], policy: nn.Module, dtype: torch.dtype, version: int,
                            stored: torch.dtype | None = None) -> None:
    """Workers hold the trainer's weights cast to ``dtype``, bit for bit. With ``stored=float32`` the
    workers keep bf16 values in fp32 tensors: each must be exactly representable and equal."""
    want = state_bits(policy, dtype)  # the trainer's weights cast to dtype: the expected worker state
    for s in states:
        assert s["version"] == version, f"worker {s['worker']} holds version {s['version']}, expected {version}"
        assert set(s["weights"]) == set(want)
        for n, b in want.items():
            got = s["weights"][n]
            if stored is not None and stored != dtype:
                wide = got.view(stored)
                assert torch.equal(wide.to(dtype).to(stored).view(got.dtype), got), f"{n}: not a {dtype} value"
                got = bits(wide.to(dtype))
            assert got.dtype == b.dtype, (n, got.dtype)
            assert torch.equal(got, b), f"worker {s['worker']}: {n} differs from the trainer's cast"


@pytest.fixture
def fork_start():
    """Collectors start their workers with ``forkserver``: forked (fast) from a server process that
    imported torch, torchrl and this module once, not from the long-lived pytest process, whose
    threads and locks (from other tests) a plain ``fork`` would copy. The scheme is still pickled to
    the workers, as with torchrl's default ``spawn``. Restores the previous start method."""
    previous = mp.get_start_method(allow_none=True)
    mp.set_forkserver_preload(["torch", "tensordict", "torchrl.collectors", "torchrl.envs.custom.pendulum",
                               "torch_deltasync.integrations.torchrl", __name__])
    mp.set_start_method("forkserver", force=True)
    yield
    mp.set_start_method(previous, force=True)


def worker_states(collector, n: int) -> list[dict]:
    return collector.map_fn("_receiver_schemes['policy'].receiver_state",
                            list_of_kwargs=[{"include_weights": True}] * n)


# --- the scheme object ------------------------------------------------------------------------------


def test_backend_registered():
    s = WeightSyncScheme.from_backend("delta", store="unused", anchor_every=5)
    assert isinstance(s, DeltaWeightSyncScheme)
    assert s.anchor_policy.every == 5
    with pytest.raises(ValueError, match="on_worker_failure"):
        DeltaWeightSyncScheme("x", on_worker_failure="ignore")


def test_sender_options_are_deltasenders(tmp_path):
    """Options other than the scheme's go to the trainer's DeltaSender as they are; a keyword that is
    neither the scheme's nor DeltaSender's is refused when the scheme is built, naming it."""
    s = DeltaWeightSyncScheme("x", anchor_every=7, codec="raw", inference_dtype=torch.float32)
    assert s.sender_options == {"anchor_every": 7, "codec": "raw", "inference_dtype": torch.float32}
    assert s.anchor_policy.every == 7
    with pytest.raises(TypeError, match=r"DeltaWeightSyncScheme got unexpected keyword argument\(s\) \['anchor_evry'\]"):
        DeltaWeightSyncScheme("x", anchor_evry=7)
    with pytest.raises(TypeError, match=r"DeltaVLLMWeightSender got unexpected keyword argument\(s\) \['group'\]"):
        DeltaVLLMWeightSender("x", group=None)
    # the workers' init_info is checked when the sender is built, not at the first sync
    with pytest.raises(TypeError, match=r"DeltaVLLMWeightSender\(init_info=...\): unknown deltasync init_info option\(s\) \['pol_s'\]"):
        DeltaVLLMWeightSender("x", init_info={"pol_s": 0.1})
    with pytest.raises(ValueError, match=r"init_info 'in_place' must be 'auto' or 'never', got 'yes'"):
        DeltaVLLMWeightSender("x", init_info={"in_place": "yes"})
    with pytest.raises(TypeError, match=r"init_info \['prefix'\] are set by the sender itself"):
        DeltaVLLMWeightSender("x", init_info={"prefix": "p"})
    # paths may be pathlib.Path: the workers get strings (their JSON form)
    from pathlib import Path

    s = DeltaVLLMWeightSender(str(tmp_path), worker_store=Path(tmp_path), init_info={"metrics_path": Path(tmp_path) / "m.jsonl"})
    assert s.worker_store == str(tmp_path) and s.init_info == {"metrics_path": str(tmp_path / "m.jsonl")}


def test_pickles_without_live_state(tmp_path):
    big = TensorDictModule(nn.Linear(256, 256), in_keys=["x"], out_keys=["y"])  # 66k weights
    s = DeltaWeightSyncScheme(str(tmp_path), sync=False)
    s.init_on_sender(model_id="policy", model=big)
    s.connect()
    assert s.version == 0 and s._sender is not None
    blob = pickle.dumps(s)
    assert len(blob) < 8_000  # the sender's 131 kB bf16 snapshot stays behind
    copy_ = pickle.loads(blob)
    for key in ("_sender", "_store", "_receiver", "_background_thread", "_stop_event"):
        assert getattr(copy_, key, None) is None, key
    assert not copy_.initialized_on_sender and not copy_.synchronized_on_sender
    assert copy_.version is None

    recv = TensorDictModule(nn.Linear(256, 256), in_keys=["x"], out_keys=["y"])
    copy_.init_on_receiver(model_id="policy", model=recv, worker_idx=3)
    copy_.connect(worker_idx=3)
    assert copy_._background_thread.is_alive()
    again = pickle.loads(pickle.dumps(copy_))  # a receiver with a running thread pickles too
    assert again._receiver is None and again._background_thread is None
    s.shutdown()
    copy_.shutdown()
    copy_.shutdown()  # idempotent
    s.shutdown()
    assert copy_._background_thread is None
    with pytest.raises(RuntimeError, match="initialized on sender"):
        again.send()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_standalone_sender_receiver(tmp_path, dtype):
    """One process, no collector: ``send`` returns once the receiver applied (store acknowledgements),
    a meta-device policy is materialised in the receiver dtype, policy calls are stamped."""
    trainer = make_policy(0)
    opt = torch.optim.Adam(trainer.parameters(), 1e-2)
    sender = DeltaWeightSyncScheme(str(tmp_path), inference_dtype=dtype, num_workers=1, ack_timeout_s=30,
                                   anchor_every=3)
    sender.init_on_sender(model_id="policy", model=trainer)
    sender.connect()

    with torch.device("meta"):
        worker = make_policy(1)  # no data, as torchrl ships policies to workers
    receiver = DeltaWeightSyncScheme(str(tmp_path), inference_dtype=dtype, receiver_dtype=dtype, num_workers=1)
    receiver.init_on_receiver(model_id="policy", model=worker, worker_idx=0)
    receiver.connect(worker_idx=0)
    try:
        assert worker.module.l1.weight.device.type == "cpu" and worker.module.l1.weight.dtype == dtype
        for step in range(5):
            if step:
                train_step(trainer, opt)
                sender.send()  # waits for worker 0's acknowledgement
            assert receiver.version == sender.version == step
            state = receiver.receiver_state(include_weights=True)
            assert_workers_bitexact([state], trainer, dtype, step)
            td = TensorDict({"th": torch.tensor(0.3), "thdot": torch.tensor(-1.0),
                             "policy_version": torch.tensor(-7)}, [])
            out = worker(td)
            assert out["policy_version"].item() == step  # the version of the weights that acted
            assert out["weight_digest"].item() == expected_digest(trainer, dtype)
        assert sender.worker_versions() == {0: 4}
        assert receiver.receiver_state()["last_update"]["path"] == "delta"
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_manual_receive(tmp_path):
    trainer = make_policy(0)
    sender = DeltaWeightSyncScheme(str(tmp_path), sync=False)
    sender.init_on_sender(model_id="policy", model=trainer)
    sender.connect()
    worker = make_policy(1)
    receiver = DeltaWeightSyncScheme(str(tmp_path), background_receive=False)
    receiver.init_on_receiver(model_id="policy", model=worker)
    receiver.connect()
    try:
        assert receiver._background_thread is None
        assert receiver.receive(timeout=0) is None  # nothing new: one cheap look, no wait
        train_step(trainer, torch.optim.SGD(trainer.parameters(), 0.1))
        sender.send()
        weights = receiver.receive(timeout=5)
        assert weights is not None and receiver.version == 1
        assert torch.equal(weights["module", "l1", "weight"].view(torch.int32),
                           worker.module.l1.weight.detach().view(torch.int32))  # live weights, not a copy
        assert_workers_bitexact([receiver.receiver_state(include_weights=True)], trainer, torch.bfloat16, 1,
                                stored=torch.float32)  # bf16 values kept in the policy's fp32 tensors
        assert receiver.receive(timeout=0.3) is None  # nothing new within the timeout
        # A receive that is waiting applies a version published meanwhile (its first look found none).
        polled = threading.Event()
        inner = receiver._receiver
        newest = inner.newest_version

        def watched():
            v = newest()
            polled.set()
            return v

        inner.newest_version = watched
        box = []
        waiter = threading.Thread(target=lambda: box.append(receiver.receive(timeout=120)))
        waiter.start()
        assert polled.wait(60)
        train_step(trainer, torch.optim.SGD(trainer.parameters(), 0.1))
        sender.send()
        waiter.join(120)
        assert box and box[0] is not None and receiver.version == 2
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_policy_with_an_integer_buffer_syncs_its_floating_tensors(tmp_path):
    """A BatchNorm policy (its ``num_batches_tracked`` is int64) could not be received at all: the
    receiver refused the integer buffer and advised options the scheme does not take. Its floating
    tensors (running statistics included) sync bit-exactly; the counter stays the worker's own."""
    torch.manual_seed(0)
    trainer = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    sender = DeltaWeightSyncScheme(str(tmp_path), sync=False)
    sender.init_on_sender(model_id="policy", model=trainer)
    sender.connect()
    worker = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    receiver = DeltaWeightSyncScheme(str(tmp_path), background_receive=False, connect_timeout_s=30)
    receiver.init_on_receiver(model_id="policy", model=worker)
    receiver.connect()
    try:
        trainer(torch.randn(8, 3))  # training mode: running statistics and the counter move
        with torch.no_grad():
            trainer[0].weight.add_(0.1)
        sender.send()
        assert receiver.receive(timeout=30) is not None and receiver.version == 1
        want, got = trainer.state_dict(), worker.state_dict()
        floating = [n for n, t in want.items() if t.is_floating_point()]
        assert "1.running_mean" in floating
        assert all(torch.equal(got[n].to(torch.bfloat16).view(torch.int16), want[n].to(torch.bfloat16).view(torch.int16))
                   for n in floating)
        assert int(want["1.num_batches_tracked"]) == 1 and int(got["1.num_batches_tracked"]) == 0
    finally:
        sender.shutdown()
        receiver.shutdown()


@pytest.mark.parametrize("strict", [True, False])
def test_a_worker_policy_with_its_own_extra_tensor(tmp_path, strict):
    """The receiver refused a worker policy holding a floating tensor the trainer does not publish,
    advising ``ModuleTarget(model, strict=False)``, which the scheme had no way to take."""
    from torch_deltasync.errors import IncompatibleTargetError

    torch.manual_seed(0)
    trainer = nn.Sequential(nn.Linear(3, 4))
    sender = DeltaWeightSyncScheme(str(tmp_path), sync=False)
    sender.init_on_sender(model_id="policy", model=trainer)
    sender.connect()
    worker = nn.Sequential(nn.Linear(3, 4))
    worker.register_parameter("noise_scale", nn.Parameter(torch.full((4,), 0.3)))  # the worker's own
    receiver = DeltaWeightSyncScheme(str(tmp_path), background_receive=False, connect_timeout_s=30, strict=strict)
    receiver.init_on_receiver(model_id="policy", model=worker)
    try:
        if strict:
            with pytest.raises(IncompatibleTargetError, match=r"\['noise_scale'\].*DeltaWeightSyncScheme\(\.\.\., "
                                                              r"strict=False\)"):
                receiver.connect()
            return
        receiver.connect()
        with torch.no_grad():
            trainer[0].weight.add_(0.1)
        sender.send()
        assert receiver.receive(timeout=30) is not None and receiver.version == 1
        want, got = trainer.state_dict(), worker.state_dict()
        assert all(torch.equal(got[n].to(torch.bfloat16).view(torch.int16), want[n].to(torch.bfloat16).view(torch.int16))
                   for n in want)
        assert torch.equal(got["noise_scale"].view(torch.int32), torch.full((4,), 0.3).view(torch.int32))
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_receiver_without_sender_times_out(tmp_path):
    """A worker whose sender never connects (or that uses another prefix) fails with a clear error."""
    receiver = DeltaWeightSyncScheme(str(tmp_path), prefix="nobody-publishes-here", connect_timeout_s=0.3)
    policy = make_policy(0)
    receiver.init_on_receiver(model_id="policy", model=policy)
    with pytest.raises(SyncTimeoutError, match="no version of 'policy' appeared in .*nobody-publishes-here within 0 s; "
                                               "is the sender connected"):
        receiver.connect()
    assert not receiver.synchronized_on_receiver
    receiver.shutdown()


class _GarbleDeltas(PassThroughStore):
    """Serves every delta object of the given versions with one byte flipped (a corrupt upload)."""

    def __init__(self, inner: Store, versions: set[int]) -> None:
        super().__init__(inner)
        self.versions = versions

    def _bad(self, key: str) -> bool:
        parts = key.split("/")
        return (len(parts) >= 3 and parts[-3] == "objects" and parts[-1].startswith("delta")
                and int(parts[-2]) in self.versions)

    def get(self, key, *, start=None, end=None):
        data = self.inner.get(key, start=start, end=end)
        if self._bad(key):
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        return data

    def describe(self):
        return f"garbled({self.inner.describe()})"


def test_worker_error_reaches_the_sender(tmp_path):
    """A receiver that cannot apply a version keeps the previous one and the sender raises with its reason."""
    trainer = make_policy(0)
    opt = torch.optim.Adam(trainer.parameters(), 1e-2)
    sender = DeltaWeightSyncScheme(LocalStore(tmp_path), num_workers=1, anchor_every=100, ack_timeout_s=30)
    sender.init_on_sender(model_id="policy", model=trainer)
    sender.connect()
    worker = make_policy(1)
    receiver = DeltaWeightSyncScheme(_GarbleDeltas(LocalStore(tmp_path), {2}), num_workers=1)
    receiver.init_on_receiver(model_id="policy", model=worker)
    receiver.connect()
    try:
        train_step(trainer, opt)
        sender.send()
        before = receiver.receiver_state(include_weights=True)
        assert_workers_bitexact([before], trainer, torch.bfloat16, 1, stored=torch.float32)
        train_step(trainer, opt)
        with pytest.raises(WorkerError, match=r"worker 0 could not apply version 2: CorruptObjectError"):
            sender.send()
        after = receiver.receiver_state(include_weights=True)
        assert after["version"] == 1
        for n, b in before["weights"].items():
            assert torch.equal(after["weights"][n], b), n
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_worker_that_cannot_connect_tells_the_sender_why(tmp_path):
    """A worker whose policy cannot hold the weights (float16 for a bf16 run) failed in connect();
    the trainer's send() waited its whole ack_timeout_s and raised a bare "did not confirm"."""
    trainer = make_policy(0)
    opt = torch.optim.Adam(trainer.parameters(), 1e-2)
    sender = DeltaWeightSyncScheme(str(tmp_path), num_workers=1, anchor_every=100, ack_timeout_s=120)
    sender.init_on_sender(model_id="policy", model=trainer)
    sender.connect()
    receiver = DeltaWeightSyncScheme(str(tmp_path), num_workers=1, receiver_dtype=torch.float16)
    worker = make_policy(1)  # torchrl keeps models by weak reference
    receiver.init_on_receiver(model_id="policy", model=worker, worker_idx=0)
    try:
        with pytest.raises(IncompatibleTargetError, match="cannot hold every torch.bfloat16 bit pattern"):
            receiver.connect(worker_idx=0)
        train_step(trainer, opt)
        t = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker 0 could not connect \(applying version 0\): "
                                              r"IncompatibleTargetError: .*cannot hold every torch.bfloat16"):
            sender.send()
        assert time.monotonic() - t < 60  # not the ack timeout
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_skipped_worker_is_waited_for_again_once_it_acknowledges(tmp_path):
    """``on_worker_failure="skip"`` with every worker skipped: ``send`` used to return at once forever
    and ``worker_versions()`` stayed ``{}`` although the worker's acknowledgements were in the store
    (issue 15, after pytorch/rl #3574). The worker's first acknowledgement brings it back."""
    trainer = make_policy(0)
    opt = torch.optim.Adam(trainer.parameters(), 1e-2)
    sender = DeltaWeightSyncScheme(str(tmp_path), num_workers=1, anchor_every=100, ack_timeout_s=0.3,
                                   on_worker_failure="skip")
    sender.init_on_sender(model_id="policy", model=trainer)
    sender.connect()
    receiver = None
    try:
        train_step(trainer, opt)
        sender.send()  # nobody acknowledges within the deadline: worker 0 is skipped
        assert sender.worker_versions() == {}
        sender.ack_timeout_s = 120.0  # from now on only a bug would run into it
        worker = make_policy(1)
        receiver = DeltaWeightSyncScheme(str(tmp_path), num_workers=1)
        receiver.init_on_receiver(model_id="policy", model=worker, worker_idx=0)
        receiver.connect(worker_idx=0)  # applies version 1 and acknowledges it
        for v in (2, 3):
            train_step(trainer, opt)
            sender.send()  # waits for worker 0 again
            assert sender.worker_versions() == {0: v}
            assert receiver.version == v
            assert_workers_bitexact([receiver.receiver_state(include_weights=True)], trainer, torch.bfloat16, v,
                                    stored=torch.float32)
    finally:
        sender.shutdown()
        if receiver is not None:
            receiver.shutdown()


# --- collectors with worker processes ---------------------------------------------------------------


@pytest.mark.timeout(300)
def test_multisync_bf16(tmp_path, fork_start):
    """MultiSyncCollector, 2 workers serving in bf16: after every update both workers are bit-identical
    to the trainer's bf16 cast, and every frame of the next batch is tagged (and produced) by it."""
    dtype = torch.bfloat16
    policy = make_policy(0)
    scheme = DeltaWeightSyncScheme(str(tmp_path), inference_dtype=dtype, receiver_dtype=dtype, anchor_every=3,
                                   ack_timeout_s=60)
    collector = MultiSyncCollector([make_env, make_env], policy, frames_per_batch=64, total_frames=64 * 6,
                                   track_policy_version=True, weight_sync_schemes={"policy": scheme})
    opt = torch.optim.Adam(policy.parameters(), 1e-2)
    digests = {0: expected_digest(policy, dtype)}
    kinds = []
    try:
        assert_workers_bitexact(worker_states(collector, 2), policy, dtype, 0)
        for i, data in enumerate(collector):
            # workers are idle between batches, so every frame of batch i comes from version i
            assert assert_frames_match(data, digests) == {i}
            train_step(policy, opt)
            collector.update_policy_weights_()
            v = scheme.version
            assert v == i + 1
            digests[v] = expected_digest(policy, dtype)
            kinds.append(scheme.last_publish.kind)
            assert scheme.worker_versions() == {0: v, 1: v}
            assert_workers_bitexact(worker_states(collector, 2), policy, dtype, v)
        assert kinds == ["delta", "delta", "anchor", "delta", "delta", "anchor"]
        assert collector.policy_version == scheme.version  # the parent's tracker follows too
    finally:
        collector.shutdown()
        scheme.shutdown()


@pytest.mark.timeout(300)
def test_multiasync_fp32_and_staleness(tmp_path, fork_start):
    """MultiAsyncCollector, 2 workers in fp32 (lossless: int32 views): frames straddle updates, each
    tagged with the version whose weights produced it; the staleness-aware sampler bounds the lag."""
    dtype = torch.float32
    policy = make_policy(0)
    scheme = DeltaWeightSyncScheme(str(tmp_path), inference_dtype=dtype, anchor_every=4, ack_timeout_s=60)
    collector = MultiAsyncCollector([make_env, make_env], policy, frames_per_batch=32, total_frames=32 * 8,
                                     track_policy_version=True, weight_sync_schemes={"policy": scheme})
    sampler = StalenessAwareSampler(max_staleness=1)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10_000), sampler=sampler, batch_size=64)
    opt = torch.optim.Adam(policy.parameters(), 1e-2)
    digests = {0: expected_digest(policy, dtype)}
    seen: set[int] = set()
    sampled = 0
    try:
        for data in collector:
            seen |= assert_frames_match(data, digests)
            rb.extend(data.reshape(-1))
            train_step(policy, opt)
            collector.update_policy_weights_()  # waits until both workers applied it
            digests[scheme.version] = expected_digest(policy, dtype)
            assert scheme.worker_versions() == {0: scheme.version, 1: scheme.version}
            sampler.consumer_version = scheme.version
            if (rb[:]["policy_version"] >= scheme.version - 1).any():
                sample = rb.sample()
                assert (sample["policy_version"] >= scheme.version - 1).all()
                sampled += 1
        assert sampled > 0  # the staleness gate was exercised, not only skipped
        assert len(seen) >= 3  # the data really came from several versions
        # Workers are idle once the collector is exhausted: read their weights back.
        assert_workers_bitexact(worker_states(collector, 2), policy, dtype, scheme.version)
    finally:
        collector.shutdown()
        scheme.shutdown()


def _collector_worker(store: str, idx: int, results, requests, seed: int) -> None:
    """A standalone rollout process: a plain ``Collector`` that follows the store."""
    torch.set_num_threads(1)
    scheme = DeltaWeightSyncScheme(store, num_workers=2, inference_dtype=torch.bfloat16, receiver_dtype=torch.bfloat16)
    collector = Collector(make_env, make_policy(seed), frames_per_batch=16, total_frames=-1, track_policy_version=True,
                          weight_recv_schemes={"policy": scheme}, worker_idx=idx, auto_register_policy_transforms=False)
    try:
        first = scheme.receiver_state()
        results.put(("joined", idx, (first["version"], first["last_update"]["path"])))
        for data in collector:
            results.put(("batch", idx, (data["policy_version"].tolist(), data["weight_digest"].tolist())))
            try:
                req = requests.get(timeout=0.05)
            except Exception:
                continue
            if req == "stop":
                break
            results.put(("state", idx, scheme.receiver_state(include_weights=True)))
    finally:
        collector.shutdown()
        scheme.shutdown()
        results.put(("exit", idx, None))


@pytest.mark.timeout(300)
def test_collector_workers_and_late_joiner(tmp_path, fork_start):
    """Trainer-side ``Collector`` publishing; two worker processes each running a ``Collector`` with
    ``weight_recv_schemes``. Worker 1 starts after 7 versions and catches up from the newest anchor."""
    dtype = torch.bfloat16
    store = str(tmp_path / "bucket")
    policy = make_policy(0)
    scheme = DeltaWeightSyncScheme(store, num_workers=2, inference_dtype=dtype, anchor_every=3, ack_timeout_s=120)
    trainer_collector = Collector(make_env, policy, frames_per_batch=16, total_frames=-1, track_policy_version=True,
                                  weight_sync_schemes={"policy": scheme}, auto_register_policy_transforms=False)
    opt = torch.optim.Adam(policy.parameters(), 1e-2)
    digests = {0: expected_digest(policy, dtype)}
    ctx = mp.get_context("forkserver")
    results = ctx.Queue()
    requests = [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=_collector_worker, args=(store, 0, results, requests[0], 1))]
    procs[0].start()
    seen: dict[tuple[str, int], list] = {}

    def pump(kind: str, idx: int, timeout: float = 120.0):
        """Read worker messages (keeping them all) until one of ``kind`` from worker ``idx`` arrives."""
        deadline = time.monotonic() + timeout
        while not seen.get((kind, idx)):
            assert time.monotonic() < deadline, f"worker {idx} sent no {kind!r} in time"
            msg = results.get(timeout=max(0.1, deadline - time.monotonic()))
            seen.setdefault((msg[0], msg[1]), []).append(msg[2])
        return seen[(kind, idx)].pop(0)

    try:
        assert pump("joined", 0) == (0, "anchor")
        for step in range(1, 8):  # only worker 0 runs: wait for it alone
            train_step(policy, opt)
            trainer_collector.update_policy_weights_(worker_ids=[0])
            digests[step] = expected_digest(policy, dtype)
            assert scheme.version == step == trainer_collector.policy_version
        procs.append(ctx.Process(target=_collector_worker, args=(store, 1, results, requests[1], 2)))
        procs[1].start()
        assert pump("joined", 1) == (7, "anchor")  # the newest anchor (6) plus the delta to 7
        for step in range(8, 11):
            train_step(policy, opt)
            trainer_collector.update_policy_weights_()  # both workers now
            digests[step] = expected_digest(policy, dtype)
            assert scheme.worker_versions() == {0: step, 1: step}
            for q in requests:
                q.put("state")
            assert_workers_bitexact([pump("state", 0), pump("state", 1)], policy, dtype, step)
        for q in requests:
            q.put("stop")
        pump("exit", 0)
        pump("exit", 1)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        for idx in (0, 1):
            batches = seen.get(("batch", idx), [])
            assert batches, f"worker {idx} collected nothing"
            for tags, got in batches:
                for v, g in zip(tags, got):
                    assert g == digests[v], f"worker {idx}: frame tagged {v} was produced by other weights"
        assert min(v for tags, _ in seen[("batch", 1)] for v in tags) >= 7
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        trainer_collector.shutdown()
        scheme.shutdown()


@pytest.mark.timeout(400)
def test_spawn_pickles_to_workers(tmp_path):
    """torchrl's default ``spawn`` start: the scheme is pickled into the worker processes."""
    dtype = torch.float32
    policy = make_policy(0)
    scheme = DeltaWeightSyncScheme(str(tmp_path), inference_dtype=dtype, ack_timeout_s=120)
    collector = MultiSyncCollector([make_env, make_env], policy, frames_per_batch=32, total_frames=32 * 2,
                                   track_policy_version=True, weight_sync_schemes={"policy": scheme})
    opt = torch.optim.Adam(policy.parameters(), 1e-2)
    digests = {0: expected_digest(policy, dtype)}
    try:
        for i, data in enumerate(collector):
            assert assert_frames_match(data, digests) == {i}
            train_step(policy, opt)
            collector.update_policy_weights_()
            digests[scheme.version] = expected_digest(policy, dtype)
            assert_workers_bitexact(worker_states(collector, 2), policy, dtype, scheme.version)
    finally:
        collector.shutdown()
        scheme.shutdown()


# --- failures: no hang ------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_dead_worker(tmp_path, fork_start, mode):
    """A worker killed mid-run: ``update_policy_weights_`` raises a clear error (or carries on with the
    other worker) as soon as the death is seen, and shutdown completes. The acknowledgement deadline
    is far beyond the test's own timeout, so only noticing the death can end the wait."""
    policy = make_policy(0)
    scheme = DeltaWeightSyncScheme(str(tmp_path), ack_timeout_s=3600, on_worker_failure=mode)
    collector = MultiAsyncCollector([make_env, make_env], policy, frames_per_batch=32, total_frames=-1,
                                    track_policy_version=True, weight_sync_schemes={"policy": scheme})
    opt = torch.optim.Adam(policy.parameters(), 1e-2)
    try:
        it = iter(collector)
        next(it)
        train_step(policy, opt)
        collector.update_policy_weights_()
        assert scheme.worker_versions() == {0: 1, 1: 1}
        os.kill(collector.procs[1].pid, signal.SIGKILL)
        collector.procs[1].join(30)
        train_step(policy, opt)
        if mode == "raise":
            with pytest.raises(WorkerError, match=r"worker 1 \(pid \d+\) exited with code -9") as err:
                collector.update_policy_weights_()
            assert "worker 0" not in str(err.value)  # fails fast, without waiting for worker 0
        else:
            collector.update_policy_weights_()
            assert scheme.worker_versions()[0] == 2 and scheme.worker_versions()[1] == 1
            train_step(policy, opt)
            collector.update_policy_weights_()  # the lost worker is not waited for again
            assert scheme.worker_versions()[0] == 3
    finally:
        collector.shutdown()
        scheme.shutdown()


def _die_holding_the_write_lock(acks, worker: int) -> None:
    # What a worker's queue feeder thread holds while it writes an acknowledgement; a worker killed
    # in that moment never releases it.
    acks.queues[worker]._wlock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def _acknowledge(acks, worker: int, version: int) -> None:
    acks.post(None, {"worker": worker, "version": version, "error": None})


@pytest.mark.timeout(120)
def test_a_dying_worker_cannot_silence_the_others(fork_start):
    """Regression: with one queue shared by all workers, a worker killed while its feeder thread held
    the queue's write lock silenced every other worker's acknowledgements for good (the sender then
    waited out ack_timeout_s). Each worker now has its own queue."""
    from torch_deltasync.integrations.torchrl._acks import QueueAcks as _QueueAcks

    ctx = mp.get_context()
    acks = _QueueAcks(ctx, 2)
    dying = ctx.Process(target=_die_holding_the_write_lock, args=(acks, 1))
    dying.start()
    dying.join(60)
    assert dying.exitcode == -signal.SIGKILL
    alive = ctx.Process(target=_acknowledge, args=(acks, 0, 5))
    alive.start()
    alive.join(60)
    assert alive.exitcode == 0  # its queue's feeder could flush: the process could exit
    got = acks.poll(None, {0, 1}, 10.0)
    assert [(m["worker"], m["version"]) for m in got] == [(0, 5)]


@pytest.mark.timeout(300)
def test_stuck_worker_times_out(tmp_path, fork_start):
    """A worker that is alive but does not answer (SIGSTOP) makes ``send`` fail after the timeout."""
    policy = make_policy(0)
    scheme = DeltaWeightSyncScheme(str(tmp_path), ack_timeout_s=2.0)
    collector = MultiSyncCollector([make_env, make_env], policy, frames_per_batch=32, total_frames=-1,
                                   weight_sync_schemes={"policy": scheme})
    pid = collector.procs[0].pid
    try:
        os.kill(pid, signal.SIGSTOP)
        train_step(policy, torch.optim.SGD(policy.parameters(), 0.1))
        with pytest.raises(SyncTimeoutError, match=r"worker 0 did not confirm version 1 within 2 s"):
            collector.update_policy_weights_()
        assert scheme.worker_versions().get(1) == 1
    finally:
        os.kill(pid, signal.SIGCONT)
        collector.shutdown()
        scheme.shutdown()


# --- the LLM stack sender ---------------------------------------------------------------------------


class ReplicatedEngine:
    """``collective_rpc`` over replicas of scripted vLLM workers (``vllm_scripted``: real vLLM models
    with real ``deltasync`` backend engines), recording every call; results come back as one future
    per replica, like torchrl's ``AsyncVLLM`` (which returns Ray futures). Every worker runs the call
    and a replica's future carries its first error, as vLLM's executor does."""

    def __init__(self, replicas: list[list]) -> None:
        self.replicas = replicas
        self.calls: list[tuple] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        from concurrent.futures import Future

        self.calls.append((method, dict(kwargs or {})))
        futures = []
        for workers in self.replicas:
            f, errors = Future(), []
            results = []
            for w in workers:
                try:
                    results.append(getattr(w, method)(*args, **(kwargs or {})))
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
            f.set_exception(errors[0]) if errors else f.set_result(results)
            futures.append(f)
        return futures

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


def _vllm_run(tmp_path, *, replicas: int, tp: int = 2, loaded=None):
    """A tiny Qwen2 trainer and ``replicas`` x ``tp`` scripted vLLM workers (``loaded``: the HF
    tensors they start from), plus a per-rank reference of vLLM's own ``load_weights``."""
    from vllm_scripted import ScriptedWorker

    from torch_deltasync.testing_vllm import TINY_VLLM_CONFIGS, build_vllm_model, hf_model, load_hf_weights, vllm_config

    spec = TINY_VLLM_CONFIGS["qwen2"]
    trainer = hf_model(spec, seed=11)
    vc = vllm_config(spec, tmp_path / "cfg")
    reps = [[ScriptedWorker(vc, r, tp, loaded(trainer) if loaded else None) for r in range(tp)]
            for _ in range(replicas)]

    def reference(rank, state):
        from torch_deltasync.testing_vllm import vllm_state_bits

        ref = build_vllm_model(vc, rank, tp)
        load_hf_weights(ref, state)
        return vllm_state_bits(ref)

    def assert_serve(state, what):
        for r in range(tp):
            want = reference(r, state)
            for workers in reps:
                got = workers[r].bits()
                bad = [n for n in want if not torch.equal(got[n], want[n])]
                assert not bad, f"{what}, rank {r}: {bad[:4]}"

    return trainer, reps, assert_serve


def _bf16_state(model):
    return {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}


def test_llm_sender_with_replicated_engine(tmp_path):
    """torchrl's wiring (``init_all_workers_group``, ``UpdateWeights``, a collector's
    ``PolicyVersion``) over 2 replicas x TP 2: every update is vLLM's start/update/finish on every
    worker, and each rank then equals vLLM's own ``load_weights`` of the trainer's bf16 weights; a
    corrupted version is refused with nothing changed, and the next anchor repairs the chain."""
    from torchrl.envs.llm.transforms import PolicyVersion
    from torchrl.trainers import UpdateWeights

    from torch_deltasync.errors import CorruptObjectError
    from torch_deltasync.testing import adam_step

    class CorruptingStore(PassThroughStore):
        """Flips a byte of the delta objects it writes while ``on`` (before any worker can read them)."""

        on = False

        def put(self, key, data):
            if self.on and "/delta-" in key:
                data = bytearray(data)
                data[len(data) // 2] ^= 0x40
            self.inner.put(key, bytes(data))

    trainer, replicas, assert_serve = _vllm_run(tmp_path, replicas=2)
    engine = ReplicatedEngine(replicas)
    store = CorruptingStore(LocalStore(tmp_path / "bucket"))
    sender = DeltaVLLMWeightSender(store, prefix="grpo", worker_store=str(tmp_path / "bucket"), anchor_every=3)
    sender.register_model(trainer)
    sender.init_all_workers_group({}, vllm_engine=engine)  # torchrl's wiring call

    class _Collector:  # what register_collector needs from an LLMCollector
        policy_version_tracker = PolicyVersion()

    collector = _Collector()
    sender.register_collector(collector)
    hook = UpdateWeights(sender=sender, update_weights_interval=1)
    opt = torch.optim.Adam(trainer.parameters(), 1e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(2):
        if step:
            adam_step(trainer, opt, batch=2, seq=16, generator=gen)
        hook()  # what GRPOTrainer runs after an optimizer step
        assert sender.version == step == collector.policy_version_tracker.version
        assert sender.last_update.version == step
        assert_serve(_bf16_state(trainer), f"version {step}")
    assert [w.engine.last_commit["path"] for ws in replicas for w in ws] == ["delta"] * 4
    calls = [c[0] for c in engine.calls]
    assert calls == ["init_weight_transfer_engine"] + [
        "start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache"] * 2
    init = engine.calls[0][1]["init_info"]
    assert init["store"] == str(tmp_path / "bucket") and init["prefix"] == "grpo" and "status_dir" not in init
    assert [c[1]["update_info"] for c in engine.calls if c[0] == "update_weights"] == [{"version": 0}, {"version": 1}]

    served = _bf16_state(trainer)
    store.on = True
    adam_step(trainer, opt, batch=2, seq=16, generator=gen)
    with pytest.raises(CorruptObjectError, match="version 2"):
        sender.update_weights()
    assert sender.version == 1 == collector.policy_version_tracker.version
    assert_serve(served, "after the corrupted version 2")
    store.on = False
    adam_step(trainer, opt, batch=2, seq=16, generator=gen)
    assert sender.update_weights() == 3  # an anchor (anchor_every=3): the way past version 2
    assert [w.engine.last_commit["path"] for ws in replicas for w in ws] == ["anchor"] * 4
    assert_serve(_bf16_state(trainer), "version 3")
    sender.shutdown()
    sender.shutdown()


def test_llm_sender_names_an_engine_without_the_backend(tmp_path):
    """torchrl 0.14's AsyncVLLM actor forces the "nccl" backend: the first update says so."""
    from vllm_scripted import ScriptedWorker

    from torch_deltasync import DeltaSyncError
    from torch_deltasync.testing_vllm import TINY_VLLM_CONFIGS, hf_model, vllm_config

    spec = TINY_VLLM_CONFIGS["qwen2"]
    vc = vllm_config(spec, tmp_path / "cfg")
    engine = ReplicatedEngine([[ScriptedWorker(vc, 0, 1, backend="nccl")]])
    sender = DeltaVLLMWeightSender(str(tmp_path / "bucket"), engine)
    trainer = hf_model(spec, seed=1)
    sender.register_model(trainer)
    with pytest.raises(DeltaSyncError, match=r"do not run the deltasync weight-transfer backend "
                                             r"\(Invalid init_info for NCCLWeightTransferEngine"):
        sender.update_weights()
    assert sender.version is None
    sender.shutdown()


def test_llm_sender_with_offline_llm(tmp_path):
    """A ``vllm.LLM``-shaped engine that loaded the trainer's first weights: the first update
    assumes them (a delta), every commit waits for the workers' readiness files and sets the
    engine's weight version."""
    from vllm_scripted import ScriptedLLM

    from torch_deltasync.testing import adam_step

    trainer, replicas, assert_serve = _vllm_run(tmp_path, replicas=1, loaded=_bf16_state)
    llm = ScriptedLLM(replicas[0])
    sender = DeltaVLLMWeightSender(str(tmp_path / "bucket"), llm, init_info={"assume_version": 0})
    sender.register_model(trainer)
    opt = torch.optim.Adam(trainer.parameters(), 1e-3)
    gen = torch.Generator().manual_seed(0)
    assert sender.update_weights() == 0
    for step in (1, 2):
        adam_step(trainer, opt, batch=2, seq=16, generator=gen)
        assert sender.update_weights() == step
        u = sender.last_update
        assert u.version == step and u.staged is True and llm.get_weight_version() == str(step)
        assert [w.engine.last_commit["path"] for w in replicas[0]] == ["delta"] * 2
        assert_serve(_bf16_state(trainer), f"version {step}")
    assert llm.calls[0] == ("init_weight_transfer_engine",)
    sender.shutdown()


# --- the recipe -------------------------------------------------------------------------------------


@pytest.mark.timeout(400)
def test_recipe_runs(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "recipes" / "torchrl_collector.py"), "--out", str(out), "--iters", "3",
           "--workers", "2", "--frames-per-batch", "64", "--start-method", "fork"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=380, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    iters = [r for r in rows if r["event"] == "iteration"]
    assert [r["version"] for r in iters] == [1, 2, 3]
    assert all(r["workers_at_version"] for r in iters)
    assert rows[-1] == {"event": "verify", "version": 3, "workers_bitexact": True, "workers": [3, 3]}
    # The recipe's own flag aside: the workers' saved weights are the trainer's, bit for bit (fp32 served).
    from safetensors.torch import load_file

    trainer = load_file(str(out / "trainer.safetensors"))
    want = {n: t.view(torch.int32) for n, t in trainer.items() if t.is_floating_point()}
    assert want
    for i in range(2):
        got = load_file(str(out / f"worker-{i}.safetensors"))
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), i


@pytest.mark.parametrize("same_weights", [True, False], ids=["copy", "other"])
def test_policy_relocated_after_connect(tmp_path, same_weights):
    """torchrl may copy the worker's policy to its device after connect and repoint the scheme
    (``collectors/_runner.py``): the scheme follows the new module, which must end up bit-exact."""
    trainer = make_policy(0)
    sender = DeltaWeightSyncScheme(str(tmp_path), num_workers=1, ack_timeout_s=30)
    sender.init_on_sender(model_id="policy", model=trainer)
    sender.connect()
    old = make_policy(1)
    receiver = DeltaWeightSyncScheme(str(tmp_path), num_workers=1)
    receiver.init_on_receiver(model_id="policy", model=old)
    receiver.connect()
    try:
        new = copy.deepcopy(old) if same_weights else make_policy(2)
        receiver.model = new
        assert receiver.model is new
        assert_workers_bitexact([receiver.receiver_state(include_weights=True)], trainer, torch.bfloat16, 0,
                                stored=torch.float32)
        frozen = state_bits(old, torch.float32)
        train_step(trainer, torch.optim.Adam(trainer.parameters(), 1e-2))
        sender.send()
        assert_workers_bitexact([receiver.receiver_state(include_weights=True)], trainer, torch.bfloat16, 1,
                                stored=torch.float32)
        now = state_bits(old, torch.float32)
        assert all(torch.equal(frozen[n], now[n]) for n in frozen)  # the old module is left alone, bit for bit
        td = new(TensorDict({"th": torch.tensor(0.1), "thdot": torch.tensor(0.2), "policy_version": torch.tensor(0)}, []))
        assert td["policy_version"].item() == 1  # hooks moved to the new module
        assert not old._forward_hooks and not old._forward_pre_hooks
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_scheme_refuses_a_bad_codec_when_built(tmp_path):
    """A codec the sender would refuse is refused by the scheme's constructor, not at connect()."""
    from torch_deltasync.integrations.torchrl import DeltaWeightSyncScheme

    with pytest.raises(ValueError, match=r"unknown codec 'zstd'; registered codecs"):
        DeltaWeightSyncScheme(str(tmp_path / "b"), codec="zstd")
    with pytest.raises(ValueError, match='codec="auto" chooses by link speed'):
        DeltaWeightSyncScheme(str(tmp_path / "b"), codec="auto")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("as_store", [False, True], ids=["uri", "store object"])
def test_a_memory_store_is_refused_for_worker_processes(fork_start, as_store):
    """The workers, in other processes, cannot read a ``memory://`` store: they waited for versions
    forever (the recipe hung after its first publish). A collector in this process may use one."""
    from torch_deltasync import open_store

    store = open_store("memory://refused-run") if as_store else "memory://refused-run"
    with pytest.raises(ValueError, match=r"DeltaWeightSyncScheme: store 'memory://refused-run' lives in this "
                                         r"process's memory, and the collector's workers are other processes"):
        MultiSyncCollector([make_env, make_env], make_policy(0), frames_per_batch=32, total_frames=64,
                           weight_sync_schemes={"policy": DeltaWeightSyncScheme(store)})


@pytest.mark.parametrize("argv,message", [
    (["--store", "memory://x"], "--store memory://... lives inside one process"),  # hung after its first publish
    (["--max-staleness", "-1"], "--max-staleness must be >= 0 (versions), got -1"),
    (["--iters", "0"], "--iters must be at least 1, got 0"),
])
def test_recipe_refuses_bad_arguments_before_starting(argv, message, capsys):
    from recipes import torchrl_collector

    with pytest.raises(SystemExit) as e:
        torchrl_collector.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
