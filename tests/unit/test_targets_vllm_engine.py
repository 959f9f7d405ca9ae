"""VLLMEngineTarget (``targets/_vllm_engine.py``) on vLLM's own CPU model classes, without an engine.

What runs here: the per-module choice between in place and reload (``check``), in-place commits
through the TP map next to the host copy in HF layout, the host-only mode (``engine_writes=False``,
the backend's ``assume_version``) and the host copy's refusals. Reloading a module
(``finish`` -> vLLM's layerwise reload) needs a loaded engine's state: the live tests cover it
(``tests/integration/test_vllm_live.py``). Refusing a model of other shapes before any reload:
``test_targets_vllm.py``.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore
from torch_deltasync.checksum import tensor_checksum
from torch_deltasync.errors import CorruptObjectError, IncompatibleTargetError
from torch_deltasync.targets import VLLMEngineTarget
from torch_deltasync.testing import adam_step, state_bits

BF16 = torch.bfloat16


def test_in_place_must_be_auto_or_never():
    with pytest.raises(ValueError, match="in_place must be 'auto' or 'never', got 'always'"):
        VLLMEngineTarget(nn.Module(), None, in_place="always")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A qwen2 tiny run: an anchor and one real Adam step as a delta, and the vLLM config."""
    pytest.importorskip("vllm")
    from torch_deltasync.testing_vllm import TINY_VLLM_CONFIGS, hf_model, vllm_config

    tmp = tmp_path_factory.mktemp("engine")
    spec = TINY_VLLM_CONFIGS["qwen2"]
    hf = hf_model(spec, seed=5)
    store = LocalStore(tmp / "bucket", fsync=False)
    sender = DeltaSender(hf, store, anchor_every=1000)
    states = {sender.publish(): state_bits(hf)}
    adam_step(hf, torch.optim.Adam(hf.parameters(), lr=1e-3), batch=2, seq=16,
              generator=torch.Generator().manual_seed(0))
    states[sender.publish()] = state_bits(hf)
    sender.close()
    shapes = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    return store, states, shapes, vllm_config(spec, tmp / "cfg")


def _model(vc):
    from torch_deltasync.testing_vllm import build_vllm_model

    return build_vllm_model(vc, 0, 1)


def _reference_bits(vc, bits: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's own loader fed the HF state whose bf16 bits are ``bits``."""
    from torch_deltasync.testing_vllm import load_hf_weights, vllm_state_bits

    ref = _model(vc)
    load_hf_weights(ref, {n: b.view(BF16) for n, b in bits.items()})
    return vllm_state_bits(ref)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


def test_auto_writes_loader_layout_in_place_bit_exact_and_keeps_the_host_copy(run):
    from torch_deltasync.testing_vllm import vllm_state_bits

    store, states, shapes, vc = run
    model = _model(vc)
    target = VLLMEngineTarget(model, vc.model_config)  # in_place="auto"
    receiver = DeltaReceiver(target, store)
    for version in sorted(states):
        assert receiver.update(version) == version
        assert _differ(vllm_state_bits(model), _reference_bits(vc, states[version])) == []
        assert _differ({n: t.view(torch.int16) for n, t in target.host.items()}, states[version]) == []
        # nothing on this (never post-processed) model is re-packed: every module is written in place
        assert target.last_reload == {"modules": 0, "tensors": 0, "ms": 0.0, "ahead": False}
    assert receiver.last_stats.path == "delta" and receiver.last_stats.changed > 0
    assert target.in_place_names == frozenset(shapes) and target.reloaded_modules == frozenset()
    name = "model.layers.1.mlp.down_proj.weight"
    assert target.checksum(name, BF16) == tensor_checksum(states[max(states)][name].view(BF16))


def test_engine_writes_off_builds_only_the_host_copy(run):
    from torch_deltasync.testing_vllm import vllm_state_bits

    store, states, _, vc = run
    model = _model(vc)
    before = vllm_state_bits(model)
    target = VLLMEngineTarget(model, vc.model_config)
    target.engine_writes = False
    receiver = DeltaReceiver(target, store)
    assert receiver.update() == max(states)
    assert _differ(vllm_state_bits(model), before) == []  # the engine's parameters are untouched
    assert _differ({n: t.view(torch.int16) for n, t in target.host.items()}, states[max(states)]) == []


def test_never_reloads_every_changed_module(run):
    _, _, shapes, vc = run
    target = VLLMEngineTarget(_model(vc), vc.model_config, in_place="never")
    target.check(shapes, {}, BF16)
    assert target.in_place_names == frozenset()
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.down_proj",
            "model.embed_tokens", "lm_head"} <= target.reloaded_modules
    assert all(not m.endswith("rotary_emb") for m in target.reloaded_modules)


