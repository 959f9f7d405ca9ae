"""Options an integration forwards to the :class:`~torch_deltasync.DeltaSender` (or
:class:`~torch_deltasync.DeltaReceiver`) it builds.

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


def check_sender_options(options: dict[str, Any], owner: str, *,
                         owned: frozenset[str] = _OWNED) -> dict[str, Any]:
    """Check that ``options`` are keyword options of :class:`~torch_deltasync.DeltaSender`, and
    that its codec choice is valid, when the integration is built (not at its first publish).

    Args:
        options: the options an integration was given (``**sender_options``).
        owner: the integration's name, for the message.
        owned: arguments the integration sets itself (default: ``model``, ``store``, ``prefix``, ``group``).

    Returns:
        A copy of ``options``.

    Raises:
        TypeError: an option ``DeltaSender`` does not take, or one the integration sets itself;
            the message lists the valid names.
        ValueError: an unknown ``codec``, or ``codec="auto"`` without a valid ``link_gbps``.
    """
    from ..codecs import get_codec
    from ..codecs._auto import sender_codec

    _check_names(options, owner, _signature(), owned, "DeltaSender")
    get_codec(sender_codec(sender_option(options, "codec"), sender_option(options, "link_gbps")))
    return dict(options)


def check_receiver_options(options: dict[str, Any], owner: str) -> dict[str, Any]:
    """Check that ``options`` are keyword options of :class:`~torch_deltasync.DeltaReceiver`
    (``max_workers``, ``metrics_path``); ``target``, ``store`` and ``prefix`` are the integration's.

    Raises:
        TypeError: an option ``DeltaReceiver`` does not take; the message lists the valid names.
    """
    from ..receiver import DeltaReceiver

    _check_names(options, owner, inspect.signature(DeltaReceiver.__init__), frozenset({"self", "target", "store", "prefix"}),
                 "DeltaReceiver")
    return dict(options)


def _check_names(options: dict[str, Any], owner: str, sig: inspect.Signature, owned: frozenset[str], of: str) -> None:
    valid = sorted(p for p in sig.parameters if p not in owned)
    bad = sorted(k for k in options if k not in valid)
    if bad:
        raise TypeError(f"{owner} got unexpected keyword argument(s) {bad}; besides its own options it takes "
                        f"{of}'s: {valid}")


def sender_option(options: dict[str, Any], name: str) -> Any:
    """The value ``DeltaSender`` would use for option ``name`` given ``options`` (its default when absent)."""
    if name in options:
        return options[name]
    return _signature().parameters[name].default
