"""Compile the numba kernels once (tools/setup.sh runs this): a fresh checkout otherwise pays the
one-time compile (~20 s on 2 cores) inside its first publish and update, and a run's first timings
report it. numba caches the compiled kernels next to the sources; later processes load them in
under a second. Publishes an fp32 model as bf16 (anchor, packed deltas) and applies it to a bf16
and an fp32 copy, then compiles the targets' remaining kernels (the vLLM TP maps) for every width
(:func:`torch_deltasync._native_apply.warm`)."""

from __future__ import annotations

import tempfile
import time

import torch

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore, _native, _native_apply


def main() -> None:
    if not _native.enabled():
        print("tools/warm_kernels.py: numba kernels are off; nothing to compile")
        return
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    trainer = {"w": torch.randn(64, 4096, generator=gen), "b": torch.randn(4096, generator=gen)}
    replica = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in trainer.items()}
    replica32 = {k: torch.zeros_like(v) for k, v in trainer.items()}  # bf16 held in fp32 storage
    with tempfile.TemporaryDirectory() as d:
        store = LocalStore(d, fsync=False)
        sender = DeltaSender(trainer, store, anchor_every=2)
        receivers = [DeltaReceiver(replica, store), DeltaReceiver(replica32, store)]
        for _ in range(3):  # an anchor, a delta, an anchor carrying a delta
            v = sender.publish()
            for receiver in receivers:
                receiver.update(v)
            for t in trainer.values():
                t.add_(torch.randn(t.shape, generator=gen) * 1e-3)
        sender.close()
    _native_apply.warm()
    print(f"tools/warm_kernels.py: kernels compiled and cached in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
