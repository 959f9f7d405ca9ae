"""``deltasync demo``: a trainer and a receiver process, synced through a local bucket.

The trainer builds a small Qwen3-architecture causal LM (std-0.02 init), runs one real Adam step
at an RL learning rate per version and publishes it; a separate receiver process follows through
the bucket, applies each version and reports the sha256 of its bf16 weights, which the trainer
compares with its own cast. Prints one row per version and a final bit-exact verdict::

    python -m torch_deltasync.cli demo --steps 50

Before building anything it prints the memory the chosen size needs (:func:`estimate_memory`) and
refuses a size that does not fit in this machine's available memory. Byte counts are those of
``deltasync ls``: the version's objects in the bucket (all its anchor and delta objects; the
manifest is not counted).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ._memory import available_nbytes

__all__ = ["run_demo", "estimate_memory", "DemoMemory"]

#: Bytes per parameter the demo holds at its peak, by part. Trainer: fp32 weights, gradients and
#: Adam's two moments (4 + 4 + 4 + 4) plus the optimizer's temporaries (4). Sender: the bf16
#: snapshot of the last published version and the bf16 cast it is compared with (2 + 2). Receiver
#: process: the bf16 model and an anchor rebuilt in full before it is applied (2 + 2). Calibrated
#: against the peak resident size of ``--size 100m`` (tools/bench_demo_memory.py, docs/benchmarks.md).
_BYTES_PER_PARAM = {"trainer": 20, "sender": 4, "receiver": 4}
#: Bytes each of the two processes holds before any tensor (Python, torch, transformers): the peak
#: resident size of ``--size tiny`` (0.94 GiB trainer, 1.10 GiB receiver, measured).
_PROCESS_NBYTES = 1 << 30


@dataclass(frozen=True)
class DemoMemory:
    """What :func:`estimate_memory` found.

    Attributes:
        parameters: parameters of the model (elements).
        need_nbytes: bytes the demo needs in all (both processes), from :data:`_BYTES_PER_PARAM`.
        parts: ``{part: bytes}`` behind ``need_nbytes`` (``"trainer"``, ``"sender"``, ``"receiver"``,
            ``"processes"``).
        available_nbytes: memory available on this machine (``None``: unknown).
    """

    parameters: int
    need_nbytes: int
    parts: dict
    available_nbytes: int | None

    @property
    def fits(self) -> bool:
        return self.available_nbytes is None or self.need_nbytes <= self.available_nbytes


def estimate_memory(size: str, *, tie: bool = False) -> DemoMemory:
    """The memory ``run_demo(size=...)`` needs, from the parameter count of the config (built on
    the meta device: nothing is allocated).

    Raises:
        KeyError: ``size`` is not a key of :data:`~torch_deltasync.testing.QWEN3_SIZES`.
    """
    from .testing import tiny_qwen3

    meta = tiny_qwen3(size, tie_word_embeddings=tie, device="meta")
    n = sum(p.numel() for p in meta.parameters())
    parts = {k: b * n for k, b in _BYTES_PER_PARAM.items()}
    parts["processes"] = 2 * _PROCESS_NBYTES
    return DemoMemory(n, sum(parts.values()), parts, available_nbytes())


def _receiver_main(bucket: str, size: str, tie: bool, cmd: mp.Queue, out: mp.Queue) -> None:
    """Receiver process: a differently initialised copy of the model, updated on request."""
    from .receiver import DeltaReceiver
    from .testing import state_digest, tiny_qwen3

    torch.set_num_threads(1)
    model = tiny_qwen3(size, seed=1234, tie_word_embeddings=tie, dtype=torch.bfloat16)
    receiver = DeltaReceiver(model, bucket)
    while True:
        version = cmd.get()
        if version is None:
            return
        try:
            receiver.update(version)
            st = receiver.last_stats
            out.put({"version": receiver.version, "path": st.path, "apply_ms": st.apply_ms,
                     "update_ms": st.total_ms, "digest": state_digest(model)})
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which stops the demo
            out.put({"version": version, "error": f"{type(e).__name__}: {e}"})


def run_demo(*, steps: int = 50, size: str = "small", lr: float = 3e-6, anchor_every: int = 10,
             bucket: str | None = None, codec: str | None = None, seed: int = 0, tie: bool = False,
             run_dir: str = "runs/demo", timeout_s: float = 120.0) -> bool:
    """Run the demo; returns ``True`` when every version was bit-exact on the receiver.

    Raises:
        MemoryError: ``size`` needs more memory than this machine has available (checked before
            anything is built; the message gives both numbers).
        PrefixInUseError, FileExistsError: the run folder's bucket has a live writer, or holds files
            no run writes (:func:`~torch_deltasync.bucket.clear_local_bucket`; nothing is deleted).
        WorkerError: the receiver process failed, died, or did not answer within ``timeout_s``.
    """
    from ._units import format_bytes
    from .bucket import clear_local_bucket
    from .errors import WorkerError
    from .manifest import load_manifest
    from .sender import DeltaSender
    from .store import LocalStore
    from .testing import adam_step, state_digest, tiny_qwen3

    mem = estimate_memory(size, tie=tie)
    detail = ", ".join(f"{k} {format_bytes(v)}" for k, v in mem.parts.items())
    have = "unknown" if mem.available_nbytes is None else format_bytes(mem.available_nbytes)
    if not mem.fits:
        raise MemoryError(
            f"Qwen3 '{size}' ({mem.parameters / 1e9:.2f}B parameters) needs about {format_bytes(mem.need_nbytes)} "
            f"of memory ({detail}); this machine has {have} available. Pick a smaller --size.")
    print(f"memory: about {format_bytes(mem.need_nbytes)} ({detail}); available {have}")
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    if bucket is None:  # the demo's own bucket: start from an empty one every run, unless another demo writes it
        bucket = str(run / "bucket")
        clear_local_bucket(bucket)
    (run / "metrics.jsonl").unlink(missing_ok=True)
    store = LocalStore(bucket)
    model = tiny_qwen3(size, seed=seed, tie_word_embeddings=tie)
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    kwargs = {"codec": codec} if codec else {}
    sender = DeltaSender(model, store, anchor_every=anchor_every, metrics_path=run / "metrics.jsonl", **kwargs)

    ctx = mp.get_context("spawn")
    cmd, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver_main, args=(bucket, size, tie, cmd, out), daemon=True)
    proc.start()
    print(f"Qwen3 '{size}': {nparams / 1e6:.1f}M parameters, Adam lr {lr:g}, {steps} versions, "
          f"anchor every {anchor_every}; bucket {store.describe()}")
    header = (f"{'ver':>4} {'kind':<6} {'changed':>10} {'density':>8} {'bytes':>11} {'full B':>11} "
              f"{'ratio':>7} {'publish ms':>10} {'apply ms':>9} {'path':<6} bit-exact")
    print(header)
    print("-" * len(header))
    exact = 0
    stored: dict[int, int] = {}  # version -> bytes of its objects, as `deltasync ls` shows them
    try:
        for step in range(steps):
            loss = adam_step(model, opt, generator=gen)
            v = sender.publish()
            expected = state_digest(model)
            cmd.put(v)
            rep, deadline = None, time.monotonic() + timeout_s
            while rep is None:
                try:
                    rep = out.get(timeout=0.5)
                except queue.Empty:  # a receiver that died is noticed within half a second
                    if not proc.is_alive():
                        raise WorkerError(f"the receiver process exited (exit code {proc.exitcode}) before it "
                                           f"applied version {v}") from None
                    if time.monotonic() > deadline:
                        raise WorkerError(f"receiver process did not answer for version {v} within {timeout_s} s") from None
            if "error" in rep:
                raise WorkerError(f"receiver failed at version {v}: {rep['error']}")
            ok = rep["version"] == v and rep["digest"] == expected
            exact += ok
            st = sender.last_stats
            stored[v] = load_manifest(store, v).nbytes
            print(f"{v:>4} {st.kind:<6} {st.changed:>10,} {st.density:>8.2%} {stored[v]:>11,} "
                  f"{st.full_nbytes:>11,} {stored[v] / st.full_nbytes:>7.3f} {st.publish_ms:>10.1f} {rep['apply_ms']:>9.1f} "
                  f"{rep['path']:<6} {'yes' if ok else 'NO'}", flush=True)
            with open(run / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"event": "receiver", "version": v, "loss": loss, **{k: rep[k] for k in ("path", "apply_ms", "update_ms")}, "bit_exact": ok}) + "\n")
    finally:
        cmd.put(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
        sender.close()
    deltas = [s for s in sender.history if s.kind == "delta" and s.version in stored]
    if deltas:
        mean_ratio = sum(stored[s.version] for s in deltas) / sum(s.full_nbytes for s in deltas)
        mean_density = sum(s.changed for s in deltas) / sum(s.numel for s in deltas)
        print(f"deltas: mean density {mean_density:.2%}, bytes {mean_ratio:.4f} of a full copy "
              f"({1 / mean_ratio:.1f}x smaller)")
    verdict = exact == steps
    print(f"bit-exact: {'YES' if verdict else 'NO'} ({exact}/{steps} versions identical on the receiver)")
    return verdict
