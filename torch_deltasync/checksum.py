r"""Per-tensor checksums that add up across any partition of the elements.

The checksum of a tensor ``x`` in the inference dtype, over its global flat indices ``i``
(row-major positions in the full HF-layout tensor), is

.. math::

    C(x) = \sum_i \operatorname{mix}(i) \cdot (\operatorname{bits}(x_i) + K_3) \bmod 2^{64}

where ``bits`` is the unsigned bit pattern of the element (``0 .. 2**16-1`` for bf16) and ``mix`` is
the splitmix64-style finaliser below. Because it is a plain sum, any partition of the elements
(FSDP2 dim-0 shards, a 2-D FSDP x TP mesh, vLLM TP slices with each replicated element counted on
one rank, or just the elements a delta changed) yields partial sums that combine by addition:

* a sharded sender computes one partial per rank and rank 0 adds them;
* a receiver updates the checksum of a tensor in ``O(nnz)`` when a delta changes ``nnz`` elements:
  ``C' = C - partial(old values at P) + partial(new values at P)``.

All arithmetic is int64 with two's-complement wrap-around, which torch implements identically on
CPU and CUDA, so the result is exactly the value modulo ``2**64``. The weighting by ``mix(i)``
makes the sum position-sensitive (swapping two values changes it), and ``K_3`` makes zero bit
patterns (``+0.0``) count. It is an integrity check against corruption and bugs, not a
cryptographic MAC; object bytes are additionally protected by sha256 in the manifest.

The wire form is 16 lower-case hex digits (``format_checksum``).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from . import _native
from ._dtypes import bits, unsigned_bits64
from .errors import ChecksumMismatchError

_HEX16 = re.compile("[0-9a-f]{16}")  # the wire form of format_checksum

__all__ = ["checksum", "checksum_change", "tensor_checksum", "combine", "combine_partials", "check_partials", "format_checksum",
           "parse_checksum"]

_MASK64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch needs."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


_K0 = _s64(0x9E3779B97F4A7C15)  # golden-ratio increment (splitmix64)
_K1 = _s64(0xBF58476D1CE4E5B9)  # splitmix64 multiplier 1
_K2 = _s64(0x94D049BB133111EB)  # splitmix64 multiplier 2
_K3 = 0x5BD1E995  # offset so that an all-zero bit pattern still contributes

# Elements per chunk when checksumming whole tensors: bounds the int64 temporaries to ~8 MiB each.
_CHUNK = 1 << 20


def _xor_lsr_(h: torch.Tensor, s: int, tmp: torch.Tensor) -> None:
    """``h ^= h >>> s`` in place (logical shift; torch's ``>>`` is arithmetic on signed integers)."""
    torch.bitwise_right_shift(h, s, out=tmp)
    tmp.bitwise_and_((1 << (64 - s)) - 1)
    h.bitwise_xor_(tmp)


def _mix_(h: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser of ``h + K0``, in place on an int64 tensor (Steele, Lea & Flood, OOPSLA
    2014). In-place ops keep it at ~7 ns/element on one CPU core instead of ~20 with temporaries."""
    tmp = torch.empty_like(h)
    h.add_(_K0)
    _xor_lsr_(h, 30, tmp)
    h.mul_(_K1)
    _xor_lsr_(h, 27, tmp)
    h.mul_(_K2)
    _xor_lsr_(h, 31, tmp)
    return h


def _u(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of a 1-D CPU tensor as a numpy unsigned array of its width (a view when
    contiguous)."""
    return bits(t.contiguous()).numpy().view(f"u{t.element_size()}")


def _native_ok(*tensors: torch.Tensor) -> bool:
    return _native.enabled() and all(t.device.type == "cpu" for t in tensors)


def checksum(values: torch.Tensor, positions: torch.Tensor | None = None, *, start: int = 0) -> int:
    """Partial checksum of some elements of one tensor.

    Args:
        values: 1-D tensor of shape ``(k,)`` in the inference dtype (any floating dtype; the bit
            pattern is what counts). Any device.
        positions: global flat indices of ``values`` in the full HF-layout tensor, shape ``(k,)``,
            integer dtype, on the same device. ``None`` means ``start, start + 1, ...``.
        start: first global flat index when ``positions`` is ``None``.

    Returns:
        The partial sum as an unsigned integer in ``[0, 2**64)``.
    """
    if values.dim() != 1:
        raise ValueError(f"checksum expects a 1-D tensor, got shape {tuple(values.shape)}")
    if positions is not None and positions.shape != values.shape:
        raise ValueError(f"positions {tuple(positions.shape)} and values {tuple(values.shape)} differ")
    if _native_ok(values, *(() if positions is None else (positions,))):
        if positions is None:
            return int(_native.checksum_range(start, _u(values)))
        return int(_native.checksum_at(positions.to(torch.int64).contiguous().numpy(), _u(values)))
    if positions is None:
        h = torch.arange(start, start + values.numel(), dtype=torch.int64, device=values.device)
    else:
        h = positions.to(torch.int64, copy=True)
    if values.numel() == 0:
        return 0
    _mix_(h)
    h.mul_(unsigned_bits64(values).add_(_K3))
    return int(h.sum().item()) & _MASK64


def checksum_change(positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int:
    """How the checksum of a tensor changes when the elements at ``positions`` go from ``old`` to
    ``new``: ``checksum(new, positions) - checksum(old, positions)`` mod ``2**64``, with one
    ``mix`` pass instead of two (the ``K3`` terms cancel): ``sum mix(i) * (bits(new_i) - bits(old_i))``.

    Args:
        positions: int64 ``(k,)`` global flat indices.
        old, new: ``(k,)`` values in the inference dtype before and after.

    Returns:
        The difference as an unsigned integer in ``[0, 2**64)``; ``combine(c, d)`` applies it.
    """
    if not (positions.shape == old.shape == new.shape) or positions.dim() != 1:
        raise ValueError(f"positions {tuple(positions.shape)}, old {tuple(old.shape)} and new {tuple(new.shape)} differ")
    if positions.numel() == 0:
        return 0
    if _native_ok(positions, old, new) and old.dtype == new.dtype:
        return int(_native.checksum_diff(positions.to(torch.int64).contiguous().numpy(), _u(old), _u(new)))
    h = _mix_(positions.to(torch.int64, copy=True))
    h.mul_(unsigned_bits64(new).sub_(unsigned_bits64(old)))
    return int(h.sum().item()) & _MASK64


def tensor_checksum(
    t: torch.Tensor,
    *,
    index_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
    chunk: int = _CHUNK,
) -> int:
    """Checksum of every element of ``t``, in chunks of ``chunk`` elements.

    Args:
        t: tensor in the inference dtype, any shape (read in row-major order).
        index_map: maps local flat positions (int64, ``(n,)``) to global flat indices of the full
            tensor; ``None`` when ``t`` is the full tensor. See :class:`torch_deltasync.layout.TensorSlice`.
        chunk: elements per step; bounds temporary memory to about ``24 * chunk`` bytes.

    Returns:
        Unsigned integer in ``[0, 2**64)``; the sum of :func:`checksum` over the chunks.
    """
    flat = t.reshape(-1)
    if index_map is None and _native_ok(flat):
        return int(_native.checksum_range(0, _u(flat)))
    total = 0
    for a in range(0, flat.numel(), chunk):
        b = min(a + chunk, flat.numel())
        if index_map is None:
            total += checksum(flat[a:b], start=a)
        else:
            local = torch.arange(a, b, dtype=torch.int64, device=t.device)
            total += checksum(flat[a:b], index_map(local))
    return total & _MASK64


def combine(*parts: int) -> int:
    """Add partial checksums modulo ``2**64`` (partials of disjoint element sets)."""
    return sum(parts) & _MASK64


def combine_partials(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Per-tensor sums of the partial checksums of several holders (e.g. every TP worker of one
    vLLM engine, each counting the elements it holds once across the engine).

    Args:
        parts: one ``{tensor name: partial checksum}`` per holder; a name missing from a holder
            counts as 0 there.

    Returns:
        ``{name: combined checksum}`` over the union of names, each in ``[0, 2**64)``.
    """
    out: dict[str, int] = {}
    for part in parts:
        for name, value in part.items():
            out[name] = (out.get(name, 0) + value) & _MASK64
    return out


def check_partials(expected: Mapping[str, int], parts: Iterable[Mapping[str, int]], *, what: str = "") -> None:
    """Check that the combined partials of several holders equal the published checksums.

    Args:
        expected: ``{tensor name: checksum}`` from the manifest of the version held.
        parts: the holders' partials (see :func:`combine_partials`).
        what: context for the message (e.g. ``"version 12"``).

    Raises:
        ChecksumMismatchError: a tensor's combined checksum differs (the message names up to 3).
    """
    combined = combine_partials(parts)
    bad = [n for n, c in expected.items() if combined.get(n, 0) != c & _MASK64]
    if bad:
        raise ChecksumMismatchError(
            f"{what + ': ' if what else ''}{len(bad)} of {len(expected)} tensors differ from the published "
            f"checksums when the holders' partials are combined, e.g. {bad[:3]}"
        )


def format_checksum(value: int) -> str:
    """Wire form: 16 lower-case hex digits."""
    return f"{value & _MASK64:016x}"


def parse_checksum(text: object) -> int:
    """Inverse of :func:`format_checksum` for untrusted input.

    Raises:
        ValueError: ``text`` is not 16 hex digits.
    """
    if not isinstance(text, str) or _HEX16.fullmatch(text) is None:
        raise ValueError(f"checksum must be 16 hex digits, got {text!r}")
    return int(text, 16)
