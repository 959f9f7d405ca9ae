"""Human-readable units for what the CLI and ``follow`` print."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"624 B"``, ``"411.2 KiB"``, ... up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
