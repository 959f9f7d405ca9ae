"""LoRA adapter sync (``torch_deltasync/integrations/peft.py``): only the adapter travels, in PEFT's names and
shapes; versions round-trip bit-exactly into a receiver PEFT model; a materialised version is what
``PeftModel.from_pretrained`` and vLLM's own LoRA loader read; the adapter config is validated."""

from __future__ import annotations

import hashlib
import json
import sys
import warnings

import pytest
import torch

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors import safe_open  # noqa: E402

from helpers import delta_payloads  # noqa: E402
from torch_deltasync import DeltaSender, LocalStore  # noqa: E402
from torch_deltasync.errors import (  # noqa: E402
    ChecksumMismatchError, CorruptObjectError, IncompatibleTargetError, PublishError, VersionNotFoundError,
)
from torch_deltasync.integrations.peft import (  # noqa: E402
    ADAPTER_CONFIG_KEY,
    AdapterReceiver,
    AdapterSender,
    adapter_config_json,
    adapter_state_dict,
    materialize_adapter,
    parse_adapter_config,
    read_adapter_config,
)
from torch_deltasync.keys import list_versions
from torch_deltasync.manifest import load_manifest  # noqa: E402
from torch_deltasync.sender import AnchorPolicy  # noqa: E402
from torch_deltasync.testing import tiny_qwen3  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(seed: int = 0, r: int = 4, alpha: int = 8, trained_b: bool = False):
    model = get_peft_model(tiny_qwen3("tiny", seed=0), LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS,
                                                                  lora_dropout=0.0))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n:
                p.uniform_(-0.1, 0.1)
            elif "lora_B" in n and trained_b:  # a trained adapter: B is no longer zero
                p.normal_(0, 0.02)
    return model


