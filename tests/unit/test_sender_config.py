"""The option dataclasses (``sender/_config.py``, ``receiver/_config.py``) and how ``DeltaSender``
and ``DeltaReceiver`` take them: ``config=`` plus keyword overrides, checked before anything is
written to the store."""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path

import pytest
import torch

import torch_deltasync
from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore, RetentionPolicy
from torch_deltasync.lease import OWNER_KEY
from torch_deltasync.receiver import ReceiverConfig
from torch_deltasync.sender import AnchorPolicy, SenderConfig

# The keyword defaults DeltaSender / DeltaReceiver had before the configs existed.
OLD_SENDER_DEFAULTS = dict(anchor_every=10, anchor_policy=None, inference_dtype=torch.bfloat16, snapshot_device=None,
                           codec="packed", link_gbps=None, threads=None, background=False, run_id=None,
                           metrics_path=None, retention=None, takeover=False, lease_s=60.0)
# threads (both): new; None stages, reads and encodes on one thread per core, as decoding and encoding did before
OLD_RECEIVER_DEFAULTS = dict(max_workers=8, threads=None, recover=True, metrics_path=None)


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}


# --- defaults, immutability, public path ------------------------------------------------------------


def test_defaults_are_the_old_keyword_defaults():
    assert dataclasses.asdict(SenderConfig()) == OLD_SENDER_DEFAULTS
    assert dataclasses.asdict(ReceiverConfig()) == OLD_RECEIVER_DEFAULTS


def test_a_default_sender_and_receiver_behave_as_before(tmp_path):
    with DeltaSender(_state(), LocalStore(tmp_path)) as sender:
        assert sender.config == SenderConfig()
        assert sender.policy == AnchorPolicy(every=10)
        assert sender.dtype is torch.bfloat16 and sender.codec.name == "packed"
        assert (sender.background, sender.metrics_path, sender.retention) == (False, None, None)
        assert len(sender.run_id) == 12 and sender._lease_s == 60.0
    receiver = DeltaReceiver(_state(), LocalStore(tmp_path))
    assert receiver.receiver_config == ReceiverConfig()
    assert (receiver.max_workers, receiver.metrics_path) == (8, None)


@pytest.mark.parametrize("config", [SenderConfig(), ReceiverConfig()], ids=["sender", "receiver"])
def test_configs_are_frozen_and_keyword_only(config):
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.metrics_path = "m.jsonl"
    with pytest.raises(TypeError):
        type(config)(4)  # positional: refused


def test_configs_live_under_their_public_packages_and_pickle():
    assert SenderConfig.__module__ == "torch_deltasync.sender"
    assert ReceiverConfig.__module__ == "torch_deltasync.receiver"
    assert "SenderConfig" not in torch_deltasync.__all__ and "ReceiverConfig" not in torch_deltasync.__all__
    config = SenderConfig(anchor_policy=AnchorPolicy(every=None, chain_ratio=1.0), retention=RetentionPolicy(),
                          inference_dtype=torch.float16, metrics_path=Path("m.jsonl"))
    assert pickle.loads(pickle.dumps(config)) == config
    assert pickle.loads(pickle.dumps(ReceiverConfig(max_workers=2))) == ReceiverConfig(max_workers=2)


def test_derived_values():
    assert SenderConfig(anchor_every=3).effective_anchor_policy == AnchorPolicy(every=3)
    policy = AnchorPolicy(every=None, chain_ratio=1.0)
    assert SenderConfig(anchor_every=3, anchor_policy=policy).effective_anchor_policy is policy  # overrides
    assert SenderConfig(codec="auto", link_gbps=1.0).codec_name == "packed"
    assert SenderConfig(codec="auto", link_gbps=25.0).codec_name == "raw"
    assert SenderConfig(codec="raw").codec_name == "raw"


# --- per-field checks ---------------------------------------------------------------------------------