def test_the_host_copy_refuses_reads_before_a_version_and_bad_full_tensors(run):
    _, _, shapes, vc = run
    target = VLLMEngineTarget(_model(vc), vc.model_config)
    target.check(shapes, {}, BF16)
    name = "model.norm.weight"
    with pytest.raises(IncompatibleTargetError, match="the host copy holds no version yet"):
        target.read(name, torch.tensor([0]), BF16)
    with pytest.raises(IncompatibleTargetError, match="'model.nope' is not a published tensor of this target"):
        target.assign("model.nope", torch.zeros(3, dtype=BF16))
    with pytest.raises(CorruptObjectError, match=r"full tensor of shape \(3,\), expected \(64,\)"):
        target.assign(name, torch.zeros(3, dtype=BF16))
    assert target.host == {}
    target.engine_writes = False
    target.assign(name, torch.arange(64, dtype=BF16))
    assert target.read(name, torch.tensor([5, 63]), BF16).tolist() == [5.0, 63.0]


# --- reloading ahead, on shadows (targets/_vllm_ahead.py) ---------------------------------------
# A model loaded and processed as vLLM's loader does it (record_metadata_for_reloading before the
# load, process_weights_after_loading after), every module reloaded (in_place="never"). In .venv
# vLLM has no compiled ops, so processing keeps the loader layout (torch's linear); the live
# engine tests run the same path against the oneDNN re-pack (tests/integration/test_vllm_live.py).


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def ahead_run(request, tmp_path_factory):
    """A run of the tiny config (qwen2: biases, untied; qwen3: tied embeddings): an anchor and two
    real Adam steps."""
    pytest.importorskip("vllm")
    from torch_deltasync.testing_vllm import TINY_VLLM_CONFIGS, hf_model, vllm_config

    tmp = tmp_path_factory.mktemp(f"ahead-{request.param}")
    spec = TINY_VLLM_CONFIGS[request.param]
    hf = hf_model(spec, seed=7)
    store = LocalStore(tmp / "bucket", fsync=False)
    sender = DeltaSender(hf, store, anchor_every=1000)
    states = {sender.publish(): state_bits(hf)}
    opt = torch.optim.Adam(hf.parameters(), lr=1e-3)
    for step in range(2):
        adam_step(hf, opt, batch=2, seq=16, generator=torch.Generator().manual_seed(step))
        states[sender.publish()] = state_bits(hf)
    sender.close()
    return store, states, vllm_config(spec, tmp / "cfg")


def _loaded_engine_model(vc, bits):
    """A worker's model as vLLM's loader leaves it: layout recorded, HF weights loaded, processed."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from torch_deltasync.testing_vllm import load_hf_weights

    model = _model(vc)
    record_metadata_for_reloading(model)
    load_hf_weights(model, {n: b.view(BF16) for n, b in bits.items()})
    process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    return model


def _follower(store, vc, states, reload_ahead, in_place="never"):
    target = VLLMEngineTarget(_loaded_engine_model(vc, states[0]), vc.model_config, in_place=in_place,
                              reload_ahead=reload_ahead)
    receiver = DeltaReceiver(target, store)
    target.engine_writes = False  # the engine serves version 0 already: build the host copy only
    receiver.update(0)
    target.engine_writes = True
    return target, receiver


def _live_state(model):
    """Bit views of every parameter and the identity of every module's non-tensor attributes."""
    from torch_deltasync.testing_vllm import vllm_state_bits

    attrs = {(name, k): id(v) for name, m in model.named_modules() for k, v in vars(m).items()
             if not k.startswith("_")}
    return vllm_state_bits(model), attrs