def train_step(model, opt, gen):
    ids = torch.randint(0, 1000, (2, 16), generator=gen)
    opt.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def bits(sd: dict, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    view = torch.int16 if dtype.itemsize == 2 else torch.int32
    return {n: t.detach().to(dtype).contiguous().view(view).clone() for n, t in sd.items()}


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("codec", ["packed", "raw"])
def test_only_the_adapter_travels_in_peft_names_and_round_trips_bit_exactly(tmp_path, codec):
    """Sparse versions (a trained adapter at an RL learning rate) ship as deltas, a dense one (every
    factor redrawn) as a full adapter, by size; a receiver PEFT model, a self-holding receiver and a late
    joiner hold every version bit-exactly (bf16 bit patterns of the trainer's fp32 factors)."""
    store = LocalStore(tmp_path / "bucket", fsync=False)
    trainer = lora_model(seed=1, trained_b=True)
    params = [p for p in trainer.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    sender = AdapterSender(trainer, store, prefix="run", codec=codec)
    receiver_model = lora_model(seed=2)
    receiver = AdapterReceiver(receiver_model, store, prefix="run")
    holder = AdapterReceiver(None, store, prefix="run")
    saved_names = set(adapter_state_dict(trainer))
    states = {}
    for step in range(8):
        v = sender.publish()
        states[v] = bits(adapter_state_dict(trainer))
        assert receiver.update() == v and holder.update() == v
        assert same_bits(bits(adapter_state_dict(receiver_model)), states[v]), v
        assert same_bits(bits(holder.tensors), states[v]), v
        if step == 5:  # every factor redrawn (e.g. the trainer restored another adapter): version 6 is dense
            with torch.no_grad():
                for p in params:
                    p.normal_(0, 0.05)
        else:
            train_step(trainer, opt, gen)
    run = store.sub("run")
    numel = sum(t.numel() for t in states[0].values())
    sizes = delta_payloads(codec, states, tmp_path / "reference")  # each delta's bytes, from a reference run

    def stored(v: int, kind: str) -> int:  # bytes of the stored objects of one kind, from the listing
        return sum(run.size(k) for k in run.list(f"objects/{v:012d}") if f"/{kind}-" in k)

    kinds, anchor_nbytes, chain = [], 0, 0
    for v in list_versions(run):
        m = load_manifest(run, v)
        assert {t.name for t in m.tensors} == saved_names  # the adapter only, PEFT's saved names
        # the default policy's rules, from stored bytes: a delta (as the codec stores it) that reaches
        # a full bf16 copy, or delta bytes since the last anchor reaching that anchor's bytes
        by_size = v > 0 and sizes[v] >= numel * 2
        assert (m.kind == "anchor") == (v == 0 or by_size or chain >= 2 * anchor_nbytes), v
        if m.kind == "anchor":
            assert m.base_version is None or not by_size  # a version anchored by size carries no delta
            anchor_nbytes, chain = stored(v, "anchor"), 0
        else:
            chain += stored(v, "delta")
        kinds.append(m.kind)
    assert kinds.count("delta") >= 3
    if codec == "raw":  # 6 bytes per change: version 6 (every factor redrawn) ships as a full adapter
        assert kinds[6] == "anchor" and load_manifest(run, 6).base_version is None
    # (packed compresses even redrawn bf16 values below 2 bytes each: version 6 stays a delta)
    late = AdapterReceiver(lora_model(seed=3), store, prefix="run")
    assert late.update() == 7 and same_bits(bits(late.tensors), states[7])
    # the receiver's base weights were never touched: only adapter tensors are targets
    base = dict(tiny_qwen3("tiny", seed=0).named_parameters())
    for n, p in receiver_model.named_parameters():
        if "lora_" not in n:
            want = base[n.replace("base_model.model.", "").replace(".base_layer", "")]
            assert torch.equal(p.detach().view(torch.int32), want.detach().view(torch.int32)), n  # bits, not values


def test_fp32_inference_dtype_ships_the_fp32_factors_exactly(tmp_path):
    trainer = lora_model(seed=1)
    opt = torch.optim.Adam([p for p in trainer.parameters() if p.requires_grad], lr=1e-3)
    sender = AdapterSender(trainer, tmp_path, inference_dtype=torch.float32)
    receiver_model = lora_model(seed=2)
    receiver = AdapterReceiver(receiver_model, tmp_path)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        train_step(trainer, opt, gen)
        sender.publish()
        receiver.update()
        assert same_bits(bits(adapter_state_dict(receiver_model), torch.float32),
                         bits(adapter_state_dict(trainer), torch.float32))


def test_materialised_version_loads_with_peft_and_vllm_reads_it(tmp_path):
    trainer = lora_model(seed=1, trained_b=True)
    opt = torch.optim.Adam([p for p in trainer.parameters() if p.requires_grad], lr=1e-3)
    sender = AdapterSender(trainer, tmp_path / "bucket")
    gen = torch.Generator().manual_seed(0)
    states = {}
    for _ in range(4):
        states[sender.publish()] = bits(adapter_state_dict(trainer))
        train_step(trainer, opt, gen)
    out = materialize_adapter(tmp_path / "bucket", tmp_path / "adapters" / "v2", version=2)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    # the same names and shapes PEFT's own save_pretrained writes
    trainer.save_pretrained(tmp_path / "peft_own")
    with safe_open(str(tmp_path / "peft_own" / "adapter_model.safetensors"), "pt") as own, \
            safe_open(str(out / "adapter_model.safetensors"), "pt") as ours:
        assert set(own.keys()) == set(ours.keys())
        assert all(own.get_slice(k).get_shape() == ours.get_slice(k).get_shape() for k in own.keys())
        assert ours.metadata()["format"] == "pt"
    # PEFT's own loader; the loaded adapter is version 2's bits
    loaded = PeftModel.from_pretrained(tiny_qwen3("tiny", seed=0), str(out))
    assert same_bits(bits(adapter_state_dict(loaded)), states[2])
    # and it computes what a receiver holding version 2 computes
    held = lora_model(seed=7)
    AdapterReceiver(held, tmp_path / "bucket").update(2)
    ids = torch.randint(0, 1000, (2, 12), generator=gen)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, held(input_ids=ids).logits)
    # newest by default, replacing an existing folder
    assert materialize_adapter(tmp_path / "bucket", out) == out
    assert same_bits(bits(adapter_state_dict(PeftModel.from_pretrained(tiny_qwen3("tiny", seed=0), str(out)))), states[3])


def test_vllm_lora_loader_parses_a_materialised_version(tmp_path, monkeypatch):
    """vLLM's own PEFT config check and LoRA checkpoint loader (CPU) read our folder."""
    import vllm.lora.lora_model as vllm_lora_model
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    monkeypatch.setattr(vllm_lora_model, "PIN_MEMORY", False)  # no CUDA driver here
    trainer = lora_model(seed=1, trained_b=True)
    AdapterSender(trainer, tmp_path / "bucket").publish()
    out = materialize_adapter(tmp_path / "bucket", tmp_path / "v0")
    helper = PEFTHelper.from_local_dir(str(out), max_position_embeddings=4096)
    helper.validate_legal(LoRAConfig(max_lora_rank=8))
    lm = vllm_lora_model.LoRAModel.from_local_checkpoint(str(out), set(TARGETS), helper, lora_model_id=1,
                                                         device="cpu", dtype=torch.bfloat16)
    want = bits(adapter_state_dict(trainer))
    assert len(lm.loras) == 2 * len(TARGETS)
    for name, w in lm.loras.items():
        stem = f"base_model.model.{name}"
        assert torch.equal(w.lora_a.view(torch.int16), want[f"{stem}.lora_A.weight"])
        assert torch.equal(w.lora_b.view(torch.int16), want[f"{stem}.lora_B.weight"])
        assert w.scaling == 8 / 4  # lora_alpha / r from the config we wrote


# --- the adapter config ---------------------------------------------------------------------------


def config_doc(**changes) -> bytes:
    doc = json.loads(adapter_config_json(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)))
    doc.update(changes)
    return json.dumps(doc).encode()


