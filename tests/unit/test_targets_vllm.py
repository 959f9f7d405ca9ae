"""VLLMTarget against vLLM 0.33's own models and loaders on CPU (the oracle).

For every tiny architecture and TP size, each rank's model is built with vLLM's own classes at that
rank (``torch_deltasync.testing_vllm``), an anchor is loaded with vLLM's ``load_weights``, real
Adam steps run on the matching transformers model, the sender publishes deltas, and the receiver
applies them through ``VLLMTarget``. A second model per rank loaded by ``load_weights`` from the new
full weights is the reference: every parameter of every rank (padding rows included) must match
bit for bit (integer views), and the ranks' partial checksums must add up to the manifest's.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import transformers  # noqa: F401
import vllm  # noqa: F401  the CPU oracle; tools/setup.sh installs it, so a missing wheel fails here

from safetensors.torch import load as st_load, save as st_save  # noqa: E402

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore
from torch_deltasync.errors import CorruptObjectError, IncompatibleTargetError, UnsupportedLayoutError
from torch_deltasync._dtypes import bits, narrow
from torch_deltasync.checksum import check_partials, tensor_checksum  # noqa: E402
from torch_deltasync.format import read_header, sha256_hex  # noqa: E402
from torch_deltasync.keys import manifest_key
from torch_deltasync.manifest import load_manifest, seal_manifest  # noqa: E402
from torch_deltasync.targets import VLLMTarget  # noqa: E402
from torch_deltasync.testing import adam_step  # noqa: E402
from torch_deltasync.testing_vllm import (  # noqa: E402
    TINY_VLLM_CONFIGS,
    build_vllm_model,
    hf_model,
    load_hf_weights,
    vllm_config,
    vllm_state_bits,
)

# The test models are never post-processed (no CPU repacking ran), so their experts are in the
# loader layout even though vLLM picked the CPU MoE backend on this machine.
CPU_MOE = ("TRITON", "BATCHED_TRITON", "CPU")
BF16 = torch.bfloat16


def _bf16_state(model) -> dict[str, torch.Tensor]:
    """The HF state in bf16, tied aliases dropped (as the sender publishes them)."""
    seen, out = {}, {}
    for n, t in model.state_dict(keep_vars=True).items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            continue
        seen[key] = n
        out[n] = t.detach().to(BF16)
    return out


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [f"{n}: {int((a[n] != b[n]).sum())} of {a[n].numel()}" for n in a if not torch.equal(a[n], b[n])]


def _train_and_publish(hf, store, steps: int, *, lr: float = 1e-3, seed: int = 0, codec: str = "packed"):
    """Anchor, then ``steps`` real Adam steps each published as a delta; returns the versions."""
    sender = DeltaSender(hf, store, anchor_every=1000, codec=codec)
    versions = [sender.publish()]
    opt = torch.optim.Adam(hf.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        adam_step(hf, opt, batch=2, seq=16, generator=g)
        versions.append(sender.publish())
    sender.close()
    return versions


def _reference(vc, tp: int, r: int, state) -> dict[str, torch.Tensor]:
    ref = build_vllm_model(vc, r, tp)
    load_hf_weights(ref, state)
    return vllm_state_bits(ref)


CASES = [(arch, tp) for arch in ("qwen2", "qwen3", "llama", "qwen3_moe") for tp in (1, 2, 4, 8)]


@pytest.mark.parametrize("arch,tp", CASES, ids=[f"{a}-tp{t}" for a, t in CASES])
def test_deltas_match_vllm_loaders_on_every_rank(tmp_path, arch, tp):
    spec = TINY_VLLM_CONFIGS[arch]
    hf = hf_model(spec, seed=1)
    store = LocalStore(tmp_path / "bucket")
    anchor_state = _bf16_state(hf)
    v = _train_and_publish(hf, store, steps=3)
    final_state = _bf16_state(hf)
    vc = vllm_config(spec, tmp_path / "cfg")

    receivers, models = [], []
    for r in range(tp):
        m = build_vllm_model(vc, r, tp)
        load_hf_weights(m, anchor_state)  # the engine loaded the trainer's starting checkpoint
        rec = DeltaReceiver(VLLMTarget(m, moe_backends=CPU_MOE), store)
        rec.assume(v[0])
        receivers.append(rec)
        models.append(m)
    anchor_manifest = load_manifest(store, v[0])
    check_partials({t.name: t.checksum for t in anchor_manifest.tensors}, [r.partial_checksums() for r in receivers])

    # One delta, then a chain of two, on every rank.
    for target_version in (v[1], v[3]):
        for rec in receivers:
            assert rec.update(target_version) == target_version
            assert rec.last_stats.path == "delta"
    assert sum(rec.last_stats.changed for rec in receivers) > 0

    final_manifest = load_manifest(store, v[3])
    check_partials({t.name: t.checksum for t in final_manifest.tensors}, [r.partial_checksums() for r in receivers])
    for r, m in enumerate(models):
        bad = _diff(vllm_state_bits(m), _reference(vc, tp, r, final_state))
        assert not bad, f"rank {r}/{tp}: {bad[:5]}"
    # The oracle really changed: the final state differs from the anchor somewhere on rank 0.
    assert _diff(_reference(vc, tp, 0, anchor_state), vllm_state_bits(models[0]))


def test_expert_parallel_moe_matches_vllm_loaders(tmp_path):
    spec = TINY_VLLM_CONFIGS["qwen3_moe"]
    hf = hf_model(spec, seed=2)
    store = LocalStore(tmp_path / "bucket")
    anchor_state = _bf16_state(hf)
    v = _train_and_publish(hf, store, steps=2)
    vc = vllm_config(spec, tmp_path / "cfg", enable_expert_parallel=True)
    tp = 4
    receivers = []
    for r in range(tp):
        m = build_vllm_model(vc, r, tp)
        experts = m.model.layers[0].mlp.experts.routed_experts
        assert experts.w13_weight.shape[0] == spec["num_experts"] // tp  # experts really split
        load_hf_weights(m, anchor_state)
        rec = DeltaReceiver(VLLMTarget(m, moe_backends=CPU_MOE), store)
        rec.assume(v[0])
        rec.update()
        receivers.append((rec, m))
        bad = _diff(vllm_state_bits(m), _reference(vc, tp, r, _bf16_state(hf)))
        assert not bad, f"rank {r}: {bad[:5]}"
    m = load_manifest(store, v[-1])
    check_partials({t.name: t.checksum for t in m.tensors}, [rec.partial_checksums() for rec, _ in receivers])


@pytest.mark.parametrize("arch,tp", [("qwen3", 8), ("qwen2", 4), ("qwen3_moe", 2)])
def test_anchor_path_writes_rank_slices_and_zeroes_padding(tmp_path, arch, tp):
    spec = TINY_VLLM_CONFIGS[arch]
    hf = hf_model(spec, seed=3)
    store = LocalStore(tmp_path / "bucket")
    v = _train_and_publish(hf, store, steps=1)
    vc = vllm_config(spec, tmp_path / "cfg")
    for r in range(tp):
        m = build_vllm_model(vc, r, tp)
        for p in m.parameters():
            p.data.fill_(float("nan"))  # garbage everywhere, padding rows included
        ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
        rec = DeltaReceiver(VLLMTarget(m, moe_backends=CPU_MOE), store)
        assert rec.update() == v[-1] and rec.last_stats.path == "anchor"
        assert {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs  # in place, no rebinding
        bad = _diff(vllm_state_bits(m), _reference(vc, tp, r, _bf16_state(hf)))
        assert not bad, f"rank {r}/{tp}: {bad[:5]}"


def test_padding_only_ranks_and_kv_replicas_are_mapped_as_vllm_does(tmp_path):
    """Independent expectations (from the layout rules, not from the code under test)."""
    spec = TINY_VLLM_CONFIGS["qwen3"]  # vocab 70 -> 128 padded; tp 8: 16 rows per rank
    vc = vllm_config(spec, tmp_path / "cfg")
    shapes = {n: tuple(t.shape) for n, t in _bf16_state(hf_model(spec)).items()}
    aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    held, counted = [], []
    for r in range(8):
        t = VLLMTarget(build_vllm_model(vc, r, 8), moe_backends=CPU_MOE)
        t.check(shapes, aliases, BF16)
        (emb,) = t.describe("model.embed_tokens.weight")
        held.append(emb["held"] // spec["hidden_size"])
        (k,) = t.describe("model.layers.0.self_attn.k_proj.weight")
        counted.append(k["counted"])
        assert k["held"] == spec["head_dim"] * spec["hidden_size"]  # the one KV head, on every rank
        # HF k_proj row 5 (the only KV head) is local row Hl*d + 5 of qkv_proj on every rank.
        pos = torch.tensor([5 * spec["hidden_size"] + 3])
        assert bool(t.owned("model.layers.0.self_attn.k_proj.weight", pos))
    assert held == [16, 16, 16, 16, 6, 0, 0, 0]
    assert counted == [True] + [False] * 7  # KV head replicated on 8 ranks, counted once


def test_per_expert_hf_names_and_sparse_writes(tmp_path):
    """Per-expert checkpoint names (``experts.{e}.gate_proj.weight``), written sparsely through the
    Target API, against vLLM loading the same modified tensors."""
    spec = TINY_VLLM_CONFIGS["qwen3_moe"]
    fused = _bf16_state(hf_model(spec, seed=4))
    state = {}
    for n, t in fused.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            head = n[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                state[f"{head}{e}.gate_proj.weight"] = gate.contiguous()
                state[f"{head}{e}.up_proj.weight"] = up.contiguous()
        elif n.endswith("mlp.experts.down_proj"):
            head = n[: -len("down_proj")]
            for e in range(t.shape[0]):
                state[f"{head}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            state[n] = t
    g = torch.Generator().manual_seed(0)
    changes = {}
    new_state = {}
    for n, t in state.items():
        k = max(1, t.numel() // 50)
        pos = torch.randperm(t.numel(), generator=g)[:k].sort().values
        vals = torch.randn(k, generator=g).to(BF16)
        changes[n] = (pos, vals)
        flat = t.clone().reshape(-1)
        flat[pos] = vals
        new_state[n] = flat.reshape(t.shape)
    vc = vllm_config(spec, tmp_path / "cfg")
    tp = 2
    parts = []
    for r in range(tp):
        m = build_vllm_model(vc, r, tp)
        load_hf_weights(m, state)
        t = VLLMTarget(m, moe_backends=CPU_MOE)
        t.check({n: tuple(x.shape) for n, x in state.items()}, {}, BF16)
        for n, (pos, vals) in changes.items():
            own = t.owned(n, pos)
            t.write(n, pos[own], vals[own])
        bad = _diff(vllm_state_bits(m), _reference(vc, tp, r, new_state))
        assert not bad, f"rank {r}: {bad[:5]}"
        parts.append({n: t.checksum(n, BF16) for n in state})
    check_partials({n: tensor_checksum(x) for n, x in new_state.items()}, parts)


def test_sender_tied_embeddings_into_untied_vllm_model(tmp_path):
    """The trainer ties lm_head to embed_tokens (published once, as an alias); the vLLM model keeps
    two parameters: both are written, the copy is not counted twice in checksums."""
    spec = TINY_VLLM_CONFIGS["qwen3"]
    hf = hf_model(spec, seed=9)
    store = LocalStore(tmp_path / "bucket")
    v = _train_and_publish(hf, store, steps=2)
    assert load_manifest(store, v[0]).aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    vc = vllm_config(dict(spec, tie_word_embeddings=False), tmp_path / "cfg")
    full = {n: t.detach().to(BF16) for n, t in hf.state_dict().items()}  # both names
    tp, parts = 2, []
    for r in range(tp):
        m = build_vllm_model(vc, r, tp)
        assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()
        rec = DeltaReceiver(VLLMTarget(m, moe_backends=CPU_MOE), store)
        rec.update(v[1])
        rec.update(v[2])
        bad = _diff(vllm_state_bits(m), _reference(vc, tp, r, full))
        assert not bad, f"rank {r}: {bad[:5]}"
        parts.append(rec.partial_checksums())
    check_partials({t.name: t.checksum for t in load_manifest(store, v[2]).tensors}, parts)


# --- refusals ------------------------------------------------------------------------------------

def _resign(store, version: int, key: str, data: bytes) -> None:
    """Replace an object and fix its size and sha256 in the manifest (a malicious but consistent
    writer), so only the receiver's content validation can catch it."""
    store.put(key, data)
    doc = json.loads(store.get(manifest_key(version)))
    for o in doc["objects"]:
        if o["key"] == key:
            o["nbytes"], o["sha256"] = len(data), sha256_hex(data)
    store.put(manifest_key(version), seal_manifest(doc))