@pytest.mark.parametrize("in_place", ["never", "auto"])
def test_reload_ahead_prepares_on_shadows_and_commits_bit_exact(ahead_run, in_place):
    from torch_deltasync.testing_vllm import vllm_state_bits

    store, states, vc = ahead_run
    target, receiver = _follower(store, vc, states, "auto", in_place)
    for version in (1, 2):
        before = _live_state(target.model)
        host_before = {n: t for n, t in target.host.items()}
        staged = receiver.prepare(version)
        assert staged.prepared is not None and staged.stats.ahead_ms > 0
        # prepared: nothing live changed (parameters, attributes, the host copy's tensors)
        after = _live_state(target.model)
        assert _differ(after[0], before[0]) == [] and after[1] == before[1]
        assert all(target.host[n] is t for n, t in host_before.items())
        assert receiver.commit(staged) == version
        assert target.last_reload["ahead"] is True
        assert 0 < target.last_reload["modules"] <= len(target.reloaded_modules)
        # "auto": kernel tensors processing leaves as loaded (here: all of them; the norms are
        # written in place) get their changes, nothing is copied; "never": all copied from shadows
        if in_place == "auto":
            assert target.last_reload["patched"] > 0 and target.last_reload["copied_mb"] == 0
        else:
            assert target.last_reload["patched"] == 0 and target.last_reload["copied_mb"] > 0
        assert _differ(vllm_state_bits(target.model), _reference_bits(vc, states[version])) == []
        # the host copy holds the published tensors (a tied lm_head is an alias, not a tensor)
        assert _differ({n: t.view(torch.int16) for n, t in target.host.items()},
                       {n: states[version][n] for n in target.host}) == []
        assert len(target.host) >= len(states[version]) - 1
    # the same versions reloaded inside the commit give the same bits
    other, other_receiver = _follower(store, vc, states, "never")
    assert other_receiver.update(2) == 2 and other.last_reload["ahead"] is False
    assert _differ(vllm_state_bits(other.model), vllm_state_bits(target.model)) == []


def test_a_prepared_commit_that_no_longer_applies_reloads_inside_the_commit(ahead_run):
    from torch_deltasync.testing_vllm import vllm_state_bits

    store, states, vc = ahead_run
    target, receiver = _follower(store, vc, states, "auto")
    staged = receiver.prepare(2)
    assert staged.prepared is not None
    target.finish(frozenset())  # e.g. a re-pack between prepare and commit: the shadows are stale
    assert receiver.commit(staged) == 2
    assert target.last_reload["ahead"] is False and target.last_reload["modules"] > 0
    assert _differ(vllm_state_bits(target.model), _reference_bits(vc, states[2])) == []
    # released: what was prepared is dropped, and the commit writes the usual way
    staged = receiver.prepare(1)  # back to version 1 (an anchor path)
    assert staged.prepared is not None
    staged.release_prepared()
    assert staged.prepared is None
    assert receiver.commit(staged) == 1 and target.last_reload["ahead"] is False
    assert _differ(vllm_state_bits(target.model), _reference_bits(vc, states[1])) == []


def test_reload_ahead_is_refused_where_it_does_not_apply(ahead_run):
    store, states, vc = ahead_run
    with pytest.raises(ValueError, match="reload_ahead must be 'auto', 'always' or 'never', got 'yes'"):
        VLLMEngineTarget(nn.Module(), None, reload_ahead="yes")
    target, receiver = _follower(store, vc, states, "never")
    assert receiver.prepare(1).prepared is None
    target.reload_ahead = "auto"
    target.engine_writes = False  # building the host copy only: nothing to reload
    assert receiver.prepare(1).prepared is None


def test_shadows_are_freed_after_commit_or_release_and_update_does_not_prepare_ahead(ahead_run):
    import gc
    import weakref

    store, states, vc = ahead_run
    target, receiver = _follower(store, vc, states, "auto")
    staged = receiver.prepare(1)
    committed = [weakref.ref(s.module) for s in staged.prepared.shadows.values()]
    receiver.commit(staged)
    staged = receiver.prepare(2)
    released = [weakref.ref(s.module) for s in staged.prepared.shadows.values()]
    staged.release_prepared()
    del staged
    gc.collect()  # vLLM's reload state kept every shadow alive before (its entries refer back to them)
    assert committed and released and all(r() is None for r in committed + released)
    # update() commits at once: nothing is prepared ahead, the modules reload inside the commit
    assert receiver.update(2) == 2 and target.last_reload["ahead"] is False and target.last_reload["modules"] > 0
    assert _differ(_live_state(target.model)[0], _reference_bits(vc, states[2])) == []


