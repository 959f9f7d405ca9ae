"""Stores: ``open_store`` routing, the ``Store`` contract on local/memory/S3 (moto on loopback),
S3 configuration from the environment, listing freshness, ranged and multi-part reads, and the
retry/deadline layer (``store/retry.py``)."""

from __future__ import annotations

import errno
import uuid

import pytest

from torch_deltasync import LocalStore, open_store
from torch_deltasync.errors import ObjectNotFoundError, StoreError, TransientStoreError
from torch_deltasync.errors import CorruptObjectError
from torch_deltasync.store import RetryingStore, RetryPolicy
from torch_deltasync.store.faults import FaultyStore
from torch_deltasync.store.retry import call_with_retry, classify_error

from s3_server import make_bucket, s3_env

FAST = RetryPolicy(attempts=4, base_delay_s=0.001, max_delay_s=0.002, jitter=0.0, timeout_s=5.0)


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "bucket", fsync=False)
    if request.param == "memory":
        return open_store(f"memory://t-{uuid.uuid4().hex[:8]}/run")
    endpoint = request.getfixturevalue("s3")
    return open_store(f"s3://{make_bucket(endpoint)}/runs/x", endpoint_url=endpoint, retry=FAST)


# --- routing -------------------------------------------------------------------------------------


def test_open_store_routes_each_scheme(tmp_path, s3):
    from torch_deltasync.store import FsspecStore, HFBucketStore

    assert isinstance(open_store(tmp_path / "a"), LocalStore)
    assert isinstance(open_store(str(tmp_path / "b")), LocalStore)
    local = open_store(f"file://{tmp_path}/c")
    assert isinstance(local, LocalStore) and local.root == (tmp_path / "c").resolve()
    mem = open_store("memory://route/x")
    assert isinstance(mem, FsspecStore) and mem.protocol == "memory"
    s = open_store(f"s3://{make_bucket(s3)}/p", endpoint_url=s3)
    assert isinstance(s, FsspecStore) and s.protocol == "s3" and s.root.endswith("/p")
    hf = open_store("hf://buckets/my-org/my-bucket/runs/7", api=object())
    assert isinstance(hf, HFBucketStore)
    assert (hf.bucket_id, hf.root) == ("my-org/my-bucket", "runs/7")
    assert open_store(local) is local


@pytest.mark.parametrize("uri, match, reason", [
    ("hf://datasets/org/name", "only Hugging Face Buckets are supported", "only buckets are stores"),
    ("hf://buckets/only-namespace", r"expected hf://buckets/<namespace>/<bucket>", "no bucket name"),
    ("hf://buckets/org/b/../escape", r"segment '\.\.' is not allowed", "prefix escapes"),
    ("s3://", "names no bucket", "no bucket"),
    ("nope://bucket/x", r"'nope://bucket/x': unknown store scheme 'nope://'", "unknown scheme, named with the URI"),
])
def test_open_store_rejects_bad_uris(uri, match, reason):
    with pytest.raises(ValueError, match=match):
        open_store(uri, api=object()) if uri.startswith("hf://") else open_store(uri)


def test_open_store_refuses_options_for_an_opened_store(tmp_path):
    with pytest.raises(ValueError, match="already opened"):
        open_store(LocalStore(tmp_path), fsync=False)


# --- the Store contract --------------------------------------------------------------------------


