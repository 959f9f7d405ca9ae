"""vLLM LoRA hot-swap client (``integrations/vllm/_lora.py``) against fakes that record every call:
offline ``LLM``, ``AsyncLLM`` and the HTTP server's ``/v1/load_lora_adapter`` routes. Each version
is loaded under its own name and id from a folder holding exactly that version; old ones are
unloaded; a refused load leaves the current version in place."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from torch_deltasync.errors import DeltaSyncError  # noqa: E402
from torch_deltasync.integrations.vllm import (  # noqa: E402
    VLLMAdapterLoader,
    async_llm_lora_ops,
    llm_lora_ops,
    server_lora_ops,
)
from torch_deltasync.integrations.peft import AdapterSender, adapter_state_dict  # noqa: E402
from torch_deltasync.testing import tiny_qwen3  # noqa: E402


@dataclass
class Req:  # stands in for vllm.lora.request.LoRARequest (same keyword arguments)
    lora_name: str
    lora_int_id: int
    lora_path: str


def snapshot(path: str) -> dict[str, torch.Tensor]:
    """What a loaded adapter folder holds, read with PEFT's own loader (bf16 bit patterns)."""
    m = PeftModel.from_pretrained(tiny_qwen3("tiny", seed=0), path)
    return {n: t.detach().to(torch.bfloat16).view(torch.int16).clone() for n, t in adapter_state_dict(m).items()}


class FakeEngine:
    """Records add_lora / remove_lora like vLLM's LLMEngine; reads each adapter folder when loaded."""

    def __init__(self, refuse: set[str] = frozenset()):
        self.calls, self.held, self.refuse, self.fail = [], {}, refuse, None

    def add_lora(self, req):
        self.calls.append(("add_lora", req.lora_name, req.lora_int_id, req.lora_path))
        if self.fail is not None:
            raise self.fail
        if req.lora_name in self.refuse:
            return False
        self.held[req.lora_int_id] = (req.lora_name, snapshot(req.lora_path))
        return True

    def remove_lora(self, lora_id):
        self.calls.append(("remove_lora", lora_id))
        return self.held.pop(lora_id, None) is not None


class FakeLLM:
    def __init__(self, **kw):
        self.llm_engine = FakeEngine(**kw)