def test_a_parameter_processing_changes_is_copied_whole(ahead_run, monkeypatch):
    """The one-time check that processing leaves a reloaded parameter as loaded: bit for bit,
    outside the changed elements too; a parameter that fails it is copied from its shadow."""
    from torch_deltasync.testing_vllm import vllm_state_bits

    store, states, vc = ahead_run
    target, receiver = _follower(store, vc, states, "auto", "auto")
    staged = receiver.prepare(1)
    prepared = staged.prepared
    vname = "model.embed_tokens.weight"
    assert target._patch_ok[vname] is True and vname in target._patch_groups
    names = target._patch_groups[vname]
    shadow = prepared.shadows["model.embed_tokens"]
    changes = {n: (pos, val) for _, n, pos, val in prepared.writes if n in names}
    assert changes.keys() == set(names)
    assert target._as_loaded(vname, shadow, changes)
    weight = shadow.module._parameters["weight"].detach().view(-1)
    pos, _ = changes[names[0]]
    for where in (int(pos[0]), int(torch.nonzero(~torch.isin(torch.arange(weight.numel()), pos))[0])):
        weight.view(torch.int16)[where] ^= 1  # a changed element, then an unchanged one: one bit off
        assert not target._as_loaded(vname, shadow, changes)
        weight.view(torch.int16)[where] ^= 1
    # no verdict without a changed element to check it on (a transform shows only there), nor
    # from a check that ran beside a commit (the target's generation moved)
    target._patch_ok = {}
    assert target._patches(prepared.shadows, {}, target._generation) == ({}, frozenset())
    sparse = {n: (p, v) for _, n, p, v in prepared.writes}
    assert target._patches(prepared.shadows, sparse, target._generation - 1) == ({}, frozenset())
    assert target._patch_ok == {}
    patch, patched = target._patches(prepared.shadows, sparse, target._generation)
    assert set(names) <= patch.keys() and patched and target._patch_ok[vname] is True
    assert receiver.commit(staged) == 1
    # a target whose processing fails the check copies every kernel tensor whole, bit-exact still
    monkeypatch.setattr(VLLMEngineTarget, "_as_loaded", lambda *a: False)
    other, other_receiver = _follower(store, vc, states, "auto", "auto")
    for version in (1, 2):
        assert other_receiver.commit(other_receiver.prepare(version)) == version
        assert other.last_reload["ahead"] is True and other.last_reload["patched"] == 0
        assert other.last_reload["copied_mb"] > 0
        assert _differ(vllm_state_bits(other.model), _reference_bits(vc, states[version])) == []
    assert other._patch_ok and not any(other._patch_ok.values())


def test_a_run_that_leaves_a_parameter_out_is_refused_unless_not_strict(run):
    """A sender without model.norm.weight was accepted: the engine kept its checkpoint norm while
    it reported every new version (the engine target mapped with strict=False)."""
    _, _, shapes, vc = run
    partial = {n: s for n, s in shapes.items() if n != "model.norm.weight"}
    with pytest.raises(IncompatibleTargetError, match=r"vLLM parameters no published tensor loads into: "
                                                      r"\['model.norm.weight'\] \(1 in all\).*strict=False"):
        VLLMEngineTarget(_model(vc), vc.model_config).check(partial, {}, BF16)
    VLLMEngineTarget(_model(vc), vc.model_config, strict=False).check(partial, {}, BF16)


def test_tensors_vllm_ties_but_the_sender_publishes_separately_are_refused(tmp_path):
    """An untied trainer (its own lm_head) into an engine that ties lm_head to embed_tokens: both
    were reloaded into the one parameter, and after an lm_head-only change the engine served
    neither the trainer's weights nor the previous ones, reporting success."""
    pytest.importorskip("vllm")
    from torch_deltasync.testing_vllm import TINY_VLLM_CONFIGS, build_vllm_model, hf_model, vllm_config

    spec = TINY_VLLM_CONFIGS["qwen3"]  # tie_word_embeddings=True in vLLM
    hf = hf_model(dict(spec, tie_word_embeddings=False), seed=3)
    shapes = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    assert "lm_head.weight" in shapes
    vc = vllm_config(spec, tmp_path / "cfg")
    for in_place in ("auto", "never"):
        target = VLLMEngineTarget(build_vllm_model(vc, 0, 1), vc.model_config, in_place=in_place)
        with pytest.raises(IncompatibleTargetError, match=r"published tensors 'model.embed_tokens.weight' and "
                                                          r"'lm_head.weight' both load into the vLLM parameter "
                                                          r"'model.embed_tokens.weight': vLLM ties 'lm_head.weight'"):
            target.check(shapes, {}, BF16)
    tied = {n: s for n, s in shapes.items() if n != "lm_head.weight"}  # the sender ties them: one tensor, an alias
    VLLMEngineTarget(build_vllm_model(vc, 0, 1), vc.model_config).check(
        tied, {"lm_head.weight": "model.embed_tokens.weight"}, BF16)