def test_store_contract(store):
    store.put("versions/000000000001.json", b'{"a": 1}')
    store.put("objects/000000000001/delta-r00000-of00001.safetensors", bytes(range(256)) * 4)
    store.put("LATEST", b"1")
    assert store.get("versions/000000000001.json") == b'{"a": 1}'
    key = "objects/000000000001/delta-r00000-of00001.safetensors"
    data = bytes(range(256)) * 4
    assert store.get(key, start=10, end=20) == data[10:20]
    assert store.get(key, start=1000) == data[1000:]
    assert store.get(key, start=0, end=0) == b""
    assert store.size(key) == 1024
    assert store.exists(key) and not store.exists("objects/000000000002/x")
    assert store.list() == ["LATEST", key, "versions/000000000001.json"]
    assert store.list("versions") == ["versions/000000000001.json"]
    assert store.list("objects/000000000001") == [key]
    assert store.list("nothing/here") == []
    store.put("LATEST", b"22")  # overwrite
    assert store.get("LATEST") == b"22"
    store.delete("LATEST")
    store.delete("LATEST")  # missing: not an error
    assert not store.exists("LATEST")
    store.delete_many([key, "versions/000000000001.json", "never/existed"])
    assert store.list() == []
    sub = store.sub("runs/a")
    sub.put("k", b"v")
    assert sub.list() == ["k"] and store.list() == ["runs/a/k"]


def test_missing_object_error_names_store_and_key(store):
    with pytest.raises(ObjectNotFoundError) as e:
        store.get("versions/000000000009.json")
    assert "versions/000000000009.json" in str(e.value)
    assert store.describe().split(" ")[0] in str(e.value)
    assert isinstance(e.value, FileNotFoundError)  # builtin stays catchable
    with pytest.raises(ObjectNotFoundError):
        store.size("nope")


@pytest.mark.parametrize("key, match", [
    ("../x", r"segment '\.\.'"), ("/abs", "absolute"), ("a//b", "segment ''"), ("a/./b", r"segment '\.'"),
    ("a\\b", r"segment 'a\\\\b'"), ("", "empty"),
])
def test_invalid_keys_are_refused_before_any_io(store, key, match):
    with pytest.raises(CorruptObjectError, match=match):
        store.put(key, b"x")
    assert store.list() == []


def test_empty_object(store):
    store.put("empty", b"")
    assert store.get("empty") == b"" and store.size("empty") == 0


def test_large_object_is_read_in_parallel_parts(s3):
    """Objects above ``part_nbytes`` are read as ranged parts; the bytes come back exact."""
    store = open_store(f"s3://{make_bucket(s3)}/big", endpoint_url=s3, retry=FAST, part_nbytes=1000,
                       max_parallel_parts=4)
    data = bytes((i * 7919) % 251 for i in range(10_500))
    store.put("anchor", data)
    calls = []
    real = store.fs.cat_file

    def spy(path, start=None, end=None, **kw):
        calls.append((start, end))
        return real(path, start=start, end=end, **kw)

    store.fs.cat_file = spy
    assert store.get("anchor") == data
    assert calls[0] == (0, 1000) and len(calls) == 11  # one head part + 10 more ranges
    assert sorted(calls[1:]) == [(s, min(s + 1000, 10_500)) for s in range(1000, 10_500, 1000)]
    calls.clear()
    assert store.get("anchor", start=2500, end=2600) == data[2500:2600] and calls == [(2500, 2600)]


def test_short_part_is_retried(s3):
    store = open_store(f"s3://{make_bucket(s3)}/short", endpoint_url=s3, retry=FAST, part_nbytes=100)
    data = bytes(range(250))
    store.put("obj", data)
    real = store.fs.cat_file
    short = {"left": 1}

    def flaky(path, start=None, end=None, **kw):
        out = real(path, start=start, end=end, **kw)
        if start == 100 and short["left"]:
            short["left"] -= 1
            return out[:-5]  # a transfer cut short
        return out

    store.fs.cat_file = flaky
    assert store.get("obj") == data and short["left"] == 0


# --- S3 configuration and freshness ---------------------------------------------------------------


