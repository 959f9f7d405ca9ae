"""Size estimates behind the ``packed`` encoder's choices (gap shift, code width, dense forms).

Entropy-coded sizes in bits from histograms (zstd's Huffman stage codes bytes; these estimate what
it will reach), shared by the numpy specification and the compiled encoder (compiled with numba
when it is installed).
"""

from __future__ import annotations

import math

import numpy as np

from .. import _native


#: ``c log2 c`` for the counts ``c < XLOG2X_TABLE`` (0 for 0): most histogram bins hold small
#: counts, and a table lookup costs a fraction of a ``log2`` call (with one per bin, the gap-shift
#: and code-width estimates took 25-32 us per tensor, 11-15 us with the table and the sums below).
XLOG2X_TABLE = 1 << 12
_XLOG2X = np.array([0.0] + [c * math.log2(c) for c in range(1, XLOG2X_TABLE)])


@_native.jit
def xlog2x(c: int) -> float:
    """``c * log2(c)`` for a count ``c >= 0`` (0 for 0), from a table below ``XLOG2X_TABLE``."""
    return _XLOG2X[c] if c < XLOG2X_TABLE else c * math.log2(c)


@_native.jit
def huffman_bits_from_sums(total: int, c_max: int, used: int, xsum: float, per_byte: int, table: bool) -> float:
    """:func:`huffman_bits` of a histogram given its sums: ``total`` count, largest count
    ``c_max``, ``used`` non-zero bins and ``xsum``, the sum of ``xlog2x`` over its bins. The
    order-0 entropy in bits is ``total log2 total - sum c log2 c`` (Shannon's ``-sum c log2(c /
    total)`` with the logarithm split)."""
    if total == 0:
        return 0.0
    nbytes = total / per_byte
    entropy = max(xlog2x(total) - xsum, 0.0)
    p_max_byte = (c_max / total) ** per_byte
    table_bits = 4 * min(used ** per_byte, 256) if table else 0
    return max(entropy, nbytes) + nbytes * (p_max_byte + 0.086) + table_bits


@_native.jit
def huffman_bits(hist: np.ndarray, per_byte: int, table: bool) -> float:
    """Estimated size in bits of a byte stream after zstd's Huffman stage.

    Compiled (:func:`torch_deltasync._native.jit`) and shared by the numpy and the native encoder,
    so both make the same choices.

    Args:
        hist: histogram of the symbols (int64 ``(m,)``); symbols are packed ``per_byte`` to a
            byte and assumed independent.
        per_byte: symbols per byte (1, 2 or 4).
        table: add the cost of describing the Huffman table.

    Returns:
        ``max(entropy, 1 bit per byte) + (p_max + 0.086) bits per byte + 4 bits per symbol``:
        the order-0 entropy, Huffman's floor of one bit per coded byte, Gallager's redundancy
        bound (see :meth:`PackedCodec._choose_code_bits`), and roughly what zstd spends to
        describe the Huffman table (which matters for small tensors).
    """
    total = 0
    c_max = 0
    used = 0
    xsum = 0.0
    for c in hist:
        total += c
        c_max = max(c_max, c)
        used += c > 0
        xsum += xlog2x(c)
    return huffman_bits_from_sums(total, c_max, used, xsum, per_byte, table)


@_native.jit
def best_gap_shift(k: int, r_lo: int, r_hi: int, base: np.ndarray) -> int:
    """The body of :meth:`PackedCodec._choose_gap_shift` (compiled). Bin ``j`` at shift ``r_lo + d``
    sums bins ``j 2**d .. (j + 1) 2**d - 1`` of ``base``: a difference of its prefix sums."""
    best_r = 0
    best = np.inf
    cum = np.empty(base.size + 1, np.int64)
    cum[0] = 0
    for q in range(base.size):
        cum[q + 1] = cum[q] + base[q]
    hist = np.empty(256, np.int64)
    for r in range(r_lo, r_hi + 1):
        f = 1 << (r - r_lo)
        for j in range(255):
            hist[j] = cum[(j + 1) * f] - cum[j * f]
        hist[255] = k - cum[255 * f]  # escapes: high part >= 255
        est = huffman_bits(hist, 1, True) + hist[255] * 16 + k * r
        if est < best:
            best_r = r
            best = est
    return best_r


