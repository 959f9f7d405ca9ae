"""The options integrations forward to the sender and receiver they build
(``integrations/_sender_options.py``): checked against ``SenderConfig`` / ``ReceiverConfig`` when
the integration is built, names and values both, with the integration's name in the message."""

from __future__ import annotations

import pickle

import pytest
import torch

from torch_deltasync.integrations._sender_options import receiver_config, sender_config, split_options
from torch_deltasync.receiver import ReceiverConfig
from torch_deltasync.sender import AnchorPolicy, SenderConfig

# --- the helpers ----------------------------------------------------------------------------------------


def test_sender_config_from_options_and_a_config():
    assert sender_config({}, "X") == SenderConfig()
    assert sender_config({"codec": "raw"}, "X") == SenderConfig(codec="raw")
    base = SenderConfig(anchor_every=3, codec="raw")
    assert sender_config({}, "X", config=base) is base
    assert sender_config({"anchor_every": 7}, "X", config=base) == SenderConfig(anchor_every=7, codec="raw")


def test_unknown_names_are_listed():
    with pytest.raises(TypeError, match=r"X got unexpected keyword argument\(s\) \['codek', 'group'\]; besides its own "
                                        r"options it takes DeltaSender's: \['anchor_every', .*'takeover', 'threads'\]"):
        sender_config({"codek": "raw", "group": None}, "X")
    with pytest.raises(TypeError, match=r"X got unexpected keyword argument\(s\) \['anchor_policy'\]; .*DeltaSender's: "
                                        r"\['anchor_every', 'background'"):  # set by the integration itself
        sender_config({"anchor_policy": None}, "X", exclude=("anchor_policy",))
    with pytest.raises(TypeError, match=r"Y got unexpected keyword argument\(s\) \['prefix'\]; besides its own options "
                                        r"it takes DeltaReceiver's: \['max_workers', 'metrics_path', 'recover', 'threads'\]"):
        receiver_config({"prefix": "p"}, "Y")


@pytest.mark.parametrize("options,error,message", [
    ({"codec": "zstd"}, ValueError, r"SenderConfig.codec: unknown codec 'zstd'"),
    ({"codec": "auto"}, ValueError, r'codec="auto" chooses by link speed'),
    ({"link_gbps": 3.0}, ValueError, r'link_gbps is only used by codec="auto"'),
    ({"inference_dtype": "int8"}, ValueError, r"SenderConfig.inference_dtype"),
    ({"anchor_every": "10"}, TypeError, r"SenderConfig.anchor_every"),
])
def test_bad_sender_values(options, error, message):
    with pytest.raises(error, match=message):
        sender_config(options, "X")


def test_bad_receiver_values():
    with pytest.raises(ValueError, match=r"ReceiverConfig.max_workers must be an int >= 1, got 0"):
        receiver_config({"max_workers": 0}, "Y")


def test_split_options():
    assert split_options({"codec": "raw", "max_workers": 2}, "Z") == ({"codec": "raw"}, {"max_workers": 2})
    assert split_options({"metrics_path": "m"}, "Z") == ({"metrics_path": "m"}, {"metrics_path": "m"})  # both sides
    with pytest.raises(TypeError, match=r"Z got unexpected keyword argument\(s\) \['metrics_path', 'nope'\]; besides "
                                        r"its own options it takes DeltaSender's: \[.*\] and DeltaReceiver's: "
                                        r"\['max_workers', 'recover', 'threads'\]"):
        split_options({"nope": 1, "metrics_path": "m"}, "Z", exclude=("metrics_path",))


# --- at the integrations' construction ------------------------------------------------------------------


def test_adapter_sender_and_receiver_check_their_options_first(tmp_path):
    pytest.importorskip("peft")
    from torch_deltasync.integrations.peft import AdapterReceiver, AdapterSender

    # checked before the model is looked at: not a PEFT model, but the option is what is reported
    with pytest.raises(ValueError, match=r"SenderConfig.codec: unknown codec 'zstd'"):
        AdapterSender(object(), str(tmp_path), codec="zstd")
    with pytest.raises(TypeError, match=r"AdapterSender got unexpected keyword argument\(s\) \['max_workers'\]"):
        AdapterSender(object(), str(tmp_path), max_workers=2)
    with pytest.raises(ValueError, match=r"ReceiverConfig.max_workers must be an int >= 1"):
        AdapterReceiver(None, str(tmp_path), max_workers=0)
    with pytest.raises(ValueError, match=r"ReceiverConfig.max_workers must be an int >= 1"):
        AdapterReceiver(None, str(tmp_path), receiver_config=ReceiverConfig(), max_workers=0)
    receiver = AdapterReceiver(None, str(tmp_path), receiver_config=ReceiverConfig(max_workers=3))
    assert receiver.max_workers == 3 and receiver.receiver_config == ReceiverConfig(max_workers=3)


