"""torchrl collectors' policy-version trackers, as the scheme and the vLLM sender set them."""

from __future__ import annotations

from typing import Any


def is_leaf_collector(obj: Any) -> bool:
    """Whether ``obj`` is a single-process ``Collector`` (it bumps its tracker itself after a send)."""
    try:
        from torchrl.collectors._single import Collector
    except ImportError:  # pragma: no cover - other torchrl layouts
        return False
    return isinstance(obj, Collector)


def int_tracker(context: Any) -> Any:
    """The context's ``PolicyVersion`` tracker if it counts integers (not UUIDs), else ``None``."""
    tracker = getattr(context, "policy_version_tracker", None)
    if tracker is None or not hasattr(tracker, "version"):
        return None
    if getattr(tracker, "version_type", int) not in (int, "int"):
        return None
    return tracker
