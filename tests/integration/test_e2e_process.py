"""Acceptance: a receiver in another process follows 200 real Adam steps bit-exactly."""

from __future__ import annotations

import multiprocessing as mp

import torch

from torch_deltasync import DeltaSender, LocalStore
from torch_deltasync.testing import adam_step, state_bits, tiny_qwen3


def _follower(bucket: str, start_at: int, cmd, out) -> None:
    """Child process: waits for version numbers, updates, sends its bf16 bits back."""
    from torch_deltasync import DeltaReceiver

    torch.set_num_threads(1)
    model = tiny_qwen3("tiny", seed=99, dtype=torch.bfloat16)
    receiver = DeltaReceiver(model, bucket)
    while (v := cmd.get()) is not None:
        if v < start_at:
            out.put((v, None, None))
            continue
        receiver.update(v)
        out.put((receiver.version, receiver.last_stats.path, state_bits(model)))


def test_200_adam_steps_bit_exact_in_another_process(tmp_path):
    bucket = str(tmp_path / "bucket")
    trainer = tiny_qwen3("tiny", seed=0)
    opt = torch.optim.Adam(trainer.parameters(), lr=3e-6)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, LocalStore(bucket), anchor_every=25)
    ctx = mp.get_context("spawn")
    procs, queues = [], []
    for start_at in (0, 57):  # one follows from the start, one is created at version 57
        cmd, out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_follower, args=(bucket, start_at, cmd, out), daemon=True)
        p.start()
        procs.append(p)
        queues.append((cmd, out))
    paths = {0: [], 57: []}
    try:
        for step in range(200):
            adam_step(trainer, opt, generator=gen, batch=2, seq=16)
            v = sender.publish()
            expected = state_bits(trainer)
            for (cmd, _), start_at in zip(queues, (0, 57)):
                cmd.put(v)
            for (_, out), start_at in zip(queues, (0, 57)):
                got_v, path, bits = out.get(timeout=120)
                if v < start_at:
                    continue
                assert got_v == v
                assert bits.keys() == expected.keys()
                for name in expected:
                    assert torch.equal(bits[name], expected[name]), f"version {v}, {name}"
                paths[start_at].append(path)
    finally:
        for cmd, _ in queues:
            cmd.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    densities = [s.density for s in sender.history if s.kind == "delta"]
    assert 0 < max(densities) < 0.5  # real sparse updates at lr 3e-6
    assert paths[0].count("anchor") == 1 and len(paths[0]) == 200  # version 0; then always deltas
    assert paths[57][0] == "anchor" and len(paths[57]) == 143  # the late one starts from anchor 50 + deltas
