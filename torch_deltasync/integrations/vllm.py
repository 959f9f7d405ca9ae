"""vLLM integration: a worker extension that applies versions in place, and the client side of the
update protocol for an offline ``LLM``, an ``AsyncLLM`` and the OpenAI-compatible HTTP server.

Architecture (no vLLM fork; ``docs/research/vllm-layout.md`` §1, §6)::

    trainer ──DeltaSender──▶ store ◀──DeltaReceiver(VLLMTarget)── each vLLM worker (TP rank)
                                        ▲  deltasync_* methods, called through collective_rpc
    client (this module): pause ─▶ collective_rpc("deltasync_update", v) ─▶ reset prefix cache
                          ─▶ collective_rpc("deltasync_checksums") (combined, checked) ─▶ resume

Launch the engine with the extension; every worker then has the ``deltasync_*`` methods::

    LLM(model=..., tensor_parallel_size=4,
        worker_extension_cls="torch_deltasync.integrations.vllm.DeltaWorkerExtension")
    # or: VLLM_SERVER_DEV_MODE=1 vllm serve <model> -tp 4 \\
    #         --worker-extension-cls torch_deltasync.integrations.vllm.DeltaWorkerExtension

and drive it with :func:`attach_llm` / :func:`update_llm` (offline), :func:`attach_async_llm` /
:func:`update_async_llm` (``AsyncLLM``), or :func:`attach_server` / :func:`update_server` (HTTP,
needs ``VLLM_SERVER_DEV_MODE=1`` for ``/collective_rpc``, ``/pause``, ``/resume`` and
``/reset_prefix_cache``; bind such a server to a trusted network: ``/collective_rpc`` can call any
worker method).

Every worker downloads and applies the same version independently from the store; the client only
sends JSON-able control messages (collective_rpc's data-plane rule). After an update the prefix
cache is reset with ``reset_running_requests=True``: cached KV was computed with the old weights,
and kept requests recompute theirs under the new ones.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

import torch

from ..checksum import check_partials, format_checksum, parse_checksum
from ..errors import ChecksumMismatchError, DeltaSyncError

__all__ = ["DeltaWorkerExtension", "EngineUpdate", "attach_llm", "update_llm", "attach_async_llm",
           "update_async_llm", "attach_server", "update_server", "check_worker_checksums"]

PauseMode = Literal["wait", "keep", "abort"]


class DeltaWorkerExtension:
    """Methods mixed into every vLLM worker (``worker_extension_cls``), called by ``collective_rpc``.

    vLLM appends this class to the worker's bases, so ``self`` is the worker (``model_runner``,
    ``rank``, ``device``). All names start with ``deltasync_`` (vLLM refuses extensions whose
    attributes clash with the worker's). Arguments and results are JSON-able, so the same calls
    work through the HTTP server's ``/collective_rpc``. The base is ``object`` at runtime, as in
    TRL, verl and PRIME-RL.

    The receiver is built lazily on :meth:`deltasync_attach` (after the model is loaded); the RPCs
    run on the worker's main thread between forward passes, never concurrently with one.
    """

    _deltasync_receiver: Any = None

    # --- lifecycle -------------------------------------------------------------------------------

    def deltasync_attach(self, store: str, prefix: str = "", *, assume_version: int | None = None,
                         strict: bool = True, max_workers: int = 8, metrics_path: str | None = None,
                         moe_backends: list[str] | None = None) -> dict[str, Any]:
        """Follow the run at ``store`` / ``prefix`` (any :func:`torch_deltasync.open_store` URI).

        Args:
            store: store URI or path, as the sender's.
            prefix: the run's sub-path.
            assume_version: the engine already holds this version bit-exactly (it loaded the
                checkpoint the trainer published as that version), so the first update takes the
                delta path. Check the claim with :func:`check_worker_checksums` (the client
                helpers do when given ``assume_version``).
            strict: see :class:`~torch_deltasync.targets.vllm.VLLMTarget`.
            max_workers: parallel downloads per worker.
            metrics_path: append one JSON line per update (``{rank}`` is replaced by the rank).
            moe_backends: override the accepted MoE backends (see ``VLLMTarget``).

        Returns:
            ``{"rank": int, "version": int | None}``.
        """
        from ..receiver import DeltaReceiver
        from ..targets.vllm import DEFAULT_MOE_BACKENDS, VLLMTarget

        tp_rank, tp_size = _tp_rank_size()
        target = VLLMTarget(self._deltasync_model(), strict=strict, tp_rank=tp_rank, tp_size=tp_size,
                            moe_backends=tuple(moe_backends) if moe_backends else DEFAULT_MOE_BACKENDS)
        rank = self._deltasync_rank()
        metrics = metrics_path.replace("{rank}", str(rank)) if metrics_path else None
        old = self._deltasync_receiver
        self._deltasync_receiver = DeltaReceiver(target, store, prefix=prefix, max_workers=max_workers,
                                                 metrics_path=metrics)
        if old is not None:
            old.close()
        if assume_version is not None:
            self._deltasync_receiver.assume(int(assume_version))
        return {"rank": rank, "version": self._deltasync_receiver.version}

    def deltasync_detach(self) -> dict[str, Any]:
        """Stop following the run (the weights stay as they are)."""
        if self._deltasync_receiver is not None:
            self._deltasync_receiver.close()
        self._deltasync_receiver = None
        return {"rank": self._deltasync_rank()}

    # --- updates ---------------------------------------------------------------------------------

    def deltasync_status(self) -> dict[str, Any]:
        """``{"rank", "version" (held), "newest" (visible in the store)}``."""
        r = self._deltasync_require()
        return {"rank": self._deltasync_rank(), "version": r.version, "newest": r.newest_version()}

    @torch.no_grad()
    def deltasync_update(self, version: int | None = None) -> dict[str, Any]:
        """Apply ``version`` (the newest visible when ``None``), all or nothing on this worker.

        Returns:
            ``{"rank", "version", "stats"}``; ``stats`` is :class:`~torch_deltasync.UpdateStats`
            as a dict (times in ms), ``None`` when nothing had to change.

        Raises:
            Everything :meth:`DeltaReceiver.update` raises; the worker's weights are unchanged then.
        """
        r = self._deltasync_require()
        before = r.last_stats
        v = r.update(None if version is None else int(version))
        dev = getattr(self, "device", None)
        if dev is not None and torch.device(dev).type == "cuda":
            torch.cuda.synchronize(dev)  # writes landed before the engine resumes
        stats = r.last_stats.to_dict() if r.last_stats is not None and r.last_stats is not before else None
        return {"rank": self._deltasync_rank(), "version": v, "stats": stats}

    def deltasync_reset(self) -> dict[str, Any]:
        """Forget which version is held, so the next update rebuilds from an anchor (recovery)."""
        r = self._deltasync_require()
        r.version = None
        return {"rank": self._deltasync_rank()}

    def deltasync_checksums(self) -> dict[str, Any]:
        """This worker's partial checksums of the version it holds (``O(local parameters)``).

        Returns:
            ``{"rank", "version", "partials": {name: hex}, "expected": {name: hex}}``: the
            partials of all workers of the engine add up (mod 2^64) to ``expected`` (the
            manifest's); names vLLM drops are left out of both.
        """
        r = self._deltasync_require()
        partials = r.partial_checksums()
        ignored = set(getattr(r.target, "ignored", ()))
        m = r.manifest(r.version)
        return {
            "rank": self._deltasync_rank(),
            "version": r.version,
            "partials": {n: format_checksum(c) for n, c in partials.items() if n not in ignored},
            "expected": {t.name: format_checksum(t.checksum) for t in m.tensors if t.name not in ignored},
        }

    # --- helpers (prefixed: the worker class must not already have these names) ------------------

    def _deltasync_model(self) -> torch.nn.Module:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _deltasync_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def _deltasync_require(self):
        if self._deltasync_receiver is None:
            raise DeltaSyncError("call deltasync_attach(store, prefix) on the workers first")
        return self._deltasync_receiver


def _tp_rank_size() -> tuple[int | None, int | None]:
    """The worker's TP rank and size from vLLM's parallel state, ``(None, None)`` if unavailable."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except Exception:  # not initialised (tests build models without torch.distributed)
        return None, None


# --- client side -----------------------------------------------------------------------------------

@dataclass
class EngineUpdate:
    """What one update of an engine did.

    Attributes:
        version: the version every worker now holds.
        workers: each worker's ``deltasync_update`` result (rank, version, stats), in rank order.
        verified: whether the combined partial checksums were checked against the manifest.
        recovered: a checksum mismatch was repaired by rebuilding from an anchor.
        cache_reset: what ``reset_prefix_cache`` returned.
        pause_ms, update_ms, verify_ms, total_ms: wall times (milliseconds).
    """

    version: int
    workers: list[dict[str, Any]] = field(default_factory=list)
    verified: bool = False
    recovered: bool = False
    cache_reset: bool | None = None
    pause_ms: float = 0.0
    update_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_worker_checksums(results: list[dict[str, Any]]) -> int:
    """Combine the workers' ``deltasync_checksums`` results and compare with the manifest.

    Args:
        results: one result per worker of one engine (``collective_rpc`` returns them in rank order).

    Returns:
        The version checked.

    Raises:
        ChecksumMismatchError: the workers hold different versions or disagree on the manifest, or
            the combined checksums differ from it.
    """
    if not results:
        raise ChecksumMismatchError("no worker returned checksums")
    versions = {r["version"] for r in results}
    if len(versions) != 1:
        raise ChecksumMismatchError(f"workers hold different versions: {sorted(map(str, versions))}")
    version = versions.pop()
    expected = {n: parse_checksum(c) for n, c in results[0]["expected"].items()}
    if any(r["expected"] != results[0]["expected"] for r in results[1:]):
        raise ChecksumMismatchError(f"version {version}: workers read different manifests")
    check_partials(expected, ({n: parse_checksum(c) for n, c in r["partials"].items()} for r in results),
                   what=f"version {version}")
    return int(version)


# The update protocol is written once, as a generator of engine steps; a sync and an async driver
# run it against an engine kind's step functions ("rpc", "pause", "reset", "resume"). Errors raised
# by a step are thrown back into the generator, so its ``finally`` (resume) runs on every engine.

def _attach_steps(store: str, prefix: str, assume_version: int | None, verify: bool, kw: dict):
    results = yield ("rpc", "deltasync_attach", [str(store), prefix], {"assume_version": assume_version, **kw})
    if assume_version is not None and verify:
        check_worker_checksums((yield ("rpc", "deltasync_checksums", [], {})))
    return results


def _update_steps(version: int | None, mode: PauseMode, verify: bool, recover: bool):
    t0 = time.perf_counter()
    if version is None:  # one version for all workers, even if a newer one appears meanwhile
        newest = [s["newest"] for s in (yield ("rpc", "deltasync_status", [], {}))]
        if not newest or any(v is None for v in newest):
            raise DeltaSyncError("no version has been published yet")
        version = max(newest)
    out = EngineUpdate(version=int(version))
    t1 = time.perf_counter()
    yield ("pause", mode)
    try:
        t2 = time.perf_counter()
        out.pause_ms = (t2 - t1) * 1e3
        out.workers = yield ("rpc", "deltasync_update", [int(version)], {})
        t3 = time.perf_counter()
        out.update_ms = (t3 - t2) * 1e3
        got = {w["version"] for w in out.workers}
        if got != {int(version)}:
            raise DeltaSyncError(f"workers report versions {sorted(map(str, got))} after updating to {version}")
        if verify:
            try:
                check_worker_checksums((yield ("rpc", "deltasync_checksums", [], {})))
            except ChecksumMismatchError:
                if not recover:
                    raise
                yield ("rpc", "deltasync_reset", [], {})  # next update takes the anchor path
                out.workers = yield ("rpc", "deltasync_update", [int(version)], {})
                check_worker_checksums((yield ("rpc", "deltasync_checksums", [], {})))
                out.recovered = True
            out.verified = True
            out.verify_ms = (time.perf_counter() - t3) * 1e3
        out.cache_reset = yield ("reset",)
    finally:
        yield ("resume",)
    out.total_ms = (time.perf_counter() - t0) * 1e3
    return out


def _drive(gen, ops: dict[str, Callable]):
    """Run a protocol generator with synchronous step functions."""
    try:
        step = next(gen)
        while True:
            try:
                result = ops[step[0]](*step[1:])
            except BaseException as e:  # noqa: BLE001 (re-raised by the generator after its cleanup)
                step = gen.throw(e)
                continue
            step = gen.send(result)
    except StopIteration as stop:
        return stop.value


async def _drive_async(gen, ops: dict[str, Callable]):
    """Run a protocol generator with ``async`` step functions."""
    try:
        step = next(gen)
        while True:
            try:
                result = await ops[step[0]](*step[1:])
            except BaseException as e:  # noqa: BLE001
                step = gen.throw(e)
                continue
            step = gen.send(result)
    except StopIteration as stop:
        return stop.value


def _llm_ops(llm: Any, timeout: float | None) -> dict[str, Callable]:
    # Offline LLM: a level-0 sleep pauses scheduling (requests queue; weights and KV cache stay),
    # as in vLLM's examples/rl/rlhf_sparse_nccl.py; wake_up(tags=["scheduling"]) ends it.
    return {
        "rpc": lambda method, args, kwargs: llm.collective_rpc(method, timeout=timeout, args=tuple(args), kwargs=kwargs),
        "pause": lambda mode: llm.sleep(level=0, mode=mode),
        "reset": lambda: llm.reset_prefix_cache(reset_running_requests=True),
        "resume": lambda: llm.wake_up(tags=["scheduling"]),
    }


def attach_llm(llm: Any, store: str, prefix: str = "", *, assume_version: int | None = None, verify: bool = True,
               timeout: float | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """Attach every worker of an offline ``vllm.LLM`` to a run (``DeltaWorkerExtension.deltasync_attach``).

    With ``assume_version`` (the engine loaded that version's checkpoint) and ``verify``, the
    combined partial checksums are checked against the manifest.

    Returns:
        The workers' attach results.

    Raises:
        ChecksumMismatchError: the engine does not hold ``assume_version``.
    """
    return _drive(_attach_steps(store, prefix, assume_version, verify, kwargs), _llm_ops(llm, timeout))


def update_llm(llm: Any, version: int | None = None, *, mode: PauseMode = "wait", verify: bool = True,
               recover: bool = True, timeout: float | None = None) -> EngineUpdate:
    """Update an offline ``vllm.LLM`` to ``version`` (the newest when ``None``).

    Protocol: ``llm.sleep(level=0, mode=mode)`` (pause scheduling; ``"wait"`` drains in-flight
    requests, ``"keep"`` freezes them, ``"abort"`` drops them) → ``collective_rpc("deltasync_update")``
    → ``collective_rpc("deltasync_checksums")`` combined and checked (``verify``) →
    ``reset_prefix_cache(reset_running_requests=True)`` → ``wake_up(tags=["scheduling"])``
    (always, also on errors).

    Args:
        version: target version; ``None`` = the newest any worker sees (one version for all).
        mode: how to pause.
        verify: check the combined checksums (``O(model)`` per worker on the device).
        recover: on a checksum mismatch, rebuild once from an anchor and check again.
        timeout: per collective_rpc, seconds.

    Raises:
        ChecksumMismatchError: verification failed (after recovery, if enabled).
        DeltaSyncError: nothing published yet, or workers disagree on the version.
    """
    return _drive(_update_steps(version, mode, verify, recover), _llm_ops(llm, timeout))


def _async_ops(engine: Any, timeout: float | None) -> dict[str, Callable]:
    async def rpc(method, args, kwargs):
        return await engine.collective_rpc(method, timeout=timeout, args=tuple(args), kwargs=kwargs)

    async def pause(mode):
        await engine.pause_generation(mode=mode, clear_cache=True)

    async def reset():
        return await engine.reset_prefix_cache(reset_running_requests=True)

    async def resume():
        await engine.resume_generation()

    return {"rpc": rpc, "pause": pause, "reset": reset, "resume": resume}


async def attach_async_llm(engine: Any, store: str, prefix: str = "", *, assume_version: int | None = None,
                           verify: bool = True, timeout: float | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`attach_llm` for a ``vllm.v1.engine.async_llm.AsyncLLM`` (or any ``EngineClient``)."""
    return await _drive_async(_attach_steps(store, prefix, assume_version, verify, kwargs), _async_ops(engine, timeout))


async def update_async_llm(engine: Any, version: int | None = None, *, mode: PauseMode = "wait",
                           verify: bool = True, recover: bool = True, timeout: float | None = None) -> EngineUpdate:
    """:func:`update_llm` for an ``AsyncLLM``: ``pause_generation(mode=mode, clear_cache=True)`` →
    update → checksums → ``reset_prefix_cache(reset_running_requests=True)`` →
    ``resume_generation()`` (always). Note: with internal-LB data parallelism ``collective_rpc``
    reaches every engine but returns engine 0's results only, so only engine 0 is verified."""
    return await _drive_async(_update_steps(version, mode, verify, recover), _async_ops(engine, timeout))


def _http_ops(base_url: str, timeout: float, headers: dict[str, str] | None) -> dict[str, Callable]:
    base = base_url.rstrip("/")

    def post(path: str, params: dict[str, Any] | None = None, body: Any = None) -> Any:
        url = base + path + ("?" + urllib.parse.urlencode(params, doseq=True) if params else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (caller's server)
            raw = resp.read()
        return json.loads(raw) if raw.strip() else None

    def rpc(method, args, kwargs):
        out = post("/collective_rpc", body={"method": method, "args": list(args), "kwargs": kwargs, "timeout": timeout})
        if not isinstance(out, dict) or not isinstance(out.get("results"), list):
            raise DeltaSyncError(f"{base}/collective_rpc answered {out!r}; is VLLM_SERVER_DEV_MODE=1 set?")
        return out["results"]

    def reset():
        out = post("/reset_prefix_cache", {"reset_running_requests": "true"})
        return None if out is None else bool(out.get("success", True)) if isinstance(out, dict) else bool(out)

    return {"rpc": rpc, "pause": lambda mode: post("/pause", {"mode": mode, "clear_cache": "true"}),
            "reset": reset, "resume": lambda: post("/resume")}


def attach_server(base_url: str, store: str, prefix: str = "", *, assume_version: int | None = None,
                  verify: bool = True, timeout: float = 600.0, headers: dict[str, str] | None = None,
                  **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`attach_llm` for a ``vllm serve`` HTTP server at ``base_url`` (e.g.
    ``http://127.0.0.1:8000``) started with ``VLLM_SERVER_DEV_MODE=1`` and the extension."""
    return _drive(_attach_steps(store, prefix, assume_version, verify, kwargs), _http_ops(base_url, timeout, headers))


def update_server(base_url: str, version: int | None = None, *, mode: PauseMode = "wait", verify: bool = True,
                  recover: bool = True, timeout: float = 600.0, headers: dict[str, str] | None = None) -> EngineUpdate:
    """:func:`update_llm` over HTTP: ``POST /pause?mode=...&clear_cache=true`` →
    ``POST /collective_rpc {"method": "deltasync_update", "args": [v]}`` → checksums →
    ``POST /reset_prefix_cache?reset_running_requests=true`` → ``POST /resume`` (always).

    Args:
        base_url: the server's root URL.
        timeout: seconds per HTTP request (also passed as the collective_rpc timeout).
        headers: extra request headers (e.g. an auth header of a proxy in front of the server).
    """
    return _drive(_update_steps(version, mode, verify, recover), _http_ops(base_url, timeout, headers))
