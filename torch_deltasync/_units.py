"""Units: human-readable ones for what the CLI and ``follow`` print, and the check of a number of
seconds or bytes given by a caller."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"624 B"``, ``"411.2 KiB"``, ... up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def is_real_number(x: object) -> bool:
    """An int or float (numpy scalars included), not a bool: what a duration or a size may be."""
    import numbers

    return isinstance(x, numbers.Real) and not isinstance(x, bool)
