"""Compile the numba kernels once (tools/setup.sh runs this): a fresh checkout otherwise pays the
one-time compile (~20 s on 2 cores) inside its first publish and update, and a run's first timings
report it. numba caches the compiled kernels next to the sources; later processes load them in
under a second. Publishes an fp32 model as bf16 (anchors, packed deltas of small and large steps) and
applies it to a bf16 and an fp32 copy, to a receiver that jumps over a chain of deltas and to one
that joins late (an anchor and the deltas after it), then compiles the targets' remaining kernels (the vLLM TP maps) for every width
(:func:`torch_deltasync._native_apply.warm`)."""

from __future__ import annotations

import argparse
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
        sender = DeltaSender(trainer, store, anchor_every=4)
        receivers = [DeltaReceiver(replica, store), DeltaReceiver(replica32, store)]
        late = DeltaReceiver({k: v.clone() for k, v in replica.items()}, store)  # jumps over a chain
        # anchors, deltas of small steps (2-bit codes) and of large ones (16-bit codes, raw values),
        # an anchor carrying a delta; the late receiver composes a chain of deltas
        for i, scale in enumerate((1e-3, 1e-3, 1.0, 1e-3, 1e-3, 1e-3)):
            v = sender.publish()
            for receiver in receivers:
                receiver.update(v)
            if i in (0, 3):
                late.update(v)
            for t in trainer.values():
                t.add_(torch.randn(t.shape, generator=gen) * scale)
        v = sender.publish()
        late.update(v)
        # a receiver joining now: the anchor of version 4, then the deltas 5 and 6 applied onto it
        DeltaReceiver({k: torch.zeros_like(t) for k, t in replica.items()}, store).update(v)
        sender.close()
    _native_apply.warm()
    print(f"tools/warm_kernels.py: kernels compiled and cached in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # --help; no options
    main()
