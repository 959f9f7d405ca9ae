"""``HFBucketStore`` against a faked ``HfApi`` layer that records calls and serves bytes (the Hub
is unreachable here), plus a live test that runs only with ``HF_TOKEN`` and
``DELTASYNC_TEST_HF_BUCKET=hf://buckets/<namespace>/<bucket>[/<prefix>]`` set (``pytest -m live``)."""

from __future__ import annotations

import itertools
import os
import time
import uuid
from pathlib import Path

import pytest

from torch_deltasync import DeltaReceiver, DeltaSender, open_store
from torch_deltasync.errors import ObjectNotFoundError, StoreError, StoreNotFoundError, TransientStoreError
from torch_deltasync.store import RetryPolicy
from torch_deltasync.store._hf import parse_bucket_uri

from remote_helpers import StepModel, assert_holds, empty_target

import httpx2  # noqa: E402
from huggingface_hub import errors as hf_errors  # noqa: E402
from huggingface_hub._buckets import BucketFile  # noqa: E402

FAST = RetryPolicy(attempts=4, base_delay_s=0.001, max_delay_s=0.002, jitter=0.0, timeout_s=5.0)
ENDPOINT = "https://hub.invalid"


def _http_error(cls, status: int, url: str = ENDPOINT):
    resp = httpx2.Response(status, request=httpx2.Request("GET", url))
    return cls(f"{status} error", response=resp)


class FakeHfApi:
    """The Buckets subset of ``HfApi`` over a dict; records every call as ``(method, args...)``.

    ``fail`` maps a method name to a list of exceptions raised by its next calls (one per call).
    """

    def __init__(self, bucket_id: str = "org/bucket") -> None:
        self.endpoint = ENDPOINT
        self.bucket_id = bucket_id
        self.files: dict[str, bytes] = {}
        self.calls: list[tuple] = []
        self.fail: dict[str, list[BaseException]] = {}

    def _enter(self, name: str, bucket_id: str, *args) -> None:
        self.calls.append((name, bucket_id, *args))
        if bucket_id != self.bucket_id:
            raise _http_error(hf_errors.BucketNotFoundError, 404)
        pending = self.fail.get(name)
        if pending:
            raise pending.pop(0)

    def _file(self, path: str) -> BucketFile:
        return BucketFile(type="file", path=path, size=len(self.files[path]), xetHash=f"xet-{hash(self.files[path])}")

    def batch_bucket_files(self, bucket_id, *, add=None, copy=None, delete=None, token=None):
        self._enter("batch_bucket_files", bucket_id, tuple(p for _, p in add or ()), tuple(delete or ()))
        for src, dest in add or ():
            assert isinstance(src, bytes), "the store uploads bytes, not paths"
            self.files[dest] = src
        for path in delete or ():
            self.files.pop(path, None)

    def list_bucket_tree(self, bucket_id, prefix=None, *, recursive=None, token=None):
        self._enter("list_bucket_tree", bucket_id, prefix, recursive)
        for path in sorted(self.files):
            if prefix is None or path.startswith(prefix.rstrip("/") + "/") or path == prefix:
                yield self._file(path)

    def get_bucket_paths_info(self, bucket_id, paths, *, token=None):
        paths = list(paths)
        self._enter("get_bucket_paths_info", bucket_id, tuple(paths))
        return [self._file(p) for p in paths if p in self.files]

    def download_bucket_files(self, bucket_id, files, *, raise_on_missing_files=False, token=None):
        self._enter("download_bucket_files", bucket_id, tuple(p for p, _ in files), raise_on_missing_files)
        for path, dest in files:
            if path not in self.files:
                if raise_on_missing_files:
                    raise hf_errors.EntryNotFoundError(f"1 file(s) not found in bucket '{bucket_id}': {path}")
                continue
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            Path(dest).write_bytes(self.files[path])

    # the HTTP route used for byte ranges: GET {endpoint}/buckets/{id}/resolve/{path}, Range header
    def http_get(self, url, headers=None, timeout=None, follow_redirects=None):
        prefix = f"{ENDPOINT}/buckets/{self.bucket_id}/resolve/"
        assert url.startswith(prefix), url
        path = url[len(prefix):]
        self.calls.append(("GET", path, headers.get("range"), timeout))
        pending = self.fail.get("GET")
        if pending:
            raise pending.pop(0)
        request = httpx2.Request("GET", url)
        if path not in self.files:
            return httpx2.Response(404, request=request, headers={"x-error-code": "EntryNotFound"})
        data = self.files[path]
        first, _, last = headers["range"].removeprefix("bytes=").partition("-")
        start, end = int(first), (int(last) + 1 if last else len(data))
        if start >= len(data):
            return httpx2.Response(416, request=request)
        return httpx2.Response(206, content=data[start:end], request=request)


@pytest.fixture
def api(monkeypatch):
    fake = FakeHfApi()

    class Session:
        get = staticmethod(fake.http_get)

    import huggingface_hub.utils as hf_utils

    monkeypatch.setattr(hf_utils, "get_session", lambda: Session())
    return fake


