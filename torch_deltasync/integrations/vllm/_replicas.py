"""Engines with several vLLM replicas (torchrl's ``AsyncVLLM``: one Ray actor per replica) driven
like one offline ``vllm.LLM``, so :func:`~torch_deltasync.integrations.vllm.attach_llm` /
:func:`~torch_deltasync.integrations.vllm.update_llm` are the one implementation of the update
for both: every worker of every replica stages, verifies and commits each version through its
``deltasync`` backend.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from ...errors import DeltaSyncError

log = logging.getLogger(__name__)


def _resolve(result: Any) -> Any:
    """Wait for one ``collective_rpc`` result: a Ray future, a ``concurrent.futures.Future``, an
    awaitable, or already a value."""
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    if type(result).__name__ == "ObjectRef":  # Ray, imported only when one is seen
        import ray

        return ray.get(result)
    if callable(getattr(result, "result", None)) and callable(getattr(result, "done", None)):
        return result.result()
    return result


async def _await(x: Any) -> Any:
    return await x


class ReplicatedEngine:
    """``vllm.LLM``'s weight-transfer surface (what :func:`~torch_deltasync.integrations.vllm.attach_llm`
    and :func:`~torch_deltasync.integrations.vllm.update_llm` drive) over an engine whose
    ``collective_rpc`` returns one result per replica: torchrl's ``AsyncVLLM`` (Ray actors, one per
    replica, ``modules/llm/backends/vllm/vllm_async.py``) or anything shaped like it.

    Replicas of such an engine share worker ranks, so their readiness files would collide: attach
    it with ``status_dir=False`` (:func:`as_llm` says which engines need this). Every replica
    stages and verifies each version itself (the backend's all-or-nothing commit, per replica).

    Each call is vLLM's own worker method of the same name (``vllm/v1/worker/gpu_worker.py``), run by
    every worker of every replica through its ``deltasync`` backend; every replica's result is
    awaited before the first error is raised, so no replica is left in the middle of a call. There
    is no engine-wide pause: vLLM runs ``collective_rpc`` between engine steps, and torchrl's own
    storage-based path (``VLLMDoubleBufferWeightReceiver``) does not pause either. The weight version
    is not set on the replicas (no worker method does that).

    Args:
        engine: the multi-replica engine (``collective_rpc(method, timeout=, args=, kwargs=)``
            returning one result per replica: a Ray ``ObjectRef``, a future, an awaitable or a value).
        timeout: seconds for each ``collective_rpc`` (``None``: the engine's).

    Raises (from each call):
        DeltaSyncError: ``init_weight_transfer_engine`` found workers that do not run the
            ``deltasync`` backend (the message says how to launch them); otherwise the first
            replica's error as raised there.

    Example:
        >>> llm, readiness = as_llm(async_vllm)            # a ReplicatedEngine, readiness False
        >>> attach_llm(llm, "s3://bucket/grpo", "run1", status_dir=False)
        >>> update_llm(llm, 12)
    """

    def __init__(self, engine: Any, timeout: float | None) -> None:
        self.engine, self.timeout = engine, timeout

    def _all(self, method: str, kwargs: dict | None = None) -> list[Any]:
        """``method`` on every worker of every replica; waits for every replica, then raises the
        first error (so no replica is left in the middle of a call)."""
        call: dict[str, Any] = {"args": (), "kwargs": dict(kwargs or {})}
        if self.timeout is not None:
            call["timeout"] = self.timeout
        result = self.engine.collective_rpc(method, **call)
        items = list(result) if isinstance(result, (list, tuple)) else [result]
        out, errors = [], []
        for r in items:
            try:
                out.append(_resolve(r))
            except Exception as e:  # noqa: BLE001 (raised below, after every replica answered)
                errors.append(e)
        if errors:
            raise errors[0]
        return out

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        try:
            self._all("init_weight_transfer_engine", {"init_info": request["init_info"]})
        except Exception as e:
            if "Invalid init_info for" in str(e) and "DeltaSync" not in str(e):
                raise DeltaSyncError(
                    f"the engine's workers do not run the deltasync weight-transfer backend ({e}): launch them "
                    "with weight_transfer_config={'backend': 'deltasync'}; torchrl 0.14's AsyncVLLM actor sets "
                    "'nccl' itself (docs/torchrl.md)") from e
            raise

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, request: dict[str, Any]) -> None:
        self._all("update_weights", {"update_info": request["update_info"]})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool | None:
        # Prefix caches are keyed by prompt content, not by weights: entries computed with the old
        # weights would be reused. Retried once, as torchrl's double-buffer receiver does.
        reset = getattr(self.engine, "reset_prefix_cache", None)
        if not callable(reset):
            return None
        ok = _resolve(reset())
        if ok is False:
            ok = _resolve(reset())
        if ok is False:
            log.warning("reset_prefix_cache could not clear the prefix cache of every replica")
        return ok


def is_offline_llm(engine: Any) -> bool:
    """A ``vllm.LLM`` (or its shape): one engine with vLLM's weight-transfer methods."""
    return all(callable(getattr(engine, m, None)) for m in ("init_weight_transfer_engine", "start_weight_update",
                                                            "update_weights", "finish_weight_update")) and \
        hasattr(engine, "llm_engine")




def as_llm(engine: Any, timeout: float | None = None) -> tuple[Any, bool]:
    """What :func:`~torch_deltasync.integrations.vllm.update_llm` drives for ``engine``.

    Args:
        engine: an offline ``vllm.LLM`` (driven as it is) or a multi-replica engine (wrapped in
            :class:`ReplicatedEngine`).
        timeout: ``collective_rpc`` timeout for a multi-replica engine (seconds).

    Returns:
        ``(llm, readiness)``: the object to attach and update, and whether its workers can keep
        readiness files (``False`` for replicas: pass ``status_dir=False`` to ``attach_llm``).
    """
    if is_offline_llm(engine):
        return engine, True
    return ReplicatedEngine(engine, timeout), False
