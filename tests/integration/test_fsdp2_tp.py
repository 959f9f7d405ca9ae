"""2D and 3D trainers: FSDP2 x tensor parallel (torchtitan's layout, ``_StridedShard``), HSDP and
expert-parallel MoE senders, end to end on 4 gloo ranks (CPU), followed by receivers in the pytest
process (a different process from every rank).

* ``test_fsdp2_x_tp_real_adam_steps``: a transformers Qwen3 sharded the torchtitan way
  (``recipes/torchrun_fsdp2.py:parallelize``, dp_shard 2 x tp 2) with an uneven vocabulary (1001 rows)
  and MLP width (126 = 2 x 63 columns, then 32 + 31 rows per dp rank), real Adam steps. Rank 0 saves
  ``full_tensor()`` (bf16) after every version; the test process follows version by version and
  from scratch at every version, bit-exactly, across anchors, and a single-process sender fed the
  same full weights writes the same manifests.
* ``test_layouts_publish_the_same_versions``: one Qwen3-MoE and one change set (synthetic, written
  into every layout's shards through ``distribute_tensor``), published under plain FSDP2, FSDP2 x TP, HSDP, expert parallel
  (experts split over 2 ranks, then over dp) and a non-box ``_StridedShard`` layout. Every layout
  gives the same manifests and the same payload bytes (raw codec: exactly 2 bytes per anchor element
  and 6 per change) as plain FSDP2, keeps exactly one snapshot of every element across its ranks,
  and a HF-module receiver and vLLM TP-2 receivers (the CPU oracle) follow it bit-exactly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from torch_deltasync._ranks import run_ranks

pytestmark = pytest.mark.timeout(900)

BF16 = torch.bfloat16


def _placements(model) -> dict[str, str]:
    from torch.distributed.tensor import DTensor

    items = model.items() if isinstance(model, dict) else model.state_dict(keep_vars=True).items()
    return {n: str(tuple(t.placements)) for n, t in items if isinstance(t, DTensor)}


def _full_bf16(model) -> dict[str, torch.Tensor]:
    """Every floating tensor gathered (a collective: all ranks) and cast to bf16."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, t in model.state_dict(keep_vars=True).items():
        t = t.detach()
        out[n] = (t.full_tensor() if isinstance(t, DTensor) else t).to(BF16).contiguous()
    return out


def _follow(store_dir: Path, expected: list[dict[str, torch.Tensor]]) -> list[str]:
    """Receivers in this process: one that updates version by version, one that jumps 1 -> 3 over
    the anchor at 2, and a fresh one at every version (anchor path). Each must be bit-identical to
    ``expected[v]``. Returns the paths taken by the step-by-step receiver."""
    from torch_deltasync import DeltaReceiver, LocalStore
    from torch_deltasync.testing import first_difference

    store = LocalStore(store_dir)
    zeros = {n: torch.zeros(t.shape, dtype=BF16) for n, t in expected[0].items()}
    step = DeltaReceiver({n: z.clone() for n, z in zeros.items()}, store)
    jump = DeltaReceiver({n: z.clone() for n, z in zeros.items()}, store)
    paths = []
    for v, want in enumerate(expected):
        assert step.update(v) == v
        paths.append(step.last_stats.path)
        assert first_difference(step.target.tensors, want) is None, f"{store_dir.name} version {v}"
        fresh = DeltaReceiver({n: z.clone() for n, z in zeros.items()}, store)
        assert fresh.update(v) == v and fresh.last_stats.path == "anchor"
        assert first_difference(fresh.target.tensors, want) is None, f"{store_dir.name} fresh at version {v}"
        if v in (1, 3):
            assert jump.update(v) == v
            assert first_difference(jump.target.tensors, want) is None, f"{store_dir.name} jump to {v}"
    assert jump.last_stats.path == "delta"  # 1 -> 2 -> 3: through the anchor's carried delta
    step.verify()
    return paths


def _manifests(store_dir: Path, versions: int) -> list:
    from torch_deltasync import LocalStore
    from torch_deltasync.manifest import load_manifest

    return [load_manifest(LocalStore(store_dir), v) for v in range(versions)]


def _summary(m) -> dict:
    return {"kind": m.kind, "base": m.base_version, "aliases": dict(m.aliases),
            "tensors": sorted((t.name, list(t.shape), t.checksum, t.changed) for t in m.tensors)}


def _reference_manifests(tmp: Path, expected: list[dict[str, torch.Tensor]], every: int, codec: str) -> list:
    """A single-process sender fed the same full bf16 weights, version by version."""
    from torch_deltasync import DeltaSender, LocalStore

    state = {n: t.clone() for n, t in expected[0].items()}
    sender = DeltaSender(state, LocalStore(tmp), anchor_every=every, codec=codec)
    for v, want in enumerate(expected):
        for n, t in want.items():
            state[n].copy_(t)
        assert sender.publish() == v
    sender.close()
    return _manifests(tmp, len(expected))