@_native.jit
def best_step_code(k: int, width: int, hz: np.ndarray) -> tuple[int, float, bool]:
    """The best code width among 2, 4 and 8 bits (at most the dtype's width) by the estimate of
    :meth:`PackedCodec._choose_code_bits`, its estimate in bits, and whether 16-bit codes could
    do better (more than 1 in 64 steps need more than 8 bits) (compiled).

    An escaped step ``z > M`` is costed as a byte of its own (a varint's first byte), so each
    width's estimate adds :func:`huffman_bits` of the bins ``M + 1 .. cap - 1``: their sums
    come from one pass down the histogram, which snapshots them at ``M + 1`` for each width."""
    raw_cost = 8 * width  # bits of an entry escaped to a raw value (or a varint as long)
    cap = hz.size - 1
    n_raw = hz[0] + hz[cap]  # no step (z = 0) or a huge one
    tails = np.zeros((3, 3), np.int64)  # per width: count, largest count, used bins above M
    tail_x = np.zeros(3)  # per width: xlog2x summed over the bins above M
    total, c_max, used, xsum = 0, 0, 0, 0.0
    q = cap - 1
    while q >= 256 + 8:  # skip the empty top bins (most of them), 8 at a time
        z = 0
        for j in range(8):
            z |= hz[q - j]
        if z:
            break
        q -= 8
    for i, M in enumerate((255, 15, 3)):  # 8, 4 then 2 bits: each tail extends the last
        while q > M:
            c = hz[q]
            total += c
            c_max = max(c_max, c)
            used += c > 0
            xsum += xlog2x(c)
            q -= 1
        tails[2 - i, 0], tails[2 - i, 1], tails[2 - i, 2], tail_x[2 - i] = total, c_max, used, xsum
    best_b = 0
    best = np.inf
    for i, b in enumerate((2, 4, 8)):
        if b > 8 * width:
            break
        M = (1 << b) - 1
        code_hist = np.empty(M + 1, np.int64)  # code c = z - 1; c = M escapes
        code_hist[:M] = hz[1 : M + 1]
        code_hist[M] = tails[i, 0] + hz[cap] + hz[0]
        est = huffman_bits(code_hist, 8 // b, False) + n_raw * raw_cost
        est += huffman_bits_from_sums(tails[i, 0], tails[i, 1], tails[i, 2], tail_x[i], 1, False)
        if est < best:
            best_b = b
            best = est
    return best_b, best, width >= 2 and (tails[2, 0] + hz[cap]) * 64 >= k


@_native.jit
def gap_shift_window(k: int, last: int, max_shift: int) -> tuple[int, int]:
    """The candidate gap shifts ``r_lo .. r_hi`` for ``k`` positions ending at ``last``: around
    ``r0 = floor(log2(mean gap / 24))``, ``r0 - 1 .. r0 + 2`` within ``0 .. max_shift``. The mean
    gap is exact from the last position: the gaps of ``k`` positions add up to ``last - (k - 1)``
    (compiled; shared by both encoders)."""
    if k == 0:
        return 0, 0
    mean = (last - k + 1) / k
    r0 = max(0, int(np.log2(max(mean, 1.0) / 24)))
    r_hi = min(max_shift, r0 + 2)
    return min(max(0, r0 - 1), r_hi), r_hi


def binary_entropy(p: float) -> float:
    """Entropy in bits of a Bernoulli(``p``) variable: ``-p log2 p - (1-p) log2 (1-p)``."""
    if p <= 0 or p >= 1:
        return 0.0
    return -p * math.log2(p) - (1 - p) * math.log2(1 - p)


#: Change sets of ``SAMPLE_FROM`` changes and more cost their gap shift and code width on every
#: ``SAMPLE_EVERY``-th block of 4096 gaps and steps, the first included (the estimates need the
#: distributions, not every entry: the full gap histogram was two thirds of ``encode_plan``'s time
#: and the full step histogram a third of the encoder's kernel time before it was sampled). From
#: 16384 changes on at least one block (4096 entries) is costed, and steps spread wide
#: (:func:`wide_steps`) are costed in full; the choices and sizes of the change sets in
#: ``tools/bench_codec.py`` are the same as when costing every entry.
SAMPLE_EVERY = 4
SAMPLE_FROM = 1 << 14


@_native.jit
def wide_steps(n_wide: int, m: int) -> bool:
    """Whether the first block of steps, ``m`` of them with ``n_wide`` of 256 or more, is spread too
    wide to cost on a sample (then every step is costed): a histogram of a few thousand samples
    over thousands of bins underestimates their entropy (the plug-in estimator's bias), enough to
    choose 2-bit codes 9% larger than 16-bit codes or raw values (compiled; shared by both
    encoders)."""
    return n_wide * 64 > m


#: Steps with a zigzag value of at least this are costed as raw values (the last bin of the step
#: histogram).
STEP_CAP = 1 << 12
