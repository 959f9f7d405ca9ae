"""Options an integration forwards to the :class:`~torch_deltasync.DeltaSender` it builds.

Integrations that publish (the torchrl scheme, the torchrl vLLM sender) take the sender's keyword
options as they are (``anchor_every``, ``anchor_policy``, ``inference_dtype``, ``codec``,
``snapshot_device``, ``background``, ``retention``, ``metrics_path``, ...) instead of declaring
them again: :class:`~torch_deltasync.DeltaSender` documents each one, and a new sender option
reaches every integration without a change here.
"""

from __future__ import annotations

import inspect
from typing import Any

#: DeltaSender arguments an integration sets itself (the model, where it publishes, the process group).
_OWNED = frozenset({"self", "model", "store", "prefix", "group"})


def _signature() -> inspect.Signature:
    from ..sender import DeltaSender

    return inspect.signature(DeltaSender.__init__)


def check_sender_options(options: dict[str, Any], owner: str) -> dict[str, Any]:
    """Check that ``options`` are keyword options of :class:`~torch_deltasync.DeltaSender`.

    Args:
        options: the options an integration was given (``**sender_options``).
        owner: the integration's name, for the message.

    Returns:
        A copy of ``options``.

    Raises:
        TypeError: an option ``DeltaSender`` does not take, or one the integration sets itself
            (``model``, ``store``, ``prefix``, ``group``); the message lists the valid names.
    """
    valid = sorted(p for p in _signature().parameters if p not in _OWNED)
    bad = sorted(k for k in options if k not in valid)
    if bad:
        raise TypeError(f"{owner} got unexpected keyword argument(s) {bad}; besides its own options it takes "
                        f"DeltaSender's: {valid}")
    return dict(options)


def sender_option(options: dict[str, Any], name: str) -> Any:
    """The value ``DeltaSender`` would use for option ``name`` given ``options`` (its default when absent)."""
    if name in options:
        return options[name]
    return _signature().parameters[name].default