BAD_CONFIGS = [
    (b"\xff\xfe", "not UTF-8"),
    (b"{", "not JSON"),
    (b"[]", "not an object"),
    (config_doc(peft_type="PREFIX_TUNING"), "not LoRA"),
    (config_doc(r=0), "rank 0"),
    (config_doc(r=4.0), "fractional-typed rank"),
    (config_doc(r=True), "bool rank"),
    (config_doc(lora_alpha="8"), "string alpha"),
    (config_doc(target_modules=[1, 2]), "non-string target modules"),
    (config_doc(rank_pattern={"q_proj": -2}), "negative rank pattern"),
    (config_doc(megatron_config={"x": 1}), "would make PEFT import a module"),
    (config_doc(target_modules=".*q_proj", layers_to_transform=[0]), "PEFT itself rejects the combination"),
    (config_doc() + b" " * (300 << 10), "over the size limit"),  # valid but for its size
]


@pytest.mark.parametrize("data, reason", BAD_CONFIGS, ids=[r for _, r in BAD_CONFIGS])
def test_config_validation_rejects(data, reason):
    with pytest.raises(CorruptObjectError, match="bytes" if reason == "over the size limit" else None):
        parse_adapter_config(data)


def test_config_round_trips_and_unknown_keys_are_ignored_with_a_warning():
    cfg = parse_adapter_config(config_doc())
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules)) == (4, 8, set(TARGETS))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = parse_adapter_config(config_doc(from_the_future=1))
    assert cfg.r == 4 and any("from_the_future" in str(x.message) for x in w)


def test_tampered_or_mismatched_config_changes_nothing(tmp_path, caplog):
    store = LocalStore(tmp_path, fsync=False)
    trainer = lora_model(seed=1, trained_b=True)
    AdapterSender(trainer, store).publish()
    # a receiving model whose adapter is scaled differently: refused before anything is written
    other = lora_model(seed=2, alpha=16)
    before = bits(adapter_state_dict(other))
    with pytest.raises(IncompatibleTargetError, match="lora_alpha"):
        AdapterReceiver(other, store).update()
    assert same_bits(bits(adapter_state_dict(other)), before)
    # a config replaced after the run published it (a valid one: only its sha256 tells)
    store.put(ADAPTER_CONFIG_KEY, config_doc(r=8))
    victim = lora_model(seed=3)
    before = bits(adapter_state_dict(victim))
    with caplog.at_level("WARNING", logger="torch_deltasync"):
        with pytest.raises(ChecksumMismatchError, match=r"adapter/adapter_config.json does not match the sha256 the "
                                                        r"manifest of version 0 records"):
            AdapterReceiver(victim, store).update()
    assert "recovering" not in caplog.text  # a bad config fails every path alike: no anchor retry
    assert same_bits(bits(adapter_state_dict(victim)), before)
    store.delete(ADAPTER_CONFIG_KEY)
    with pytest.raises(VersionNotFoundError, match="adapter run"):
        AdapterReceiver(victim, store).update()


def test_configs_of_runs_whose_manifests_record_no_sha256_are_validated(tmp_path):
    """Manifests written before they recorded the config's sha256 (here: a plain sender publishing
    adapter tensors): the config is read unchecked, and its rules still hold."""
    store = LocalStore(tmp_path, fsync=False)
    DeltaSender(adapter_state_dict(lora_model(seed=1, trained_b=True)), store).publish()
    assert load_manifest(store, 0).run_files == {}
    store.put(ADAPTER_CONFIG_KEY, config_doc(r=8))  # lies about the rank: the tensors do not fit it
    victim = lora_model(seed=3)
    before = bits(adapter_state_dict(victim))
    with pytest.raises(CorruptObjectError, match="rank"):
        AdapterReceiver(victim, store).update()
    store.put(ADAPTER_CONFIG_KEY, b'{"peft_type": "LORA", "r": "4"}')
    with pytest.raises(CorruptObjectError, match="r must be"):
        AdapterReceiver(victim, store).update()
    assert same_bits(bits(adapter_state_dict(victim)), before)
    store.put(ADAPTER_CONFIG_KEY, config_doc())
    assert AdapterReceiver(victim, store).update() == 0