VALID_SENDER = [
    dict(anchor_every=None),  # never by cadence
    dict(anchor_every=0),  # the same
    dict(inference_dtype="fp16"),  # an alias
    dict(inference_dtype=torch.float32),
    dict(snapshot_device="cpu"),
    dict(snapshot_device=torch.device("cpu")),
    dict(snapshot_device=torch.device("cpu")),
    dict(codec="auto", link_gbps=10),  # an int is a number of Gbit/s
    dict(run_id=""),  # empty: random, as before
    dict(metrics_path=""),  # empty: none, as before
    dict(metrics_path=Path("m.jsonl")),
    dict(lease_s=5),  # int seconds
]

INVALID_SENDER = [
    # (fields, error, message, the rule it breaks)
    (dict(anchor_every=-1), ValueError, r"SenderConfig.anchor_every must be an int >= 0 or None, got -1", "negative cadence"),
    (dict(anchor_every=2.5), TypeError, r"SenderConfig.anchor_every must be an int >= 0 or None, got 2.5", "not an int"),
    (dict(anchor_every=True), TypeError, r"SenderConfig.anchor_every", "a bool is not a cadence"),
    (dict(anchor_policy=10), TypeError, r"SenderConfig.anchor_policy must be an AnchorPolicy or None", "not a policy"),
    (dict(inference_dtype=torch.int8), ValueError, r"SenderConfig.inference_dtype: unsupported inference dtype", "integer dtype"),
    (dict(inference_dtype="int8"), ValueError, r"SenderConfig.inference_dtype: unsupported .*'bfloat16'", "unknown name"),
    (dict(inference_dtype=16), TypeError, r"SenderConfig.inference_dtype must be a torch.dtype or its name", "not a dtype"),
    (dict(snapshot_device="gpu0"), ValueError, r"SenderConfig.snapshot_device must be a device such as 'cpu'", "bad device"),
    (dict(snapshot_device=0), TypeError, r"SenderConfig.snapshot_device must be a torch.device", "an index alone"),
    (dict(codec="zstd"), ValueError, r"SenderConfig.codec: unknown codec 'zstd'; registered codecs: \[.*'packed'", "unknown codec"),
    (dict(codec=None), TypeError, r"SenderConfig.codec must be a codec name \(str\)", "not a name"),
    (dict(codec="auto"), ValueError, r'codec="auto" chooses by link speed: pass link_gbps=', "auto needs a link speed"),
    (dict(codec="auto", link_gbps=-1), ValueError, r"link_gbps must be a positive number of Gbit/s", "negative speed"),
    (dict(codec="auto", link_gbps=float("inf")), ValueError, r"link_gbps must be a positive number", "infinite speed"),
    (dict(link_gbps=10), ValueError, r'link_gbps is only used by codec="auto"', "speed without auto: ignored"),
    (dict(background=1), TypeError, r"SenderConfig.background must be True or False, got 1", "not a bool"),
    (dict(takeover="yes"), TypeError, r"SenderConfig.takeover must be True or False", "not a bool"),
    (dict(run_id=7), TypeError, r"SenderConfig.run_id must be a string or None, got 7", "not a string"),
    (dict(metrics_path=3), TypeError, r"SenderConfig.metrics_path must be a path", "not a path"),
    (dict(retention=dict(keep_anchors=1)), TypeError, r"SenderConfig.retention must be a RetentionPolicy or None", "a dict"),
    (dict(lease_s=0), ValueError, r"SenderConfig.lease_s must be a positive number of seconds \(finite, at least 0.1\), got 0", "zero"),
    (dict(lease_s=float("nan")), ValueError, r"SenderConfig.lease_s must be a positive number", "nan"),
    (dict(lease_s="60"), ValueError, r"SenderConfig.lease_s must be a positive number of seconds", "a string"),
    (dict(lease_s=True), ValueError, r"SenderConfig.lease_s", "a bool is not a duration"),
    (dict(threads=0), ValueError, r"SenderConfig.threads must be an int in \[1, 256\] or None \(one per CPU core, at most 8, shared among local ranks\), "
     r"got 0", "no thread"),
    (dict(threads=1000), ValueError, r"SenderConfig.threads must be an int in \[1, 256\] or None .*got 1000", "more threads than the cap"),
    (dict(threads="2"), TypeError, r"SenderConfig.threads must be an int in \[1, 256\] or None", "threads not an int"),
    (dict(threads=True), TypeError, r"SenderConfig.threads", "a bool is not a count"),
]