@pytest.fixture
def published_qwen2(tmp_path):
    spec = TINY_VLLM_CONFIGS["qwen2"]
    hf = hf_model(spec, seed=5)
    store = LocalStore(tmp_path / "bucket")
    anchor_state = _bf16_state(hf)
    v = _train_and_publish(hf, store, steps=1, codec="raw")  # the forgery below edits raw indices
    vc = vllm_config(spec, tmp_path / "cfg")
    return spec, store, anchor_state, v, vc


def test_out_of_range_delta_is_refused_and_params_unchanged(published_qwen2):
    spec, store, anchor_state, v, vc = published_qwen2
    m = load_manifest(store, v[1])
    (obj,) = m.objects
    data = store.get(obj.key)
    tensors = st_load(data)
    _, meta = read_header(data)  # keep the metadata: only the index is bad
    name = "model.layers.0.self_attn.k_proj.weight"
    idx = tensors[f"{name}:idx"].clone()
    idx[-1] = math.prod(m.tensor_map()[name].shape) + 7  # past the end of the HF tensor
    tensors[f"{name}:idx"] = idx
    _resign(store, v[1], obj.key, st_save(tensors, metadata=meta))

    for r in range(2):
        model = build_vllm_model(vc, r, 2)
        load_hf_weights(model, anchor_state)
        before = vllm_state_bits(model)
        rec = DeltaReceiver(VLLMTarget(model, moe_backends=CPU_MOE), store)
        rec.assume(v[0])
        with pytest.raises(CorruptObjectError):
            rec.update(v[1])
        assert not _diff(before, vllm_state_bits(model))