# --- real Adam steps under the torchtitan 2D layout ------------------------------------------------

QWEN3_UNEVEN = dict(vocab_size=1001, intermediate_size=126)


def _real_steps(rank: int, world: int, bucket: str, steps: int, every: int) -> dict:
    from safetensors.torch import save_file

    from recipes.torchrun_fsdp2 import parallelize
    from test_fsdp2 import _NoGather
    from torch_deltasync import DeltaSender, LocalStore
    from torch_deltasync.testing import adam_step, tiny_qwen3

    model = tiny_qwen3("tiny", seed=0, **QWEN3_UNEVEN)
    dp = parallelize(model, world, tp=2)
    opt = torch.optim.Adam(model.parameters(), lr=3e-6)
    sender = DeltaSender(model, LocalStore(os.path.join(bucket, "store")), anchor_every=every)
    gen = torch.Generator().manual_seed(1000 + dp)  # the two ranks of a tp group train on one batch
    for step in range(steps + 1):
        if step:
            adam_step(model, opt, batch=2, seq=16, generator=gen)
        with _NoGather():  # no rank gathers a parameter while publishing
            assert sender.publish() == step
        full = _full_bf16(model)  # a test-only collective, after the publish
        if rank == 0:
            save_file(full, os.path.join(bucket, f"expected-{step}.safetensors"))
    sender.close()
    return {"placements": _placements(model), "uploads": sender._uploads, "slots": sender._slots,
            "snapshot_nbytes": sender.detector.snapshot_nbytes()}


