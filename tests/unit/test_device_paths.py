"""Change detection, publishing and updating with tensors on an accelerator, bit for bit against the CPU.

Every test runs on the CPU, and on CUDA with ``pytest -m gpu`` on a GPU machine (``tools/gpu_check.sh``
runs them there): the CUDA paths (Triton detection, snapshots and replicas in GPU memory, staging
onto CUDA parameters) have no other test. Expected values are the CPU detector's and the trainer's
own weights cast to bf16 on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_kernels_checks import cpu_detect, special_fp32

from torch_deltasync import DeltaReceiver, DeltaSender
from torch_deltasync._dtypes import bits
from torch_deltasync.detect import ChangeDetector
from torch_deltasync.testing import adam_step, tiny_qwen3


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    if request.param == "cuda":
        assert torch.cuda.is_available(), "run with -m gpu on a machine with a CUDA device"
    return torch.device(request.param)


@pytest.mark.parametrize("snapshot_device", [None, "cpu"])
@pytest.mark.parametrize("src_dtype,dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float16)])
def test_detector_on_the_device_finds_what_the_cpu_finds(device, snapshot_device, src_dtype, dtype):
    n = 300_001  # several Triton programs and a ragged last one
    base = special_fp32(n, 1)
    live = base.clone()
    moved = torch.rand(n, generator=torch.Generator().manual_seed(2)) < 0.02
    live[moved] = special_fp32(n, 3)[moved]
    base, live = base.to(src_dtype), live.to(src_dtype)
    det = ChangeDetector(inference_dtype=dtype, snapshot_device=snapshot_device, chunk_numel=1 << 16)
    det.reset("w", base.to(device))
    ch = det.detect("w", live.to(device))
    want = cpu_detect(base, live, dtype)  # the CPU detector's torch path
    assert not det._gpu_failed  # on CUDA the Triton kernels ran, not torch's fallback
    assert want[0].numel() > 1000
    assert torch.equal(ch.positions.cpu(), want[0])
    assert torch.equal(bits(ch.values).cpu(), want[1]) and torch.equal(bits(ch.old_values).cpu(), want[2])


@pytest.mark.parametrize("codec", ["packed", "raw"])
def test_versions_published_from_the_device_reach_replicas_on_both_devices(device, store, codec):
    torch.manual_seed(0)
    model = tiny_qwen3("tiny", seed=0, device=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    sender = DeltaSender(model, store, codec=codec, anchor_every=1000)
    on_device = tiny_qwen3("tiny", seed=1, dtype=torch.bfloat16, device=device)
    on_cpu = tiny_qwen3("tiny", seed=2, dtype=torch.bfloat16)
    receivers = [DeltaReceiver(on_device, store), DeltaReceiver(on_cpu, store)]
    changed, before = 0, None
    for version in range(4):  # the anchor, then three deltas
        if version:
            adam_step(model, opt, generator=gen)
        assert sender.publish() == version
        want = {n: bits(p.detach().to(torch.bfloat16).cpu()) for n, p in model.state_dict().items()}
        for r, replica in zip(receivers, (on_device, on_cpu)):
            assert r.update() == version
            got = {n: bits(p.detach().cpu()) for n, p in replica.state_dict().items()}
            assert got.keys() == want.keys()
            for n in want:
                assert torch.equal(got[n], want[n]), (version, n)
        if version:
            changed += sum(int((want[n] != before[n]).sum()) for n in want)
        before = want
    assert changed > 0  # the deltas carried changes


def test_a_step_coded_delta_applies_onto_device_parameters(device, store):
    """Steps are resolved against the replica's own old values: on the device, the receiver reads
    them there (and checks their checksum) before it writes."""
    rng = np.random.default_rng(0)
    w = (torch.from_numpy(rng.standard_normal(50_000).astype(np.float32)) * 0.02).to(device)
    trainer = {"w": w}
    sender = DeltaSender(trainer, store, codec="packed", anchor_every=1000)
    replica = {"w": torch.zeros(50_000, dtype=torch.bfloat16, device=device)}
    receiver = DeltaReceiver(replica, store)
    for version in range(3):
        if version:
            step = torch.from_numpy(rng.choice([-2.0, -1.0, 1.0, 2.0], size=50_000).astype(np.float32)).to(device)
            moved = torch.from_numpy(rng.random(50_000) < 0.05).to(device)
            w.add_(torch.where(moved, step * w.abs() * 2**-7, torch.zeros_like(w)))
        sender.publish()
        assert receiver.update() == version
        assert torch.equal(bits(replica["w"]).cpu(), bits(w.to(torch.bfloat16)).cpu()), version