def _other_model_published(tmp_path, published_qwen2):
    """A store holding another model (twice the MLP width), and a TP-1 vLLM model at the anchor of
    ``published_qwen2`` with its parameters' bits: ``(store, model, vllm_config, bits)``."""
    spec, _, anchor_state, _, vc = published_qwen2
    other = dict(spec, intermediate_size=spec["intermediate_size"] * 2)  # a different model
    store = LocalStore(tmp_path / "other")
    _train_and_publish(hf_model(other, seed=6), store, steps=0)
    model = build_vllm_model(vc, 1, 2)
    load_hf_weights(model, anchor_state)
    return store, model, vc, vllm_state_bits(model)


def test_wrong_shape_is_refused_and_params_unchanged(tmp_path, published_qwen2):
    store, model, vc, before = _other_model_published(tmp_path, published_qwen2)
    rec = DeltaReceiver(VLLMTarget(model, moe_backends=CPU_MOE), store)
    with pytest.raises(IncompatibleTargetError, match="gate_proj"):
        rec.update()
    assert not _diff(before, vllm_state_bits(model))
    assert rec.version is None


@pytest.mark.parametrize("engine_writes", [True, False])
def test_engine_target_refuses_other_shapes_before_any_reload(tmp_path, published_qwen2, engine_writes):
    # Modules VLLMEngineTarget reloads (every linear on vLLM's CPU build; all of them with
    # in_place="never") are checked against the layer's sizes before anything is written, also
    # when only the host copy is built (engine_writes=False: the backend's assume_version).
    from torch_deltasync.targets import VLLMEngineTarget

    store, model, vc, before = _other_model_published(tmp_path, published_qwen2)
    target = VLLMEngineTarget(model, vc.model_config, in_place="never")
    target.engine_writes = engine_writes
    rec = DeltaReceiver(target, store)
    spec = published_qwen2[0]
    h, i = spec["hidden_size"], spec["intermediate_size"]
    with pytest.raises(IncompatibleTargetError,
                       match=rf"'model.layers.0.mlp.gate_proj.weight' has shape \({2 * i}, {h}\), the vLLM layer "
                             rf"'model.layers.0.mlp.gate_up_proj' expects \({i}, {h}\): the run publishes another model"):
        rec.update()
    assert not _diff(before, vllm_state_bits(model))
    assert rec.version is None and target.host == {}


