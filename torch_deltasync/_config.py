"""Keyword options on top of a config dataclass: ``Owner(..., config=Config(...), **options)``.

:class:`~torch_deltasync.sender.SenderConfig` and :class:`~torch_deltasync.receiver.ReceiverConfig`
are frozen, keyword-only dataclasses that document and check each option where it is declared. Their
owners (``DeltaSender``, ``DeltaReceiver`` and the integrations that build them) also take the
fields as plain keyword arguments, applied on top of a config with :func:`dataclasses.replace`, as
vLLM's ``LLM(model, **kwargs)`` builds its ``EngineArgs``. :func:`with_options` is that step, so
that every owner refuses a misspelt option the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

C = TypeVar("C")


def with_options(config: C | None, cls: type[C], options: Mapping[str, Any], owner: str, *, takes: str,
                 exclude: Collection[str] = (), argument: str = "config") -> C:
    """``config`` (default ``cls()``) with ``options`` replacing its fields; the new config checks
    them (``__post_init__``).

    Args:
        config: the config the caller passed, or ``None`` for the defaults.
        cls: the config class the owner takes (``SenderConfig``).
        options: ``{field name: value}`` overrides, e.g. a constructor's ``**options``.
        owner: who was given ``options``, for the message (``"DeltaSender"``).
        takes: how the message introduces the valid names (``"its options are SenderConfig's fields"``).
        exclude: fields the owner sets itself, refused as options.
        argument: the owner's name for ``config``, for the message (``"sender_config"``).

    Returns:
        ``config`` itself when ``options`` is empty, else a new config.

    Raises:
        TypeError: ``config`` is not a ``cls`` (e.g. a dict, or the other side's config); a name
            that is not a field of ``cls`` (or is excluded), the message listing the valid names,
            sorted. Also what the config's own checks raise for a bad value.
        ValueError: what the config's own checks raise for a bad value.
    """
    if config is None:
        config = cls()
    elif not isinstance(config, cls):
        raise TypeError(f"{owner}: {argument} must be a {cls.__name__} (or None for the defaults), got "
                        f"{type(config).__name__} {config!r}")
    valid = sorted(f.name for f in dataclasses.fields(cls) if f.name not in exclude)
    bad = sorted(k for k in options if k not in valid)
    if bad:
        raise TypeError(f"{owner} got unexpected keyword argument(s) {bad}; {takes}: {valid}")
    return dataclasses.replace(config, **options) if options else config