def _qwen3_spec(**over):
    return dict(arch="Qwen3ForCausalLM", model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                tie_word_embeddings=False, **over)


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.weight_scale",
                                   "model.norm.bias", "lm_head.bias"])
def test_published_tensors_the_engine_has_no_parameter_for_are_refused(tmp_path, extra):
    """A trainer with q/k/v biases (attention_bias=True) into an engine without: every module it
    reloads accepted them (in_place="never", and every linear on the CPU build), and vLLM's
    load_weights dropped them without a word; an unknown leaf failed the commit inside the pause."""
    pytest.importorskip("vllm")
    from torch_deltasync.testing_vllm import hf_model, vllm_config

    spec = _qwen3_spec()
    vc = vllm_config(spec, tmp_path / "cfg")
    shapes = {n: tuple(t.shape) for n, t in hf_model(spec).state_dict().items()}
    shapes[extra] = (32,)
    vname = extra.replace("q_proj", "qkv_proj")
    for in_place in ("auto", "never"):
        for strict in (True, False):
            target = VLLMEngineTarget(_model(vc), vc.model_config, in_place=in_place, strict=strict)
            with pytest.raises(IncompatibleTargetError, match=rf"published tensor '{extra}' \(vLLM name '{vname}'\) is "
                                                              r"unknown to the vLLM model: its layer .* has no parameter"):
                target.check(shapes, {}, BF16)