def test_direct_writes_outside_the_rank_are_refused(published_qwen2):
    spec, store, anchor_state, v, vc = published_qwen2
    model = build_vllm_model(vc, 0, 2)
    load_hf_weights(model, anchor_state)
    before = vllm_state_bits(model)
    t = VLLMTarget(model, moe_backends=CPU_MOE)
    m = load_manifest(store, v[0])
    t.check({e.name: e.shape for e in m.tensors}, dict(m.aliases), BF16)
    name = "model.layers.0.mlp.gate_proj.weight"  # rows 0..31 on rank 0, 32..63 on rank 1
    hidden = spec["hidden_size"]
    with pytest.raises(CorruptObjectError, match="not held"):
        t.write(name, torch.tensor([0, 40 * hidden]), torch.zeros(2, dtype=BF16))
    with pytest.raises(CorruptObjectError, match="outside"):
        t.owned(name, torch.tensor([64 * hidden]))
    assert not _diff(before, vllm_state_bits(model))


class _FakeQuantMethod:
    """Stands in for a quantized linear method (any class the map does not know)."""


@pytest.mark.parametrize("how", ["quant_method", "cpu_prepacked", "packed_param", "unknown_layer", "moe_backend"])
def test_unsupported_layers_are_refused_before_any_change(published_qwen2, tmp_path, how):
    spec, store, anchor_state, v, vc = published_qwen2
    moe_backends = CPU_MOE
    if how == "moe_backend":  # the CPU backend prepacks experts on real engines: refused by default
        spec = TINY_VLLM_CONFIGS["qwen3_moe"]
        hf = hf_model(spec, seed=7)
        store = LocalStore(tmp_path / "moe")
        anchor_state = _bf16_state(hf)
        _train_and_publish(hf, store, steps=0)
        vc = vllm_config(spec, tmp_path / "moe-cfg")
        moe_backends = ("TRITON",)
    model = build_vllm_model(vc, 0, 2)
    load_hf_weights(model, anchor_state)
    layer = model.model.layers[1]
    if how == "quant_method":
        layer.mlp.down_proj.quant_method = _FakeQuantMethod()
    elif how == "cpu_prepacked":
        layer.self_attn.qkv_proj.cpu_linear = torch.nn.functional.linear
    elif how == "packed_param":
        layer.mlp.gate_up_proj.weight.packed_dim = 1
    elif how == "unknown_layer":
        weight = layer.input_layernorm.weight
        layer.input_layernorm = torch.nn.Module()
        layer.input_layernorm.weight = weight
    before = vllm_state_bits(model)
    rec = DeltaReceiver(VLLMTarget(model, moe_backends=moe_backends), store)
    with pytest.raises(UnsupportedLayoutError):
        rec.update()
    assert not _diff(before, vllm_state_bits(model))


