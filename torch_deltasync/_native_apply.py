"""Compiled CPU kernels (numba) that read and write changed elements of live tensors: the targets'
apply step, the read of the old values a relative delta needs, and a decoded delta written in one
pass (:func:`apply_at`). Each prefetches the line it will touch :data:`PREFETCH_AHEAD` changes
ahead (:func:`prefetch`).

:class:`~torch_deltasync.targets.ModuleTarget` and :class:`~torch_deltasync.targets.VLLMTarget`
call them when :func:`torch_deltasync._native.enabled` is true and run their torch code
(``index_copy_`` after the layout map) otherwise; that torch code is the specification, and
``tests/unit/test_native.py`` checks both paths against each other and against a plain-Python map, bit
for bit (hypothesis fuzz over random maps, unsorted positions, positions outside the tensor or the
rank). The kernels write without bounds checks: each says what its caller must check first.
Compiled like the codec kernels (:func:`torch_deltasync._native.jit`: on first use, cached on
disk, releasing the GIL).
"""

from __future__ import annotations

import numpy as np

from ._dtypes import bits
from ._native import _K3, _U0, PREFETCH_AHEAD, _mix, _u64, prefetch
from ._native import jit as _jit

#: What :func:`apply_at` did.
APPLIED, BAD_POSITIONS, MISMATCH = 0, 1, 2

# The kernels a commit calls, which warm() compiles (apply_at serves the receiver's anchor path).
__all__ = ["np_bits", "warm", "scatter", "scatter_widened", "gather", "gather_widened", "grid_first_bad", "grid_held",
           "scatter_grid", "gather_grid"]


def np_bits(t):
    """The bit patterns of a CPU tensor (floating, or an integer view of one) as an unsigned numpy
    array of its width, sharing memory (numpy has no bf16; the kernels only move bit patterns).
    Always unsigned, so that a bf16 parameter and an int16 view of one reach a kernel with the
    same types and share one compiled specialization (:func:`warm`)."""
    return (bits(t) if t.is_floating_point() else t).numpy().view(f"u{t.element_size()}")


@_jit
def scatter(flat, pos, vals, offset):
    """``flat[pos[i] + offset] = vals[i]`` for every ``i`` (bit patterns of one width; ``pos``
    int64 ``(k,)``): ``index_copy_`` into a 1-D tensor, in one pass (each target line prefetched
    :data:`PREFETCH_AHEAD` changes ahead, as in every kernel here). The
    caller checked that every ``pos + offset`` is inside ``flat``."""
    k = pos.size
    for i in range(k):
        if i + PREFETCH_AHEAD < k:
            prefetch(flat, pos[i + PREFETCH_AHEAD] + offset)
        flat[pos[i] + offset] = vals[i]


@_jit
def scatter_widened(flat, pos, vals):
    """``flat[pos[i]] = vals[i] << 16``: bf16 bit patterns (uint16) into fp32 storage (uint32),
    where a bf16 value is the fp32 whose high half is its pattern (``ModuleTarget``'s widened
    storage). The caller checked the positions."""
    k = pos.size
    for i in range(k):
        if i + PREFETCH_AHEAD < k:
            prefetch(flat, pos[i + PREFETCH_AHEAD])
        flat[pos[i]] = np.uint32(vals[i]) << np.uint32(16)


@_jit
def gather(flat, pos, out, offset):
    """``out[i] = flat[pos[i] + offset]`` (bit patterns of one width): the inverse of
    :func:`scatter`, for the old values a relative delta resolves against (``flat[pos]`` in torch
    costs ~40 ns per element on the CPU, this ~1-5). Returns the index of the first ``pos[i] +
    offset`` outside ``flat`` (``out`` then holds garbage from there on), else -1."""
    n = flat.size
    k = pos.size
    for i in range(k):
        if i + PREFETCH_AHEAD < k:
            prefetch(flat, pos[i + PREFETCH_AHEAD] + offset)  # a prefetch never faults
        p = pos[i] + offset
        if p < 0 or p >= n:
            return i
        out[i] = flat[p]
    return -1


