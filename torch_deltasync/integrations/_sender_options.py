"""Options an integration forwards to the :class:`~torch_deltasync.DeltaSender` (or
:class:`~torch_deltasync.DeltaReceiver`) it builds.

Integrations that publish (the torchrl scheme, the torchrl vLLM sender, PEFT's ``AdapterSender``)
take the sender's options as they are, either as keywords (``anchor_every``, ``anchor_policy``,
``inference_dtype``, ``codec``, ``snapshot_device``, ``background``, ``retention``, ...) or as a
:class:`~torch_deltasync.sender.SenderConfig`, instead of declaring them again: the config
documents and checks each one, and a new sender option reaches every integration without a change
here. The same holds for the receiving side and :class:`~torch_deltasync.receiver.ReceiverConfig`.

The options are checked when the integration is built, by building the config: a misspelt name is
a ``TypeError`` that lists the valid ones, a bad value the config's own ``TypeError`` /
``ValueError``, in the caller rather than at the first publish or on a worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from .._config import with_options
from ..receiver import ReceiverConfig
from ..sender import SenderConfig

_TAKES = "besides its own options it takes {}'s"


def sender_config(options: Mapping[str, Any], owner: str, *, config: SenderConfig | None = None,
                  exclude: Collection[str] = (), argument: str = "sender_config") -> SenderConfig:
    """The :class:`~torch_deltasync.sender.SenderConfig` an integration's sender publishes with.

    Args:
        options: the integration's ``**sender_options``: ``SenderConfig`` fields.
        owner: the integration's name, for the message.
        config: the integration's ``sender_config=`` (default ``SenderConfig()``); ``options``
            override its fields.
        exclude: fields the integration sets itself (refused as options).
        argument: the integration's name for ``config``, for the message.

    Raises:
        TypeError: ``config`` is not a ``SenderConfig``; an option that is not a ``SenderConfig`` field, or one the integration sets
            itself (the message lists the valid names); an option of the wrong type.
        ValueError: a value ``SenderConfig`` refuses (e.g. an unknown ``codec``, or ``codec="auto"``
            without a valid ``link_gbps``).
    """
    return with_options(config, SenderConfig, options, owner, takes=_TAKES.format("DeltaSender"),
                        exclude=exclude, argument=argument)


def receiver_config(options: Mapping[str, Any], owner: str, *, config: ReceiverConfig | None = None,
                    exclude: Collection[str] = (), argument: str = "receiver_config") -> ReceiverConfig:
    """The :class:`~torch_deltasync.receiver.ReceiverConfig` an integration's receiver uses; as
    :func:`sender_config`, for ``DeltaReceiver``'s options (``max_workers``, ``threads``, ``metrics_path``)."""
    return with_options(config, ReceiverConfig, options, owner, takes=_TAKES.format("DeltaReceiver"),
                        exclude=exclude, argument=argument)


def split_options(options: Mapping[str, Any], owner: str, *,
                  exclude: Collection[str] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sort the keywords of an integration that builds both sides into ``SenderConfig`` fields and
    ``ReceiverConfig`` fields (a name that is a field of both goes to both).

    Returns:
        ``(sender options, receiver options)``, new dicts.

    Raises:
        TypeError: a name that is a field of neither, or one in ``exclude``; the message lists the
            valid names of both.
    """
    sender = _names(SenderConfig, exclude)
    receiver = _names(ReceiverConfig, exclude)
    bad = sorted(k for k in options if k not in sender and k not in receiver)
    if bad:
        raise TypeError(f"{owner} got unexpected keyword argument(s) {bad}; {_TAKES.format('DeltaSender')}: "
                        f"{sorted(sender)} and DeltaReceiver's: {sorted(receiver)}")
    return ({k: v for k, v in options.items() if k in sender},
            {k: v for k, v in options.items() if k in receiver})


def _names(config: type, exclude: Collection[str]) -> set[str]:
    return {f.name for f in dataclasses.fields(config)} - set(exclude)