@pytest.mark.parametrize("left_out", ["model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_a_fused_layer_published_in_part_is_refused_where_it_would_be_reloaded(tmp_path, left_out):
    """A run without v_proj (or up_proj) was accepted with strict on; the live engine then reloaded
    qkv_proj with its v rows never filled and generated token 0 over and over."""
    pytest.importorskip("vllm")
    from torch_deltasync.testing_vllm import hf_model, vllm_config

    spec = _qwen3_spec()
    vc = vllm_config(spec, tmp_path / "cfg")
    shapes = {n: tuple(t.shape) for n, t in hf_model(spec).state_dict().items() if n != left_out}
    fused, part = ("qkv_proj", 2) if "v_proj" in left_out else ("gate_up_proj", 1)
    for in_place in ("auto", "never"):
        with pytest.raises(IncompatibleTargetError, match=rf"fill only in part: \['model\.layers\.0\.\w+\.{fused}\.weight "
                                                          rf"\(parts \[{part}\] of"):
            VLLMEngineTarget(_model(vc), vc.model_config, in_place=in_place).check(shapes, {}, BF16)
    # Not strict: a layer written in place keeps the part no tensor covers; one reloaded cannot.
    VLLMEngineTarget(_model(vc), vc.model_config, strict=False).check(shapes, {}, BF16)
    with pytest.raises(IncompatibleTargetError, match=rf"the vLLM layer 'model\.layers\.0\.\w+\.{fused}' .* is reloaded "
                                                      rf"whole, .* leave out weight \(parts \[{part}\]\)"):
        VLLMEngineTarget(_model(vc), vc.model_config, in_place="never", strict=False).check(shapes, {}, BF16)


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused expert tensors as per-expert checkpoint names."""
    out = {}
    for n, t in state.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[n.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.contiguous()
                out[n.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.contiguous()
        elif n.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[n.replace("down_proj", f"{e}.down_proj.weight")] = t[e].contiguous()
        else:
            out[n] = t
    return out


@pytest.mark.parametrize("names,ep", [("fused", False), ("per_expert", False), ("fused", True), ("per_expert", True)])
def test_moe_experts_are_written_in_place_or_refused_by_name(tmp_path, names, ep):
    """Qwen3-MoE through the backend's target was refused with "no published tensor loads into
    w13_weight" (fused names) or "no module ...experts.0.gate_proj" (per-expert names), though the TP
    map writes both. Now: in place, bit-exact on every TP rank, where the MoE backend keeps the
    loader's layout; refused by name, as a reload it cannot do, where the backend does not."""
    pytest.importorskip("vllm")
    from torch_deltasync.errors import UnsupportedLayoutError
    from torch_deltasync.testing_vllm import TINY_VLLM_CONFIGS, build_vllm_model, hf_model, load_hf_weights, \
        vllm_config, vllm_state_bits

    spec = TINY_VLLM_CONFIGS["qwen3_moe"]
    vc = vllm_config(spec, tmp_path / "cfg", enable_expert_parallel=ep)  # ep: each rank holds half the experts
    hf = hf_model(spec, seed=2)
    convert = _per_expert if names == "per_expert" else dict
    weights = convert({n: t.detach().to(BF16) for n, t in hf.state_dict().items()})
    store = LocalStore(tmp_path / "bucket", fsync=False)
    sender = DeltaSender(weights, store, anchor_every=1000)
    states = [{n: t.clone() for n, t in weights.items()}]
    sender.publish()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(2):  # ~2% of every tensor (experts included) moves by a few bf16 steps
            for t in weights.values():
                flat = t.view(-1)
                pos = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 50)]
                flat[pos] = (flat[pos].float() * 1.03 + 1e-3).to(BF16)
            states.append({n: t.clone() for n, t in weights.items()})
            sender.publish()
    sender.close()
    expert = next(n for n in weights if ".experts." in n)
    with pytest.raises(UnsupportedLayoutError, match=rf"published tensor '{re.escape(expert)}': the fused-MoE experts "
                                                     r"'model\.layers\.0\.mlp\.experts' would have to be reloaded"):
        DeltaReceiver(VLLMEngineTarget(build_vllm_model(vc, 0, 1), vc.model_config), store).update(0)
    tp = 2
    for r in range(tp):
        model = build_vllm_model(vc, r, tp)
        target = VLLMEngineTarget(model, vc.model_config, moe_backends=("TRITON", "BATCHED_TRITON", "CPU"))
        rec = DeltaReceiver(target, store)
        for v in (0, 1, 2):
            assert rec.update(v) == v
            ref = build_vllm_model(vc, r, tp)
            load_hf_weights(ref, states[v])
            assert _differ(vllm_state_bits(model), vllm_state_bits(ref)) == [], f"rank {r}, version {v}"
        assert target.last_reload["modules"] == 0  # every tensor, experts included, written in place
        assert any(".experts." in n for n in target._inplace)
    # strict: experts are checked element by element, as the TP map does (any expert tensor used to do)
    shapes = {n: tuple(t.shape) for n, t in weights.items() if n != expert}
    for strict in (True, False):
        target = VLLMEngineTarget(build_vllm_model(vc, 0, tp), vc.model_config, strict=strict,
                                  moe_backends=("TRITON", "BATCHED_TRITON", "CPU"))
        if strict:
            with pytest.raises(IncompatibleTargetError, match=r"not covered by the published tensors: "
                                                              r"\['model\.layers\.0\.mlp\.experts\.routed_experts\.w13_weight"):
                target.check(shapes, {}, BF16)
        else:
            target.check(shapes, {}, BF16)


def test_tensors_vllm_itself_drops_are_ignored(tmp_path):
    """A trainer that publishes rotary ``inv_freq`` (a persistent buffer): vLLM's AutoWeightsLoader
    drops it (REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER); the name check refused it as unknown."""
    pytest.importorskip("vllm")
    from torch_deltasync.targets import VLLMTarget
    from torch_deltasync.testing_vllm import hf_model, vllm_config

    spec = _qwen3_spec()
    vc = vllm_config(spec, tmp_path / "cfg")
    shapes = {n: tuple(t.shape) for n, t in hf_model(spec).state_dict().items()}
    shapes["model.layers.0.self_attn.rotary_emb.inv_freq"] = (8,)
    for in_place in ("auto", "never"):
        VLLMEngineTarget(_model(vc), vc.model_config, in_place=in_place).check(shapes, {}, BF16)
    target = VLLMTarget(_model(vc))
    target.check(shapes, {}, BF16)
    assert target._entries["model.layers.0.self_attn.rotary_emb.inv_freq"].ignored