@_jit
def gather_widened(flat, pos, out):
    """``out[i] = flat[pos[i]] >> 16``: the bf16 bit patterns (uint16) held in fp32 storage
    (uint32), the inverse of :func:`scatter_widened`. Returns the first out-of-range index, else -1."""
    n = flat.size
    k = pos.size
    for i in range(k):
        if i + PREFETCH_AHEAD < k:
            prefetch(flat, pos[i + PREFETCH_AHEAD])
        p = pos[i]
        if p < 0 or p >= n:
            return i
        out[i] = np.uint16(flat[p] >> np.uint32(16))
    return -1


@_jit
def grid_first_bad(pos, numel, ncols, rows, cols):
    """Index of the first of ``pos`` (int64 global flat indices of a tensor viewed as ``(numel //
    ncols, ncols)``) that is outside ``[0, numel)`` or that a separable 2-D map does not hold
    (``rows[r] < 0`` or ``cols[c] < 0``; an empty table is the identity), else -1. The check pass of
    :func:`scatter_grid`: one division per row change, not per element."""
    start = -ncols - 1  # the row held in ``lr``: none yet
    lr = np.int64(0)
    for i in range(pos.size):
        p = pos[i]
        if p < 0 or p >= numel:
            return i
        if p < start or p - start >= ncols:
            r = p // ncols
            start = r * ncols
            lr = rows[r] if rows.size else r
        if lr < 0 or (cols.size and cols[p - start] < 0):
            return i
    return -1


@_jit
def grid_held(pos, ncols, rows, cols, out):
    """``out[i]`` (bool) = whether the separable 2-D map of :func:`grid_first_bad` holds
    ``pos[i]``; every position must be inside the tensor (checked by the caller)."""
    start = -ncols - 1
    lr = np.int64(0)
    for i in range(pos.size):
        p = pos[i]
        if p < start or p - start >= ncols:
            r = p // ncols
            start = r * ncols
            lr = rows[r] if rows.size else r
        out[i] = lr >= 0 and (cols.size == 0 or cols[p - start] >= 0)


@_jit
def _grid_at(p, start, rb, ncols, rows, cols, s0, s1, base):
    """``(start, rb, offset)``: the local offset of global flat index ``p = r * ncols + c`` under
    the separable map of :func:`scatter_grid`, carrying the current row (``start``: its first
    global index, ``rb``: its local base) so that only a row change costs a division."""
    if p < start or p - start >= ncols:
        r = p // ncols
        start = r * ncols
        rb = base + (rows[r] if rows.size else r) * s0
    c = p - start
    return start, rb, rb + (cols[c] if cols.size else c) * s1


@_jit
def scatter_grid(flat, pos, vals, ncols, rows, cols, s0, s1, base):
    """``flat[base + R(r) * s0 + C(c) * s1] = vals[i]`` for every ``pos[i] = r * ncols + c``, with
    ``R = rows``, ``C = cols`` (empty: identity): a separable 2-D layout map (``VLLMTarget``'s TP
    maps; its module doc) fused with the scatter, one division per row change. The caller ran
    :func:`grid_first_bad` on ``pos`` first (every entry held and in range)."""
    start, rb = -ncols - 1, np.int64(0)
    ahead, ahead_rb = -ncols - 1, np.int64(0)  # a second cursor, mapping the entry to prefetch
    k = pos.size
    for i in range(k):
        if i + PREFETCH_AHEAD < k:
            ahead, ahead_rb, next_at = _grid_at(pos[i + PREFETCH_AHEAD], ahead, ahead_rb, ncols, rows, cols, s0, s1, base)
            prefetch(flat, next_at)
        start, rb, at = _grid_at(pos[i], start, rb, ncols, rows, cols, s0, s1, base)
        flat[at] = vals[i]


