"""The torchrl integration's own options (``DeltaWeightSyncScheme``, ``DeltaVLLMWeightSender``) are
checked when it is built, with the option named: a wrong type is a ``TypeError`` (``bool`` is not
an ``int``), an out-of-range value a ``ValueError``. Values that pass used to fail much later (at
``connect`` in a worker process, at the first ``send``) or never (a ``sync='no'`` that waits)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

pytest.importorskip("torchrl")

from torch_deltasync.integrations.torchrl import DeltaVLLMWeightSender, DeltaWeightSyncScheme  # noqa: E402

NAN, INF = float("nan"), float("inf")

# (option, value, error, message)
BAD_SCHEME_OPTIONS = [
    ("metrics_path", 5, TypeError, r"DeltaWeightSyncScheme: metrics_path must be a path \(str or os.PathLike; "
                                   r"'\{worker\}' is replaced by the worker index\) or None, got int 5"),
    ("metrics_path", b"m.jsonl", TypeError, r"metrics_path must be a path .*got bytes b'm.jsonl'"),
    ("num_workers", True, TypeError, r"DeltaWeightSyncScheme: num_workers must be an int >= 1 \(the number of "
                                     r"receivers send waits for\) or None, got bool True"),
    ("num_workers", 2.5, TypeError, r"num_workers must be an int >= 1 .*got float 2.5"),
    ("num_workers", "2", TypeError, r"num_workers must be an int >= 1 .*got str '2'"),
    ("num_workers", 0, ValueError, r"DeltaWeightSyncScheme: num_workers must be >= 1 or None, got 0"),
    ("sync", "no", TypeError, r"DeltaWeightSyncScheme: sync must be a bool \(True: send waits for the workers' "
                              r"acknowledgements\), got str 'no'"),
    ("sync", 1, TypeError, r"sync must be a bool .*got int 1"),
    ("sync", None, TypeError, r"sync must be a bool .*got NoneType None"),
    ("background_receive", "x", TypeError, r"DeltaWeightSyncScheme: background_receive must be a bool \(True: "
                                           r"receivers follow the store on a daemon thread\), got str 'x'"),
    ("version_key", 5, TypeError, r"DeltaWeightSyncScheme: version_key must be a str \(the root key of the collected "
                                  r"data stamped with the policy version\) or None, got int 5"),
    ("version_key", "", ValueError, r"DeltaWeightSyncScheme: version_key must be a non-empty str or None"),
    ("ack_timeout_s", "5", TypeError, r"DeltaWeightSyncScheme: ack_timeout_s must be a number of seconds > 0, "
                                      r"got str '5'"),
    ("ack_timeout_s", True, TypeError, r"ack_timeout_s must be a number of seconds > 0, got bool True"),
    ("ack_timeout_s", 0, ValueError, r"DeltaWeightSyncScheme: ack_timeout_s must be a finite number of seconds > 0, "
                                     r"got 0"),
    ("ack_timeout_s", NAN, ValueError, r"ack_timeout_s must be a finite number of seconds > 0, got nan"),
    ("ack_timeout_s", INF, ValueError, r"ack_timeout_s must be a finite number of seconds > 0, got inf"),
    ("poll_interval_s", "0.1", TypeError, r"DeltaWeightSyncScheme: poll_interval_s must be a number of seconds > 0"),
    ("poll_interval_s", -1, ValueError, r"poll_interval_s must be a finite number of seconds > 0, got -1"),
    ("poll_interval_s", INF, ValueError, r"poll_interval_s must be a finite number of seconds > 0, got inf"),
    ("connect_timeout_s", "300", TypeError, r"DeltaWeightSyncScheme: connect_timeout_s must be a number of seconds > 0, "
                                            r"got str '300'"),
    ("connect_timeout_s", NAN, ValueError, r"DeltaWeightSyncScheme: connect_timeout_s must be > 0 seconds, got nan"),
    ("strict", "no", TypeError, r"DeltaWeightSyncScheme: strict must be a bool \(False: the workers leave their "
                                r"floating tensors that the trainer does not publish alone\), got str 'no'"),
    ("store_options", 5, TypeError, r"DeltaWeightSyncScheme: store_options must be a dict of open_store options "
                                    r"\(endpoint, credentials, ...\) or None, got int 5"),
    ("store_options", [("endpoint", "x")], TypeError, r"store_options must be a dict .*got list"),
    ("store_options", {1: "x"}, TypeError, r"DeltaWeightSyncScheme: store_options keys must be open_store option "
                                           r"names \(str\), got \['1'\]"),
]


@pytest.mark.parametrize("option,value,error,message", BAD_SCHEME_OPTIONS,
                         ids=[f"{o}={v!r}" for o, v, _, _ in BAD_SCHEME_OPTIONS])
def test_scheme_refuses_a_bad_value_of_its_own_options_when_built(tmp_path, option, value, error, message):
    with pytest.raises(error, match=message):
        DeltaWeightSyncScheme(str(tmp_path), **{option: value})


def test_scheme_refuses_a_bad_store_device_or_receiver_dtype_when_built(tmp_path):
    """These failed only at connect, in the worker process (or as a raw ``TypeError`` from
    ``open_store``), or named the wrong option."""
    import torch

    from torch_deltasync import LocalStore

    cases = [
        (dict(receiver_dtype=torch.float16, inference_dtype=torch.bfloat16), ValueError,
         r"receiver_dtype torch\.float16 cannot hold every torch\.bfloat16 value \(the inference_dtype\) exactly; use "
         r"torch\.bfloat16 or torch\.float32, or None"),
        (dict(receiver_dtype="bf16", inference_dtype="fp32"), ValueError,
         r"receiver_dtype torch\.bfloat16 cannot hold every torch\.float32 value .*use torch\.float32,"),
        (dict(receiver_dtype=torch.int8), ValueError, r"receiver_dtype torch\.int8 is not a floating dtype the workers"),
        (dict(device="gpu"), ValueError, r"device 'gpu' is no torch device .*e\.g\. 'cpu' or 'cuda:0'"),
        (dict(device=5.5), TypeError, r"device must be a torch\.device, a device string .*got float 5\.5"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            DeltaWeightSyncScheme(str(tmp_path), **kwargs)
    for store, error, message in [(None, TypeError, r"store must be a store URI or path .*got NoneType None"),
                                  (5, TypeError, r"store must be .*got int 5"),
                                  ("", ValueError, r"DeltaWeightSyncScheme: store '' is empty"),
                                  ("s3://", ValueError, r"DeltaWeightSyncScheme: 's3://' names no bucket"),
                                  ("hf://buckets/", ValueError, r"DeltaWeightSyncScheme: expected hf://buckets/"),
                                  (Path("s3://b/run"), ValueError, r"'s3:/b/run' looks like a URI that lost a slash"),
                                  ("S3://b/run", ValueError, r"unknown store scheme 'S3://'")]:
        with pytest.raises(error, match=message):
            DeltaWeightSyncScheme(store)
    with pytest.raises(ValueError, match=r"store_options \['endpoint'\] apply to a store URI, and the store given is "
                                         r"already open \(file://"):
        DeltaWeightSyncScheme(LocalStore(tmp_path), store_options={"endpoint": "x"})
    with pytest.raises(ValueError, match=r"DeltaWeightSyncScheme: metrics_path '.*' is a folder; give a file in it"):
        DeltaWeightSyncScheme(str(tmp_path), metrics_path=tmp_path)
    DeltaWeightSyncScheme(str(tmp_path), metrics_path=tmp_path / "{worker}")  # a folder per worker: fine
    # a receiver that was not told the inference dtype takes the manifest's (checked at connect)
    assert DeltaWeightSyncScheme(str(tmp_path), receiver_dtype=torch.float16).receiver_dtype == torch.float16
    assert DeltaWeightSyncScheme(tmp_path, receiver_dtype="float32", inference_dtype="bf16",
                                 device="cpu").receiver_dtype == torch.float32


def test_scheme_keeps_valid_values_of_its_own_options(tmp_path):
    s = DeltaWeightSyncScheme(str(tmp_path), sync=False, num_workers=2, ack_timeout_s=5, poll_interval_s=0.5,
                              connect_timeout_s=INF, background_receive=False, version_key=None,
                              metrics_path=tmp_path / "m-{worker}.jsonl", store_options={})
    assert (s.sync, s.num_workers, s.ack_timeout_s, s.poll_interval_s, s.background_receive, s.version_key) == \
        (False, 2, 5.0, 0.5, False, None)
    assert s.metrics_path == str(tmp_path / "m-{worker}.jsonl")  # a Path is kept as the str template
    assert s._metrics_path("3", None) == str(tmp_path / "m-3.jsonl")
    assert pickle.loads(pickle.dumps(s)).metrics_path == s.metrics_path
    d = DeltaWeightSyncScheme(str(tmp_path))
    assert (d.sync, d.num_workers, d.ack_timeout_s, d.poll_interval_s, d.connect_timeout_s, d.background_receive,
            d.version_key, d.metrics_path, d.store_options) == (True, None, 120.0, 0.05, 300.0, True, "policy_version",
                                                                None, {})


@pytest.mark.parametrize("value,error,message", [
    (-1, ValueError, r"DeltaVLLMWeightSender: rpc_timeout_s must be a finite number of seconds > 0, got -1; pass None "
                     r"to use the engine's own timeout"),
    (0, ValueError, r"rpc_timeout_s must be a finite number of seconds > 0, got 0"),
    (NAN, ValueError, r"rpc_timeout_s must be a finite number of seconds > 0, got nan"),
    (INF, ValueError, r"rpc_timeout_s must be a finite number of seconds > 0, got inf"),
    ("x", TypeError, r"DeltaVLLMWeightSender: rpc_timeout_s must be a number of seconds > 0 or None, got str 'x'"),
    (True, TypeError, r"rpc_timeout_s must be a number of seconds > 0 or None, got bool True"),
])
def test_vllm_sender_refuses_a_bad_rpc_timeout_when_built(tmp_path, value, error, message):
    with pytest.raises(error, match=message):
        DeltaVLLMWeightSender(str(tmp_path), rpc_timeout_s=value)


def test_vllm_sender_keeps_a_valid_rpc_timeout(tmp_path):
    assert DeltaVLLMWeightSender(str(tmp_path)).rpc_timeout_s is None
    assert DeltaVLLMWeightSender(str(tmp_path), rpc_timeout_s=30).rpc_timeout_s == 30
    assert DeltaVLLMWeightSender(Path(tmp_path), rpc_timeout_s=0.5).rpc_timeout_s == 0.5


def test_scheme_threads_option_sets_both_sides(tmp_path):
    """``threads`` is a field of both configs: the scheme's keyword sets the trainer's reading and
    encoding threads and the workers' staging threads; a bad value is refused when it is built."""
    s = DeltaWeightSyncScheme(str(tmp_path), threads=2)
    assert (s.sender_config.threads, s.receiver_config.threads) == (2, 2)
    copy = pickle.loads(pickle.dumps(s))
    assert (copy.sender_config.threads, copy.receiver_config.threads) == (2, 2)
    d = DeltaWeightSyncScheme(str(tmp_path))
    assert (d.sender_config.threads, d.receiver_config.threads) == (None, None)
    with pytest.raises(ValueError, match=r"threads must be an int in \[1, 256\] or None"):
        DeltaWeightSyncScheme(str(tmp_path), threads=0)


def test_a_queue_acknowledgement_naming_another_worker_confirms_nobody():
    """Worker 0's queue carrying worker 1's acknowledgement credits nobody, as under another
    worker's key in the store (``acks.StoreAcks``)."""
    import multiprocessing as mp

    from torch_deltasync.acks import AckBook, ack_message
    from torch_deltasync.errors import SyncTimeoutError
    from torch_deltasync.integrations.torchrl._acks import QueueAcks

    acks = QueueAcks(mp.get_context("spawn"), 2)
    acks.queues[0].put(ack_message(0, 5, None))
    acks.queues[0].put(ack_message(1, 5, None))
    acks.queues[0].put("not a message")
    book = AckBook(acks, [0, 1], who="test sender")
    with pytest.raises(SyncTimeoutError, match=r"worker 1 did not confirm version 5 within 0.5 s \(it holds "
                                               r"version None\)"):
        book.wait(5, None, timeout_s=0.5, poll_s=0.01)
    assert book.acked == {0: 5}
    acks.post(None, ack_message(1, 5, None))
    book.wait(5, None, timeout_s=10, poll_s=0.01)
    assert book.acked == {0: 5, 1: 5}