INVALID_RECEIVER = [
    (dict(max_workers=0), ValueError, r"ReceiverConfig.max_workers must be an int >= 1, got 0", "no downloads"),
    (dict(max_workers=2.0), TypeError, r"ReceiverConfig.max_workers must be an int >= 1, got 2.0", "not an int"),
    (dict(max_workers=True), TypeError, r"ReceiverConfig.max_workers", "a bool is not a count"),
    (dict(threads=0), ValueError, r"ReceiverConfig.threads must be an int in \[1, 256\] or None \(one per CPU core, at most 8, shared among local ranks\), "
     r"got 0", "no thread"),
    (dict(threads=257), ValueError, r"ReceiverConfig.threads must be an int in \[1, 256\]", "more threads than the cap"),
    (dict(threads=2.0), TypeError, r"ReceiverConfig.threads must be an int in \[1, 256\] or None", "threads not an int"),
    (dict(threads=True), TypeError, r"ReceiverConfig.threads", "a bool is not a count"),
    (dict(metrics_path=1), TypeError, r"ReceiverConfig.metrics_path must be a path", "not a path"),
]


@pytest.mark.parametrize("fields", VALID_SENDER, ids=lambda f: repr(f))
def test_valid_sender_fields(fields):
    config = SenderConfig(**fields)
    assert {k: getattr(config, k) for k in fields} == fields  # kept as given; the sender converts them


@pytest.mark.parametrize("fields,error,message,rule", INVALID_SENDER, ids=[r[3] for r in INVALID_SENDER])
def test_invalid_sender_fields(fields, error, message, rule):
    with pytest.raises(error, match=message):
        SenderConfig(**fields)


@pytest.mark.parametrize("fields,error,message,rule", INVALID_RECEIVER, ids=[r[3] for r in INVALID_RECEIVER])
def test_invalid_receiver_fields(fields, error, message, rule):
    with pytest.raises(error, match=message):
        ReceiverConfig(**fields)


def test_replace_checks_again():
    with pytest.raises(ValueError, match="SenderConfig.anchor_every"):
        dataclasses.replace(SenderConfig(), anchor_every=-2)


# --- config= plus keyword options ---------------------------------------------------------------------


def test_sender_options_override_the_config(tmp_path):
    config = SenderConfig(anchor_every=5, codec="raw", inference_dtype=torch.float32)
    with DeltaSender(_state(), LocalStore(tmp_path), config=config, anchor_every=7, background=True) as sender:
        assert sender.config == dataclasses.replace(config, anchor_every=7, background=True)
        assert sender.policy.every == 7 and sender.codec.name == "raw" and sender.dtype is torch.float32
        assert sender.background is True
        assert config.anchor_every == 5  # the caller's config is left alone
        assert sender.publish(background=False) == 0


def test_keyword_options_alone_still_work(tmp_path):
    with DeltaSender(_state(), LocalStore(tmp_path), anchor_every=3, codec="raw", metrics_path=tmp_path / "m.jsonl",
                     run_id="run-a") as sender:
        assert sender.config == SenderConfig(anchor_every=3, codec="raw", metrics_path=tmp_path / "m.jsonl",
                                             run_id="run-a")
        assert sender.run_id == "run-a" and sender.metrics_path == tmp_path / "m.jsonl"


