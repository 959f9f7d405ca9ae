"""The ``init_info`` of the ``deltasync`` vLLM backend, declared once and importable without vLLM:
the workers parse it (:class:`._backend.DeltaSyncInitInfo` adds vLLM's base class), and the
drivers' ``attach_*`` helpers check it before sending, so a misspelt option or a bad value fails
in the caller with the option's name rather than on every worker of the engine."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from ..._pool import MAX_THREADS


@dataclass
class InitInfo:
    """``init_info`` of the ``deltasync`` backend (JSON-able; every worker gets the same).

    Attributes:
        store: the run's store, any :func:`torch_deltasync.open_store` URI or path (as the sender's).
        prefix: the run's sub-path in the store.
        assume_version: the engine already serves this version (it loaded the checkpoint the
            trainer published as that version): the host copy is built from the store without
            touching the engine, and later versions are applied as deltas. The claim is trusted;
            check it with outputs (or ``/weight_checker`` where weights are not re-packed).
        in_place: ``"auto"`` (write in place where the live layout is the loader's, reload the
            rest) or ``"never"`` (reload every changed module).
        reload_ahead: ``"auto"``, ``"always"`` or ``"never"``: re-pack the changed modules while
            staging, on copies, so the commit only swaps them in
            (:class:`~torch_deltasync.targets.VLLMEngineTarget`, "Reloading ahead"; costs about
            the model's bytes twice from staging to commit).
        strict: refuse a run that publishes no tensor for some of the engine's parameters (they
            would keep their checkpoint values while the engine reports each new version);
            ``False`` leaves them as loaded.
        stage_ahead: stage the newest version in the background (``False``: prepare inside
            ``update_weights``).
        poll_s: seconds between looks at the store for a newer version (background stager).
        max_workers: parallel downloads per worker.
        threads: tensors staged at once per worker (``ReceiverConfig.threads``); ``None``: one per
            CPU core the worker may use, at most 8; workers vLLM did not pin to their own cores
            share the host's (``cores // TP``: vLLM's CPU workers set ``LOCAL_WORLD_SIZE``,
            :func:`torch_deltasync._pool.default_threads`).
        status_dir: directory for per-worker readiness files (``._readiness``); ``None``: none.
        metrics_path: append one JSON line per commit (``{rank}`` is replaced by the worker rank);
            ``None`` or ``""``: none.

    Raises:
        ValueError: a field of the wrong type or outside its range (the message names it).
    """

    store: str
    prefix: str = ""
    assume_version: int | None = None
    in_place: str = "auto"
    reload_ahead: str = "auto"
    strict: bool = True
    stage_ahead: bool = True
    poll_s: float = 0.05
    max_workers: int = 8
    threads: int | None = None
    status_dir: str | None = None
    metrics_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store:
            raise ValueError(f"init_info 'store' must be a non-empty store URI or path, got {self.store!r}")
        if not isinstance(self.prefix, str):
            raise ValueError(f"init_info 'prefix' must be a string, got {self.prefix!r}")
        if self.assume_version is not None and (type(self.assume_version) is not int or self.assume_version < 0):
            raise ValueError(f"init_info 'assume_version' must be a version (int >= 0) or null, got {self.assume_version!r}")
        if self.in_place not in ("auto", "never"):
            raise ValueError(f"init_info 'in_place' must be 'auto' or 'never', got {self.in_place!r}")
        if self.reload_ahead not in ("auto", "always", "never"):
            raise ValueError(f"init_info 'reload_ahead' must be 'auto', 'always' or 'never', got {self.reload_ahead!r}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"init_info 'strict' must be true or false, got {self.strict!r}")
        if not isinstance(self.stage_ahead, bool):
            raise ValueError(f"init_info 'stage_ahead' must be true or false, got {self.stage_ahead!r}")
        if not isinstance(self.poll_s, (int, float)) or isinstance(self.poll_s, bool) or not 0 < self.poll_s <= 60:
            raise ValueError(f"init_info 'poll_s' must be in (0, 60] seconds, got {self.poll_s!r}")
        if type(self.max_workers) is not int or not 1 <= self.max_workers <= 256:
            raise ValueError(f"init_info 'max_workers' must be an int in [1, 256], got {self.max_workers!r}")
        if self.threads is not None and (type(self.threads) is not int or not 1 <= self.threads <= MAX_THREADS):
            raise ValueError(f"init_info 'threads' must be an int in [1, {MAX_THREADS}] or null (one per CPU core, at most 8, shared among local ranks), "
                             f"got {self.threads!r}")
        if self.status_dir is not None and (not isinstance(self.status_dir, str) or not self.status_dir):
            raise ValueError(f"init_info 'status_dir' must be a non-empty path or null, got {self.status_dir!r}")
        if self.metrics_path is not None and not isinstance(self.metrics_path, str):
            raise ValueError(f"init_info 'metrics_path' must be a path string or null, got {self.metrics_path!r}")


def check_init_info(info: dict[str, Any], owner: str) -> dict[str, Any]:
    """``info`` as the workers will receive it, checked as they will check it (:class:`InitInfo`),
    in the caller: path-like values (``pathlib.Path``) become strings, the JSON form.

    Returns:
        The checked ``init_info`` (a new dict).

    Raises:
        TypeError: an option the backend does not take (the message lists the valid names).
        ValueError: a bad value (the message names the option).
    """
    info = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in info.items()}
    names = [f.name for f in fields(InitInfo)]
    unknown = sorted(set(info) - set(names))
    if unknown:
        raise TypeError(f"{owner}: unknown deltasync init_info option(s) {unknown}; the backend takes {names}")
    InitInfo(**info)
    return info
