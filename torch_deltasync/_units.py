"""Units: human-readable sizes for what the CLI and ``follow`` print, and checked numbers of seconds
(durations, timeouts, poll intervals) given by a caller."""

from __future__ import annotations

import math
import numbers


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"624 B"``, ``"411.2 KiB"``, ... up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def is_real_number(x: object) -> bool:
    """An int or float (numpy scalars included), not a bool: what a duration or a size may be."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_seconds(value: object, name: str, where: str, *, positive: bool, none_ok: bool = False,
                  none_means: str = "to wait without a time limit", finite: bool = True) -> float | None:
    """A duration in seconds from the caller (a timeout, a poll interval), returned unchanged (but
    for an int past a float's range, which is ``inf`` where that is accepted).

    Args:
        value: the caller's value: a real number (``bool`` is not one), or ``None`` if ``none_ok``.
        name: the argument's name, for the message (``"poll_s"``).
        where: the function or object that takes it, for the message (``"poll_until"``).
        positive: ``> 0`` (a poll interval: ``0`` would spin); else ``>= 0`` (a timeout).
        none_ok: ``None`` is accepted (what it means is the caller's: "never", "the default").
        none_means: what ``None`` does, for the hint in the message (with ``none_ok``).
        finite: refuse ``inf`` (``False``: ``inf`` is accepted, e.g. a timeout that never ends).

    Raises:
        TypeError: not a real number (nor ``None`` where that is accepted).
        ValueError: NaN, infinite, or out of range.
    """
    if value is None and none_ok:
        return None
    bound = "> 0" if positive else ">= 0"
    forever = f"; pass None {none_means}" if none_ok else ""
    if not is_real_number(value):
        raise TypeError(f"{where}: {name} must be a number of seconds {bound}"
                        f"{' or None' if none_ok else ''}, got {type(value).__name__} {value!r}")
    try:
        as_float = float(value)
    except OverflowError:  # an int past ~1.8e308: as long as forever
        as_float = value = math.inf if value > 0 else -math.inf
    if math.isnan(as_float) or (finite and math.isinf(as_float)) or (value <= 0 if positive else value < 0):
        raise ValueError(f"{where}: {name} must be a{' finite' if finite else ''} number of seconds {bound}, "
                         f"got {value!r}{forever}")
    return value