@pytest.mark.parametrize("options,error,message", [
    (dict(anchor_evry=3), TypeError,
     r"DeltaSender got unexpected keyword argument\(s\) \['anchor_evry'\]; its options are SenderConfig's fields: "
     r"\['anchor_every', 'anchor_policy', 'background', 'codec', 'inference_dtype', 'lease_s', 'link_gbps', "
     r"'metrics_path', 'retention', 'run_id', 'snapshot_device', 'takeover', 'threads'\]"),
    (dict(max_workers=2, codec="raw"), TypeError, r"\['max_workers'\]"),  # a receiver option
    (dict(codec="zstd"), ValueError, r"SenderConfig.codec: unknown codec 'zstd'"),
    (dict(lease_s=-1), ValueError, r"SenderConfig.lease_s"),
])
def test_bad_sender_options_are_refused_before_the_store_is_touched(tmp_path, options, error, message):
    store = LocalStore(tmp_path)
    with pytest.raises(error, match=message):
        DeltaSender(_state(), store, **options)
    with pytest.raises(error, match=message):
        DeltaSender(_state(), store, config=SenderConfig(codec="raw"), **options)
    assert not store.exists(OWNER_KEY)  # the prefix was not claimed


def test_receiver_options_override_the_config(tmp_path):
    config = ReceiverConfig(max_workers=3, metrics_path=tmp_path / "a.jsonl")
    receiver = DeltaReceiver(_state(), LocalStore(tmp_path), config=config, max_workers=2)
    assert receiver.receiver_config == ReceiverConfig(max_workers=2, metrics_path=tmp_path / "a.jsonl")
    assert receiver.max_workers == 2 and receiver.metrics_path == tmp_path / "a.jsonl"
    assert DeltaReceiver(_state(), LocalStore(tmp_path), max_workers=1, metrics_path="").metrics_path is None


def test_bad_receiver_options(tmp_path):
    with pytest.raises(TypeError, match=r"DeltaReceiver got unexpected keyword argument\(s\) \['max_worker'\]; its "
                                        r"options are ReceiverConfig's fields: \['max_workers', 'metrics_path', 'recover', 'threads'\]"):
        DeltaReceiver(_state(), LocalStore(tmp_path), max_worker=2)
    with pytest.raises(TypeError, match=r"ReceiverConfig.recover must be a bool, got 'no'"):
        DeltaReceiver(_state(), LocalStore(tmp_path), recover="no")
    with pytest.raises(ValueError, match=r"ReceiverConfig.max_workers must be an int >= 1, got 0"):
        DeltaReceiver(_state(), LocalStore(tmp_path), max_workers=0)


@pytest.mark.parametrize("config", [ReceiverConfig(), {}, {"anchor_every": 3}, "packed"])
def test_a_config_of_another_class_is_refused_naming_the_argument(tmp_path, config):
    from torch_deltasync import DeltaSender, LocalStore

    store = LocalStore(tmp_path / "b")
    with pytest.raises(TypeError, match=r"DeltaSender: config must be a SenderConfig \(or None"):
        DeltaSender({"w": torch.zeros(4)}, store, config=config)
    assert not (tmp_path / "b" / "OWNER").exists()  # nothing claimed, nothing written


def test_a_sender_config_given_to_the_receiver_is_refused(tmp_path):
    from torch_deltasync import DeltaReceiver, LocalStore

    with pytest.raises(TypeError, match=r"DeltaReceiver: config must be a ReceiverConfig"):
        DeltaReceiver({"w": torch.zeros(4)}, LocalStore(tmp_path / "b"), config=SenderConfig(), max_workers=2)


@pytest.mark.parametrize("options,match", [
    (dict(run_id="r" * 257), r"run_id must be at most 256 characters, got 257"),
    (dict(lease_s=1e-9), r"lease_s must be a positive number of seconds \(finite, at least 0.1\)"),
    (dict(snapshot_device="meta"), r"snapshot_device 'meta' cannot hold a snapshot \(meta tensors hold no data\)"),
])
def test_values_that_would_fail_a_later_publish_are_refused_when_built(options, match):
    with pytest.raises(ValueError, match=match):
        SenderConfig(**options)