def test_s3_endpoint_and_region_come_from_the_environment(s3):
    from torch_deltasync.store._fsspec import s3_storage_options

    env = {"AWS_ENDPOINT_URL": "http://a:1", "AWS_REGION": "eu-west-3"}
    opts = s3_storage_options({}, env)
    assert opts["endpoint_url"] == "http://a:1" and opts["client_kwargs"]["region_name"] == "eu-west-3"
    assert opts["config_kwargs"]["retries"]["max_attempts"] == 1 and opts["use_listings_cache"] is False
    assert s3_storage_options({}, {**env, "AWS_ENDPOINT_URL_S3": "http://s3:2"})["endpoint_url"] == "http://s3:2"
    explicit = s3_storage_options({"endpoint_url": "http://mine:3", "config_kwargs": {"retries": {"max_attempts": 9}}}, env)
    assert explicit["endpoint_url"] == "http://mine:3" and explicit["config_kwargs"]["retries"]["max_attempts"] == 9

    bucket = make_bucket(s3)
    with s3_env({"AWS_ENDPOINT_URL": s3}):
        store = open_store(f"s3://{bucket}/env")  # no options: endpoint from AWS_ENDPOINT_URL
        store.put("k", b"from-env")
        assert store.storage_options["endpoint_url"] == s3 and store.describe() == f"s3://{bucket}/env"
    import boto3

    body = boto3.client("s3", endpoint_url=s3, region_name="us-east-1").get_object(Bucket=bucket, Key="env/k")["Body"]
    assert body.read() == b"from-env"


def test_listing_sees_writes_of_another_client_at_once(s3):
    """A receiver's store must see a manifest the trainer (another client) just wrote: no stale
    s3fs listing cache."""
    import boto3

    bucket = make_bucket(s3)
    reader = open_store(f"s3://{bucket}/run", endpoint_url=s3, retry=FAST)
    client = boto3.client("s3", endpoint_url=s3, region_name="us-east-1")
    assert reader.list("versions") == [] and not reader.exists("versions/000000000000.json")
    for v in range(3):
        client.put_object(Bucket=bucket, Key=f"run/versions/{v:012d}.json", Body=b"{}")
        assert reader.list("versions")[-1] == f"versions/{v:012d}.json"
        assert reader.exists(f"versions/{v:012d}.json")
    client.delete_object(Bucket=bucket, Key="run/versions/000000000002.json")
    assert reader.list("versions")[-1] == "versions/000000000001.json"
    assert not reader.exists("versions/000000000002.json")


def test_unreachable_endpoint_is_transient_and_named():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now: connection refused
    with s3_env():
        store = open_store(f"s3://nobucket/x", endpoint_url=f"http://127.0.0.1:{port}",
                           retry=RetryPolicy(attempts=2, base_delay_s=0.001, timeout_s=20))
        with pytest.raises(TransientStoreError) as e:
            store.get("versions/000000000001.json")
    msg = str(e.value)
    assert "s3://nobucket/x" in msg and "versions/000000000001.json" in msg and "2 attempts" in msg


def test_a_bucket_that_does_not_exist_is_named_everywhere(s3, capsys):
    """A mistyped bucket used to read as "no object ..." (publish), "no versions" with exit 0
    (``deltasync ls``) and "no version has been published yet" (receivers)."""
    import torch

    from torch_deltasync import DeltaReceiver, DeltaSender
    from torch_deltasync.errors import StoreNotFoundError
    from torch_deltasync.cli import main

    uri = "s3://no-such-bucket/run"
    store = open_store(uri, endpoint_url=s3, retry=FAST)
    named = rf"s3://no-such-bucket/run \(endpoint {s3}\): the bucket does not exist"
    for call in (lambda: store.list("versions"), lambda: store.get("LATEST"), lambda: store.exists("LATEST"),
                 lambda: store.size("LATEST"), lambda: store.put("k", b"v"), lambda: store.put_new("k", b"v")):
        with pytest.raises(StoreNotFoundError, match=named):
            call()
    with pytest.raises(StoreNotFoundError, match=named):
        DeltaReceiver({"w": torch.zeros(3, dtype=torch.bfloat16)}, store).update()
    with pytest.raises(StoreNotFoundError, match=named):
        DeltaSender({"w": torch.ones(3)}, store).publish()
    with s3_env({"AWS_ENDPOINT_URL": s3}):
        for cmd in (["ls", uri], ["verify", uri], ["gc", uri], ["follow", uri, "--idle-timeout", "1"]):
            assert main(cmd) == 2, cmd
            captured = capsys.readouterr()
            assert "the bucket does not exist" in captured.err and "no version" not in captured.out, cmd