def test_scheme_takes_configs_and_keywords(tmp_path):
    pytest.importorskip("torchrl")
    from torch_deltasync.integrations.torchrl import DeltaWeightSyncScheme

    s = DeltaWeightSyncScheme(str(tmp_path))
    assert s.sender_config == SenderConfig() and s.sender_options == {}
    assert s.receiver_config == ReceiverConfig(max_workers=4) and s.max_workers == 4  # the scheme's own default
    s = DeltaWeightSyncScheme(str(tmp_path), sender_config=SenderConfig(anchor_every=3, codec="raw"),
                              receiver_config=ReceiverConfig(max_workers=16), anchor_every=5, max_workers=2)
    assert s.sender_config == SenderConfig(anchor_every=5, codec="raw") and s.anchor_policy == AnchorPolicy(every=5)
    assert s.sender_options == {"anchor_every": 5}
    assert s.receiver_config == ReceiverConfig(max_workers=2)
    copy_ = pickle.loads(pickle.dumps(s))  # the configs travel to the workers
    assert (copy_.sender_config, copy_.receiver_config) == (s.sender_config, s.receiver_config)


def test_scheme_refuses_bad_options_when_built(tmp_path):
    pytest.importorskip("torchrl")
    from torch_deltasync.integrations.torchrl import DeltaWeightSyncScheme

    with pytest.raises(ValueError, match=r"SenderConfig.codec: unknown codec 'zstd'"):
        DeltaWeightSyncScheme(str(tmp_path), codec="zstd")
    with pytest.raises(TypeError, match=r"SenderConfig.inference_dtype"):
        DeltaWeightSyncScheme(str(tmp_path), inference_dtype=16)
    with pytest.raises(ValueError, match=r"ReceiverConfig.max_workers must be an int >= 1, got 0"):
        DeltaWeightSyncScheme(str(tmp_path), max_workers=0)
    with pytest.raises(TypeError, match=r"DeltaWeightSyncScheme got unexpected keyword argument\(s\) \['max_worker'\]; "
                                        r".*DeltaSender's: \[.*\] and DeltaReceiver's: \['max_workers', 'recover', 'threads'\]"):
        DeltaWeightSyncScheme(str(tmp_path), max_worker=2)


def test_scheme_metrics_path_template(tmp_path):
    pytest.importorskip("torchrl")
    from torch_deltasync.integrations.torchrl import DeltaWeightSyncScheme

    s = DeltaWeightSyncScheme(str(tmp_path), metrics_path="m-{worker}.jsonl")
    assert s._metrics_path("3", "ignored.jsonl") == "m-3.jsonl"  # the scheme's own wins
    s = DeltaWeightSyncScheme(str(tmp_path), receiver_config=ReceiverConfig(metrics_path=tmp_path / "r-{worker}.jsonl"))
    assert s._metrics_path("3", s.receiver_config.metrics_path) == str(tmp_path / "r-3.jsonl")
    assert s._metrics_path("sender", s.sender_config.metrics_path) is None


def test_vllm_weight_sender_takes_a_config(tmp_path):
    pytest.importorskip("torchrl")
    from torch_deltasync.integrations.torchrl import DeltaVLLMWeightSender

    s = DeltaVLLMWeightSender(str(tmp_path), sender_config=SenderConfig(codec="raw"), inference_dtype=torch.float32)
    assert s.sender_config == SenderConfig(codec="raw", inference_dtype=torch.float32)
    assert s.sender_options == {"inference_dtype": torch.float32}
    with pytest.raises(ValueError, match=r'link_gbps is only used by codec="auto"'):
        DeltaVLLMWeightSender(str(tmp_path), link_gbps=5.0)


def test_a_config_of_the_other_side_is_refused_naming_the_integrations_argument():
    with pytest.raises(TypeError, match=r"Scheme: sender_config must be a SenderConfig .*got ReceiverConfig"):
        sender_config({}, "Scheme", config=ReceiverConfig())
    with pytest.raises(TypeError, match=r"Scheme: receiver_config must be a ReceiverConfig .*got SenderConfig"):
        receiver_config({"max_workers": 2}, "Scheme", config=SenderConfig())
    with pytest.raises(TypeError, match=r"AdapterSender: config must be a SenderConfig .*got dict"):
        sender_config({}, "AdapterSender", config={"anchor_every": 3}, argument="config")


def test_the_torchrl_scheme_refuses_a_wrong_config_when_built():
    from torch_deltasync.integrations.torchrl import DeltaWeightSyncScheme

    with pytest.raises(TypeError, match=r"sender_config must be a SenderConfig"):
        DeltaWeightSyncScheme("unused-bucket", sender_config=ReceiverConfig())
    with pytest.raises(TypeError, match=r"receiver_config must be a ReceiverConfig"):
        DeltaWeightSyncScheme("unused-bucket", receiver_config=SenderConfig(), max_workers=2)
