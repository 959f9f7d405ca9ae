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
plain float buffer (whole on every rank; exactly one rank ships it).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_deltasync._ranks import run_ranks

pytestmark = pytest.mark.timeout(900)

VOCAB, HIDDEN, MID, SMALL = 1001, 64, 45, 5
LR = 3e-6
CHUNK = 1024  # detection / checksum chunk in the memory check (see _publish_measured)


class TinyLM(nn.Module):
    """Embedding(1001, 64) tied to the LM head, a residual MLP 64->45->64, LayerNorm, two 5-way heads."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.up = nn.Linear(HIDDEN, MID)
        self.down = nn.Linear(MID, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.aux = nn.Linear(HIDDEN, SMALL)
        self.aux2 = nn.Linear(HIDDEN, SMALL)  # same shape as aux: two distinct empty shards on rank 3 of 4
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
        return loss + self.aux(h).pow(2).mean() + self.aux2(h).pow(2).mean()


def _make_model(kind: str, seed: int) -> nn.Module:
    if kind == "tinylm":
        return TinyLM(seed=seed)
    from torch_deltasync.testing import tiny_qwen3

    return tiny_qwen3("tiny", seed=seed)  # Qwen3ForCausalLM (transformers), untied


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids) if isinstance(model, TinyLM) else model(input_ids=ids, labels=ids).loss


def _shard(model: nn.Module, layout: str, world: int):
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
    units = [model.up, model.down] if isinstance(model, TinyLM) else list(model.model.layers)
    for unit in units:
        fully_shard(unit, mesh=mesh)
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
            assert src.slice.box is not None, name  # every layout here gives boxes
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
              measure: bool, kind: str = "tinylm", anchor_every: int = 2) -> dict:
    """Train ``steps`` Adam steps of model ``kind`` on ``layout``, publish after each, follow with a
    receiver on an unsharded model. Without ``measure`` every local shard is read for changes on
    two threads (a helper takes part: the reference comparison covers sharded blocks read there);
    with it, on one (the memory bound counts one set of detection temporaries)."""
    import torch.distributed as dist

    from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore
    from torch_deltasync.manifest import load_manifest
    from torch_deltasync.sender import _sender
    from torch_deltasync.testing import first_difference

    if measure:
        from torch_deltasync import checksum as _cs

        _cs.tensor_checksum.__kwdefaults__["chunk"] = CHUNK  # small chunks: temporaries << a shard

    model = _make_model(kind, seed=0)
    dp = _shard(model, layout, world)
    checked = _check_blocks(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    store = LocalStore(os.path.join(bucket, layout))
    if not measure:
        _sender.DETECT_MIN_NUMEL = 1  # this process only: the small shards count as large
    sender = DeltaSender(model, store, anchor_every=anchor_every, background=background, threads=1 if measure else 2)
    if measure:
        sender.detector.chunk_numel = CHUNK
    out: dict = {"rank": rank, "checked_blocks": checked, "memory": [], "versions": []}

    receiver = reference = None
    if rank == 0:
        plain = _make_model(kind, seed=123)  # different weights: everything must come from the store
        receiver = DeltaReceiver(plain, store)
    full32 = _full_fp32(model)  # collective
    if rank == 0:
        ref_state = {n: t for n, t in full32.items()}
        if kind == "tinylm":
            ref_state["lm_head.weight"] = ref_state["embed.weight"]  # tied, as in the module
        reference = DeltaSender(ref_state, LocalStore(os.path.join(bucket, layout + "-single")),
                                anchor_every=anchor_every)

    gen = torch.Generator().manual_seed(1000 + dp)
    vocab = VOCAB if kind == "tinylm" else model.config.vocab_size
    for step in range(steps + 1):
        if step:
            ids = torch.randint(0, vocab, (2, 17), generator=gen)
            opt.zero_grad(set_to_none=True)
            _loss(model, ids).backward()
            opt.step()
        if measure and step < 2:
            largest = max(model.parameters(), key=lambda p: p.numel())
            out["memory"].append(_publish_measured(sender, largest))
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
                    if not (kind == "tinylm" and n == "lm_head.weight"):  # the tied alias
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
                                    # the ranks that wrote this version's own kind of object (an
                                    # anchor also carries a delta against the previous version)
                                    "object_ranks": sorted(o.rank for o in (m.anchor_objects if m.kind == "anchor" else m.delta_objects)),
                                    "delta_ranks": sorted(o.rank for o in m.delta_objects),
                                    "worlds": sorted({o.world for o in m.objects})})
        dist.barrier()
    if rank == 0:  # a fresh receiver: newest anchor + deltas, blocks reassembled from every rank
        fresh = DeltaReceiver(_make_model(kind, seed=7), store)
        assert fresh.update() == steps
        assert fresh.plan().path == "noop"
        assert first_difference(fresh.target.state_dict(), full) is None
        fresh.verify()
    sender.close()
    out["uploads"] = dict(sender._uploads or {})
    return out


def _result_checks(results: list[dict], world: int, layout: str, steps: int, anchor_every: int = 2) -> None:
    r0 = results[0]
    assert len(r0["versions"]) == steps + 1
    for rec in r0["versions"]:
        assert rec["worlds"] == [world]
        if rec["kind"] == "delta":
            # sparse but real: an RL-sized Adam step flips a few % of the bf16 weights
            assert 0 < rec["changed"] < 0.5 * rec["numel"], rec
            assert rec["path"] == "delta"
    kinds = [rec["kind"] for rec in r0["versions"]]
    assert kinds == ["anchor" if v % anchor_every == 0 else "delta" for v in range(steps + 1)]
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
    # the plain buffer is whole on every rank: exactly one rank ships it
    if world > 1:
        assert sum(r["uploads"]["gain"] for r in results) == 1
    if measure:
        for r in results:
            for m in r["memory"]:
                assert m["peak"] <= m["bound"], m
                # the bound would have caught a rank gathering the largest parameter
                assert m["essential"] + m["gather_peak"] > m["bound"], m


# --- HSDP and FSDP x TP ----------------------------------------------------------------------------


def _two_layouts(rank: int, world: int, bucket: str, steps: int) -> dict:
    return {layout: _scenario(rank, world, bucket, layout, steps, layout == "hsdp", False)
            for layout in ("hsdp", "fsdp_tp")}


def test_hsdp_and_fsdp_x_tp(tmp_path):
    """A (2, 2) HSDP mesh ``[Replicate(), Shard(0)]``: each block has two holders (ranks r and r + 2)
    and exactly one of them uploads it; the replicas share the work. A (dp=2, tp=2) mesh with a
    row-parallel linear (``[Shard(0), Shard(1)]``): every rank ships its own block of it, while the
    non-TP parameters, which sit on the dp sub-mesh and so are held twice (ranks 2d and 2d + 1), go up
    once."""
    steps = 2
    results = run_ranks(_two_layouts, 4, str(tmp_path), steps, timeout_s=600)
    for layout in ("hsdp", "fsdp_tp"):
        per_rank = [r[layout] for r in results]
        _result_checks(per_rank, 4, layout, steps)
        objects = [rec["object_ranks"] for rec in per_rank[0]["versions"]]
        assert objects == [[0, 1, 2, 3]] * (steps + 1)  # every rank ships a share
        holders = [(0, 2), (1, 3)] if layout == "hsdp" else [(0, 1), (2, 3)]
        for name in per_rank[0]["uploads"]:
            if name == "gain":  # whole on every rank
                assert sum(r["uploads"][name] for r in per_rank) == 1
            elif layout == "fsdp_tp" and name == "down.weight":  # four distinct blocks
                assert all(r["uploads"][name] for r in per_rank)
            else:
                for pair in holders:
                    assert sum(per_rank[r]["uploads"][name] for r in pair) == 1, (layout, name, pair)


# --- refusals --------------------------------------------------------------------------------------


def _refusals(rank: int, world: int, bucket: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from torch_deltasync import DeltaSender, LocalStore
    from torch_deltasync.errors import UnsupportedLayoutError

    store = LocalStore(bucket)
    out = {}
    mesh = init_device_mesh("cpu", (world,))

    def refused(model) -> str:
        try:
            DeltaSender(model, store)
        except UnsupportedLayoutError as e:
            return str(e)
        raise AssertionError("not refused")

    # Partial: the local values are unreduced partial sums, not weights
    out["partial"] = refused({"w.partial": DTensor.from_local(torch.ones(3, 2), mesh, [Partial()])})
    # a local shard whose shape disagrees with its placements on one rank only (its metadata does not
    # describe its data): refused on every rank, with no rank left waiting in a collective
    rows = torch.ones(1 if rank == 3 else 2, 3)
    out["disagree"] = refused({"w.bad": DTensor.from_local(rows, mesh, [Shard(0)], shape=torch.Size([8, 3]), stride=(3, 1))})
    # ranks that disagree on the model (e.g. pipeline stages): refused on every rank, no hang
    rep = DTensor.from_local(torch.ones(4), mesh, [Replicate()])
    out["mismatch"] = refused({f"stage{rank}.w": rep})
    # a DTensor on a sub-mesh: the other ranks hold nothing and the mesh ranks cover it -> accepted
    from torch.distributed.device_mesh import DeviceMesh

    sub = DeviceMesh("cpu", [0, 1])  # every rank constructs it (a collective); ranks 2, 3 are outside
    local = torch.full((3,), float(rank)) if rank < 2 else torch.empty(0)
    half = DTensor.from_local(local, sub, [Shard(0)], shape=torch.Size([6]), stride=(1,))
    # a second one of the same shape: on ranks 2, 3 both are empty (no storage to tell them apart)
    other = DTensor.from_local(local.clone(), sub, [Shard(0)], shape=torch.Size([6]), stride=(1,))
    sender = DeltaSender({"half": half, "other": other}, LocalStore(os.path.join(bucket, "sub")))
    out["sub_uploads"] = sender._uploads
    sender.publish()
    sender.close()
    return out


def test_refused_layouts_fail_on_every_rank(tmp_path):
    results = run_ranks(_refusals, 4, str(tmp_path), timeout_s=300)
    for r in results:
        assert "'w.partial'" in r["partial"] and "Partial" in r["partial"]
        assert "rank 3: tensor 'w.bad': the local shard has shape (1, 3)" in r["disagree"]
        assert "(Shard(dim=0),)" in r["disagree"] and "give (2, 3)" in r["disagree"]
        assert "different tensors" in r["mismatch"]
    assert [r["sub_uploads"] for r in results] == [{"half": True, "other": True}] * 2 + [{"half": False, "other": False}] * 2


# --- failures ---------------------------------------------------------------------------------------


def _flaky_store(root: str):
    """A LocalStore whose next ``put`` of a key containing ``fail_on`` raises (once)."""
    from torch_deltasync import LocalStore
    from torch_deltasync.errors import StoreError

    class FlakyStore(LocalStore):
        fail_on: str | None = None
        crash_on: str | None = None

        def _inject(self, key: str, data: bytes) -> None:
            if self.crash_on and self.crash_on in key:
                self._path(key).parent.mkdir(parents=True, exist_ok=True)
                self._path(key).write_bytes(data[: len(data) // 2])  # a torn object, then the rank dies
                os._exit(17)
            if self.fail_on and self.fail_on in key:
                self.fail_on = None
                raise StoreError(f"injected failure writing {key!r}")

        def put(self, key: str, data: bytes) -> None:
            self._inject(key, data)
            super().put(key, data)

        def put_new(self, key: str, data: bytes) -> None:  # manifests
            self._inject(key, data)
            super().put_new(key, data)

    return FlakyStore(root)


def _fail_detect_once(sender) -> None:
    det = sender.detector
    original = det.detect

    def broken(name, tensor):
        det.detect = original
        raise RuntimeError("injected detection failure")

    det.detect = broken


def _failures(rank: int, world: int, bucket: str) -> dict:
    import torch.distributed as dist

    from torch_deltasync import DeltaReceiver, DeltaSender
    from torch_deltasync.errors import PublishError
    from torch_deltasync.keys import list_versions
    from torch_deltasync.testing import first_difference

    model = TinyLM(seed=0)
    _shard(model, "fsdp", world)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    store = _flaky_store(bucket)
    sender = DeltaSender(model, store, anchor_every=100)
    receiver = DeltaReceiver(TinyLM(seed=5), store) if rank == 0 else None
    gen = torch.Generator().manual_seed(rank)
    log = []

    def step():
        ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
        opt.zero_grad(set_to_none=True)
        model(ids).backward()
        opt.step()

    def follow(expected: int) -> None:
        full = _full_bf16(model)  # collective
        if rank == 0:
            assert receiver.update() == expected
            assert first_difference(receiver.target.state_dict(), full) is None, expected

    def failed(fn) -> str:
        try:
            fn()
        except PublishError as e:
            return str(e)
        raise AssertionError("publish did not fail")

    assert sender.publish() == 0
    follow(0)
    # 1: rank 1's upload fails -> every rank raises, rank 0 writes no manifest
    step()
    if rank == 1:
        store.fail_on = "objects/000000000001/delta-r00001"
    log.append(failed(sender.publish))
    assert 1 not in list_versions(store)
    if rank == 0:
        assert receiver.update() == 0  # nothing new is visible
    # 2: recovers; the delta is based on version 0 and carries both steps
    step()
    assert sender.publish() == 2
    follow(2)
    # 3: rank 0 fails while reading its shards (before any upload) -> nobody hangs, nothing visible
    step()
    if rank == 0:
        _fail_detect_once(sender)
    log.append(failed(sender.publish))
    assert 3 not in list_versions(store)
    assert sender.publish() == 4
    follow(4)
    # 5: background; rank 0 cannot write the manifest -> reported by flush() on every rank
    step()
    if rank == 0:
        store.fail_on = "versions/000000000005"
    assert sender.publish(background=True) == 5
    _full_bf16(model)  # training-group collectives while the sender's worker gathers
    log.append(failed(sender.flush))
    assert 5 not in list_versions(store)
    # 6: background; rank 1 fails before uploading -> also reported by the next flush()
    step()
    if rank == 1:
        _fail_detect_once(sender)
    assert sender.publish(background=True) == 6
    log.append(failed(sender.flush))
    # 7: background, fine
    assert sender.publish(background=True) == 7
    assert sender.flush() == 7
    follow(7)
    dist.barrier()
    sender.close()
    return {"errors": log, "versions": list_versions(store)}


def test_failed_rank_leaves_no_version_and_next_publish_recovers(tmp_path):
    results = run_ranks(_failures, 2, str(tmp_path), timeout_s=300)
    for r in results:
        assert r["versions"] == [0, 2, 4, 7]
        upload, detect0, manifest, detect1 = r["errors"]
        assert "version 1 was not published" in upload and "rank 1" in upload and "injected failure" in upload
        assert "version 3" in detect0 and "rank 0: RuntimeError: injected detection failure" in detect0
        assert "version 5" in manifest and "rank 0 manifest" in manifest
        assert "version 6" in detect1 and "rank 1: RuntimeError: injected detection failure" in detect1


def _crash_then_restart(rank: int, world: int, bucket: str, phase: str, out_file: str) -> dict:
    """phase "crash": version 0, then rank 1 dies in the middle of uploading version 1.
    phase "restart": a new job on the same bucket trains on and publishes; rank 0 saves the bf16
    weights (safetensors) for the test to compare with its own receiver."""
    from safetensors.torch import save_file

    from torch_deltasync import DeltaSender
    from torch_deltasync.keys import list_versions

    model = TinyLM(seed=0)
    _shard(model, "fsdp", world)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    store = _flaky_store(bucket)
    sender = DeltaSender(model, store, anchor_every=100)
    gen = torch.Generator().manual_seed(rank + (10 if phase == "restart" else 0))

    def step():
        ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
        opt.zero_grad(set_to_none=True)
        model(ids).backward()
        opt.step()

    if phase == "crash":
        assert sender.publish() == 0
        step()
        if rank == 1:
            store.crash_on = "objects/000000000001/delta-r00001"
        try:
            sender.publish()
        except Exception as e:  # noqa: BLE001 - rank 0 sees its peer vanish (gloo)
            return {"error": f"{type(e).__name__}", "versions": list_versions(store)}
        raise AssertionError("publish survived a dead peer")
    step()
    first = sender.publish()
    step()
    second = sender.publish()
    full = _full_bf16(model)
    sender.close()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items() if k != "lm_head.weight"}, out_file)
    return {"published": [first, second], "kinds": [h.kind for h in sender.history]}


def test_crashed_rank_then_restarted_job(tmp_path):
    """A rank dies while uploading: no version appears, the torn object is never read, and a
    restarted job continues with an anchor after the newest visible version and after the number
    the crashed job left objects under (object keys are never reused)."""
    from safetensors.torch import load_file

    from torch_deltasync import DeltaReceiver, LocalStore
    from torch_deltasync.keys import list_versions

    bucket = str(tmp_path / "bucket")
    res = run_ranks(_crash_then_restart, 2, bucket, "crash", "", timeout_s=300, allow_exit=(1,))
    assert res[1] is None and res[0]["versions"] == [0]
    receiver = DeltaReceiver(TinyLM(seed=9), LocalStore(bucket))
    assert receiver.update() == 0
    out = str(tmp_path / "full.safetensors")
    res = run_ranks(_crash_then_restart, 2, bucket, "restart", out, timeout_s=300)
    assert res[0]["published"] == [2, 3] and res[0]["kinds"] == ["anchor", "delta"]
    assert list_versions(LocalStore(bucket)) == [0, 2, 3]
    assert receiver.update() == 3
    full = load_file(out)
    full["lm_head.weight"] = full["embed.weight"]
    from torch_deltasync.testing import first_difference

    assert first_difference(receiver.target.state_dict(), full) is None


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_qwen3_many_versions_in_the_background(world, tmp_path):
    """Longer: a transformers Qwen3 (tiny config), 12 Adam steps, background publishing, an anchor
    every 5 versions; bit-exact after every version and equal to a single-process sender."""
    steps, every = 12, 5
    results = run_ranks(_scenario, world, str(tmp_path), "fsdp", steps, True, False, "qwen3", every,
                        timeout_s=1200)
    _result_checks(results, world, "fsdp", steps, every)


def _dense_on_one_rank(rank: int, world: int, bucket: str) -> dict:
    """``AnchorPolicy.max_delta_ratio`` with shards: one rank's dense shard makes the version an
    anchor (without a delta) on every rank; a rank failing detection with the rule on hangs nobody."""
    from torch_deltasync import AnchorPolicy, DeltaReceiver, DeltaSender, LocalStore
    from torch_deltasync.errors import PublishError
    from torch_deltasync.keys import list_versions
    from torch_deltasync.manifest import load_manifest
    from torch_deltasync.testing import first_difference

    model = TinyLM(seed=0)
    _shard(model, "fsdp", world)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    store = LocalStore(bucket, fsync=False)
    # raw codec: 6 bytes per changed element, so a fully changed shard is 3x its bf16 bytes
    sender = DeltaSender(model, store, codec="raw", anchor_policy=AnchorPolicy(every=None, max_delta_ratio=1.0))
    receiver = DeltaReceiver(TinyLM(seed=5), store) if rank == 0 else None
    gen = torch.Generator().manual_seed(rank)

    def step():
        ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
        opt.zero_grad(set_to_none=True)
        model(ids).backward()
        opt.step()

    def follow(expected: int) -> None:
        full = _full_bf16(model)
        if rank == 0:
            assert receiver.update() == expected
            assert first_difference(receiver.target.state_dict(), full) is None, expected

    assert sender.publish() == 0
    follow(0)
    step()
    assert sender.publish() == 1  # an RL-rate Adam step: sparse everywhere
    follow(1)
    if rank == 1:  # every element of rank 1's shards changes; rank 0's do not change at all
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local()
                local.add_(torch.randn(local.shape, generator=gen) * 0.05)
    assert sender.publish() == 2
    follow(2)
    step()
    if rank == 0:
        _fail_detect_once(sender)
    try:
        sender.publish()
        raise AssertionError("publish did not fail")
    except PublishError as e:
        error = str(e)
    assert sender.publish() == 4
    follow(4)
    sender.close()
    return {"kinds": [[v, load_manifest(store, v).kind, load_manifest(store, v).base_version] for v in list_versions(store)],
            "error": error}


def test_max_delta_ratio_agrees_across_ranks(tmp_path):
    results = run_ranks(_dense_on_one_rank, 2, str(tmp_path), timeout_s=300)
    for r in results:
        assert r["kinds"] == [[0, "anchor", None], [1, "delta", 0], [2, "anchor", None], [4, "delta", 2]]
        assert "version 3" in r["error"] and "rank 0: RuntimeError: injected detection failure" in r["error"]
