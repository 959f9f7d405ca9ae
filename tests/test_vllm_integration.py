"""DeltaWorkerExtension and the client update protocol, without running vLLM inference (CPU).

The workers are real vLLM models built on CPU at each TP rank (``testing_vllm``) with the extension
mixed in, as vLLM does with ``worker_extension_cls``. The engines are fakes that forward
``collective_rpc`` to those workers (through JSON for the HTTP server, as vLLM's dev endpoint does)
and record every call, so the protocol's order and arguments are checked, and the weights are
checked bitwise against vLLM's own ``load_weights``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import parse_qs, urlparse

import pytest
import torch

import vllm  # noqa: F401  the CPU oracle; tools/setup.sh installs it, so a missing wheel fails here

from torch_deltasync import ChecksumMismatchError, DeltaSender, LocalStore, VersionNotFoundError  # noqa: E402
from torch_deltasync.integrations.vllm import (  # noqa: E402
    DeltaWorkerExtension,
    attach_async_llm,
    attach_llm,
    attach_server,
    check_worker_checksums,
    update_async_llm,
    update_llm,
    update_server,
)
from torch_deltasync.testing import adam_step  # noqa: E402
from torch_deltasync.testing_vllm import (  # noqa: E402
    TINY_VLLM_CONFIGS,
    build_vllm_model,
    hf_model,
    load_hf_weights,
    vllm_config,
    vllm_state_bits,
)

CPU_MOE = ["TRITON", "BATCHED_TRITON", "CPU"]
TP = 2


class FakeWorker(DeltaWorkerExtension):
    """What vLLM's worker looks like to the extension: ``model_runner.get_model()`` and ``rank``."""

    def __init__(self, model, rank: int) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.rank = rank
        self.device = torch.device("cpu")


class FakeLLM:
    """Offline ``vllm.LLM`` surface the protocol uses; records calls."""

    def __init__(self, workers) -> None:
        self.workers, self.calls = workers, []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method, tuple(args), dict(kwargs or {})))
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level, mode))

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return True

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return True


class FakeAsyncLLM:
    """``AsyncLLM`` surface the protocol uses; records calls."""

    def __init__(self, workers) -> None:
        self.workers, self.calls = workers, []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method))
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        self.calls.append(("pause_generation", mode, clear_cache))

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return True

    async def resume_generation(self):
        self.calls.append(("resume_generation",))