def test_a_config_changed_after_publishing_is_caught_by_every_reader(tmp_path, capsys):
    """lora_alpha 8 -> 80 in the stored config parses as well as 8: materialize_adapter wrote it
    into the folder vLLM loads, and `deltasync verify` passed the run. Every manifest now records
    the config's sha256."""
    from torch_deltasync.cli import main

    store = LocalStore(tmp_path / "b", fsync=False)
    sender = AdapterSender(lora_model(seed=1, trained_b=True), store, anchor_every=10)
    sender.publish()
    sender.publish()
    good = store.get(ADAPTER_CONFIG_KEY)
    want = hashlib.sha256(good).hexdigest()
    assert [load_manifest(store, v).run_files for v in (0, 1)] == [{ADAPTER_CONFIG_KEY: want}] * 2
    assert main(["verify", str(tmp_path / "b")]) == 0
    assert "1 run file(s) checked" in capsys.readouterr().out
    doc = json.loads(good)
    doc["lora_alpha"] = 80
    store.put(ADAPTER_CONFIG_KEY, json.dumps(doc).encode())
    for read in (lambda: materialize_adapter(str(tmp_path / "b"), tmp_path / "out"),
                 lambda: AdapterReceiver(None, store).update(),
                 lambda: read_adapter_config(store, manifest=load_manifest(store, 1))):
        with pytest.raises(ChecksumMismatchError, match="changed or damaged after the run published it"):
            read()
    assert not (tmp_path / "out").exists()
    assert read_adapter_config(store).lora_alpha == 80  # (without a manifest: parsed, unchecked)
    assert main(["verify", str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert out.count("FAILED: ChecksumMismatchError") == 2 and "0/2 versions verified" in out
    store.put(ADAPTER_CONFIG_KEY, good)  # restored: all is well again
    assert main(["verify", str(tmp_path / "b")]) == 0
    # a sender restarted on the prefix with another dropout (not structural) keeps the stored
    # config and records its sha256
    sender.close()
    model = get_peft_model(tiny_qwen3("tiny", seed=0),
                           LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.1))
    again = AdapterSender(model, store, anchor_every=10)
    assert again.run_files == {ADAPTER_CONFIG_KEY: good} and store.get(ADAPTER_CONFIG_KEY) == good


def test_init_only_fields_and_deep_configs(tmp_path):
    """A LoftQ-initialised trainer's config made PEFT import scipy on every receiver; JSON nested
    100,000 deep raised a bare RecursionError; fields PEFT does not check went into the folders
    vLLM loads."""
    cfg = parse_adapter_config(config_doc(init_lora_weights="loftq", loftq_config={"loftq_bits": 4, "loftq_iter": 1}))
    assert cfg.init_lora_weights is True and cfg.loftq_config == {} and cfg.r == 4
    assert parse_adapter_config(config_doc(init_lora_weights=False)).init_lora_weights is False
    with pytest.raises(CorruptObjectError, match="not valid JSON .RecursionError"):
        parse_adapter_config(b"[" * 100_000 + b"]" * 100_000)
    for field, value in (("use_dora", "yes"), ("bias", "everything"), ("layers_to_transform", "abc"),
                         ("modules_to_save", 5), ("fan_in_fan_out", 1), ("exclude_modules", [3])):
        with pytest.raises(CorruptObjectError, match=f"{field} has a value PEFT does not define"):
            parse_adapter_config(config_doc(**{field: value}))
    ok = parse_adapter_config(config_doc(modules_to_save=["lm_head"], layers_to_transform=[0, 1], bias="lora_only"))
    assert (ok.modules_to_save, ok.layers_to_transform, ok.bias) == (["lm_head"], [0, 1], "lora_only")


def test_an_output_folder_under_a_file_is_refused_before_downloading(tmp_path, monkeypatch):
    AdapterSender(lora_model(0), LocalStore(tmp_path / "b"), anchor_every=10).publish()
    (tmp_path / "afile").write_text("x")
    updates = []
    monkeypatch.setattr(AdapterReceiver, "update", lambda self, *a, **k: updates.append(a))
    with pytest.raises(ValueError, match=r"'.*afile/sub' lies under '.*afile', which is a file"):
        materialize_adapter(str(tmp_path / "b"), tmp_path / "afile" / "sub")
    with pytest.raises(ValueError, match="is a file"):
        materialize_adapter(str(tmp_path / "b"), tmp_path / "afile")
    assert updates == [] and (tmp_path / "afile").read_text() == "x"


def test_non_adapter_tensors_under_an_adapter_config_are_refused(tmp_path):
    store = LocalStore(tmp_path, fsync=False)
    store.put(ADAPTER_CONFIG_KEY, config_doc())
    DeltaSender({"model.layers.0.weight": torch.randn(4, 4)}, store).publish()  # not an adapter
    with pytest.raises(CorruptObjectError, match="PEFT adapter tensor name"):
        materialize_adapter(store, tmp_path / "out")


def test_sender_refuses_a_prefix_of_another_adapter_and_continues_its_own(tmp_path):
    AdapterSender(lora_model(seed=1), tmp_path, prefix="run").publish()
    with pytest.raises(ValueError, match="another adapter.*r: 4 vs 8"):
        AdapterSender(lora_model(seed=1, r=8), tmp_path, prefix="run")
    again = AdapterSender(lora_model(seed=1), tmp_path, prefix="run")  # same structure: continues
    assert again.publish() == 1
    with pytest.raises(TypeError, match="PeftModel"):
        AdapterSender(tiny_qwen3("tiny"), tmp_path, prefix="other")


@pytest.mark.parametrize("change, shown", [
    (dict(r=8), "r: 4 vs 8"),
    (dict(target_modules=["q_proj", "v_proj"]), "target_modules: .* vs \\['q_proj', 'v_proj'\\]"),
])
def test_an_adapter_replaced_under_the_sender_is_not_published(tmp_path, change, shown):
    # The structure was checked when the sender was built; a replaced adapter (delete_adapter +
    # add_adapter) used to be published against the run's adapter_config.json: receivers then
    # failed on the ranks, or materialized folders whose config did not name the new modules.
    model = lora_model(seed=1)
    sender = AdapterSender(model, tmp_path, prefix="run")
    assert sender.publish() == 0
    model.base_model.delete_adapter("default")
    model.add_adapter("default", LoraConfig(**{**dict(r=4, lora_alpha=8, target_modules=TARGETS), **change}))
    keys = LocalStore(tmp_path).list("run")
    with pytest.raises(IncompatibleTargetError, match=rf"no longer has the structure this run publishes \({shown}; "
                                                      r"run vs model\).*new AdapterSender on a new prefix"):
        sender.publish()
    assert LocalStore(tmp_path).list("run") == keys  # nothing written
    model.base_model.delete_adapter("default")  # none left: the read names what the model has
    with pytest.raises(PublishError, match=r"the model has no adapter 'default'; it has \[\]"):
        sender.publish()


@pytest.mark.parametrize("run_base, local_base, warned", [
    ("org/base-A", "org/base-B", True),  # same shapes, other weights: silently another function
    ("Qwen/Qwen3-0.6B", "/models/Qwen3-0.6B/", False),  # a local copy of the same model
    (None, "org/base-B", False),
])
def test_a_receiver_on_another_base_model_is_warned(tmp_path, run_base, local_base, warned):
    trainer, model = lora_model(seed=1), lora_model(seed=2)
    trainer.peft_config["default"].base_model_name_or_path = run_base
    model.peft_config["default"].base_model_name_or_path = local_base
    AdapterSender(trainer, tmp_path, prefix="run").publish()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert AdapterReceiver(model, tmp_path, prefix="run").update() == 0
    ours = [str(w.message) for w in caught if "was trained on base model" in str(w.message)]
    assert ours == ([f"the run's adapter was trained on base model {run_base!r}, the receiving model's adapter "
                     f"names {local_base!r}: LoRA factors compute the trained function only on the base weights "
                     "they were trained on"] if warned else [])


def test_default_policy_is_by_size(tmp_path):
    s = AdapterSender(lora_model(seed=1), tmp_path)
    assert s.policy == AnchorPolicy(every=None, chain_ratio=2.0, max_delta_ratio=1.0)


def test_misspelt_options_are_named_with_the_adapter_class(tmp_path):
    from torch_deltasync.integrations.peft import AdapterReceiver

    with pytest.raises(TypeError, match=r"AdapterReceiver got unexpected keyword argument\(s\) \['prefx'\].*'max_workers'"):
        AdapterReceiver(None, str(tmp_path / "b"), prefx="x")


def test_anchor_every_as_a_keyword_sets_the_adapter_cadence(tmp_path):
    """``AdapterSender(..., anchor_every=k)`` anchors every k versions (it used to be ignored)."""
    from torch_deltasync.integrations.peft import AdapterSender

    model = lora_model()
    sender = AdapterSender(model, LocalStore(tmp_path / "b"), anchor_every=5)
    assert sender.policy.every == 5 and sender.policy.chain_ratio == 2.0
    sender.close()
    default = AdapterSender(model, LocalStore(tmp_path / "c"))
    assert default.policy.every is None
    default.close()


def test_a_takeover_by_another_adapter_is_refused_before_the_prefix_changes_hands(tmp_path):
    """``takeover=True`` with an adapter of another structure took the prefix over (replacing the
    running writer's lease record, then dropping it) before it refused the adapter."""
    from torch_deltasync.lease import OWNER_KEY

    first = AdapterSender(lora_model(seed=1), tmp_path, prefix="run")
    first.publish()
    store = LocalStore(tmp_path).sub("run")
    owner = store.get(OWNER_KEY)
    with pytest.raises(ValueError, match="another adapter.*r: 4 vs 8"):
        AdapterSender(lora_model(seed=1, r=8), tmp_path, prefix="run", takeover=True)
    assert store.get(OWNER_KEY) == owner  # the running writer still owns its prefix
    assert first.publish() == 1
    first.close()


def test_a_merged_adapter_is_not_updated(tmp_path):
    """merge_adapter() on the receiving model: update() returned the new version while the merged
    base kept the old adapter's product, so the model served neither version."""
    trainer = lora_model(0)
    sender = AdapterSender(trainer, LocalStore(tmp_path), anchor_every=10)
    sender.publish()
    worker = lora_model(1)
    receiver = AdapterReceiver(worker, LocalStore(tmp_path))
    assert receiver.update() == 0
    worker.merge_adapter()
    before = bits(worker.state_dict(), torch.float32)
    train_step(trainer, torch.optim.Adam(trainer.parameters(), 1e-3), torch.Generator().manual_seed(0))
    sender.publish()
    with pytest.raises(IncompatibleTargetError, match=r"adapter 'default' is merged into the model's base weights "
                                                      r".*unmerge_adapter\(\)"):
        receiver.update()
    assert receiver.version == 0 and same_bits(bits(worker.state_dict(), torch.float32), before)
    worker.unmerge_adapter()
    assert receiver.update() == 1
    assert same_bits(bits(adapter_state_dict(worker)), bits(adapter_state_dict(trainer)))


def test_a_new_run_on_a_wiped_prefix_brings_its_own_adapter_config(tmp_path):
    """Run 1 (alpha 8), the prefix wiped, run 2 (alpha 32, same shapes): the receiver kept run 1's
    config, saved it next to run 2's weights, and a model built for alpha 8 was not refused."""
    store = LocalStore(tmp_path)
    first = AdapterSender(lora_model(0, alpha=8), store, anchor_every=10)
    first.publish()
    holder = AdapterReceiver(None, store)
    worker = lora_model(1, alpha=8)
    receiver = AdapterReceiver(worker, store)
    assert holder.update() == 0 and receiver.update() == 0 and holder.config.lora_alpha == 8
    first.close()
    for key in store.list():
        store.delete(key)
    second_model = lora_model(2, alpha=32)
    second = AdapterSender(second_model, store, anchor_every=10)
    second.publish()
    second.publish()
    assert holder.update() == 1 and holder.config.lora_alpha == 32
    out = holder.save(tmp_path / "out" / "v1")
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 32
    before = bits(adapter_state_dict(worker))
    with pytest.raises(IncompatibleTargetError, match="lora_alpha"):
        receiver.update()
    assert receiver.version == 0 and same_bits(bits(adapter_state_dict(worker)), before)


def test_an_embedding_in_target_modules_never_ships_the_base_embedding(tmp_path):
    """PEFT adds the base embedding to the adapter's state dict (save_embedding_layers="auto") when
    target_modules name an embedding: it was published in every anchor and overwrote the
    receiving model's base embedding (another base's, or an fp32 one rounded to bf16)."""
    targets = ["embed_tokens", "q_proj"]
    trainer = get_peft_model(tiny_qwen3("tiny", seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    assert not any("base_layer" in n for n in adapter_state_dict(trainer))
    AdapterSender(trainer, LocalStore(tmp_path), anchor_every=10).publish()
    assert not any("base_layer" in t.name for t in load_manifest(LocalStore(tmp_path), 0).tensors)
    worker = get_peft_model(tiny_qwen3("tiny", seed=42), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    key = "base_model.model.model.embed_tokens.base_layer.weight"
    before = worker.state_dict()[key].clone()
    assert AdapterReceiver(worker, LocalStore(tmp_path)).update() == 0
    assert torch.equal(worker.state_dict()[key].view(torch.int32), before.view(torch.int32))
    assert same_bits(bits(adapter_state_dict(worker)), bits(adapter_state_dict(trainer)))


def test_materializing_never_deletes_a_folder_that_is_not_an_adapters(tmp_path, monkeypatch):
    """materialize_adapter(store, ".") removed everything in the working folder before failing,
    and an existing project folder given as out_dir lost every file."""
    AdapterSender(lora_model(0), LocalStore(tmp_path / "b"), anchor_every=10).publish()
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "train.py").write_text("print('hi')")
    monkeypatch.chdir(work)
    with pytest.raises(ValueError, match=r"'\.' is the current folder or one above it"):
        materialize_adapter(str(tmp_path / "b"), ".")
    with pytest.raises(ValueError, match=r"'src/\.\.' is the current folder"):
        materialize_adapter(str(tmp_path / "b"), "src/..")
    project = tmp_path / "project"  # not the current folder
    (project / "src").mkdir(parents=True)
    (project / "train.py").write_text("x")
    with pytest.raises(ValueError, match=r"is no adapter folder \(it holds \['src', 'train.py'\]"):
        materialize_adapter(str(tmp_path / "b"), project)
    assert sorted(p.name for p in project.iterdir()) == ["src", "train.py"]
    assert (work / "train.py").read_text() == "print('hi')" and (work / "src").is_dir()
    out = materialize_adapter(str(tmp_path / "b"), "adapters/v0")
    (out / "adapter_config.json").write_text("{}")  # an adapter folder written before is replaced
    assert materialize_adapter(str(tmp_path / "b"), "adapters/v0") == out
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    # the store's own adapter/ folder holds only the config: no adapter folder, never replaced
    with pytest.raises(ValueError, match=r"is no adapter folder \(it holds \['adapter_config.json'\]"):
        materialize_adapter(str(tmp_path / "b"), tmp_path / "b" / "adapter")
    assert AdapterReceiver(None, str(tmp_path / "b")).config.r == 4
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(ValueError, match="is a symbolic link"):
        materialize_adapter(str(tmp_path / "b"), tmp_path / "link")
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no leftovers


@pytest.mark.filterwarnings("ignore:Already unmerged")  # PEFT, for the layers "other" does not target
def test_an_unloaded_or_other_merged_adapter(tmp_path):
    """merge_and_unload() removed the LoRA layers: update() returned the new version and changed
    nothing the model computes with. A merged model was refused even with nothing to apply, and
    merging another adapter refused updates of this one."""
    trainer = lora_model(0)
    sender = AdapterSender(trainer, LocalStore(tmp_path), anchor_every=10)
    sender.publish()
    worker = lora_model(1)
    worker.add_adapter("other", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], lora_dropout=0.0))
    receiver = AdapterReceiver(worker, LocalStore(tmp_path))
    assert receiver.update() == 0
    worker.base_model.merge_adapter(["other"])  # another adapter merged: this one may still be updated
    train_step(trainer, torch.optim.Adam(trainer.parameters(), 1e-3), torch.Generator().manual_seed(0))
    sender.publish()
    assert receiver.update() == 1
    worker.base_model.unmerge_adapter()
    worker.merge_adapter()
    assert receiver.update() == 1  # nothing to apply: no refusal
    worker.unmerge_adapter()
    worker.merge_and_unload()
    sender.publish()
    with pytest.raises(IncompatibleTargetError, match=r"no longer holds the adapter tensors this receiver writes "
                                                      r"\(merge_and_unload\(\)"):
        receiver.update()
    assert receiver.version == 1


def test_an_adapter_run_emptied_under_its_sender_is_readable_again_from_the_next_anchor(tmp_path):
    """The next version after a wiped prefix is an anchor; its manifest vouched for a config that
    was no longer there, so the run stayed unreadable. The anchor writes the config again."""
    store = LocalStore(tmp_path / "b", fsync=False)
    trainer = lora_model(seed=1, trained_b=True)
    opt = torch.optim.Adam([p for p in trainer.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    sender = AdapterSender(trainer, store, anchor_every=100)
    for _ in range(2):
        train_step(trainer, opt, gen)
        sender.publish()
    for key in store.list():
        store.delete(key)
    train_step(trainer, opt, gen)
    with pytest.raises(PublishError, match="base version 1 is gone"):
        sender.publish()
    assert sender.publish() == 3 and load_manifest(store, 3).kind == "anchor"
    out = materialize_adapter(str(tmp_path / "b"), tmp_path / "out")
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        got = {n: f.get_tensor(n).view(torch.int16) for n in f.keys()}
    assert same_bits(got, bits(adapter_state_dict(trainer)))
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4


def test_save_writes_the_config_of_the_run_it_holds(tmp_path):
    """Held: run 1 (alpha 8). An update to run 2 (alpha 16, same shapes) failed on damaged
    objects; save() then wrote run 1's tensors with run 2's config."""
    store = LocalStore(tmp_path / "b", fsync=False)
    first = AdapterSender(lora_model(0, alpha=8, trained_b=True), store, anchor_every=10)
    first.publish()
    holder = AdapterReceiver(None, store)
    assert holder.update() == 0
    first.close()
    for key in store.list():
        store.delete(key)
    second = AdapterSender(lora_model(2, alpha=16, trained_b=True), store, anchor_every=10)
    second.publish()
    second.publish()
    for key in store.list():
        if key.startswith("objects/"):
            store.put(key, b"\0" * len(store.get(key)))  # every object of run 2 damaged
    with pytest.raises(CorruptObjectError):
        holder.update()
    assert holder.version == 0 and holder.config.lora_alpha == 8
    out = holder.save(tmp_path / "out")
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 8


def test_deep_values_and_base_changing_init_methods(recwarn):
    deep = 1.0
    for _ in range(600):
        deep = [deep]
    with pytest.raises(CorruptObjectError, match="nests deeper than 16 levels"):
        parse_adapter_config(config_doc(lora_dropout=deep))
    for field, value in (("layer_replication", "x"), ("layer_replication", [[3, 1]]), ("target_parameters", 7),
                         ("trainable_token_indices", "x"), ("lora_dropout", 2.0)):
        with pytest.raises(CorruptObjectError, match=f"{field} has a value PEFT does not define"):
            parse_adapter_config(config_doc(**{field: value}))
    from torch_deltasync.integrations._adapter_config import check_init_method

    check_init_method(LoraConfig(r=4, init_lora_weights="gaussian"), "x")
    assert not recwarn.list
    with pytest.warns(UserWarning, match="init_lora_weights='pissa' changed the base weights"):
        check_init_method(LoraConfig(r=4, init_lora_weights="pissa"), "AdapterSender")


def test_the_next_version_restores_a_damaged_config(tmp_path, caplog):
    """A config edited in the store was written again only by the next anchor: the deltas before
    it vouched for a config no reader could match (every receiver refused them)."""
    store = LocalStore(tmp_path / "b", fsync=False)
    trainer = lora_model(seed=1, trained_b=True)
    sender = AdapterSender(trainer, store, anchor_every=10)
    sender.publish()
    good = store.get(ADAPTER_CONFIG_KEY)
    store.put(ADAPTER_CONFIG_KEY, good.replace(b'"lora_alpha": 8', b'"lora_alpha": 80'))  # damaged, not gone
    with pytest.raises(ChecksumMismatchError):
        materialize_adapter(str(tmp_path / "b"), tmp_path / "out")
    with caplog.at_level("WARNING", logger="torch_deltasync.sender"):
        assert sender.publish() == 1 and load_manifest(store, 1).kind == "delta"
    assert f"{ADAPTER_CONFIG_KEY} differs from this run's (edited or damaged in the store); written again before " \
           "version 1" in caplog.text
    assert store.get(ADAPTER_CONFIG_KEY) == good
    out = materialize_adapter(str(tmp_path / "b"), tmp_path / "out")
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 8
    store.delete(ADAPTER_CONFIG_KEY)  # gone: written again too
    assert sender.publish() == 2 and store.get(ADAPTER_CONFIG_KEY) == good
    receiver = AdapterReceiver(lora_model(seed=2), store)
    assert receiver.update() == 2


def test_receivers_without_a_model_need_no_peft(tmp_path, monkeypatch):
    """vLLM's environment has no ``peft`` (vLLM parses adapter configs itself): materialising a
    version and the vLLM loader's receiver run without it; what needs a ``LoraConfig`` says so."""
    trainer = lora_model(seed=1, trained_b=True)
    sender = AdapterSender(trainer, tmp_path / "bucket")
    sender.publish()
    want = bits(adapter_state_dict(trainer))
    expected_config = json.loads(adapter_config_json(trainer))
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError from here on
    out = materialize_adapter(tmp_path / "bucket", tmp_path / "v0", base_model_name_or_path="base/here")
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert same_bits(bits({k: f.get_tensor(k) for k in f.keys()}), want)
    written = json.loads((out / "adapter_config.json").read_text())
    assert written == {**expected_config, "base_model_name_or_path": "base/here"}
    receiver = AdapterReceiver(None, tmp_path / "bucket")
    assert receiver.update() == 0 and same_bits(bits(receiver.tensors), want)
    with pytest.raises(ImportError):
        receiver.config
    monkeypatch.delitem(sys.modules, "peft")
    assert receiver.config.r == 4


def test_lone_or_mismatched_factors_are_refused():
    """vLLM loads a lone or mismatched factor and serves it; PEFT's ``B @ A`` needs both, of one rank."""
    from torch_deltasync.integrations.peft import check_adapter_tensors

    cfg = LoraConfig(r=8, rank_pattern={"q_proj": 4})
    stem = "base_model.model.model.layers.0.self_attn.q_proj"
    good = {f"{stem}.lora_A.weight": (4, 64), f"{stem}.lora_B.weight": (64, 4)}
    check_adapter_tensors(cfg, good)
    check_adapter_tensors(json.loads(adapter_config_json(cfg)), good)  # the config as a dict: the same rules
    for shapes, found in (
            ({f"{stem}.lora_A.weight": (8, 64), f"{stem}.lora_B.weight": (64, 4)}, "lora_A of rank 8, lora_B of rank 4"),
            ({f"{stem}.lora_A.weight": (8, 64)}, "lora_A of rank 8"),
            ({**good, "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight": (32, 8)}, "lora_B of rank 8"),
            ({**good, "base_model.model.model.embed_tokens.lora_embedding_B": (64, 8)}, "lora_embedding_B of rank 8")):
        with pytest.raises(CorruptObjectError, match=f"has {found}; a LoRA module has both factors, of one rank"):
            check_adapter_tensors(cfg, shapes)


def test_a_base_changing_init_method_reaches_the_folder_as_the_trainer_wrote_it(tmp_path, monkeypatch):
    """A PiSSA run's folder keeps ``init_lora_weights``, so vLLM refuses it as it refuses the
    trainer's own checkpoint (it used to be reset to ``true`` and served on the unchanged base);
    receivers warn, as the sender did."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    model = get_peft_model(tiny_qwen3("tiny", seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                                  init_lora_weights="pissa"))
    with pytest.warns(UserWarning, match="init_lora_weights='pissa' changed the base weights"):
        AdapterSender(model, tmp_path / "bucket").publish()
    with pytest.warns(UserWarning, match=r"adapter_config.json: init_lora_weights='pissa' changed the base weights"):
        out = materialize_adapter(tmp_path / "bucket", tmp_path / "v0")
    assert json.loads((out / "adapter_config.json").read_text())["init_lora_weights"] == "pissa"
    model.save_pretrained(tmp_path / "checkpoint")
    for folder in (out, tmp_path / "checkpoint"):
        with pytest.raises(ValueError, match="does not support init_lora_weights='pissa'"):
            PEFTHelper.from_local_dir(str(folder), max_position_embeddings=4096).validate_legal(LoRAConfig(max_lora_rank=8))
    # a receiver's LoraConfig still resets it (building it must not re-initialise or import scipy)
    receiver = AdapterReceiver(None, tmp_path / "bucket")
    with pytest.warns(UserWarning, match="init_lora_weights='pissa'"):
        assert receiver.update() == 0
    assert receiver.config.init_lora_weights is True
