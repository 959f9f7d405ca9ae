"""Scripted vLLM engines for the client-side tests (``.venv``, vLLM 0.33 CPU oracle, no inference).

The weight path is real: every worker holds a real ``DeltaSyncWeightTransferEngine`` (made by vLLM's
``WeightTransferEngineFactory`` from the backend name, as a vLLM worker does) over a real vLLM model
built at its TP rank by :mod:`torch_deltasync.testing_vllm`. What is scripted is what sits around it:
the worker's four weight-transfer methods (``vllm/v1/worker/gpu_worker.py``, 0.32 and 0.33 alike),
and the engine front ends (``vllm.LLM``'s ``RLOfflineMixin``, ``AsyncLLM``), which record every call
so that tests can check the order of the protocol.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

import torch_deltasync.integrations.vllm._backend as vllm_transfer
from torch_deltasync.testing_vllm import build_vllm_model, load_hf_weights, vllm_state_bits


class ScriptedWorker:
    """vLLM's ``Worker`` weight-transfer methods around a real ``deltasync`` backend engine.

    Args:
        vllm_cfg: the engine's ``VllmConfig`` (``testing_vllm.vllm_config``).
        rank, tp: this worker's TP rank and the TP size (the model is built for them).
        weights: HF tensors the engine loaded at start (``load_weights``), or ``None``.
        backend: the engine's ``weight_transfer_config`` backend.
    """

    def __init__(self, vllm_cfg: Any, rank: int, tp: int, weights: dict[str, torch.Tensor] | None = None, *,
                 backend: str = "deltasync") -> None:
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        vllm_transfer.register()
        self.rank = rank
        self.model = build_vllm_model(vllm_cfg, rank, tp)
        if weights is not None:
            load_hf_weights(self.model, weights)
        self.engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend=backend), vllm_cfg, torch.device("cpu"), self.model)
        self._active = False

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        # One process holds every rank here, without torch.distributed: the backend reads the rank
        # (for its readiness file) from the process group, so give it this worker's.
        with mock.patch.object(vllm_transfer, "_worker_rank", lambda: self.rank):
            self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        if self._active:
            raise RuntimeError("start_weight_update called while a weight update is already active. "
                               "Call finish_weight_update first.")
        self.engine.start_weight_update()
        self._active = True

    def update_weights(self, update_info: dict) -> None:
        if not self._active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            # WeightTransferEngine.update_weights minus its torch.accelerator.synchronize(), which
            # needs a device (a no-op for CPU tensors).
            self.engine.receive_weights(self.engine.parse_update_info(update_info))
        except BaseException:
            self._active = False  # as vLLM's worker: the session ends with the error
            raise

    def finish_weight_update(self) -> None:
        if not self._active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.engine.finish_weight_update()
        self._active = False

    def shutdown_weight_transfer_engine(self) -> None:
        self.engine.shutdown()

    def bits(self) -> dict[str, torch.Tensor]:
        """Every parameter of this worker's model as an integer bit view."""
        return vllm_state_bits(self.model)


class ScriptedLLM:
    """The surface of ``vllm.LLM`` the helpers use (``entrypoints/rl/offline.py``): every RL call is a
    ``collective_rpc`` over the workers, the weight version lives on the engine. Records calls."""

    def __init__(self, workers: list[ScriptedWorker]) -> None:
        self.workers = workers
        self.calls: list[tuple] = []
        self.weight_version = "0"
        self.llm_engine = SimpleNamespace()  # what marks a vllm.LLM (torchrl integration)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """Every worker runs ``method`` (as vLLM's executor broadcasts it); the first error is raised."""
        results, errors = [], []
        for w in self.workers:
            try:
                results.append(getattr(w, method)(*args, **(kwargs or {})))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]
        return results

    def init_weight_transfer_engine(self, request):
        self.calls.append(("init_weight_transfer_engine",))
        info = request["init_info"] if isinstance(request, dict) else request.init_info
        self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})

    def start_weight_update(self):
        self.calls.append(("start_weight_update",))
        self.collective_rpc("start_weight_update")

    def update_weights(self, request):
        info = request["update_info"] if isinstance(request, dict) else request.update_info
        self.calls.append(("update_weights", info))
        self.collective_rpc("update_weights", kwargs={"update_info": info})

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish_weight_update", weight_version))
        self.collective_rpc("finish_weight_update")
        if weight_version is not None:
            self.weight_version = weight_version

    def get_weight_version(self):
        return self.weight_version

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return True

    def shutdown(self):
        for w in self.workers:
            w.shutdown_weight_transfer_engine()


class ScriptedAsyncLLM:
    """The surface of ``AsyncLLM`` the helpers and vLLM's RL HTTP routes use; records calls."""

    def __init__(self, workers: list[ScriptedWorker]) -> None:
        self.llm = ScriptedLLM(workers)
        self.calls = self.llm.calls
        self.paused = False

    async def init_weight_transfer_engine(self, request):
        self.llm.init_weight_transfer_engine({"init_info": request.init_info})

    async def start_weight_update(self):
        self.llm.start_weight_update()

    async def update_weights(self, request):
        self.llm.update_weights({"update_info": request.update_info})

    async def finish_weight_update(self, weight_version=None):
        self.llm.finish_weight_update(weight_version)

    async def get_weight_version(self):
        return self.llm.weight_version

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        self.calls.append(("pause_generation", mode, clear_cache))
        self.paused = True

    async def resume_generation(self):
        self.calls.append(("resume_generation",))
        self.paused = False

    async def is_paused(self):
        return self.paused


class RLServer:
    """vLLM 0.33's own RL routes (``vllm.entrypoints.rl.online.api_router``) over a
    :class:`ScriptedAsyncLLM`, served by uvicorn on 127.0.0.1 in a thread.

    Errors are answered as vLLM's server answers them (``create_error_response``: ``{"error":
    {"message", "type", "code"}}``); ``requests`` records every (method, path, query).
    """

    def __init__(self, engine: ScriptedAsyncLLM) -> None:
        import uvicorn
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse
        from vllm.entrypoints.rl.online.api_router import router
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        app = FastAPI()
        app.state.engine_client = engine
        app.include_router(router)
        self.requests: list[tuple[str, str, str]] = []

        @app.middleware("http")
        async def record(request: Request, call_next):
            self.requests.append((request.method, request.url.path, request.url.query))
            return await call_next(request)

        @app.exception_handler(Exception)
        async def error(request: Request, exc: Exception):  # vllm/entrypoints/serve/exception_handling
            err = create_error_response(exc)
            return JSONResponse(err.model_dump(), status_code=err.error.code)

        # Bound before the thread starts: connections wait in the backlog until uvicorn accepts.
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[self._sock])),
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()
