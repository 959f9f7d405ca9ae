"""The HTTP rollout service (``integrations/rollout/``): validation, auth, back-pressure,
staleness and exact accounting, over real HTTP (uvicorn on loopback, httpx clients)."""

from __future__ import annotations

import json
import os
import random
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from torch_deltasync.errors import EpisodeError, RolloutServiceError, ServiceClosedError
from torch_deltasync.integrations.rollout import (
    BufferFull,
    EpisodeBuffer,
    RolloutClient,
    RolloutServiceConfig,
    collate_episodes,
    start_service,
    validate_episodes,
)

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token-for-tests"


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (what the service stores log-probs as)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def episode(uid: int, version: int, *, n: int = 3, worker: str = "w") -> dict:
    rng = random.Random(uid)
    return {"prompt": [rng.randrange(16) for _ in range(4)], "completion": [rng.randrange(16) for _ in range(n)],
            "logprobs": [f32(-rng.random() * 3) for _ in range(n)], "reward": float(rng.random()),
            "advantage": f32(rng.uniform(-1, 1)), "policy_version": version, "group": uid, "worker": worker}


@pytest.fixture
def service(request):
    cfg = getattr(request, "param", None) or RolloutServiceConfig(capacity=64, max_lag=1, vocab_size=16, token=TOKEN,
                                                                  max_completion_tokens=32, max_body_bytes=1 << 16,
                                                                  max_episodes_per_post=64, retry_after_s=0.02)
    handle = start_service(cfg)
    yield handle
    handle.stop()


# --- validation (the rules, one row each) ---------------------------------------------------------

CFG = RolloutServiceConfig(capacity=8, vocab_size=16, max_prompt_tokens=8, max_completion_tokens=8, max_episodes_per_post=4)
GOOD = {"prompt": [1, 2], "completion": [3, 4], "logprobs": [-0.5, -1.0], "reward": 1.0, "policy_version": 0}

INVALID = [
    ([], "body is not an object with episodes"),
    ({"episodes": []}, "empty batch"),
    ({"episodes": [GOOD] * 5}, "more episodes than max_episodes_per_post"),
    ({"episodes": [GOOD], "extra": 1}, "unknown top-level key"),
    ({"episodes": ["x"]}, "episode is not an object"),
    ({"episodes": [{k: v for k, v in GOOD.items() if k != "reward"}]}, "missing reward"),
    ({"episodes": [{**GOOD, "secret": 1}]}, "unknown episode field"),
    ({"episodes": [{**GOOD, "completion": []}]}, "empty completion"),
    ({"episodes": [{**GOOD, "completion": [1] * 9, "logprobs": [-1.0] * 9}]}, "completion over max_completion_tokens"),
    ({"episodes": [{**GOOD, "prompt": [1] * 9}]}, "prompt over max_prompt_tokens"),
    ({"episodes": [{**GOOD, "completion": [3, 16]}]}, "token outside the vocabulary"),
    ({"episodes": [{**GOOD, "completion": [3, -1]}]}, "negative token"),
    ({"episodes": [{**GOOD, "completion": [3, 4.0]}]}, "float token id (wrong dtype)"),
    ({"episodes": [{**GOOD, "completion": [3, True]}]}, "bool token id (wrong dtype)"),
    ({"episodes": [{**GOOD, "prompt": "12"}]}, "prompt is a string, not a list"),
    ({"episodes": [{**GOOD, "logprobs": [-0.5]}]}, "one log-prob short"),
    ({"episodes": [{**GOOD, "logprobs": [-0.5, 0.7]}]}, "positive log-prob"),
    ({"episodes": [{**GOOD, "logprobs": [-0.5, "x"]}]}, "string log-prob"),
    ({"episodes": [{**GOOD, "reward": float("nan")}]}, "NaN reward"),
    ({"episodes": [{**GOOD, "reward": "1"}]}, "string reward"),
    ({"episodes": [{**GOOD, "advantage": float("inf")}]}, "infinite advantage"),
    ({"episodes": [{**GOOD, "policy_version": -1}]}, "negative version"),
    ({"episodes": [{**GOOD, "policy_version": 1.5}]}, "fractional version"),
    ({"episodes": [{**GOOD, "worker": "w" * 129}]}, "worker name too long"),
    ({"episodes": [{**GOOD, "group": [1]}]}, "group neither int nor string"),
    ({"episodes": [{**GOOD, "group": "\ud800"}]}, "group a lone surrogate"),  # lost whole batches at /sample
    ({"episodes": [{**GOOD, "worker": "w\udfff"}]}, "worker a lone surrogate"),  # broke /stats for good
]