def test_uncovered_parameters_are_refused_unless_not_strict(published_qwen2):
    spec, store, anchor_state, v, vc = published_qwen2
    model = build_vllm_model(vc, 0, 1)
    m = load_manifest(store, v[0])
    shapes = {e.name: e.shape for e in m.tensors if e.name != "model.norm.weight"}
    with pytest.raises(IncompatibleTargetError, match="model.norm.weight"):
        VLLMTarget(model, moe_backends=CPU_MOE).check(shapes, {}, BF16)
    VLLMTarget(model, moe_backends=CPU_MOE, strict=False).check(shapes, {}, BF16)


# --- a longer run: every version, across anchors, TP 2 and 8 (~5-10 s per architecture) -----------

@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_long_run_across_anchors_every_rank_every_version(tmp_path, arch):
    """12 versions with an anchor every 4, receivers at TP 2 and 8 updating at every version
    (delta path, then across anchor versions by the delta they carry), bitwise against vLLM's
    loaders at every version."""
    spec = dict(TINY_VLLM_CONFIGS[arch], num_hidden_layers=3)
    hf = hf_model(spec, seed=8)
    store = LocalStore(tmp_path / "bucket")
    sender = DeltaSender(hf, store, anchor_every=4)
    states = {sender.publish(): _bf16_state(hf)}
    opt = torch.optim.Adam(hf.parameters(), lr=3e-5)
    g = torch.Generator().manual_seed(8)
    paths = []
    vc = vllm_config(spec, tmp_path / "cfg")
    fleets = {}
    for tp in (2, 8):
        fleets[tp] = []
        for r in range(tp):
            m = build_vllm_model(vc, r, tp)
            for p in m.parameters():
                p.data.fill_(float("nan"))
            fleets[tp].append((m, DeltaReceiver(VLLMTarget(m, moe_backends=CPU_MOE), store)))
    for step in range(12):
        if step:
            adam_step(hf, opt, batch=2, seq=16, generator=g)
            states[sender.publish()] = _bf16_state(hf)
        v = max(states)
        manifest = load_manifest(store, v)
        for tp, fleet in fleets.items():
            for r, (m, rec) in enumerate(fleet):
                assert rec.update() == v
                paths.append(rec.last_stats.path)
                bad = _diff(vllm_state_bits(m), _reference(vc, tp, r, states[v]))
                assert not bad, f"v{v} rank {r}/{tp}: {bad[:5]}"
            check_partials({t.name: t.checksum for t in manifest.tensors}, [rec.partial_checksums() for _, rec in fleet])
    sender.close()
    # Following every version, only the first update reads an anchor: anchors 4 and 8 are crossed by
    # the delta they carry from the version before.
    assert paths == ["anchor"] * 10 + ["delta"] * (11 * 10)