@pytest.fixture
def store(api, tmp_path):
    return open_store("hf://buckets/org/bucket/runs/7", api=api, retry=FAST, tmp_dir=tmp_path)


@pytest.mark.parametrize("uri, expected", [
    ("hf://buckets/org/bucket", ("org/bucket", "")),
    ("hf://buckets/org/bucket/", ("org/bucket", "")),
    ("hf://buckets/org/bucket/runs/7", ("org/bucket", "runs/7")),
])
def test_parse_bucket_uri(uri, expected):
    assert parse_bucket_uri(uri) == expected


@pytest.mark.parametrize("uri, reason", [
    ("hf://org/bucket", "not a bucket URI"),
    ("hf://buckets/org", "no bucket name"),
    ("hf://buckets//bucket", "empty namespace"),
    ("hf://buckets/org/bucket/a/../../x", "prefix escapes the bucket"),
    ("s3://org/bucket", "another scheme"),
])
def test_parse_bucket_uri_rejects(uri, reason):
    with pytest.raises((ValueError,)):
        parse_bucket_uri(uri)


def test_calls_map_to_the_buckets_api(store, api):
    store.put("versions/000000000001.json", b"{}")
    assert api.calls[-1] == ("batch_bucket_files", "org/bucket", ("runs/7/versions/000000000001.json",), ())
    assert api.files == {"runs/7/versions/000000000001.json": b"{}"}

    assert store.get("versions/000000000001.json") == b"{}"
    assert api.calls[-1] == ("download_bucket_files", "org/bucket", ("runs/7/versions/000000000001.json",), True)

    store.put("objects/000000000001/a.safetensors", bytes(range(100)))
    assert store.get("objects/000000000001/a.safetensors", start=10, end=20) == bytes(range(10, 20))
    assert api.calls[-1][:3] == ("GET", "runs/7/objects/000000000001/a.safetensors", "bytes=10-19")
    assert api.calls[-1][3] is not None  # every remote call has a timeout
    assert store.get("objects/000000000001/a.safetensors", start=95) == bytes(range(95, 100))
    assert api.calls[-1][2] == "bytes=95-"
    assert store.get("objects/000000000001/a.safetensors", start=100, end=120) == b""

    assert store.exists("versions/000000000001.json") and not store.exists("versions/000000000002.json")
    assert api.calls[-1] == ("get_bucket_paths_info", "org/bucket", ("runs/7/versions/000000000002.json",))
    assert store.size("objects/000000000001/a.safetensors") == 100

    api.files["runs/70/other"] = b"not ours"  # a sibling prefix must not leak into our listing
    api.files["elsewhere/x"] = b"not ours"
    assert store.list() == ["objects/000000000001/a.safetensors", "versions/000000000001.json"]
    assert api.calls[-1] == ("list_bucket_tree", "org/bucket", "runs/7", True)
    assert store.list("versions") == ["versions/000000000001.json"]
    assert api.calls[-1] == ("list_bucket_tree", "org/bucket", "runs/7/versions", True)

    store.delete_many(["versions/000000000001.json", "objects/000000000001/a.safetensors"])
    assert api.calls[-1] == ("batch_bucket_files", "org/bucket", (),
                             ("runs/7/versions/000000000001.json", "runs/7/objects/000000000001/a.safetensors"))
    store.delete("never/there")
    assert store.list() == []


def test_missing_objects(store, api):
    for call in (lambda: store.get("LATEST"), lambda: store.get("LATEST", start=0, end=4), lambda: store.size("LATEST")):
        with pytest.raises(ObjectNotFoundError, match=r"hf://buckets/org/bucket/runs/7: no object 'LATEST'"):
            call()


def test_transient_hub_errors_are_retried(store, api):
    api.fail["batch_bucket_files"] = [_http_error(hf_errors.HfHubHTTPError, 503), _http_error(hf_errors.HfHubHTTPError, 429)]
    store.put("k", b"v")
    assert [c[0] for c in api.calls].count("batch_bucket_files") == 3 and api.files["runs/7/k"] == b"v"
    api.fail["download_bucket_files"] = [httpx2.ConnectError("connection refused")]
    assert store.get("k") == b"v"
    api.fail["GET"] = [httpx2.ReadTimeout("slow")]
    assert store.get("k", start=0, end=1) == b"v"


def test_fatal_hub_errors_are_not_retried(api, tmp_path):
    store = open_store("hf://buckets/org/other-bucket", api=api, retry=FAST, tmp_dir=tmp_path)
    with pytest.raises(StoreError) as e:
        store.put("k", b"v")
    assert not isinstance(e.value, TransientStoreError)
    assert "hf://buckets/org/other-bucket" in str(e.value) and "'k'" in str(e.value)
    assert len(api.calls) == 1
    api.fail["list_bucket_tree"] = [_http_error(hf_errors.HfHubHTTPError, 401)]
    right = open_store("hf://buckets/org/bucket", api=api, retry=FAST, tmp_dir=tmp_path)
    with pytest.raises(StoreError, match="401"):
        right.list()


