"""Sharded (FSDP2 / HSDP / FSDP x TP) senders, end to end: real process groups (gloo, CPU), real
``fully_shard`` models, real Adam steps at an RL learning rate, a receiver on a plain unsharded model.

Every scenario runs in freshly spawned processes (``torch_deltasync._ranks.run_ranks``). After every
version, all ranks gather ``full_tensor()`` (a test-only collective, outside ``publish``) and rank 0
checks that the receiver's weights are bit-identical to ``full_tensor().to(bf16)``, that a
single-process sender fed the same full weights in lockstep writes the same per-tensor checksums and
change counts, and which ranks wrote objects.

The model is a small LM-shaped module (no ``transformers`` import, to keep the suite fast): a
1001-row embedding tied to the LM head (uneven ``torch.chunk`` rows over 2, 3 and 4 ranks), a
45-row and a 5-row linear (5 rows over 4 ranks leave rank 3 an empty shard), a LayerNorm and a
plain float buffer (whole on every rank; rank 0 alone ships it).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_deltasync._ranks import run_ranks

pytestmark = pytest.mark.timeout(900)

VOCAB, HIDDEN, MID, SMALL = 1001, 64, 45, 5
LR = 3e-6
CHUNK = 1024  # detection / checksum chunk in the memory check (see _check_memory)


class TinyLM(nn.Module):
    """Embedding(1001, 64) tied to the LM head, a residual MLP 64->45->64, LayerNorm, a 5-way head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.up = nn.Linear(HIDDEN, MID)
        self.down = nn.Linear(MID, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.aux = nn.Linear(HIDDEN, SMALL)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 3))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.02, generator=g)
                elif p.dim() == 2:
                    p.normal_(0, 0.02, generator=g)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids[:, :-1])
        h = self.norm(x + self.down(torch.relu(self.up(x))))
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        return loss + self.aux(h).pow(2).mean()


def _shard(model: TinyLM, layout: str, world: int):
    """Apply ``layout`` in place; returns the data-parallel coordinate (ranks with equal coordinates
    must see the same batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = torch.distributed.get_rank()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        dp = rank
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        dp = rank
    elif layout == "fsdp_tp":
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        # Row-parallel `down` (weight Shard(1) on tp); fully_shard then adds Shard(0) on dp.
        parallelize_module(model, mesh2["tp"], {"down": RowwiseParallel(input_layouts=Replicate())})
        mesh = mesh2["dp"]
        dp = mesh2.get_coordinate()[0]
    else:
        raise ValueError(layout)
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return dp


def _full_bf16(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every floating tensor gathered (a collective: all ranks) and cast to bf16."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, t in model.state_dict(keep_vars=True).items():
        t = t.detach()
        out[n] = (t.full_tensor() if isinstance(t, DTensor) else t).to(torch.bfloat16)
    return out


def _full_fp32(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()).clone()
            for n, t in model.state_dict(keep_vars=True).items()}


def _manifest_summary(m) -> dict:
    return {"kind": m.kind, "base": m.base_version, "aliases": dict(m.aliases),
            "tensors": [(t.name, list(t.shape), t.checksum, t.changed) for t in m.tensors]}


def _check_blocks(model: nn.Module) -> int:
    """Our torch.chunk rule against torch's own compute_local_shape_and_global_offset; returns the
    number of DTensors checked."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from torch_deltasync.dtensor import local_source

    n = 0
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, DTensor):
            src = local_source(name, t.detach())
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            assert (src.slice.shape, src.slice.offsets) == (tuple(shape), tuple(offset)), name
            assert src.slice.shape == tuple(t.to_local().shape), name
            n += 1
    return n


# --- memory ----------------------------------------------------------------------------------------


