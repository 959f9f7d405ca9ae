"""Choosing the delta codec by link speed: ``DeltaSender(codec="auto", link_gbps=...)``.

``packed`` ships about 1 byte per changed bf16 element where ``raw`` ships 6, and costs more CPU
per change on each side: on the benchmark machine (``docs/benchmarks.md``, "Native kernels", cost
model) packed encode + decode+resolve cost 10-14 ns per change against 2-3 ns for raw, one core
each side. The ~5 bytes saved take ``8 * 5 / link_gbps`` ns to send, so ``packed`` is faster to a
new version while ``40 / link_gbps > ~9``, i.e. below **3-4.5 Gbit/s per encoding/decoding core**
(the measured crossover of the Qwen3 and synthetic change sets), and ``raw`` above. The threshold
here, :data:`PACKED_BELOW_GBPS`, is 4 Gbit/s. Bytes stored (and egress billed) are always 5-6x
smaller with ``packed``: choose it explicitly when storage or egress cost matters more than time.
"""

from __future__ import annotations

import math

__all__ = ["PACKED_BELOW_GBPS", "auto_codec", "sender_codec"]

#: Link speed (Gbit/s, per sender-to-receiver path) below which ``codec="auto"`` picks ``packed``
#: and at or above which it picks ``raw``: the crossover of the cost model in
#: ``docs/benchmarks.md`` (3-4.5 Gbit/s per core on the Qwen3 and synthetic change sets).
PACKED_BELOW_GBPS = 4.0


def auto_codec(link_gbps: float) -> str:
    """The codec that brings a new version to the receivers sooner over a link of ``link_gbps``.

    Args:
        link_gbps: the bandwidth each receiver gets from the store, in Gbit/s (the slowest
            receiver's, when they differ).

    Returns:
        ``"packed"`` below :data:`PACKED_BELOW_GBPS`, else ``"raw"``.

    Raises:
        ValueError: ``link_gbps`` is not a positive finite number.

    Example:
        >>> auto_codec(1.0), auto_codec(25.0)
        ('packed', 'raw')
    """
    if isinstance(link_gbps, bool) or not isinstance(link_gbps, (int, float)) or not math.isfinite(link_gbps) \
            or link_gbps <= 0:
        raise ValueError(f"link_gbps must be a positive number of Gbit/s (e.g. 10.0), got {link_gbps!r}")
    return "packed" if link_gbps < PACKED_BELOW_GBPS else "raw"


def sender_codec(codec: str, link_gbps: float | None) -> str:
    """The codec name a sender built with ``codec`` and ``link_gbps`` uses: :func:`auto_codec`
    of ``link_gbps`` for ``"auto"``, else ``codec`` itself.

    Raises:
        ValueError: ``"auto"`` without ``link_gbps`` or with a bad one, or ``link_gbps`` given
            with another codec (it would be ignored).
    """
    if codec == "auto":
        if link_gbps is None:
            raise ValueError('codec="auto" chooses by link speed: pass link_gbps= (Gbit/s from the store to '
                             'each receiver), or name the codec ("packed" or "raw")')
        return auto_codec(link_gbps)
    if link_gbps is not None:
        raise ValueError(f'link_gbps is only used by codec="auto"; this sender uses codec={codec!r}')
    return codec