@pytest.mark.parametrize("batch, reason", INVALID, ids=[r for _, r in INVALID])
def test_validation_rejects(batch, reason):
    with pytest.raises(EpisodeError):
        validate_episodes(batch, CFG)


def test_validation_accepts_the_schema():
    ok = {**GOOD, "advantage": -0.25, "group": "g-1", "worker": "rollout-3", "prompt": []}
    assert validate_episodes({"episodes": [ok, GOOD]}, CFG) == [ok, GOOD]


@pytest.mark.parametrize("kwargs", [dict(capacity=0), dict(capacity=99999999999), dict(max_lag=-1), dict(on_full="drop"), dict(vocab_size=0),
                                    dict(token="short"), dict(retry_after_s=0), dict(retry_after_s=float("inf")),
                                    dict(max_wait_s=float("nan"))])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        RolloutServiceConfig(**kwargs)


# --- the buffer (in process) --------------------------------------------------------------------


def test_oldest_version_first_each_episode_once_and_staleness():
    buf = EpisodeBuffer(RolloutServiceConfig(capacity=10, max_lag=1))
    buf.add([episode(i, v) for i, v in enumerate([2, 0, 1, 0, 2, 1])])
    assert buf.sample(7, trainer_version=2) is None  # only 6 buffered; nothing consumed
    got = buf.sample(3, trainer_version=2)
    # versions 0 are 2 behind (> max_lag 1): dropped, never handed out
    assert [(e["group"], e["policy_version"], e["lag"]) for e in got] == [(2, 1, 1), (5, 1, 1), (0, 2, 0)]
    st = buf.stats()
    assert (st["sampled"], st["dropped_stale"], st["size"], st["unaccounted"]) == (3, 2, 1, 0)
    assert [e["group"] for e in buf.sample(1, trainer_version=2)] == [4]
    assert buf.sample(1) is None
    # stale on arrival: accepted and dropped at once, and the answer says so
    res = buf.add([episode(10, 0), episode(11, 2)])
    assert (res.accepted, res.stored, res.dropped_stale, res.trainer_version) == (2, 1, 1, 2)
    st = buf.stats()
    assert st["accepted"] == 8 and st["dropped_stale_on_arrival"] == 1 and st["unaccounted"] == 0


def test_stats_count_a_bounded_number_of_worker_names(monkeypatch):
    """Each new worker name grew ``/stats`` for the life of the service (12.5 MB after 100K names)."""
    from torch_deltasync.integrations.rollout import _buffer

    monkeypatch.setattr(_buffer, "MAX_WORKERS_COUNTED", 2)
    buf = EpisodeBuffer(RolloutServiceConfig(capacity=16, max_lag=5))
    buf.add([{**episode(i, 0), "worker": f"w{i % 4}"} for i in range(8)])
    assert buf.stats()["workers"] == {"w0": 2, "w1": 2, "(others)": 4}


def test_full_ring_rejects_whole_batch_then_evict_mode_counts():
    buf = EpisodeBuffer(RolloutServiceConfig(capacity=4, max_lag=5))
    buf.add([episode(i, 0) for i in range(3)])
    with pytest.raises(BufferFull):
        buf.add([episode(3, 0), episode(4, 0)])  # 3 + 2 > 4: nothing of the batch is taken
    st = buf.stats()
    assert (st["accepted"], st["size"], st["rejected_full"], st["evicted"]) == (3, 3, 2, 0)
    buf.set_version(6)  # versions 0 are now 6 behind: a full ring first drops the stale
    buf.add([episode(5, 6), episode(6, 6)])
    assert buf.stats()["dropped_stale"] == 3

    ev = EpisodeBuffer(RolloutServiceConfig(capacity=4, max_lag=5, on_full="evict"))
    ev.add([episode(i, 0) for i in range(4)])
    res = ev.add([episode(10, 0), episode(11, 0)])
    assert res.evicted == 2
    assert sorted(e["group"] for e in ev.sample(4)) == [2, 3, 10, 11]  # the two oldest were evicted
    st = ev.stats()
    assert (st["accepted"], st["sampled"], st["evicted"], st["size"], st["unaccounted"]) == (6, 4, 2, 0, 0)
    with pytest.raises(EpisodeError):
        ev.add([episode(i, 0) for i in range(5)])  # can never fit


