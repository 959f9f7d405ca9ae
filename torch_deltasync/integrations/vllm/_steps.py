"""One protocol, every engine kind: a protocol is written once as a generator of engine steps, and a
sync or an async driver runs it against one engine kind's step functions.

A step is a tuple ``(name, *args)``; the driver calls ``ops[name](*args)`` (awaiting it in
:func:`drive_async`) and sends the result back into the generator. An error raised by a step is
thrown back into the generator at that ``yield``, so the protocol's own ``try``/``except`` clean-up
(resume the engine, remove a folder) runs on every engine kind. The generator's return value is
the driver's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator
from typing import Any

from ... import errors

#: ``TypeName: `` of our errors in a message (vLLM hands a worker's error to the driver as a plain
#: ``Exception`` carrying only its text; the backend puts the type name in front).
_ERROR_NAME = re.compile(r"\b([A-Z][A-Za-z]*Error): ")


def typed_error(e: BaseException) -> BaseException:
    """``e`` as the :mod:`torch_deltasync.errors` type its message names, when it is not one
    already: a worker's ``VersionNotFoundError`` reaches an offline ``LLM``'s or an ``AsyncLLM``'s
    driver as ``Exception("Call to collective_rpc method failed: Worker failed with error
    'VersionNotFoundError: ...'")``. Every worker's type when they agree (TP: ``worker 0:
    CorruptObjectError: ...; worker 1: ...``), else :class:`~torch_deltasync.errors.DeltaSyncError`;
    ``e`` itself for anything else. The original is the new error's ``__cause__``."""
    already = isinstance(e, errors.DeltaSyncError) and type(e) is not errors.DeltaSyncError
    if already or not isinstance(e, Exception):  # typed, or no error to map (KeyboardInterrupt, ...)
        return e
    named = {getattr(errors, n, None) for n in _ERROR_NAME.findall(str(e))}
    kinds = {k for k in named if isinstance(k, type) and issubclass(k, errors.DeltaSyncError)}
    if not kinds:
        return e
    kind = kinds.pop() if len(kinds) == 1 else errors.DeltaSyncError
    if kind is type(e):
        return e
    typed = kind(str(e))
    typed.__cause__ = e
    return typed

Steps = Generator[tuple, Any, Any]


def drive(gen: Steps, ops: dict[str, Callable[..., Any]]) -> Any:
    """Run a protocol generator with synchronous step functions; returns what the generator returns."""
    try:
        step = next(gen)
        while True:
            try:
                result = ops[step[0]](*step[1:])
            except BaseException as e:  # noqa: BLE001 (re-raised by the generator after its cleanup)
                step = gen.throw(typed_error(e))
                continue
            step = gen.send(result)
    except StopIteration as stop:
        return stop.value


async def drive_async(gen: Steps, ops: dict[str, Callable[..., Any]]) -> Any:
    """Run a protocol generator with ``async`` step functions; returns what the generator returns."""
    try:
        step = next(gen)
        while True:
            try:
                result = await ops[step[0]](*step[1:])
            except BaseException as e:  # noqa: BLE001 (re-raised by the generator after its cleanup)
                step = gen.throw(typed_error(e))
                continue
            step = gen.send(result)
    except StopIteration as stop:
        return stop.value