def _peak_cpu_alloc(fn):
    """Run ``fn`` under the profiler; return ``(result, peak, largest, at_peak)``.

    ``peak`` is the most CPU memory (bytes) that allocations made inside ``fn`` held at once,
    ``largest`` the largest single allocation, ``at_peak`` the live bytes at the peak by allocating
    op (for failure messages).

    Why the profiler: torch's CPU allocator reports every allocation and free to it while
    ``profile_memory=True``, with the running total of bytes allocated *since profiling started*
    (``total_allocated``; frees of older blocks are not counted). Its maximum is exactly the extra
    CPU memory the code under test held at its worst moment, including temporaries inside ops, on
    every code path (summed here from the individual events, see below). ``tracemalloc`` does not see torch's allocator, and RSS moves in pages and
    allocator caches, far too coarse for shards of a few hundred KiB.
    """
    from collections import Counter

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()

    def walk(evs, parents=()):
        for e in evs:
            yield e, parents
            yield from walk(e.children, parents + (e.name,))

    allocs = sorted(((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, "/".join(parents[-2:]))
                     for e, parents in walk(prof.profiler.kineto_results.experimental_event_tree())
                     if e.tag == _EventType.Allocation), key=lambda x: x[0])
    # Sum the live blocks ourselves: the allocator's running ``total_allocated`` also carries blocks
    # from earlier profiling sessions that were freed while profiling was off.
    live: dict[int, tuple[int, str]] = {}
    now = peak = largest = 0
    at_peak: dict[str, int] = {}
    for _, ptr, size, where in allocs:
        if size > 0:
            live[ptr] = (size, where)
            now += size
            largest = max(largest, size)
        elif ptr in live:
            now -= live.pop(ptr)[0]
        if now > peak:
            peak = now
            c: Counter = Counter()
            for n, w in live.values():
                c[w] += n
            at_peak = dict(c.most_common(8))
    return result, peak, largest, at_peak


class _NoGather:
    """Make every way of gathering a DTensor raise while active (a structural check)."""

    def __enter__(self):
        from torch.distributed.tensor import DTensor

        self._saved = {k: getattr(DTensor, k) for k in ("full_tensor", "redistribute")}

        def refuse(*a, **k):
            raise AssertionError("publish() gathered a DTensor")

        for k in self._saved:
            setattr(DTensor, k, refuse)
        return self

    def __exit__(self, *exc):
        from torch.distributed.tensor import DTensor

        for k, v in self._saved.items():
            setattr(DTensor, k, v)


def _local_counts(sender) -> tuple[int, int]:
    """``(L, k)``: elements of this rank's local shards, and how many of them differ (bf16 bits) from
    the sender's snapshot, i.e. what the next publish will detect. Computed here, independently."""
    from torch_deltasync.sender import collect_sources

    sources, _ = collect_sources(sender.model)
    L = sum(s.slice.numel for s in sources)
    k = 0
    det = sender.detector
    for s in sources:
        if s.name in det:
            now = s.local.detach().reshape(-1).to(torch.bfloat16).view(torch.int16)
            k += int((now != det.snapshot(s.name).view(torch.int16)).sum())
    return L, k


def _publish_measured(sender, largest_param) -> dict:
    """Publish (foreground) under the profiler and check the peak against the local bound.

    Bound, in bytes, for one rank (``L`` = elements of its local shards, ``k`` = elements it sees
    change, ``C`` = the chunk of the detection and checksum loops):

    * anchor: ``2 L``, the new bf16 snapshot (the anchor object is serialised from it);
    * delta: ``40 k``: per change, local and global int64 positions, new and old bf16 values, the
      codec's index and value parts, an int64 checksum term;
    * both: ``48 C`` for the reused detection buffers (3 B/element) and the int64 temporaries of a
      chunked checksum (index, mixed hash, shift scratch, widened bits: 32 B/element), plus 16 KiB
      for small tensors (pickled metadata, scalars).

    A rank that materialised the largest full parameter would need at least ``4 N`` bytes more (an
    fp32 ``full_tensor()``); the test measures that too and checks it would have broken the bound.
    """
    L, k = _local_counts(sender)
    with _NoGather():
        version, peak, largest, at_peak = _peak_cpu_alloc(lambda: sender.publish(background=False))
    kind = sender.last_stats.kind
    essential = 2 * L if kind == "anchor" else 40 * k
    bound = essential + 48 * CHUNK + (16 << 10)
    _, gather_peak, _, _ = _peak_cpu_alloc(lambda: largest_param.full_tensor())
    return {"version": version, "kind": kind, "peak": peak, "largest": largest, "bound": bound,
            "gather_peak": gather_peak, "essential": essential, "local_numel": L, "local_changed": k,
            "at_peak": at_peak}


# --- scenarios -------------------------------------------------------------------------------------