@_jit
def gather_grid(flat, pos, out, ncols, rows, cols, s0, s1, base):
    """``out[i] = flat[base + R(r) * s0 + C(c) * s1]`` for ``pos[i] = r * ncols + c``: the read
    of :func:`scatter_grid`'s map. The caller ran :func:`grid_first_bad` on ``pos`` first."""
    start, rb = -ncols - 1, np.int64(0)
    ahead, ahead_rb = -ncols - 1, np.int64(0)
    k = pos.size
    for i in range(k):
        if i + PREFETCH_AHEAD < k:
            ahead, ahead_rb, next_at = _grid_at(pos[i + PREFETCH_AHEAD], ahead, ahead_rb, ncols, rows, cols, s0, s1, base)
            prefetch(flat, next_at)
        start, rb, at = _grid_at(pos[i], start, rb, ncols, rows, cols, s0, s1, base)
        out[i] = flat[at]


@_jit
def apply_at(flat, pos, steps, relative, values, check, base):
    """Write a decoded delta into ``flat`` (unsigned bit patterns of the whole tensor) in place:
    ``flat[p] = flat[p] + step`` (wrapped) where relative, else the raw value; ``steps`` empty
    means overwrite every entry with ``values``. With ``check``, the checksum of the old values at
    ``pos`` must equal ``base`` (uint64) first.

    Returns:
        ``APPLIED``; ``BAD_POSITIONS`` (``pos`` is not strictly increasing inside ``flat``: a
        repeated position would take two steps) or ``MISMATCH``, writing nothing.
    """
    k = pos.size
    if k and (pos[0] < 0 or pos[k - 1] >= flat.size):
        return BAD_POSITIONS
    bad = False
    for i in range(1, k):  # vectorises (increasing from pos[0] >= 0 to pos[-1] < size: all inside)
        bad |= pos[i] <= pos[i - 1]
    if bad:
        return BAD_POSITIONS
    if check:
        ck = _U0
        for i in range(k):
            if i + PREFETCH_AHEAD < k:
                prefetch(flat, pos[i + PREFETCH_AHEAD])
            ck += _mix(_u64(pos[i])) * (_u64(flat[pos[i]]) + _K3)
        if ck != base:
            return MISMATCH
    for i in range(k):
        if i + PREFETCH_AHEAD < k:
            prefetch(flat, pos[i + PREFETCH_AHEAD])
        p = pos[i]
        if steps.size == 0:
            flat[p] = values[i]
        elif relative.size == 0:
            flat[p] = flat[p] + steps[i]
        else:
            flat[p] = flat[p] + steps[i] if relative[i] else values[i]
    return APPLIED


def warm() -> None:
    """Compile every kernel of this module (or load it from numba's disk cache, ~0.1 s) for the
    types targets call them with: bit patterns of 2 bytes (bf16, fp16) and 4 bytes (fp32) as
    unsigned 1-D arrays (:func:`np_bits`), int64 positions and Python-int offsets and strides.

    A kernel compiles on its first call (seconds on 2 cores), and a commit's writes are its first
    call in a process: the vLLM backend calls this when it attaches, so that an engine's first
    pause does not include a compile; ``tools/warm_kernels.py`` calls it on set-up to fill the
    cache. A no-op without numba.
    """
    from . import _native

    if not _native.enabled():
        return
    pos, none = np.zeros(1, np.int64), np.empty(0, np.int64)
    for width in (np.uint16, np.uint32):
        flat, vals = np.zeros(2, width), np.zeros(1, width)
        scatter(flat, pos, vals, 0)
        gather(flat, pos, vals, 0)
        scatter_grid(flat, pos, vals, 1, none, none, 0, 1, 0)
        gather_grid(flat, pos, vals, 1, none, none, 0, 1, 0)
    scatter_widened(np.zeros(1, np.uint32), pos, np.zeros(1, np.uint16))
    gather_widened(np.zeros(1, np.uint32), pos, np.zeros(1, np.uint16))
    grid_first_bad(pos, 1, 1, none, none)
    grid_held(pos, 1, none, none, np.zeros(1, np.bool_))