def test_collate_pads_and_masks():
    eps = [{**episode(1, 3, n=2), "lag": 1}, {**episode(2, 4, n=4), "lag": 0}]
    td = collate_episodes(eps, pad_id=15)
    assert td["input_ids"].shape == (2, 8)
    assert td["input_ids"][0].tolist() == eps[0]["prompt"] + eps[0]["completion"] + [15, 15]
    assert td["completion_mask"][0].tolist() == [False] * 4 + [True] * 2 + [False] * 2
    assert td["logprobs"][1, 4:].tolist() == eps[1]["logprobs"]
    assert td["policy_version"].tolist() == [3, 4] and td["lag"].tolist() == [1, 0]


# --- over HTTP ----------------------------------------------------------------------------------


def test_http_errors_are_clear(service):
    url = service.url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{url}/episodes", json={"episodes": [GOOD]})
    assert r.status_code == 401 and r.json()["error"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(f"{url}/episodes", json={"episodes": [GOOD]}, headers={"Authorization": "Bearer wrong-token-x"})
    assert r.status_code == 401
    r = httpx.post(f"{url}/episodes", json={"episodes": [{**GOOD, "completion": [3, 99]}]}, headers=auth)
    assert r.status_code == 422 and "episodes[0].completion[1] is 99" in r.json()["detail"]
    r = httpx.post(f"{url}/episodes", content=b"{not json", headers=auth)
    assert r.status_code == 422 and r.json()["error"] == "invalid_json"
    big = {"episodes": [{**GOOD, "prompt": [1] * 40000}]}  # ~80 KB > max_body_bytes (64 KiB)
    r = httpx.post(f"{url}/episodes", json=big, headers=auth)
    assert r.status_code == 413 and r.json()["error"] == "too_large"

    def chunks():  # no Content-Length: the limit holds while streaming
        yield b'{"episodes": [' + b" " * 40000
        yield b" " * 40000 + b"]}"

    r = httpx.post(f"{url}/episodes", content=chunks(), headers=auth)
    assert r.status_code == 413
    r = httpx.post(f"{url}/episodes", json={"episodes": [GOOD]}, headers=auth)
    assert r.status_code == 200 and r.json()["accepted"] == 1
    r = httpx.post(f"{url}/sample", json={"batch_size": 0}, headers=auth)
    assert r.status_code == 422
    st = httpx.get(f"{url}/stats").json()  # open
    assert st["accepted"] == 1 and st["requests"]["http_401"] == 2 and st["requests"]["http_413"] == 2
    assert st["config"]["token"] == "<set>" and TOKEN not in json.dumps(st)


def test_what_the_http_layer_refuses_loses_nothing(service, tmp_path):
    """A lone surrogate in ``group`` was accepted, then lost its whole batch at /sample (the answer
    could not be encoded); a sample larger than the ring waited out ``wait_s``; a sampler whose
    client had gone took the next episodes into a dead socket."""
    import socket

    url, auth = service.url, {"Authorization": f"Bearer {TOKEN}"}
    raw = b'{"episodes": [{"prompt": [1], "completion": [3], "logprobs": [-0.1], "reward": 1, ' \
          b'"policy_version": 0, "group": "\\ud800"}]}'
    r = httpx.post(f"{url}/episodes", content=raw, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 422 and "episodes[0].group is not valid Unicode (a lone surrogate)" in r.json()["detail"]
    r = httpx.post(f"{url}/sample", json={"batch_size": 65, "wait_s": 30}, headers=auth, timeout=10)
    assert r.status_code == 422 and "batch_size 65 can never be filled from a ring of 64" in r.json()["detail"]

    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"batch_size": 2, "wait_s": 10}).encode()
    with socket.create_connection((host, int(port))) as sock:  # a trainer that dies while /sample waits
        sock.sendall(b"POST /sample HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.5)
    time.sleep(0.5)  # the handler notices within one poll
    with RolloutClient(url, token=TOKEN) as c:
        c.post_episodes([episode(1, 0), episode(2, 0)])
        time.sleep(0.3)
        assert len(c.sample(2)) == 2  # nobody else took them
        st = c.stats()
    assert (st["accepted"], st["sampled"]) == (2, 2)


def test_an_empty_token_file_is_an_error_not_an_open_service(tmp_path, monkeypatch):
    from torch_deltasync.integrations.rollout import read_token

    (tmp_path / "token").write_text(" \n")
    with pytest.raises(ValueError, match=r"token file '.*token' is empty: write the shared token into it"):
        read_token(tmp_path / "token")
    monkeypatch.setenv("DELTASYNC_BUFFER_TOKEN", "longtoken123\n")  # every write was refused (401)
    assert read_token() == "longtoken123"
    monkeypatch.setenv("DELTASYNC_BUFFER_TOKEN", "")
    assert read_token() is None


def test_numbers_json_allows_but_no_float_holds_are_refused_and_leave_the_service_working(service):
    """A 400-digit integer reward and deeply nested arrays were answered with HTTP 500; a trainer
    version of 10**20 was stored, after which every /episodes, /sample and /version failed (500)."""
    url, auth = service.url, {"Authorization": f"Bearer {TOKEN}"}
    body = '{"episodes": [{"prompt": [1], "completion": [2], "logprobs": [-0.1], "reward": 1%s, "policy_version": 0}]}'
    r = httpx.post(f"{url}/episodes", content=body % ("0" * 400), headers=auth)
    assert r.status_code == 422 and "episodes[0].reward is" in r.json()["detail"] and len(r.json()["detail"]) < 200
    r = httpx.post(f"{url}/episodes", content="[" * 20000 + "]" * 20000, headers=auth)
    assert r.status_code == 422 and r.json()["error"] == "invalid_json" and "RecursionError" in r.json()["detail"]
    for lp in (-1e308, -3.5e38):  # stored as float32 -inf: the next /sample failed and lost the batch
        r = httpx.post(f"{url}/episodes", json={"episodes": [{**GOOD, "logprobs": [lp, -1.0]}]}, headers=auth)
        assert r.status_code == 422 and "log-probabilities are finite numbers in [-3.402823e+38, 0]" in r.json()["detail"]
    r = httpx.post(f"{url}/version", json={"version": 10**20}, headers=auth)
    assert r.status_code == 422 and "trainer version must be an integer in [0, 10**12)" in r.json()["detail"]
    assert httpx.post(f"{url}/episodes", json={"episodes": [GOOD]}, headers=auth).status_code == 200
    r = httpx.post(f"{url}/sample", json={"batch_size": 1, "trainer_version": 0}, headers=auth)
    assert r.status_code == 200 and len(r.json()["episodes"]) == 1 and r.json()["trainer_version"] == 0
    st = httpx.get(f"{url}/stats").json()
    assert st["requests"]["http_422"] == 5 and st["trainer_version"] == 0


def test_client_backpressure_and_close(service):
    with RolloutClient(service.url, token=TOKEN) as c:
        assert c.set_version(0) == 0
        # (json's bare "Out of range float values are not JSON compliant" named no episode or field)
        for field, bad, said in [("reward", float("nan"), "'reward' is nan"),
                                 ("logprobs", [-0.5, float("-inf")], "'logprobs'[1] is -inf")]:
            with pytest.raises(ValueError, match=rf"post_episodes: episode 1: {re.escape(said)}; JSON carries finite"):
                c.post_episodes([episode(0, 0), {**episode(1, 0), field: bad}])
        assert c.stats()["accepted"] == 0  # nothing was posted
        eps = [episode(i, 0) for i in range(64)]
        assert c.post_episodes(eps)["stored"] == 64
        with pytest.raises(RolloutServiceError, match="HTTP 429"):
            c.post_episodes([episode(100, 0)], max_wait_s=0.1)  # full; no room within 0.1 s
        refused = c.stats()["rejected_full"]
        done = []
        t = threading.Thread(target=lambda: done.append(c.post_episodes([episode(101, 0)], max_wait_s=60)))
        t.start()
        deadline = time.monotonic() + 60  # until the service has refused the waiting post once
        while c.stats()["rejected_full"] == refused:
            assert time.monotonic() < deadline, "the post never reached the full service"
            threading.Event().wait(0.01)
        assert not done  # refused (429) and still waiting for room
        got = c.sample(8, trainer_version=0)
        t.join(30)
        assert done and done[0]["stored"] == 1
        assert [e["group"] for e in got] == list(range(8))
        assert got[0]["logprobs"] == eps[0]["logprobs"] and got[0]["prompt"] == eps[0]["prompt"]
        assert c.sample(60, wait_s=0.1) is None  # 57 live: fewer than asked, more may come
        c.close_service()
        with pytest.raises(ServiceClosedError):
            c.post_episodes([episode(102, 0)])
        assert len(c.sample(57)) == 57  # draining still works
        st = c.stats()
        assert st["closed"] and st["rejected_closed"] == 1 and st["rejected_full"] >= 2 and st["unaccounted"] == 0


def test_under_load_every_accepted_episode_is_accounted_for(service):
    """4 concurrent posting clients, 2,000 episodes, a sampling trainer that advances its version;
    a small ring (64) forces 429s, and lagging workers make some episodes stale."""
    n_clients, per_client, batch = 4, 500, 10
    posted, results, sampled, errors = {}, [], [], []
    version = [0]

    def worker(k: int) -> None:
        try:
            with RolloutClient(service.url, token=TOKEN) as c:
                for start in range(0, per_client, batch):
                    v = max(0, version[0] - (k % 3))  # workers 1 and 2 lag by 1 and 2 versions
                    eps = [episode(k * 100_000 + start + i, v, worker=f"w{k}") for i in range(batch)]
                    for e in eps:
                        posted[e["group"]] = e
                    results.append(c.post_episodes(eps, max_wait_s=120))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def trainer(stop: threading.Event) -> None:
        try:
            with RolloutClient(service.url, token=TOKEN) as c:
                deadline = time.monotonic() + 60  # let the producers fill the ring first: 429s for sure
                while c.stats()["rejected_full"] == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                while not stop.is_set():
                    got = c.sample(16, trainer_version=version[0], wait_s=0.2)
                    if got:
                        sampled.extend(got)
                        version[0] += 1 if len(sampled) % 64 == 0 else 0
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    stop = threading.Event()
    tt = threading.Thread(target=trainer, args=(stop,))
    tt.start()
    ws = [threading.Thread(target=worker, args=(k,)) for k in range(n_clients)]
    for w in ws:
        w.start()
    for w in ws:
        w.join(300)
    stop.set()
    tt.join(60)
    assert not errors, errors
    with RolloutClient(service.url, token=TOKEN) as c:
        while (got := c.sample(1)) is not None:  # drain
            sampled.append(got[0])
        st = c.stats()
    total = n_clients * per_client
    assert len(posted) == total and sum(r["accepted"] for r in results) == total
    assert st["accepted"] == total
    assert st["sampled"] + st["dropped_stale"] + st["evicted"] + st["size"] == total and st["unaccounted"] == 0
    assert st["evicted"] == 0 and st["size"] == 0  # reject mode never overwrites; drained
    assert st["sampled"] == len(sampled) and st["dropped_stale"] == total - len(sampled)
    assert st["rejected_full"] > 0 and st["requests"]["http_429"] > 0  # back-pressure happened
    assert st["dropped_stale"] > 0  # lagging workers
    ids = [e["group"] for e in sampled]
    assert len(set(ids)) == len(ids)  # each episode at most once
    for e in sampled:  # bit-identical to what was posted (log-probs were float32 values)
        src = posted[e["group"]]
        assert {k: e[k] for k in src} == src and 0 <= e["lag"] <= 1
    assert set(st["workers"]) == {f"w{k}" for k in range(n_clients)}


def test_cli_serve_buffer(tmp_path):
    port_file, token_file = tmp_path / "port", tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "torch_deltasync.cli", "serve-buffer", "--port", "0",
                             "--port-file", str(port_file), "--token-file", str(token_file), "--capacity", "8",
                             "--max-lag", "0", "--vocab-size", "16", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text()):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        assert httpx.get(f"{url}/healthz", timeout=30).json() == {"ok": True}  # listening once the file is there
        with RolloutClient(url, token=TOKEN) as c:
            assert c.post_episodes([episode(1, 3), episode(2, 2)])["stored"] == 2
            got = c.sample(1, trainer_version=3)
            assert got[0]["group"] == 1 and got[0]["lag"] == 0
            st = c.stats()
            assert (st["accepted"], st["sampled"], st["dropped_stale"], st["capacity"]) == (2, 1, 1, 8)
        with RolloutClient(url) as anon:
            with pytest.raises(RolloutServiceError, match="401"):
                anon.post_episodes([episode(3, 3)])
    finally:
        proc.terminate()
        proc.wait(30)