def _compiled_signatures() -> dict[str, int]:
    from torch_deltasync import _native_apply

    return {n: len(getattr(_native_apply, n).signatures) for n in _native_apply.__all__
            if n not in ("np_bits", "warm")}


def test_warm_compiles_every_kernel_a_commit_calls(tmp_path):
    """After ``_native_apply.warm()`` (the vLLM backend calls it when it attaches), updates of a
    ``ModuleTarget`` and of ``VLLMTarget`` ranks (affine and grid places, bf16 and fp32 storage)
    compile nothing more: an engine's first commit does not compile inside its pause. Before the
    fix a bf16 parameter and ModuleTarget's int16 view reached ``scatter`` as two specializations."""
    from torch_deltasync import _native, _native_apply

    if not _native.enabled():
        pytest.skip("numba kernels are switched off (TORCH_DELTASYNC_NATIVE=0)")
    _native_apply.warm()
    before = _compiled_signatures()
    assert all(n >= 1 for n in before.values()), before
    spec = TINY_VLLM_CONFIGS["qwen3"]
    hf = hf_model(spec, seed=2)
    store = LocalStore(tmp_path / "bucket")
    anchor_state = _bf16_state(hf)
    v = _train_and_publish(hf, store, steps=2)
    vc = vllm_config(spec, tmp_path / "cfg")
    for r in range(2):
        m = build_vllm_model(vc, r, 2)
        load_hf_weights(m, anchor_state)
        rec = DeltaReceiver(VLLMTarget(m, moe_backends=CPU_MOE), store)
        rec.assume(v[0])
        assert rec.update(v[2]) == v[2] and rec.last_stats.changed > 0
    for dtype in (BF16, torch.float32):  # bf16 values in bf16 and in (widened) fp32 storage
        replica = {n: torch.zeros(t.shape, dtype=dtype) for n, t in anchor_state.items()}
        rec = DeltaReceiver(replica, store)
        assert rec.update(v[0]) == v[0]
        assert rec.update(v[2]) == v[2] and rec.last_stats.path == "delta" and rec.last_stats.changed > 0
    assert _compiled_signatures() == before