class Trainer:
    def __init__(self, bucket: Path):
        self.model = get_peft_model(tiny_qwen3("tiny", seed=0),
                                    LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        self.opt = torch.optim.Adam([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)
        self.sender = AdapterSender(self.model, bucket, prefix="run")
        self.gen = torch.Generator().manual_seed(0)
        self.states = {}

    def step_and_publish(self) -> int:
        ids = torch.randint(0, 1000, (2, 12), generator=self.gen)
        self.opt.zero_grad()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        v = self.sender.publish()
        self.states[v] = {n: t.detach().to(torch.bfloat16).view(torch.int16).clone()
                          for n, t in adapter_state_dict(self.model).items()}
        return v


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_offline_llm_each_version_new_name_and_id_old_ones_unloaded(tmp_path):
    trainer = Trainer(tmp_path / "bucket")
    llm = FakeLLM()
    loader = VLLMAdapterLoader(llm_lora_ops(llm, request_cls=Req), tmp_path / "bucket", prefix="run",
                               cache_dir=tmp_path / "cache", name="grpo", keep=2)
    assert loader.poll() is None and loader.current is None  # nothing published yet
    with pytest.raises(DeltaSyncError, match="no adapter version"):
        loader.lora_request()
    trainer.step_and_publish()
    first = loader.wait(timeout_s=10)
    assert (first.version, first.lora_name, first.lora_int_id) == (0, "grpo-v0", 1)
    assert loader.poll() is None  # nothing new: no engine call
    trainer.step_and_publish()
    trainer.step_and_publish()  # the loader skips version 1: it loads the newest
    got = loader.poll()
    assert (got.version, got.lora_name, got.lora_int_id) == (2, "grpo-v2", 3)
    trainer.step_and_publish()
    loader.poll()
    eng = llm.llm_engine
    assert eng.calls == [
        ("add_lora", "grpo-v0", 1, str(tmp_path / "cache" / "grpo-v0")),
        ("add_lora", "grpo-v2", 3, str(tmp_path / "cache" / "grpo-v2")),
        ("add_lora", "grpo-v3", 4, str(tmp_path / "cache" / "grpo-v3")),
        ("remove_lora", 1),
    ]
    # each folder held exactly its version when vLLM read it
    assert same(eng.held[3][1], trainer.states[2]) and same(eng.held[4][1], trainer.states[3])
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["grpo-v2", "grpo-v3"]  # v0 deleted
    assert loader.lora_request() == Req("grpo-v3", 4, str(tmp_path / "cache" / "grpo-v3"))
    assert [a.version for a in loader.loaded] == [2, 3]


def test_a_refused_load_keeps_the_current_version(tmp_path):
    trainer = Trainer(tmp_path / "bucket")
    llm = FakeLLM(refuse={"a-v1"})
    loader = VLLMAdapterLoader(llm_lora_ops(llm, request_cls=Req), tmp_path / "bucket", prefix="run",
                               cache_dir=tmp_path / "cache", name="a", id_offset=100)
    trainer.step_and_publish()
    assert loader.poll().lora_int_id == 100
    trainer.step_and_publish()
    with pytest.raises(DeltaSyncError, match="refused"):
        loader.poll()
    assert loader.current.version == 0 and not (tmp_path / "cache" / "a-v1").exists()
    # the refused id is unregistered (vLLM registers it before activating the adapter) and never offered
    # again: vLLM answers add_lora of a registered id with success without loading anything
    assert llm.llm_engine.calls[-2:] == [("add_lora", "a-v1", 101, str(tmp_path / "cache" / "a-v1")),
                                         ("remove_lora", 101)]
    llm.llm_engine.refuse = set()
    assert (loader.poll().lora_int_id, loader.current.version) == (102, 1)  # the same version, a new id
    trainer.step_and_publish()
    assert (loader.poll().lora_int_id, loader.current.version) == (103, 2)  # a later version loads


def test_an_engine_failure_is_not_a_refusal_and_its_id_is_not_offered_again(tmp_path):
    """A dead engine or a timeout is not the adapter's fault: it propagates unchanged (not as the
    DeltaSyncError of a refusal, which callers retry), and the next attempt uses a new id."""
    trainer = Trainer(tmp_path / "bucket")
    llm = FakeLLM()
    loader = VLLMAdapterLoader(llm_lora_ops(llm, request_cls=Req), tmp_path / "bucket", prefix="run",
                               cache_dir=tmp_path / "cache", name="a")
    trainer.step_and_publish()
    llm.llm_engine.fail = TimeoutError("RPC call to add_lora timed out.")
    with pytest.raises(TimeoutError, match="timed out"):
        loader.poll()
    llm.llm_engine.fail = Exception("Call to add_lora method failed: Worker failed with error 'bad adapter'")
    with pytest.raises(DeltaSyncError, match=r"vLLM refused to load LoRA adapter 'a-v0' from .*: Call to add_lora"):
        loader.poll()
    llm.llm_engine.fail = None
    assert loader.poll().lora_int_id == 3 and [c[2] for c in llm.llm_engine.calls if c[0] == "add_lora"] == [1, 2, 3]


def loaded_then_wiped(tmp_path: Path, llm: FakeLLM) -> tuple[Trainer, VLLMAdapterLoader, Trainer]:
    """A loader (stem "g", keep 2) that loaded version 2 of a first run; then the prefix wiped and a
    second run's trainer (other data: other weights at the same versions) that published nothing yet."""
    first = Trainer(tmp_path / "bucket")
    loader = VLLMAdapterLoader(llm_lora_ops(llm, request_cls=Req), tmp_path / "bucket", prefix="run",
                               cache_dir=tmp_path / "cache", name="g", keep=2)
    for _ in range(3):
        first.step_and_publish()
    assert loader.poll().lora_name == "g-v2"
    first.sender.close()
    shutil.rmtree(tmp_path / "bucket" / "run")
    second = Trainer(tmp_path / "bucket")
    second.gen.manual_seed(1)
    return first, loader, second


def test_a_new_run_on_a_wiped_prefix_is_loaded_under_new_names_and_ids(tmp_path):
    """The loader compared version numbers only: after the prefix was wiped and a new run published
    versions 0-2, poll() returned None and the engine went on serving the old run's version 2 (and
    a same-numbered version of the new run would have reused the old one's name and id)."""
    llm = FakeLLM()
    first, loader, second = loaded_then_wiped(tmp_path, llm)
    assert second.step_and_publish() == 0
    got = loader.poll()  # a lower number, but a new run: loaded at once
    assert (got.version, got.lora_name, got.lora_int_id) == (0, "g-r1-v0", 4) and got.run_id == second.sender.run_id
    assert loader.poll() is None
    second.step_and_publish()
    second.step_and_publish()
    assert (loader.poll().lora_name, loader.current.lora_int_id) == ("g-r1-v2", 6)
    eng = llm.llm_engine
    assert [c[:3] for c in eng.calls] == [("add_lora", "g-v2", 3), ("add_lora", "g-r1-v0", 4),
                                          ("add_lora", "g-r1-v2", 6), ("remove_lora", 3)]
    assert same(eng.held[4][1], second.states[0]) and same(eng.held[6][1], second.states[2])
    assert not same(second.states[2], first.states[2])
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["g-r1-v0", "g-r1-v2"]


def test_a_refused_first_version_of_a_new_run_is_tried_again(tmp_path):
    """The engine refused the new run's version 2 (same number as the old run's current one): every
    later poll() returned None while the engine served the old run's adapter."""
    llm = FakeLLM(refuse={"g-r1-v2"})
    _, loader, second = loaded_then_wiped(tmp_path, llm)
    for _ in range(3):
        second.step_and_publish()
    with pytest.raises(DeltaSyncError, match="refused"):
        loader.poll()
    assert loader.current.lora_name == "g-v2"
    llm.llm_engine.refuse = set()  # the engine accepts it now
    got = loader.poll()  # under a new id: 4 was offered (and refused) once
    assert (got.lora_name, got.lora_int_id, got.run_id) == ("g-r1-v2", 5, second.sender.run_id)
    assert same(llm.llm_engine.held[5][1], second.states[2])


def test_async_llm(tmp_path):
    trainer = Trainer(tmp_path / "bucket")
    calls = []

    class FakeAsyncLLM:
        async def add_lora(self, req):
            calls.append(("add_lora", req.lora_name, req.lora_int_id))
            return True

        async def remove_lora(self, lora_id):
            calls.append(("remove_lora", lora_id))
            return True

    loader = VLLMAdapterLoader(async_llm_lora_ops(FakeAsyncLLM(), request_cls=Req), tmp_path / "bucket",
                               prefix="run", cache_dir=tmp_path / "cache", keep=1)

    async def run():
        for _ in range(3):
            trainer.step_and_publish()
            await loader.apoll()

    asyncio.run(run())
    assert calls == [("add_lora", "adapter-v0", 1), ("add_lora", "adapter-v1", 2), ("remove_lora", 1),
                     ("add_lora", "adapter-v2", 3), ("remove_lora", 2)]


class _Recorder(BaseHTTPRequestHandler):
    calls: list = []
    status = 200

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append((self.path, body, self.headers.get("Authorization")))
        if self.path == "/v1/load_lora_adapter":
            type(self).calls[-1] += (snapshot(body["lora_path"]),)
        self.send_response(type(self).status)
        self.end_headers()
        self.wfile.write(b"Success" if type(self).status == 200 else b'{"error": "nope"}')

    def log_message(self, *args):
        pass


def test_http_server_routes(tmp_path):
    trainer = Trainer(tmp_path / "bucket")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        _Recorder.calls, _Recorder.status = [], 200
        loader = VLLMAdapterLoader(server_lora_ops(url, api_key="k-123"), tmp_path / "bucket", prefix="run",
                                   cache_dir=tmp_path / "cache", keep=1)
        for _ in range(2):
            trainer.step_and_publish()
            loader.poll()
        (p0, b0, a0, s0), (p1, b1, a1, s1), (p2, b2, a2) = _Recorder.calls
        assert (p0, b0, a0) == ("/v1/load_lora_adapter",
                                {"lora_name": "adapter-v0", "lora_path": str(tmp_path / "cache" / "adapter-v0")},
                                "Bearer k-123")
        assert p1 == "/v1/load_lora_adapter" and b1["lora_name"] == "adapter-v1"
        assert (p2, b2) == ("/v1/unload_lora_adapter", {"lora_name": "adapter-v0"})
        assert same(s0, trainer.states[0]) and same(s1, trainer.states[1])
        _Recorder.status = 404
        trainer.step_and_publish()
        with pytest.raises(DeltaSyncError, match="HTTP 404.*VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
            loader.poll()
        assert loader.current.version == 1
    finally:
        server.shutdown()


def test_real_lora_request_class(tmp_path):
    """The default request class is vLLM's own ``LoRARequest`` (needs vllm importable)."""
    from vllm.lora.request import LoRARequest

    trainer = Trainer(tmp_path / "bucket")
    trainer.step_and_publish()
    llm = FakeLLM()
    loader = VLLMAdapterLoader(llm_lora_ops(llm), tmp_path / "bucket", prefix="run", cache_dir=tmp_path / "c")
    loader.poll()
    req = loader.lora_request()
    assert isinstance(req, LoRARequest) and (req.lora_name, req.lora_int_id) == ("adapter-v0", 1)
    assert req.lora_path == str(tmp_path / "c" / "adapter-v0")


def test_loader_without_load_and_unload_ops_is_refused(tmp_path):
    from torch_deltasync.integrations.vllm import VLLMAdapterLoader

    with pytest.raises(TypeError, match=r"ops lacks \['load', 'unload'\]; build them with llm_lora_ops"):
        VLLMAdapterLoader({}, str(tmp_path / "b"), cache_dir=tmp_path / "c")


def test_a_version_with_non_finite_values_is_never_offered_to_the_engine(tmp_path):
    """In vLLM's CPU LoRA kernels one NaN adapter turns later requests without any adapter into NaN
    (a break-test found it on the live engine): such a version is refused before ``add_lora``, every
    poll, and the next finite version loads."""
    trainer = Trainer(tmp_path / "bucket")
    llm = FakeLLM()
    loader = VLLMAdapterLoader(llm_lora_ops(llm, request_cls=Req), tmp_path / "bucket", prefix="run",
                               cache_dir=tmp_path / "cache", name="a")
    trainer.step_and_publish()
    assert loader.poll().version == 0
    b = next(t for n, t in adapter_state_dict(trainer.model).items() if n.endswith("lora_B.weight"))
    with torch.no_grad():
        saved, b[0, 0] = b[0, 0].item(), float("nan")
    assert trainer.sender.publish() == 1
    for _ in range(2):
        with pytest.raises(DeltaSyncError, match=r"version 1 of the adapter holds non-finite values \(1 in "
                                                 r"'base_model.model.*lora_B.weight'; a diverged trainer\?\); not loaded"):
            loader.poll()
        assert loader.current.version == 0 and [c[1] for c in llm.llm_engine.calls] == ["a-v0"]
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["a-v0"]
    with torch.no_grad():
        b[0, 0], b[0, 1] = saved, float("inf")
    assert trainer.sender.publish() == 2
    with pytest.raises(DeltaSyncError, match=r"version 2 of the adapter holds non-finite values \(1 in"):
        loader.poll()
    with torch.no_grad():
        b[0, 1] = 0.0
    assert trainer.step_and_publish() == 3
    assert loader.poll().version == 3 and same(llm.llm_engine.held[4][1], trainer.states[3])