def _scenario(rank: int, world: int, bucket: str, layout: str, steps: int, background: bool,
              measure: bool) -> dict:
    """Train ``steps`` Adam steps on ``layout``, publish after each, follow with a receiver."""
    import torch.distributed as dist

    from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore
    from torch_deltasync.manifest import load_manifest
    from torch_deltasync.testing import first_difference

    if measure:
        from torch_deltasync import checksum as _cs

        _cs.tensor_checksum.__kwdefaults__["chunk"] = CHUNK  # small chunks: temporaries << a shard

    model = TinyLM(seed=0)
    dp = _shard(model, layout, world)
    checked = _check_blocks(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    store = LocalStore(os.path.join(bucket, layout))
    sender = DeltaSender(model, store, anchor_every=2, background=background)
    if measure:
        sender.detector.chunk_numel = CHUNK
    out: dict = {"rank": rank, "checked_blocks": checked, "memory": [], "versions": []}

    receiver = reference = None
    if rank == 0:
        plain = TinyLM(seed=123)  # different weights: everything must come from the store
        receiver = DeltaReceiver(plain, store)
    full32 = _full_fp32(model)  # collective
    if rank == 0:
        ref_state = {n: t for n, t in full32.items()}
        ref_state["lm_head.weight"] = ref_state["embed.weight"]  # tied, as in the module
        reference = DeltaSender(ref_state, LocalStore(os.path.join(bucket, layout + "-single")), anchor_every=2)

    gen = torch.Generator().manual_seed(1000 + dp)
    for step in range(steps + 1):
        if step:
            ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
            opt.zero_grad(set_to_none=True)
            model(ids).backward()
            opt.step()
        if measure and step < 2:
            out["memory"].append(_publish_measured(sender, model.embed.weight))
            v = out["memory"][-1]["version"]
        else:
            v = sender.publish()
        full = _full_bf16(model)  # collectives on the training group while a background upload runs
        full32 = _full_fp32(model)
        v = sender.flush() if background else v
        assert v == step, (v, step)
        if rank == 0:
            with torch.no_grad():
                for n, t in full32.items():
                    if n != "lm_head.weight":
                        ref_state[n].copy_(t)
            assert reference.publish() == v
            got = receiver.update()
            assert got == v, (got, v)
            diff = first_difference(receiver.target.state_dict(), full)
            assert diff is None, f"version {v}: {diff}"
            m = load_manifest(store, v)
            single = load_manifest(reference.store, v)
            assert _manifest_summary(m) == _manifest_summary(single), f"version {v}: sharded != single-process"
            out["versions"].append({"version": v, "kind": m.kind, "path": receiver.last_stats.path,
                                    "changed": m.changed, "numel": m.numel,
                                    "object_ranks": sorted(o.rank for o in m.objects),
                                    "worlds": sorted({o.world for o in m.objects})})
        dist.barrier()
    if rank == 0:  # a fresh receiver: newest anchor + deltas, blocks reassembled from every rank
        fresh = DeltaReceiver(TinyLM(seed=7), store)
        assert fresh.update() == steps
        assert fresh.plan().path == "noop"
        assert first_difference(fresh.target.state_dict(), full) is None
        fresh.verify()
    sender.close()
    out["uploads"] = dict(sender._uploads or {})
    return out


def _result_checks(results: list[dict], world: int, layout: str, steps: int) -> None:
    r0 = results[0]
    assert len(r0["versions"]) == steps + 1
    for rec in r0["versions"]:
        assert rec["worlds"] == [world]
        if rec["kind"] == "delta":
            # sparse but real: an RL-sized Adam step flips a few % of the bf16 weights
            assert 0 < rec["changed"] < 0.5 * rec["numel"], rec
            assert rec["path"] == "delta"
    kinds = [rec["kind"] for rec in r0["versions"]]
    assert kinds == ["anchor" if v % 2 == 0 else "delta" for v in range(steps + 1)]
    for r in results:
        assert r["checked_blocks"] > 0


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fsdp2_bit_exact_every_version(world, tmp_path):
    """World sizes 1-4 (1001 rows over 2/3/4 ranks; 5 rows over 4 leave an empty shard). Worlds 2
    and 3 publish in the background while the training group gathers; 2 and 4 measure memory."""
    steps = 3
    background = world in (2, 3)
    measure = world in (2, 4)
    results = run_ranks(_scenario, world, str(tmp_path), "fsdp", steps, background, measure, timeout_s=600)
    _result_checks(results, world, "fsdp", steps)
    for rec in results[0]["versions"]:
        # every rank holds a block of the embedding, so every rank writes an object
        assert rec["object_ranks"] == list(range(world))
    # the plain buffer is whole on every rank: only rank 0 ships it
    for r in results:
        assert r["uploads"].get("gain", True) == (r["rank"] == 0) or world == 1
    if measure:
        for r in results:
            for m in r["memory"]:
                assert m["peak"] <= m["bound"], m
                # the bound would have caught a rank gathering the largest parameter
                assert m["essential"] + m["gather_peak"] > m["bound"], m