def test_fp32_parameters_holding_values_that_are_no_bf16_values_fail_the_checksum(tmp_path):
    """A vLLM parameter in fp32 for a bf16 run was cast to bf16 for its checksum: an fp32 value that
    merely rounds to the published one (something else wrote it) passed ``assume()`` and the
    partial checksums while the engine computed with another number."""
    from torch_deltasync.errors import ChecksumMismatchError

    spec = TINY_VLLM_CONFIGS["qwen3"]
    hf = hf_model(spec, seed=2)
    store = LocalStore(tmp_path / "bucket")
    anchor_state = _bf16_state(hf)
    v = _train_and_publish(hf, store, steps=1)
    m = build_vllm_model(vllm_config(spec, tmp_path / "cfg"), 0, 1).to(torch.float32)
    load_hf_weights(m, anchor_state, dtype=torch.float32)  # bf16 values, held exactly in fp32
    rec = DeltaReceiver(VLLMTarget(m, moe_backends=CPU_MOE), store)
    rec.assume(v[0])
    m0 = load_manifest(store, v[0])
    check_partials({t.name: t.checksum for t in m0.tensors}, [rec.partial_checksums()])
    name, param = next((n, p) for n, p in m.named_parameters() if p.dim() == 2)
    with torch.no_grad():
        param.view(-1)[7] = torch.nextafter(param.view(-1)[7], torch.tensor(math.inf))  # rounds back to the same bf16
    assert param.view(-1)[7].to(BF16) == param.view(-1)[7].to(BF16)
    with pytest.raises(ChecksumMismatchError, match=r"is held in torch\.float32 and 1 of these \d+ elements are no "
                                                    r"torch\.bfloat16 values"):
        rec.partial_checksums()


@pytest.mark.parametrize("dtype,storage,nan", [
    (BF16, torch.float32, -1), (BF16, torch.float32, 0x7F81), (BF16, torch.float64, -1),
    (torch.float16, torch.float32, -512), (torch.float32, torch.float64, -(1 << 22)),
])  # 0xFFFF (what torch's vector cast writes), a payload, fp16 0xFE00, x86's default NaN 0xFFC00000
def test_wider_parameters_hold_a_senders_nan_with_its_bits(tmp_path, dtype, storage, nan):
    """A trainer already in the inference dtype publishes its NaN as it is (no cast). A vLLM
    parameter in a wider dtype must hold it exactly: torch's widening cast quiets or drops a NaN's
    payload, and reading it back through a float cast rewrote its bits, so the checksums failed."""
    spec = TINY_VLLM_CONFIGS["qwen3"]
    hf = hf_model(spec, seed=2, dtype=dtype)
    p = dict(hf.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    view = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    with torch.no_grad():
        p.view(view).view(-1)[5] = nan
    store = LocalStore(tmp_path / "bucket")
    sender = DeltaSender(hf, store, inference_dtype=dtype, anchor_every=1000)
    v0 = sender.publish()
    with torch.no_grad():
        p.view(-1)[0] += 1
    v1 = sender.publish()
    m = build_vllm_model(vllm_config(spec, tmp_path / "cfg"), 0, 1).to(storage)
    rec = DeltaReceiver(VLLMTarget(m, moe_backends=CPU_MOE), store)
    for v in (v0, v1):
        assert rec.update(v) == v
        m_v = load_manifest(store, v)
        check_partials({t.name: t.checksum for t in m_v.tensors}, [rec.partial_checksums()])
    held = dict(m.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"].detach()  # q: its first rows
    assert bits(narrow(held.view(-1)[5:6], dtype)).item() == nan
    sender.close()