# --- retry layer ---------------------------------------------------------------------------------


class _Err(Exception):
    def __init__(self, response):
        super().__init__("boom")
        self.response = response


class _Resp:
    def __init__(self, status_code):
        self.status_code = status_code


CLASSIFY_TABLE = [
    (FileNotFoundError("k"), "missing", "a missing key"),
    (ObjectNotFoundError("k"), "missing", "our own missing-key error"),
    (PermissionError("denied"), "fatal", "credentials will not fix themselves"),
    (TimeoutError(), "transient", "timeout"),
    (ConnectionResetError(), "transient", "dropped connection"),
    (OSError(errno.EBUSY, "SlowDown"), "transient", "s3fs maps SlowDown/503 to EBUSY"),
    (OSError(errno.EIO, "weird"), "fatal", "unknown I/O error"),
    (_Err({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}), "transient", "botocore 503"),
    (_Err({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}), "fatal", "botocore 403"),
    (_Err(_Resp(429)), "transient", "HTTP 429 throttling"),
    (_Err(_Resp(502)), "transient", "HTTP 5xx"),
    (_Err(_Resp(400)), "fatal", "HTTP 400 bad request"),
    (TransientStoreError("x"), "transient", "a store that already classified it"),
    (StoreError("x"), "fatal", "a store error that is not transient"),
    (CorruptObjectError("bad key"), "reraise", "not a store failure"),
    (_Err({"Error": {"Code": "NoSuchBucket"}, "ResponseMetadata": {"HTTPStatusCode": 404}}), "no_store",
     "a missing bucket is not a missing key"),
    (ValueError("x"), "fatal", "anything else"),
]


@pytest.mark.parametrize("exc, verdict, reason", CLASSIFY_TABLE, ids=[r for *_, r in CLASSIFY_TABLE])
def test_classify_error(exc, verdict, reason):
    assert classify_error(exc) == verdict


def test_classify_looks_at_the_cause_chain():
    try:
        try:
            raise ConnectionResetError("peer reset")
        except ConnectionResetError as inner:
            raise OSError(errno.EIO, "wrapped") from inner
    except OSError as e:
        assert classify_error(e) == "transient"


def test_transient_failures_are_retried_until_success(monkeypatch):
    from torch_deltasync.store import retry as retry_mod

    calls, slept = [], []
    monkeypatch.setattr(retry_mod, "_sleep", slept.append)  # record the backoff instead of waiting

    def fn():
        calls.append(len(slept))  # how many sleeps came before this attempt
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    policy = RetryPolicy(attempts=5, base_delay_s=0.02, max_delay_s=1.0, jitter=0.0, timeout_s=None)
    assert call_with_retry(fn, policy=policy, store="s://x", op="read", key="k") == "ok"
    assert calls == [0, 1, 2]  # one sleep between consecutive attempts
    assert slept == [0.02, 0.04]  # exponential backoff: 0.02 s, then 0.04 s


def test_fatal_and_missing_are_not_retried():
    calls = []

    def denied():
        calls.append(1)
        raise PermissionError("AccessDenied")

    with pytest.raises(StoreError) as e:
        call_with_retry(denied, policy=FAST, store="s3://b/run", op="write", key="versions/1.json")
    assert len(calls) == 1 and not isinstance(e.value, TransientStoreError)
    assert str(e.value) == "s3://b/run: cannot write 'versions/1.json': PermissionError: AccessDenied"

    def missing():
        calls.append(1)
        raise FileNotFoundError("nope")

    with pytest.raises(ObjectNotFoundError, match=r"s3://b/run: no object 'k'"):
        call_with_retry(missing, policy=FAST, store="s3://b/run", op="read", key="k")
    assert len(calls) == 2


