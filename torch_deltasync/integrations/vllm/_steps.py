"""One protocol, every engine kind: a protocol is written once as a generator of engine steps, and a
sync or an async driver runs it against one engine kind's step functions.

A step is a tuple ``(name, *args)``; the driver calls ``ops[name](*args)`` (awaiting it in
:func:`drive_async`) and sends the result back into the generator. An error raised by a step is
thrown back into the generator at that ``yield``, so the protocol's own ``try``/``except`` clean-up
(resume the engine, remove a folder) runs on every engine kind. The generator's return value is
the driver's.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

Steps = Generator[tuple, Any, Any]


def drive(gen: Steps, ops: dict[str, Callable[..., Any]]) -> Any:
    """Run a protocol generator with synchronous step functions; returns what the generator returns."""
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


async def drive_async(gen: Steps, ops: dict[str, Callable[..., Any]]) -> Any:
    """Run a protocol generator with ``async`` step functions; returns what the generator returns."""
    try:
        step = next(gen)
        while True:
            try:
                result = await ops[step[0]](*step[1:])
            except BaseException as e:  # noqa: BLE001 (re-raised by the generator after its cleanup)
                step = gen.throw(e)
                continue
            step = gen.send(result)
    except StopIteration as stop:
        return stop.value