@pytest.mark.parametrize("status", [401, 403, 404])
def test_refused_or_private_buckets_say_how_to_authenticate(api, tmp_path, status):
    """The Hub answers a private bucket without a token like a missing one (404): both, and a
    refused token, end in a hint to pass a token (not only "the bucket does not exist")."""
    uri = "hf://buckets/org/bucket" if status != 404 else "hf://buckets/org/private-bucket"
    api.fail["get_bucket_paths_info"] = [_http_error(hf_errors.HfHubHTTPError, status)]
    with pytest.raises(StoreError) as e:
        open_store(uri, api=api, retry=FAST, tmp_dir=tmp_path).exists("OWNER")
    assert type(e.value) is (StoreNotFoundError if status == 404 else StoreError)
    assert uri in str(e.value) and "set HF_TOKEN or run `hf auth login`" in str(e.value)
    api.fail.clear()
    with pytest.raises(ObjectNotFoundError) as missing:  # a missing key in a bucket we may read: no hint
        open_store("hf://buckets/org/bucket", api=api, retry=FAST, tmp_dir=tmp_path).get("LATEST")
    assert "HF_TOKEN" not in str(missing.value)


def test_a_listing_whose_pages_loop_ends(api, tmp_path):
    """huggingface_hub follows "next page" links without a bound: a server whose pages loop made
    every abandoned attempt page for ever. An entry seen twice ends the attempt, and an attempt
    past its deadline stops paging."""
    pages = [0]

    def looping_tree(bucket_id, prefix=None, *, recursive=None, token=None):
        while True:  # page after page of the same two entries
            pages[0] += 1
            yield from (api._file("runs/7/LATEST"), api._file("runs/7/OWNER"))

    api.files.update({"runs/7/LATEST": b"0", "runs/7/OWNER": b"{}"})
    api.list_bucket_tree = looping_tree
    store = open_store("hf://buckets/org/bucket/runs/7", api=api, retry=FAST, tmp_dir=tmp_path)
    with pytest.raises(StoreError, match=r"returned 'runs/7/LATEST' twice: the server's pages loop"):
        store.list()
    assert pages[0] == 2

    def slow_endless_tree(bucket_id, prefix=None, *, recursive=None, token=None):
        for i in itertools.count():
            pages[0] = i
            time.sleep(0.01)
            yield BucketFile(type="file", path=f"runs/7/objects/{i}", size=1, xetHash="x")

    api.list_bucket_tree = slow_endless_tree
    quick = RetryPolicy(attempts=1, timeout_s=0.2)
    with pytest.raises(TransientStoreError, match="timed out"):
        open_store("hf://buckets/org/bucket/runs/7", api=api, retry=quick, tmp_dir=tmp_path).list()
    time.sleep(0.5)  # the abandoned attempt stops at its own deadline
    stopped = pages[0]
    time.sleep(0.3)
    assert pages[0] == stopped and stopped < 60


def test_giving_up_after_retries(store, api):
    api.fail["get_bucket_paths_info"] = [_http_error(hf_errors.HfHubHTTPError, 503)] * 10
    with pytest.raises(TransientStoreError, match=r"cannot stat 'k'.*gave up after 4 attempts"):
        store.exists("k")


def test_sender_and_receivers_through_a_bucket(store, api):
    model = StepModel(seed=5)
    sender = DeltaSender(model.tensors, store, anchor_every=4)
    targets = [empty_target(), empty_target()]
    receivers = [DeltaReceiver(t, open_store("hf://buckets/org/bucket/runs/7", api=api, retry=FAST)) for t in targets]
    for step in range(12):
        model.set_step(step)
        assert sender.publish() == step
        receivers[0].update()
        assert_holds(targets[0], model, step)
        if step % 5 == 4:
            receivers[1].update()
            assert_holds(targets[1], model, step)
    receivers[1].update()
    assert_holds(targets[1], model, 11)
    assert (receivers[1].last_stats.from_version, receivers[1].last_stats.path) == (9, "delta")
    # every object of the run went through batch_bucket_files, under the run prefix
    assert all(p.startswith("runs/7/") for p in api.files)
    assert sum(1 for p in api.files if p.startswith("runs/7/versions/")) == 12


@pytest.mark.live
def test_live_bucket_round_trip():
    uri = os.environ.get("DELTASYNC_TEST_HF_BUCKET")
    if not (os.environ.get("HF_TOKEN") and uri):
        pytest.skip("set HF_TOKEN and DELTASYNC_TEST_HF_BUCKET=hf://buckets/<namespace>/<bucket>[/<prefix>]")
    store = open_store(uri).sub(f"deltasync-test-{uuid.uuid4().hex[:8]}")
    try:
        store.put("probe", b"0123456789")
        assert store.get("probe") == b"0123456789"
        assert store.get("probe", start=3, end=6) == b"345"
        assert store.list() == ["probe"] and store.size("probe") == 10
        model = StepModel(seed=9)
        sender = DeltaSender(model.tensors, store, anchor_every=3)
        target = empty_target()
        receiver = DeltaReceiver(target, store)
        for step in range(5):
            model.set_step(step)
            sender.publish()
            receiver.update()
            assert_holds(target, model, step)
    finally:
        store.delete_many(store.list())
