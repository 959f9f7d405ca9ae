"""vLLM LoRA hot-swap: load every new adapter version into a running engine under its own name.

A rollout worker follows an adapter run (:class:`~torch_deltasync.integrations.peft.AdapterReceiver` holding the
adapter tensors on CPU: deltas or full adapters, whichever is cheaper), writes each new version as
a PEFT folder (:func:`~torch_deltasync.integrations.peft.materialize_adapter`'s format, atomically), and asks
vLLM to load it as a new LoRA adapter::

    trainer ──AdapterSender──▶ store ──AdapterReceiver (CPU)──▶ <cache_dir>/<name>-v<version>/
                                                                    │ adapter_model.safetensors
                                                                    │ adapter_config.json
    engine.add_lora(LoRARequest("<name>-v<version>", id_offset + version, path))   (offline / AsyncLLM)
    POST /v1/load_lora_adapter {"lora_name": ..., "lora_path": ...}                  (vllm serve)

Each version gets a **new** name and id (vLLM caches adapters by id and its prefix cache by
adapter; loading new weights under an old name would serve cached KV of the old weights, as vLLM's
own warning for in-place reloads says). New requests use :attr:`VLLMAdapterLoader.current`; requests
already running keep the version they started with, and the rollout records that version for the
staleness bookkeeping. The oldest versions beyond ``keep`` are unloaded and their folders deleted.

Engines (the calls each makes):

=================  ==========================================  =======================================
engine             load                                        unload
=================  ==========================================  =======================================
offline ``LLM``    ``llm.llm_engine.add_lora(LoRARequest)``    ``llm.llm_engine.remove_lora(id)``
``AsyncLLM``       ``await engine.add_lora(LoRARequest)``      ``await engine.remove_lora(id)``
HTTP server        ``POST /v1/load_lora_adapter``              ``POST /v1/unload_lora_adapter``
=================  ==========================================  =======================================

The engine must run with ``enable_lora=True`` and ``max_lora_rank >= r`` (``--enable-lora
--max-lora-rank R``; ``max_loras >= keep``); the HTTP routes exist only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, and ``lora_path`` is read by the server, so the cache
folder must be on the server's file system. See ``docs/lora.md``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ...errors import DeltaSyncError
from ...follow import poll_until
from ._steps import drive, drive_async



@dataclass(frozen=True)
class LoadedAdapter:
    """One adapter version loaded into the engine.

    Attributes:
        version: the adapter version.
        lora_name: the name vLLM knows it by (``"<name>-v<version>"``, ``"<name>-r<k>-v<version>"`` in
            the k-th run followed after the first; the ``model`` of OpenAI requests).
        lora_int_id: its vLLM adapter id (``id_offset + version`` until a load fails, above every id
            offered before after that and in a later run: never offered twice; ``>= 1``).
        path: the materialised PEFT folder vLLM loaded.
        load_ms: materialise + load time (milliseconds).
        run_id: the writer run the version belongs to (``Manifest.run_id``).
    """

    version: int
    lora_name: str
    lora_int_id: int
    path: str
    load_ms: float = 0.0
    run_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _lora_request_cls():
    from vllm.lora.request import LoRARequest

    return LoRARequest


def _refused(name: str, path: str, reason: BaseException | None = None) -> DeltaSyncError:
    """The error of an ``add_lora`` the engine refused (it raised ``reason`` or returned false)."""
    why = f": {reason}" if reason is not None else ""
    return DeltaSyncError(f"vLLM refused to load LoRA adapter {name!r} from {path}{why}")


@contextlib.contextmanager
def _refusals(name: str, path: str) -> Iterator[None]:
    """Turn the engine's refusal of adapter ``name`` inside the block into :func:`_refused`'s error.
    vLLM's engine core answers a utility call that failed in a worker with a plain
    ``Exception("Call to add_lora method failed: Worker failed with error 'LoRA rank 16 is greater
    than max_lora_rank 8.'")`` (``vllm/v1/engine/core_client.py``, ``_process_utility_output``).
    Anything else (a dead engine, a timeout, a cancelled call) is not the adapter's fault and
    propagates as it is."""
    try:
        yield
    except Exception as e:
        if type(e) is Exception and str(e).startswith("Call to add_lora method failed"):
            raise _refused(name, path, e) from e
        raise


def llm_lora_ops(llm: Any, request_cls: Callable[..., Any] | None = None) -> dict[str, Callable]:
    """Load/unload steps for an offline ``vllm.LLM`` (``llm.llm_engine.add_lora`` / ``remove_lora``).

    Args:
        llm: the engine (started with ``enable_lora=True``).
        request_cls: builds the request; default ``vllm.lora.request.LoRARequest``.

    Raises (from the steps):
        DeltaSyncError: the engine refused the adapter (the message has its reason). Other errors
        (``EngineDeadError``, timeouts) propagate unchanged.
    """
    make = request_cls or _lora_request_cls()

    def load(name: str, lora_id: int, path: str) -> Any:
        req = make(lora_name=name, lora_int_id=lora_id, lora_path=path)
        with _refusals(name, path):
            loaded = llm.llm_engine.add_lora(req)
        if loaded is False:
            raise _refused(name, path)
        return req

    def unload(name: str, lora_id: int) -> None:
        llm.llm_engine.remove_lora(lora_id)

    return {"load": load, "unload": unload, "request": make}


def async_llm_lora_ops(engine: Any, request_cls: Callable[..., Any] | None = None) -> dict[str, Callable]:
    """Load/unload steps for a ``vllm.v1.engine.async_llm.AsyncLLM`` (``await add_lora`` / ``remove_lora``);
    errors as :func:`llm_lora_ops`'."""
    make = request_cls or _lora_request_cls()

    async def load(name: str, lora_id: int, path: str) -> Any:
        req = make(lora_name=name, lora_int_id=lora_id, lora_path=path)
        with _refusals(name, path):
            loaded = await engine.add_lora(req)
        if loaded is False:
            raise _refused(name, path)
        return req

    async def unload(name: str, lora_id: int) -> None:
        await engine.remove_lora(lora_id)

    return {"load": load, "unload": unload, "request": make}


def server_lora_ops(base_url: str, *, api_key: str | None = None, timeout: float = 120.0) -> dict[str, Callable]:
    """Load/unload steps for ``vllm serve`` (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``).

    ``POST {base_url}/v1/load_lora_adapter {"lora_name", "lora_path"}`` and
    ``POST {base_url}/v1/unload_lora_adapter {"lora_name"}``; the server assigns the integer id.

    Args:
        base_url: the server's root URL, e.g. ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer <api_key>`` (the server's ``--api-key``).
        timeout: seconds per request.

    Raises (from the steps):
        DeltaSyncError: the server answered with an error (refused the adapter, or has no LoRA
            routes); the message has the adapter, its status and body.
    """
    base = base_url.rstrip("/")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"

    def post(path: str, body: dict) -> str:
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (the caller's server)
                return resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            hint = " (is VLLM_ALLOW_RUNTIME_LORA_UPDATING=True set?)" if e.code == 404 else ""
            raise DeltaSyncError(f"{base}{path} answered HTTP {e.code}{hint}: {detail}") from None

    def load(name: str, lora_id: int, path: str) -> str:
        try:
            return post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except DeltaSyncError as e:
            raise _refused(name, path, e) from None

    def unload(name: str, lora_id: int) -> str:
        return post("/v1/unload_lora_adapter", {"lora_name": name})

    return {"load": load, "unload": unload}


class VLLMAdapterLoader:
    """Follows an adapter run and loads each new version into a vLLM engine as a new LoRA adapter.

    Args:
        ops: the engine's steps (``"load"``, ``"unload"``, optionally ``"request"``, the request class):
            :func:`llm_lora_ops`, :func:`async_llm_lora_ops` (then use :meth:`apoll`) or
            :func:`server_lora_ops`.
        store: the run's store (anything :func:`~torch_deltasync.open_store` accepts).
        prefix: the run's sub-path.
        cache_dir: where versions are materialised (on the engine's file system).
        name: adapter name stem; version ``v`` is loaded as ``f"{name}-v{v}"``.
        id_offset: version ``v`` gets vLLM id ``id_offset + v`` (``>= 1``); give runs sharing one
            engine disjoint ranges. A new run on the prefix (a writer that started over on a wiped
            prefix, whose numbers restart) is followed like a newer version: its version ``v`` is
            loaded as ``f"{name}-r{k}-v{v}"`` (``k``: runs seen before it), with ids that continue
            above every id this loader used, so no name or id ever stands for two adapters. After
            a refused or interrupted load the ids move on the same way: an id offered once is never
            offered again (vLLM registers an id before it activates the adapter, and answers a
            later ``add_lora`` of a registered id with success without loading anything).
        keep: loaded versions to keep (>= 1); older ones are unloaded and their folders deleted.
            Keep at least 2 so requests started just before a swap finish on their version.
        base_model_name_or_path: recorded in each folder's ``adapter_config.json``.
        receiver_kwargs: passed to the :class:`~torch_deltasync.integrations.peft.AdapterReceiver`.

    Attributes:
        current: the newest loaded version (:class:`LoadedAdapter`), ``None`` before the first.
        loaded: every loaded version, oldest first.

    Example:
        >>> llm = LLM(model="Qwen/Qwen3-8B", enable_lora=True, max_lora_rank=16, max_loras=2)
        >>> loader = VLLMAdapterLoader(llm_lora_ops(llm), "s3://bucket/runs", prefix="grpo-lora-1",
        ...                            cache_dir="/tmp/adapters")
        >>> loader.wait()                              # the first version
        >>> while training:
        ...     loader.poll()                          # None when nothing new
        ...     outs = llm.generate(prompts, params, lora_request=loader.lora_request())
    """

    def __init__(self, ops: dict[str, Callable], store: Any, *, prefix: str = "", cache_dir: str | Path,
                 name: str = "adapter", id_offset: int = 1, keep: int = 2, base_model_name_or_path: str | None = None,
                 **receiver_kwargs: Any) -> None:
        from ..peft import AdapterReceiver

        missing = [op for op in ("load", "unload") if not callable(ops.get(op) if isinstance(ops, dict) else None)]
        if missing:
            raise TypeError(f"VLLMAdapterLoader: ops lacks {missing}; build them with llm_lora_ops(llm), "
                            "async_llm_lora_ops(engine) or server_lora_ops(url)")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if id_offset < 1:
            raise ValueError(f"id_offset must be >= 1 (vLLM ids start at 1), got {id_offset}")
        if not name or any(c in name for c in "/\\ \n"):
            raise ValueError(f"invalid adapter name stem {name!r}")
        self.ops = ops
        self.receiver = AdapterReceiver(None, store, prefix=prefix, **receiver_kwargs)
        self.cache_dir = Path(cache_dir)
        self.name = name
        self.id_offset = id_offset
        self.keep = keep
        self.base_model_name_or_path = base_model_name_or_path
        self.loaded: list[LoadedAdapter] = []
        self._numbering = (0, id_offset)  # runs followed before the current one; the id of its version 0
        self._last_id = id_offset - 1  # the highest id offered to the engine
        self._fetched: tuple[int, str] | None = None  # (version, run) the receiver last applied

    @property
    def current(self) -> LoadedAdapter | None:
        return self.loaded[-1] if self.loaded else None

    def lora_request(self) -> Any:
        """A ``LoRARequest`` for the current version (offline ``LLM`` / ``AsyncLLM`` generate calls;
        over HTTP, pass ``current.lora_name`` as the request's ``model`` instead).

        Raises:
            DeltaSyncError: nothing loaded yet.
        """
        cur = self.current
        if cur is None:
            raise DeltaSyncError("no adapter version is loaded yet; call poll() or wait() first")
        make = self.ops.get("request") or _lora_request_cls()
        return make(lora_name=cur.lora_name, lora_int_id=cur.lora_int_id, lora_path=cur.path)

    def _fetch_newer(self) -> tuple[LoadedAdapter, float, tuple[int, int]] | None:
        """Apply the newest version unless the engine serves it (it is newer, or of a new run on a
        wiped prefix: :meth:`DeltaReceiver.needs_update`) and write its folder. Returns the adapter
        to load it as (``load_ms`` not yet set), the start time and the numbering it used."""
        cur = self.current
        if cur is not None and self._fetched == (cur.version, cur.run_id) and not self.receiver.needs_update():
            return None
        if cur is None and self.receiver.newest_version() is None:
            return None
        t0 = time.perf_counter()
        version = self.receiver.update()  # the newest (>= newest), re-planned if retention moves on
        run = self.receiver.manifest(version).run_id
        self._fetched = (version, run)  # what the receiver holds (the engine may refuse to load it)
        runs, id_base = self._numbering
        if cur is not None and run != cur.run_id:  # a new run: numbers restart, names and ids move on
            runs = runs + 1
        if id_base + version <= self._last_id:  # a new run's restarted numbers, or a retry after a failed load
            id_base = self._last_id + 1 - version
        counts = {n: int((~torch.isfinite(t)).sum()) for n, t in self.receiver.tensors.items()}  # one pass each
        bad = {n: k for n, k in counts.items() if k}
        if bad:
            # vLLM's CPU LoRA kernels let one NaN adapter turn later requests without any adapter into NaN
            n, k = next(iter(bad.items()))
            raise DeltaSyncError(
                f"{self.receiver.store.describe()}: version {version} of the adapter holds non-finite values ({k} in "
                f"{n!r}{f' and {len(bad) - 1} more tensors' if len(bad) > 1 else ''}; a diverged trainer?); not "
                "loaded into the engine, which keeps the version it serves. A newer version is tried on the next poll")
        name = f"{self.name}-v{version}" if runs == 0 else f"{self.name}-r{runs}-v{version}"
        path = self.receiver.save(self.cache_dir / name, base_model_name_or_path=self.base_model_name_or_path)
        return LoadedAdapter(version, name, id_base + version, str(path), run_id=run), t0, (runs, id_base)

    def _load_steps(self, adapter: LoadedAdapter, t0: float, numbering: tuple[int, int]):
        """Engine steps (a generator run by :mod:`._steps`' drivers): load, then unload the oldest.
        The numbering of ``adapter``'s run is kept once the engine has loaded it."""
        self._last_id = max(self._last_id, adapter.lora_int_id)
        try:
            yield ("load", adapter.lora_name, adapter.lora_int_id, adapter.path)
        except BaseException as refused:
            if isinstance(refused, Exception):
                # vLLM registers the id before it activates the adapter: one refused while being
                # activated (say, made for another base model) stays registered and takes a slot.
                # (A retry gets a new id either way; vllm serve's unload route only forgets the name.)
                try:
                    yield ("unload", adapter.lora_name, adapter.lora_int_id)
                except Exception:  # noqa: BLE001 (not registered: nothing to remove)
                    pass
            shutil.rmtree(adapter.path, ignore_errors=True)
            raise refused
        loaded = replace(adapter, load_ms=(time.perf_counter() - t0) * 1e3)
        self.loaded.append(loaded)
        self._numbering = numbering
        while len(self.loaded) > self.keep:
            old = self.loaded.pop(0)
            yield ("unload", old.lora_name, old.lora_int_id)
            shutil.rmtree(old.path, ignore_errors=True)
        return loaded

    def poll(self) -> LoadedAdapter | None:
        """Load the newest version if the engine does not serve it yet (a newer version, or a
        new run on a wiped prefix).

        Returns:
            The newly loaded version, or ``None`` when there is nothing new.

        Raises:
            Everything :meth:`AdapterReceiver.update` raises (nothing is loaded then), and
            ``DeltaSyncError`` when the engine refuses the adapter (its folder is removed, its id
            unregistered; the current version stays) or the version holds NaN or Inf values (not
            offered to the engine: in vLLM's CPU LoRA kernels one such adapter turns later requests
            without any adapter into NaN).
        """
        got = self._fetch_newer()
        return None if got is None else drive(self._load_steps(*got), self.ops)

    async def apoll(self) -> LoadedAdapter | None:
        """:meth:`poll` for ``async`` ops (:func:`async_llm_lora_ops`). The store reads and the
        folder write run on the event loop's thread (adapters are small)."""
        got = self._fetch_newer()
        return None if got is None else await drive_async(self._load_steps(*got), self.ops)

    def wait(self, *, timeout_s: float = 600.0, poll_s: float = 0.5) -> LoadedAdapter:
        """Block until a first (or newer) version is loaded: :meth:`poll` every ``poll_s`` seconds
        (:func:`torch_deltasync.follow.poll_until`).

        Raises:
            TimeoutError: nothing new within ``timeout_s`` seconds.
            Everything :meth:`poll` raises (the wait ends at the first error).
        """
        got = poll_until(self.poll, timeout_s=timeout_s, poll_s=poll_s)
        if got is None:
            raise TimeoutError(f"no new adapter version within {timeout_s} s")
        return got

    def close(self) -> None:
        self.receiver.close()