def test_giving_up_names_store_key_cause_and_attempts():
    with pytest.raises(TransientStoreError) as e:
        call_with_retry(lambda: (_ for _ in ()).throw(TimeoutError("read timed out")), policy=FAST,
                        store="hf://buckets/o/b", op="read", key="LATEST")
    assert str(e.value) == ("hf://buckets/o/b: cannot read 'LATEST': TimeoutError: read timed out "
                            "(gave up after 4 attempts)")


@pytest.mark.timeout(60)
def test_deadline_abandons_a_hung_call_and_retries():
    import threading

    release = threading.Event()  # a hung socket: blocks until the test ends
    calls = []

    def hangs_once():
        calls.append(1)
        if len(calls) == 1:
            release.wait()
        return b"data"

    policy = RetryPolicy(attempts=3, base_delay_s=0.0, timeout_s=0.1)
    try:
        assert call_with_retry(hangs_once, policy=policy, store="s", op="read", key="k") == b"data"
        assert len(calls) == 2 and not release.is_set()  # answered by the retry while the first still hangs
        with pytest.raises(TransientStoreError, match=r"timed out after 0\.1 s \(gave up after 2 attempts\)"):
            call_with_retry(release.wait, policy=RetryPolicy(attempts=2, base_delay_s=0, timeout_s=0.1),
                            store="s", op="read", key="k")
    finally:
        release.set()


def test_deadline_grows_with_known_bytes():
    p = RetryPolicy(timeout_s=10.0, min_bytes_per_s=1e6)
    assert p.deadline_s() == 10.0 and p.deadline_s(5_000_000) == 15.0
    assert RetryPolicy(timeout_s=None).deadline_s(10**9) is None


def test_backoff_is_exponential_capped_and_jittered():
    p = RetryPolicy(base_delay_s=0.1, max_delay_s=1.0, jitter=0.0)
    assert [p.delay_s(i) for i in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    j = RetryPolicy(base_delay_s=1.0, max_delay_s=1.0, jitter=0.5)
    import random

    rng = random.Random(0)
    delays = [j.delay_s(0, rng) for _ in range(200)]
    assert 0.5 <= min(delays) < 0.6 and 0.9 < max(delays) <= 1.0


@pytest.mark.parametrize("kwargs, match, reason", [
    (dict(attempts=0), "attempts must be an integer >= 1, got 0", "at least one attempt"),
    (dict(attempts=1.5), "attempts must be an integer >= 1, got 1.5", "attempts is an integer"),
    (dict(jitter=1.5), r"jitter must be in \[0, 1\], got 1.5", "jitter is a fraction"),
    (dict(timeout_s=0), "timeout_s must be > 0 or None, got 0", "a zero deadline never succeeds"),
    (dict(base_delay_s=-1), "base_delay_s and max_delay_s must be >= 0", "negative sleep"),
    (dict(min_bytes_per_s=0), "min_bytes_per_s must be > 0, got 0", "division by zero"),
])
def test_retry_policy_rejects_bad_values(kwargs, match, reason):
    with pytest.raises(ValueError, match=match):
        RetryPolicy(**kwargs)


def test_retrying_store_over_faults(tmp_path):
    faulty = FaultyStore(LocalStore(tmp_path, fsync=False), error_rate=0.3, lost_ack_rate=0.2, seed=3)
    store = RetryingStore(faulty, RetryPolicy(attempts=30, base_delay_s=0, timeout_s=None))
    for i in range(50):
        store.put(f"k/{i}", str(i).encode())
    assert [store.get(f"k/{i}") for i in range(50)] == [str(i).encode() for i in range(50)]
    assert store.list("k") == sorted(f"k/{i}" for i in range(50))
    store.delete_many([f"k/{i}" for i in range(25)])
    assert len(store.list()) == 25
    assert faulty.injected["error"] > 10 and faulty.injected["lost_ack"] > 5