def test_fsdp2_x_tp_real_adam_steps(tmp_path):
    from safetensors.torch import load_file

    steps, every = 3, 2
    results = run_ranks(_real_steps, 4, str(tmp_path), steps, every, timeout_s=800)
    pl = results[0]["placements"]
    # torchtitan's layout, as FSDP2 builds it: column-parallel and vocab-parallel weights are
    # _StridedShard over dp, row-parallel ones Shard(1) on tp, norms on the dp sub-mesh
    strided = "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert pl["model.embed_tokens.weight"] == pl["lm_head.weight"] == strided
    assert pl["model.layers.0.self_attn.q_proj.weight"] == pl["model.layers.1.mlp.up_proj.weight"] == strided
    assert pl["model.layers.0.mlp.down_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert pl["model.norm.weight"] == "(Shard(dim=0),)"
    for r in results:
        assert r["slots"] == 1  # 2 x 2 shards are boxes, uneven ones included
        # TP-split tensors: every rank ships its own block; dp-only tensors: one of the two tp ranks
        for name, up in r["uploads"].items():
            if pl[name] != "(Shard(dim=0),)":  # on the 2-D (dp, tp) mesh
                assert up, (r, name)
    for name in results[0]["uploads"]:
        if pl[name] == "(Shard(dim=0),)":
            for pair in ((0, 1), (2, 3)):  # the two tp ranks of one dp rank hold the same block
                assert sum(results[i]["uploads"][name] for i in pair) == 1, name
    expected = [load_file(str(tmp_path / f"expected-{v}.safetensors")) for v in range(steps + 1)]
    paths = _follow(tmp_path / "store", expected)
    assert paths == ["anchor", "delta", "delta", "delta"]
    got = [_summary(m) for m in _manifests(tmp_path / "store", steps + 1)]
    want = [_summary(m) for m in _reference_manifests(tmp_path / "single", expected, every, "packed")]
    assert got == want
    kinds = [g["kind"] for g in got]
    assert kinds == ["anchor", "delta", "anchor", "delta"]
    for g in got[1:]:  # an RL-rate Adam step: sparse but real changes
        changed = sum(t[3] for t in g["tensors"])
        numel = sum(torch.Size(t[1]).numel() for t in g["tensors"])
        assert 0 < changed < 0.5 * numel


# --- one model, one change set, five layouts -------------------------------------------------------

LAYOUTS = ("fsdp", "fsdp_tp", "hsdp", "ep", "strided")
VERSIONS, EVERY = 4, 2


def _moe_spec() -> dict:
    from torch_deltasync.testing_vllm import TINY_VLLM_CONFIGS

    return TINY_VLLM_CONFIGS["qwen3_moe"]


def _weights(v: int) -> dict[str, torch.Tensor]:
    """The full fp32 weights of version ``v``: the seed-0 Qwen3-MoE after ``v`` synthetic steps
    (``testing.synthetic_step``: ~5% of every tensor's elements move a few bf16 ULPs), the same on
    every process."""
    from torch_deltasync.testing import synthetic_step
    from torch_deltasync.testing_vllm import hf_model

    state = {n: t.detach().clone() for n, t in hf_model(_moe_spec(), seed=0).state_dict().items()}
    for step in range(1, v + 1):
        synthetic_step(state, step)
    return state


def _shard(layout: str, world: int):
    """The Qwen3-MoE under ``layout``; returns what the sender publishes (a module or a dict of
    DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from recipes.torchrun_fsdp2 import parallelize
    from torch_deltasync.testing_vllm import hf_model

    model = hf_model(_moe_spec(), seed=0)
    if layout in ("fsdp", "fsdp_tp", "hsdp"):
        parallelize(model, world, tp=2 if layout == "fsdp_tp" else 1, dp_replicate=2 if layout == "hsdp" else 1)
        return model
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))
    if layout == "strided":  # every tensor [Shard(0), _StridedShard(0, sf=2)]: two boxes per rank
        pl = [Shard(0), _StridedShard(0, split_factor=2)]
        return {n: distribute_tensor(t.detach(), mesh, pl, src_data_rank=None) for n, t in model.state_dict().items()}
    # expert parallel the torchtitan way: experts Shard(0) over ep ("b"), then fully_shard over the
    # rest of dp ("a", dp_shard_mod_ep); everything else fully_shard over all 4 ranks
    dp = mesh["a", "b"]._flatten("dp")
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for n, p in list(experts.named_parameters(recurse=False)):
            setattr(experts, n, torch.nn.Parameter(distribute_tensor(p.detach(), mesh["b"], [Shard(0)])))
        fully_shard(experts, mesh=mesh["a"])
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _layouts(rank: int, world: int, bucket: str) -> dict:
    from test_fsdp2 import _NoGather
    from torch_deltasync import DeltaSender, LocalStore
    from torch_deltasync.dtensor import plan_uploads
    from torch_deltasync.sender import collect_sources
    from torch_deltasync.testing import set_full_weights

    weights = [_weights(v) for v in range(VERSIONS)]
    out = {}
    for layout in LAYOUTS:
        model = _shard(layout, world)
        sender = DeltaSender(model, LocalStore(os.path.join(bucket, layout)), anchor_every=EVERY, codec="raw")
        for v in range(VERSIONS):
            set_full_weights(model, weights[v])
            with _NoGather():
                assert sender.publish() == v
        again = plan_uploads(sender.group, collect_sources(model)[0])  # the decision is deterministic
        assert (again.uploads, again.slots) == (sender._uploads, sender._slots)
        out[layout] = {"placements": _placements(model), "uploads": sender._uploads, "slots": sender._slots,
                       "snapshot_nbytes": sender.detector.snapshot_nbytes()}
        sender.close()
    return out


def _payload(store_dir: Path, m) -> tuple[int, int, int]:
    """``(payload, header, entries)``: tensor bytes, safetensors header bytes and tensor entries
    summed over the objects of manifest ``m``."""
    from torch_deltasync.format import read_header

    payload = header = entries = 0
    for o in m.objects:
        data = (store_dir / o.key).read_bytes()
        index, _ = read_header(data)
        n = int.from_bytes(data[:8], "little")
        header += 8 + n
        payload += len(data) - 8 - n
        entries += len(index)
    return payload, header, entries


def test_layouts_publish_the_same_versions(tmp_path):
    results = run_ranks(_layouts, 4, str(tmp_path), timeout_s=800)
    expected = [{n: t.to(BF16) for n, t in _weights(v).items()} for v in range(VERSIONS)]
    numel = sum(t.numel() for t in expected[0].values())
    reference = [_summary(m) for m in _reference_manifests(tmp_path / "single", expected, EVERY, "raw")]
    assert [r["kind"] for r in reference] == ["anchor", "delta", "anchor", "delta"]
    base = {}
    for layout in LAYOUTS:
        per_rank = [r[layout] for r in results]
        pl = per_rank[0]["placements"]
        store_dir = tmp_path / layout
        manifests = _manifests(store_dir, VERSIONS)
        assert [_summary(m) for m in manifests] == reference, layout
        # exactly one snapshot of every element across the ranks (no replica keeps a second one)
        assert sum(r["snapshot_nbytes"] for r in per_rank) == 2 * numel, layout
        # every rank ships a share, and every version's payload equals plain FSDP2's to the byte
        sizes = [_payload(store_dir, m) for m in manifests]
        for m, (payload, header, entries) in zip(manifests, sizes):
            owners = {o.rank for o in m.objects}
            slots = per_rank[0]["slots"]
            assert {r // slots for r in owners} == {0, 1, 2, 3}, (layout, m.version)
            assert {o.world for o in m.objects} == {4 * slots}
            assert header <= 600 * entries + 400 * len(m.objects), (layout, m.version, header, entries)
        if layout == "fsdp":
            base = {"payload": [s[0] for s in sizes]}
            assert base["payload"][0] == 2 * numel  # the anchor: every element once, in bf16
        else:
            assert [s[0] for s in sizes] == base["payload"], layout
        _follow(store_dir, expected)
        if layout == "fsdp_tp":
            assert pl["model.layers.0.self_attn.k_proj.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        if layout == "hsdp":
            assert pl["model.embed_tokens.weight"] == "(Replicate(), Shard(dim=0))"
            for name in per_rank[0]["uploads"]:  # ranks r and r + 2 are replicas: one of them ships
                for pair in ((0, 2), (1, 3)):
                    assert sum(per_rank[i]["uploads"][name] for i in pair) == 1, name
        if layout == "ep":
            assert pl["model.layers.1.mlp.experts.down_proj"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
            assert pl["model.layers.1.mlp.gate.weight"] == "(Shard(dim=0),)"
            assert all(r["uploads"]["model.layers.1.mlp.experts.down_proj"] for r in per_rank)
        assert per_rank[0]["slots"] == (2 if layout == "strided" else 1), layout
    _vllm_follows(tmp_path / "strided", expected, tmp_path / "vllm")


def _vllm_follows(store_dir: Path, expected: list[dict[str, torch.Tensor]], workdir: Path) -> None:
    """vLLM TP-2 workers (the CPU oracle: vLLM's own models and loaders) follow the store from
    nothing; every rank ends equal to vLLM loading the last full weights, and their partial
    checksums add up to the manifest's."""
    from torch_deltasync import DeltaReceiver, LocalStore
    from torch_deltasync.checksum import check_partials
    from torch_deltasync.manifest import load_manifest
    from torch_deltasync.targets import VLLMTarget
    from torch_deltasync.testing_vllm import build_vllm_model, load_hf_weights, vllm_config, vllm_state_bits

    cpu_moe = ("TRITON", "BATCHED_TRITON", "CPU")  # as tests/unit/test_targets_vllm.py: loader layout
    vc = vllm_config(_moe_spec(), workdir)
    store = LocalStore(store_dir)
    last = len(expected) - 1
    receivers = []
    for r in range(2):
        m = build_vllm_model(vc, r, 2)
        rec = DeltaReceiver(VLLMTarget(m, moe_backends=cpu_moe), store)
        assert rec.update(1) == 1 and rec.last_stats.path == "anchor"
        assert rec.update(last) == last and rec.last_stats.path == "delta"
        ref = build_vllm_model(vc, r, 2)
        load_hf_weights(ref, expected[last])
        got, want = vllm_state_bits(m), vllm_state_bits(ref)
        assert got.keys() == want.keys()
        bad = [n for n in got if not torch.equal(got[n], want[n])]
        assert not bad, f"vLLM rank {r}/2: {bad[:5]}"
        receivers.append(rec)
    final = load_manifest(store, last)
    check_partials({t.name: t.checksum for t in final.tensors}, [r.partial_checksums() for r in receivers])


# --- the recipe under torchrun, followed live --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("nproc, flags", [(4, ["--tp", "2"]), (8, ["--tp", "2", "--dp-replicate", "2"])],
                         ids=["2D dp_shard 2 x tp 2", "3D dp_replicate 2 x dp_shard 2 x tp 2"])
def test_recipe_2d_and_3d_followed_live(tmp_path, nproc, flags):
    """``recipes/torchrun_fsdp2.py --tp`` (and ``--dp-replicate``) under real torchrun, with
    ``deltasync follow`` running alongside: the follower ends bit-identical to the trainer's gathered
    weights and every rank wrote a share of every version (~40 s for 8 ranks on 2 cores)."""
    import io
    import subprocess
    import sys
    import threading

    from safetensors.torch import load_file

    from torch_deltasync.follow import follow
    from torch_deltasync.testing import first_difference

    root = Path(__file__).resolve().parents[2]
    bucket, final = tmp_path / "bucket", tmp_path / "final.safetensors"
    box: dict = {}

    def follower():
        try:
            box["report"] = follow(str(bucket), idle_timeout_s=300, poll_s=0.05, out=io.StringIO(), until_version=3)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = e

    t = threading.Thread(target=follower)
    t.start()
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(root / "recipes" / "torchrun_fsdp2.py"), "--bucket", str(bucket), "--steps", "3",
           "--anchor-every", "2", "--save-final", str(final), *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=800)
    t.join(300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["last_version"] == 3
    assert "error" not in box, box.get("error")
    report = box["report"]
    assert report.failures == [] and report.versions[-1] == 3
    assert first_difference(dict(report.model.items()), load_file(str(final))) is None
    for v in range(4):
        names = {p.name for p in (bucket / "objects" / f"{v:012d}").iterdir()}
        kind = "anchor" if v % 2 == 0 else "delta"
        assert {f"{kind}-r{r:05d}-of{nproc:05d}.safetensors" for r in range(nproc)} <= names, (v, names)
