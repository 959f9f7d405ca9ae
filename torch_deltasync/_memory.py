"""How much memory this machine has: the bound the manifest checks untrusted tensor shapes against
(:meth:`~torch_deltasync.manifest.Manifest.zeros`) and the one ``deltasync demo`` sizes itself by."""

from __future__ import annotations

import os


def physical_nbytes() -> int | None:
    """Bytes of physical memory, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def available_nbytes() -> int | None:
    """Bytes of memory available for new work (Linux ``MemAvailable``; else physical), or ``None``."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_nbytes()
