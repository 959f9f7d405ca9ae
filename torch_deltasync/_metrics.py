"""Metrics as JSON lines: the ``metrics_path`` of senders, receivers and ``deltasync follow``.

A metrics file records what happened; it never decides it. A record that cannot be written (a full
disk, a path that became a folder) is logged once per path and dropped: the publish or update it
describes has already happened, and raising would tell the caller it had not.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("torch_deltasync")

_warned: set[str] = set()


def check_metrics_path(what: str, path: str | os.PathLike | None) -> None:
    """Refuse a metrics path that cannot name a file (``""`` and ``None``: no metrics).

    Args:
        what: the argument, for the message (``"SenderConfig.metrics_path"``; the CLI: ``"the path"``).

    Raises:
        TypeError: not a path (``str`` or ``os.PathLike`` of ``str``) or ``None``.
        ValueError: an existing folder.
    """
    if path is None:
        return
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise TypeError(f"{what} must be a path (str or os.PathLike) or None, got {path!r}")
    text = os.fspath(path)
    if text and os.path.isdir(text):
        raise ValueError(f"{what} {text!r} is a folder; give a file in it, e.g. {os.path.join(text, 'metrics.jsonl')!r}")


def append_metrics(path: str | os.PathLike, record: dict[str, Any]) -> bool:
    """Append ``record`` to ``path`` as one JSON line (creating its folder); ``False``, with a
    warning the first time for this path, when it cannot be written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return True
    except OSError as e:
        if str(path) not in _warned:
            _warned.add(str(path))
            log.warning("cannot write metrics to %s (%s); its records are dropped", path, e)
        return False