@pytest.fixture
def engine_setup(tmp_path):
    """A run with an anchor and 2 deltas, and TP workers that loaded the anchor with vLLM."""
    spec = TINY_VLLM_CONFIGS["qwen2"]
    hf = hf_model(spec, seed=11)
    store = LocalStore(tmp_path / "bucket")
    sender = DeltaSender(hf, store, anchor_every=1000)
    anchor = {n: t.detach().to(torch.bfloat16) for n, t in hf.state_dict().items()}
    versions = [sender.publish()]
    opt = torch.optim.Adam(hf.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        adam_step(hf, opt, batch=2, seq=16, generator=g)
        versions.append(sender.publish())
    final = {n: t.detach().to(torch.bfloat16) for n, t in hf.state_dict().items()}
    vc = vllm_config(spec, tmp_path / "cfg")
    workers = []
    for r in range(TP):
        m = build_vllm_model(vc, r, TP)
        load_hf_weights(m, anchor)
        workers.append(FakeWorker(m, r))

    def reference(r):
        ref = build_vllm_model(vc, r, TP)
        load_hf_weights(ref, final)
        return vllm_state_bits(ref)

    return SimpleNamespace(store=store, versions=versions, workers=workers, reference=reference, path=tmp_path)


def _assert_matches(setup):
    for r, w in enumerate(setup.workers):
        got = vllm_state_bits(w._deltasync_model())
        ref = setup.reference(r)
        bad = [n for n in ref if not torch.equal(got[n], ref[n])]
        assert not bad, f"rank {r}: {bad[:5]}"


def test_offline_llm_protocol(engine_setup):
    s = engine_setup
    llm = FakeLLM(s.workers)
    attached = attach_llm(llm, str(s.path / "bucket"), assume_version=s.versions[0], moe_backends=CPU_MOE)
    assert [a["rank"] for a in attached] == [0, 1] and {a["version"] for a in attached} == {s.versions[0]}
    llm.calls.clear()

    out = update_llm(llm)
    assert out.version == s.versions[-1] and out.verified and not out.recovered and out.cache_reset
    assert [w["version"] for w in out.workers] == [s.versions[-1]] * TP
    assert all(w["stats"]["path"] == "delta" and w["stats"]["changed"] > 0 for w in out.workers)
    steps = [c[:2] if c[0] == "rpc" else c for c in llm.calls]
    assert steps == [
        ("rpc", "deltasync_status"),  # newest version, chosen once for all workers
        ("sleep", 0, "wait"),
        ("rpc", "deltasync_update"),
        ("rpc", "deltasync_checksums"),
        ("reset_prefix_cache", True),
        ("wake_up", ["scheduling"]),
    ]
    assert llm.calls[2][2] == (s.versions[-1],)
    _assert_matches(s)
    json.dumps(out.to_dict())  # JSON-able results (they also travel over HTTP)


def test_wrong_assumed_version_is_caught(engine_setup):
    s = engine_setup
    with pytest.raises(ChecksumMismatchError):
        attach_llm(FakeLLM(s.workers), str(s.path / "bucket"), assume_version=s.versions[1], moe_backends=CPU_MOE)


def test_corruption_is_detected_and_recovered_from_the_anchor(engine_setup):
    s = engine_setup
    llm = FakeLLM(s.workers)
    attach_llm(llm, str(s.path / "bucket"), assume_version=s.versions[0], moe_backends=CPU_MOE)
    update_llm(llm, s.versions[1])
    # Bits flip in rank 1's weights behind the receiver's back (more than the next delta rewrites).
    p = s.workers[1]._deltasync_model().model.layers[0].mlp.down_proj.weight
    p.data.view(torch.int16).bitwise_xor_(1)
    with pytest.raises(ChecksumMismatchError):
        check_worker_checksums(llm.collective_rpc("deltasync_checksums"))
    with pytest.raises(ChecksumMismatchError):
        update_llm(llm, s.versions[2], recover=False)
    assert llm.calls[-1] == ("wake_up", ["scheduling"])  # resumed even though it failed
    out = update_llm(llm, s.versions[2])
    assert out.recovered and out.verified
    assert all(w["stats"]["path"] == "anchor" for w in out.workers)
    _assert_matches(s)


def test_resume_runs_when_the_update_fails(engine_setup):
    s = engine_setup
    llm = FakeLLM(s.workers)
    attach_llm(llm, str(s.path / "bucket"), assume_version=s.versions[0], moe_backends=CPU_MOE)
    llm.calls.clear()
    with pytest.raises(VersionNotFoundError):
        update_llm(llm, 999, mode="keep")
    assert llm.calls[0] == ("sleep", 0, "keep") and llm.calls[-1] == ("wake_up", ["scheduling"])


def test_async_llm_protocol(engine_setup):
    s = engine_setup
    engine = FakeAsyncLLM(s.workers)

    async def run():
        await attach_async_llm(engine, str(s.path / "bucket"), assume_version=s.versions[0], moe_backends=CPU_MOE)
        engine.calls.clear()
        return await update_async_llm(engine, mode="keep")

    out = asyncio.run(run())
    assert out.version == s.versions[-1] and out.verified
    assert engine.calls == [
        ("rpc", "deltasync_status"),
        ("pause_generation", "keep", True),
        ("rpc", "deltasync_update"),
        ("rpc", "deltasync_checksums"),
        ("reset_prefix_cache", True),
        ("resume_generation",),
    ]
    _assert_matches(s)


def _serve(workers, log):
    """A stand-in for ``vllm serve`` with VLLM_SERVER_DEV_MODE=1: the dev/RL routes the protocol
    uses, with collective_rpc args and results going through JSON as vLLM's do."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            url = urlparse(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            log.append((url.path, query, json.loads(body) if body else None))
            if url.path == "/collective_rpc":
                req = json.loads(body)
                try:
                    results = [getattr(w, req["method"])(*req.get("args", []), **req.get("kwargs", {})) for w in workers]
                except Exception as e:  # vLLM answers 500 with the error text
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(str(e).encode())
                    return
                payload = {"results": results}
            elif url.path == "/reset_prefix_cache":
                payload = {"success": True}
            elif url.path in ("/pause", "/resume"):
                payload = None
            else:
                self.send_response(404)
                self.end_headers()
                return
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_http_server_protocol(engine_setup):
    s = engine_setup
    log: list = []
    server = _serve(s.workers, log)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        attach_server(url, str(s.path / "bucket"), assume_version=s.versions[0], moe_backends=CPU_MOE, timeout=60)
        log.clear()
        out = update_server(url, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert out.version == s.versions[-1] and out.verified and out.cache_reset
    assert [(p, q) for p, q, _ in log] == [
        ("/collective_rpc", {}),
        ("/pause", {"mode": "wait", "clear_cache": "true"}),
        ("/collective_rpc", {}),
        ("/collective_rpc", {}),
        ("/reset_prefix_cache", {"reset_running_requests": "true"}),
        ("/resume", {}),
    ]
    assert [b["method"] for p, _, b in log if p == "/collective_rpc"] == [
        "deltasync_status", "deltasync_update", "deltasync_checksums"]
    assert log[2][2]["args"] == [s.versions[-1]]
    _assert_matches(s)
