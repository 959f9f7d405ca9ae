"""Stores: ``open_store`` routing, the ``Store`` contract on local/memory/S3 (moto on loopback),
S3 configuration from the environment, listing freshness, ranged and multi-part reads, and
unreachable endpoints and missing buckets through the retry layer (its own tests:
``tests/unit/test_store_retry.py``)."""

from __future__ import annotations

import uuid

import pytest

from torch_deltasync import LocalStore, open_store
from torch_deltasync.errors import ObjectNotFoundError, TransientStoreError
from torch_deltasync.errors import CorruptObjectError
from torch_deltasync.store import RetryPolicy

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
    ("hf://buckets/my-org/../run", r"bucket '\.\.' is no Hub name", "the bucket climbs out"),
    ("hf://buckets/my-org/rl?x=1/run", r"bucket 'rl\?x=1' is no Hub name", "a query in the bucket"),
    ("hf://buckets/my org/rl/run", r"namespace 'my org' is no Hub name", "a space in the namespace"),
    ("s3:/bucket/run", r"'s3:/bucket/run' looks like a URI that lost a slash \(s3://...\)", "pathlib.Path('s3://b')"),
    ("S3:/bucket/run", r"'S3:/bucket/run' looks like a URI that lost a slash \(S3://...\)", "in capitals"),
    ("hf://buckets/my-org/rl.git/run", r"bucket 'rl\.git' is no Hub name", "the Hub refuses '.git' names"),
])
def test_open_store_rejects_bad_uris(uri, match, reason):
    from pathlib import Path

    if uri.startswith("s3:/") and not uri.startswith("s3://"):
        with pytest.raises(ValueError, match=match):
            open_store(Path("s3://bucket/run"))
    with pytest.raises(ValueError, match=match):
        open_store(uri, api=object()) if uri.startswith("hf://") else open_store(uri)


def test_a_relative_folder_with_a_colon_is_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_store("ckpt:/run")  # no object store scheme: a folder "ckpt:" under the current one
    assert isinstance(store, LocalStore) and store.root == tmp_path / "ckpt:" / "run"


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


def test_folder_markers_are_not_listed(s3):
    """Keys ending in ``/`` (the S3 console's and ``s3fs.mkdir``'s "folders") are no objects: a
    marker named like a manifest must not read as a version."""
    import boto3

    bucket = make_bucket(s3)
    store = open_store(f"s3://{bucket}/run", endpoint_url=s3, retry=FAST)
    store.put("versions/000000000001.json", b"{}")
    client = boto3.client("s3", endpoint_url=s3, region_name="us-east-1")
    for key in ("run/", "run/versions/", "run/versions/000000000007.json/"):
        client.put_object(Bucket=bucket, Key=key, Body=b"")
    assert store.list() == ["versions/000000000001.json"]
    assert store.list("versions") == ["versions/000000000001.json"]


def test_unreachable_endpoint_is_transient_and_named():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now: connection refused
    with s3_env():
        store = open_store("s3://nobucket/x", endpoint_url=f"http://127.0.0.1:{port}",
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