def test_a_256_character_run_id_and_numpy_lease_work(tmp_path):
    import numpy as np

    from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore

    w = {"w": torch.arange(8, dtype=torch.float32)}
    sender = DeltaSender(w, LocalStore(tmp_path / "b"), run_id="r" * 256, lease_s=np.float64(5.0))
    v = sender.publish()
    sender.close()
    replica = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    assert DeltaReceiver(replica, LocalStore(tmp_path / "b")).update() == v
    assert torch.equal(replica["w"].view(torch.int16), w["w"].to(torch.bfloat16).view(torch.int16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: 'cuda:0' is valid here")
def test_a_cuda_snapshot_without_cuda_is_refused_when_built():
    with pytest.raises(ValueError, match=r"snapshot_device 'cuda:0' cannot hold a snapshot on this machine \(no CUDA device\)"):
        SenderConfig(snapshot_device="cuda:0")
    if torch.accelerator.current_accelerator(check_available=True) is None:  # 'mps' passed on any machine
        with pytest.raises(ValueError, match=r"snapshot_device 'mps' cannot hold a snapshot on this machine \(no mps"):
            SenderConfig(snapshot_device="mps")


def test_entries_that_do_not_sync_are_named(tmp_path, caplog):
    """Complex tensors and values that are not tensors were dropped without a word (integer
    buffers are passed over by design); a model of nothing else named none of them."""
    weights = {"w": torch.randn(4), "c": torch.randn(3, dtype=torch.complex64), "l": [1.0], "ids": torch.arange(3)}
    with caplog.at_level("WARNING", logger="torch_deltasync.sender"):
        sender = DeltaSender(weights, tmp_path / "a")
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not published")]
    assert warned == ["not published: 'c' (complex64 tensor), 'l' (list). Only real floating-point tensors sync; "
                      "publish a complex tensor as its real view (torch.view_as_real) under its own name, and keep "
                      "other values out of the state dict"]
    assert sender.publish() == 0
    assert [t.name for t in DeltaReceiver({"w": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "a").manifest(0).tensors] == ["w"]
    for model, held in [({"c": weights["c"], "ids": weights["ids"]}, "; it holds 'c' (complex64 tensor), 'ids' (int64 tensor)"),
                        ({}, " (it is empty)")]:
        with pytest.raises(ValueError, match=re.escape(f"the model has no floating-point tensors to publish{held}")):
            DeltaSender(model, tmp_path / "b")


def test_a_sender_on_a_prefix_of_another_model_warns(tmp_path, caplog):
    """Another model published into a prefix went unnoticed until its followers failed."""
    from torch import nn

    def senders_warnings(model, **kwargs):
        caplog.clear()
        with caplog.at_level("WARNING", logger="torch_deltasync.sender"):
            with DeltaSender(model, tmp_path, **kwargs) as sender:
                sender.publish()
        return [r.getMessage() for r in caplog.records if "of another model" in r.getMessage()]

    torch.manual_seed(0)
    assert senders_warnings(nn.Linear(16, 16)) == []  # a new prefix
    assert senders_warnings(nn.Linear(16, 16)) == []  # a restart of the same model
    assert senders_warnings(nn.Linear(32, 32)) == [
        f"{LocalStore(tmp_path).describe()}: its newest version 1 is of another model ('weight': (16, 16) -> (32, 32), "
        "'bias': (16,) -> (32,)). This sender publishes its own from version 2 on, and receivers that hold the old "
        "model will refuse it (IncompatibleTargetError): publish under a new prefix unless the model changed on purpose"]
    assert senders_warnings(nn.Linear(32, 32), inference_dtype="float32")[0].startswith(
        f"{LocalStore(tmp_path).describe()}: its newest version 2 is of another model (inference dtype torch.bfloat16 "
        "-> torch.float32)")


def test_a_receiver_refuses_a_sparse_tensor_and_a_version_that_is_not_one(tmp_path):
    """A sparse tensor was called overlapping memory, with .contiguous() as the fix; the version
    setter took a str and failed later inside update()."""
    from torch_deltasync.errors import IncompatibleTargetError

    DeltaSender({"w": torch.randn(4, 4)}, tmp_path).publish()
    with pytest.raises(IncompatibleTargetError, match=r"tensor 'w' has layout torch.sparse_coo; only strided tensors "
                                                      r"receive \(make it dense: .to_dense\(\)\)"):
        DeltaReceiver({"w": torch.zeros(4, 4, dtype=torch.bfloat16).to_sparse()}, tmp_path).update()
    receiver = DeltaReceiver({"w": torch.zeros(4, 4, dtype=torch.bfloat16)}, tmp_path)
    for value, error in [("x", TypeError), (-1, ValueError), (1.0, TypeError)]:
        with pytest.raises(error, match="version"):
            receiver.version = value
        assert receiver.version is None
    assert receiver.update() == 0 and receiver.version == 0
    receiver.version = None  # the next update rebuilds from the anchor
    assert receiver.update() == 0 and receiver.last_stats.path == "anchor"


def test_misused_arguments_are_named(tmp_path, caplog):
    """Values that raised from deep inside (``'>' not supported between 'str' and 'int'``, an
    ``AttributeError`` on a dict) or were taken for ``True`` (``"no"``)."""
    from torch import nn

    from torch_deltasync import ModuleTarget, collect_garbage
    from torch_deltasync.errors import UnsupportedLayoutError

    refused = [
        (lambda: AnchorPolicy(chain_ratio="1.0"), TypeError, r"AnchorPolicy\.chain_ratio must be a number > 0 or None, "
                                                             r"got str '1\.0'"),
        (lambda: AnchorPolicy(max_delta_ratio=True), TypeError, r"AnchorPolicy\.max_delta_ratio must be a number"),
        (lambda: RetentionPolicy(grace_s=None), TypeError, r"RetentionPolicy: grace_s must be a number of seconds >= 0, "
                                                           r"got NoneType None"),
        (lambda: RetentionPolicy(verify_cut="no"), TypeError, r"RetentionPolicy\.verify_cut must be True or False"),
        (lambda: collect_garbage(tmp_path, {"keep_anchors": 1}), TypeError,
         r"collect_garbage: policy must be a RetentionPolicy or None, got dict"),
        (lambda: ModuleTarget(nn.Linear(2, 2), strict="no"), TypeError, r"ModuleTarget\(strict=\.\.\.\) must be True "
                                                                        r"or False, got 'no'"),
        (lambda: DeltaSender({1: torch.zeros(3)}, tmp_path / "a"), TypeError,
         r"tensor names are strings \(state-dict keys\), got int 1"),
        (lambda: DeltaSender({"m": torch.empty(3, device="meta")}, tmp_path / "b"), UnsupportedLayoutError,
         r"tensor 'm' is on the meta device \(no data to publish\)"),
    ]
    for call, error, message in refused:
        with pytest.raises(error, match=message):
            call()
    assert collect_garbage(str(tmp_path / "empty"), RetentionPolicy()).reason == "no versions"  # a path works
    weights = {"w": torch.arange(4, dtype=torch.float32)}
    sender = DeltaSender(weights, tmp_path / "c")
    with pytest.raises(TypeError, match=r"publish\(background=\.\.\.\) must be True, False or None"):
        sender.publish(background="no")
    assert sender.version is None
    sender.publish()
    receiver = DeltaReceiver({"w": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "c")
    for kwargs, error, message in [(dict(version="0"), TypeError, r"a version is an int, got str '0'"),
                                   (dict(timeout_s=None), TypeError, r"wait_for: timeout_s must be a number"),
                                   (dict(poll_s=-1), ValueError, r"wait_for: poll_s must be a finite number of "
                                                                 r"seconds > 0, got -1")]:
        with pytest.raises(error, match=message):
            receiver.wait_for(**kwargs)
    assert receiver.wait_for(0, timeout_s=float("inf")) == 0  # inf: as long as it takes
    # A state dict given as the model is frozen: a delta without changes says how that happens, once.
    policy = nn.Linear(4, 4)
    frozen = DeltaSender(policy.state_dict(), tmp_path / "d")
    frozen.publish()
    policy.load_state_dict({k: v * 2 for k, v in policy.state_dict().items()}, assign=True)
    with caplog.at_level("WARNING", logger="torch_deltasync.sender"):
        frozen.publish()
        frozen.publish()
    said = [r.getMessage() for r in caplog.records if "no element changed" in r.getMessage()]
    assert len(said) == 1 and "version 1: no element changed since version 0" in said[0] and "pass the module" in said[0]
