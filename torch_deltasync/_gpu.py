"""Triton kernels for change detection and for applying deltas on CUDA tensors.

What they compute is specified by the CPU code: :meth:`ChangeDetector.detect
<torch_deltasync.detect.ChangeDetector.detect>` (positions, new and old values of the elements
whose bit pattern in the inference dtype differs from the snapshot) and ``flat.index_copy_(0,
positions, values)`` / :meth:`TensorDelta.resolve <torch_deltasync.codecs.TensorDelta.resolve>`
(overwrite, or add steps to the bit patterns). ``tests/unit/test_gpu.py`` runs them on the CPU
under Triton's interpreter (``TRITON_INTERPRET=1``) against that code, and ``tools/gpu_check.sh``
measures them against HBM bandwidth on a GPU (``tools/bench_gpu_kernels.py``).

Detection is a stream compaction in two passes over the tensor: pass 1 casts each block (fp32 ->
bf16 by round-to-nearest-even on the bit pattern, or no cast when the tensor is already in the
inference dtype), compares bit patterns with the snapshot and writes the block's count of
changes; an exclusive prefix sum of the counts gives each block its output offset; pass 2 writes
positions, new and old values in order. A NaN becomes 0x7FC0, as in the published cast
(:func:`torch_deltasync._dtypes.cast`) and the CPU kernel. Two ways to find the changes again in
pass 2 (``detect(method=...)``):

* ``"reread"``: cast and compare again, reading the tensor and the snapshot in full a second time
  (12 bytes per fp32 element over both passes, never a mask or a cast copy);
* ``"bitmask"``: pass 1 also writes one bit per element (1/8 byte), and pass 2 reads the bits and
  loads the tensor and the snapshot only where a bit is set. A GPU fetches memory in 32-byte
  sectors for the lanes that load, so at 1% density pass 2 reads about 0.7 bytes per element
  instead of 6 (at 5%, about 2.6; changes at random).

Both write the same outputs (``tests/gpu_kernels_checks.py``); ``tools/bench_gpu_kernels.py``
times both against HBM bandwidth, and ``"reread"`` stays the default until a GPU has measured them.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch's CUDA wheels
    triton = None

__all__ = ["available", "detect", "scatter", "apply_steps", "METHODS"]

BLOCK = 1024  # elements per program (a multiple of 32: the bitmask's words)

#: The kernels index with int32 offsets: tensors of this many elements or more (and as many
#: changes) are left to torch (:func:`detect` returns ``None``; the apply kernels refuse them).
MAX_NUMEL = 2**31 - BLOCK

#: The ways :func:`detect` can find the changes in its second pass (the module's docstring).
METHODS = ("reread", "bitmask")


def available(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: a CUDA device with triton importable, or any
    device under Triton's interpreter (``TRITON_INTERPRET=1``, for tests on the CPU)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _load(src_ptr, snap_ptr, offs, mask, CAST: tl.constexpr):
        """New (cast) and old bit patterns at ``offs`` where ``mask`` (the snapshot's integer type)."""
        old = tl.load(snap_ptr + offs, mask=mask, other=0)
        if CAST:  # fp32 bits -> bf16 bits: round to nearest even, a NaN as 0x7FC0 (the published cast)
            u = tl.load(src_ptr + offs, mask=mask, other=0)
            rne = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            new = (tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rne) & 0xFFFF).to(tl.int16)  # wraps to signed
        else:
            new = tl.load(src_ptr + offs, mask=mask, other=0)
        return new, old

    @triton.jit
    def _changed(src_ptr, snap_ptr, offs, n, CAST: tl.constexpr):
        """Mask of changed elements at ``offs`` and their new and old bit patterns."""
        inside = offs < n
        new, old = _load(src_ptr, snap_ptr, offs, inside, CAST)
        return (new != old) & inside, new, old

    @triton.jit
    def _or(a, b):
        return a | b

    @triton.jit
    def _count_kernel(src_ptr, snap_ptr, counts_ptr, n, CAST: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        changed, _, _ = _changed(src_ptr, snap_ptr, offs, n, CAST)
        tl.store(counts_ptr + pid, tl.sum(changed.to(tl.int32), axis=0))

    @triton.jit
    def _count_bits_kernel(src_ptr, snap_ptr, counts_ptr, bits_ptr, n, CAST: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 1 of ``"bitmask"``: the block's count, and bit ``j`` of word ``i`` set where element
        ``32 i + j`` of the block changed (int32 words, ``BLOCK // 32`` per block)."""
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        changed, _, _ = _changed(src_ptr, snap_ptr, offs, n, CAST)
        c = changed.to(tl.int32)
        tl.store(counts_ptr + pid, tl.sum(c, axis=0))
        words = tl.reduce(tl.reshape(c, (BLOCK // 32, 32)) << tl.arange(0, 32)[None, :], 1, _or)
        tl.store(bits_ptr + pid * (BLOCK // 32) + tl.arange(0, BLOCK // 32), words)

    @triton.jit
    def _store_changes(offs, changed, new, old, starts_ptr, pos_ptr, new_ptr, old_ptr, base, pid):
        c = changed.to(tl.int32)
        at = tl.load(starts_ptr + pid) + tl.cumsum(c, axis=0) - c  # exclusive prefix within the block
        tl.store(pos_ptr + at, offs.to(tl.int64) + base, mask=changed)
        tl.store(new_ptr + at, new.to(new_ptr.dtype.element_ty), mask=changed)
        tl.store(old_ptr + at, old.to(old_ptr.dtype.element_ty), mask=changed)

    @triton.jit
    def _write_kernel(src_ptr, snap_ptr, starts_ptr, pos_ptr, new_ptr, old_ptr, n, base,
                      CAST: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        changed, new, old = _changed(src_ptr, snap_ptr, offs, n, CAST)
        _store_changes(offs, changed, new, old, starts_ptr, pos_ptr, new_ptr, old_ptr, base, pid)

    @triton.jit
    def _write_bits_kernel(src_ptr, snap_ptr, bits_ptr, starts_ptr, pos_ptr, new_ptr, old_ptr, n, base,
                           CAST: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 2 of ``"bitmask"``: the tensor and the snapshot are loaded only where a bit is set."""
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        w = tl.load(bits_ptr + offs // 32, mask=offs < n, other=0)
        changed = ((w >> (offs % 32)) & 1) != 0
        new, old = _load(src_ptr, snap_ptr, offs, changed, CAST)
        _store_changes(offs, changed, new, old, starts_ptr, pos_ptr, new_ptr, old_ptr, base, pid)

    @triton.jit
    def _scatter_kernel(dst_ptr, pos_ptr, val_ptr, k, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < k
        p = tl.load(pos_ptr + offs, mask=inside, other=0)
        tl.store(dst_ptr + p, tl.load(val_ptr + offs, mask=inside), mask=inside)

    @triton.jit
    def _steps_kernel(dst_ptr, pos_ptr, step_ptr, rel_ptr, val_ptr, k, HAS_REL: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < k
        p = tl.load(pos_ptr + offs, mask=inside, other=0)
        old = tl.load(dst_ptr + p, mask=inside, other=0)
        new = (old + tl.load(step_ptr + offs, mask=inside, other=0)).to(old.dtype)  # wraps
        if HAS_REL:
            rel = tl.load(rel_ptr + offs, mask=inside, other=1) != 0
            new = tl.where(rel, new, tl.load(val_ptr + offs, mask=inside, other=0))
        tl.store(dst_ptr + p, new, mask=inside)


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def detect(flat: torch.Tensor, snap_bits: torch.Tensor, dtype: torch.dtype, base: int = 0, method: str = "reread"):
    """Changed elements of ``flat`` cast to ``dtype`` against a snapshot, as
    :meth:`ChangeDetector.detect <torch_deltasync.detect.ChangeDetector.detect>` finds them.

    Args:
        flat: the live tensor, 1-D contiguous: fp32 with ``dtype`` bf16, or already ``dtype``.
        snap_bits: the snapshot's integer bit view (same width as ``dtype``), same length and device.
        dtype: the inference dtype.
        base: added to every position.
        method: how pass 2 finds the changes again, one of :data:`METHODS` (the module's docstring);
            the outputs are the same.

    Returns:
        ``(positions int64, new values, old values)`` in ``dtype`` on ``flat``'s device, or ``None``
        for other dtype pairs and for tensors of :data:`MAX_NUMEL` elements or more (torch's path
        then runs).

    Raises:
        ValueError: an unknown ``method``; ``flat`` and ``snap_bits`` not 1-D contiguous on one
            device, of different lengths, or ``snap_bits`` not of ``dtype``'s width.
    """
    if method not in METHODS:
        raise ValueError(f"detect: method must be one of {METHODS}, got {method!r}")
    _check_flat("detect", flat, snap_bits)
    if snap_bits.numel() != flat.numel() or snap_bits.element_size() != dtype.itemsize:
        raise ValueError(f"detect: a snapshot of {snap_bits.numel()} {snap_bits.dtype} for {flat.numel()} "
                         f"elements in {dtype}: it must have as many elements, of {dtype}'s width")
    cast = flat.dtype == torch.float32 and dtype == torch.bfloat16
    if (not cast and flat.dtype != dtype) or flat.numel() >= MAX_NUMEL:
        return None
    n = flat.numel()
    dev = flat.device
    src = flat.view(torch.int32) if cast else _int_view(flat)
    blocks = max(1, triton.cdiv(n, BLOCK))
    counts = torch.empty(blocks, dtype=torch.int32, device=dev)
    if method == "bitmask":
        words = torch.empty(blocks * (BLOCK // 32), dtype=torch.int32, device=dev)
        _count_bits_kernel[(blocks,)](src, snap_bits, counts, words, n, CAST=cast, BLOCK=BLOCK)
    else:
        _count_kernel[(blocks,)](src, snap_bits, counts, n, CAST=cast, BLOCK=BLOCK)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    k = int(ends[-1])  # (the one sync)
    pos = torch.empty(k, dtype=torch.int64, device=dev)
    new = torch.empty(k, dtype=snap_bits.dtype, device=dev)
    old = torch.empty(k, dtype=snap_bits.dtype, device=dev)
    if k and method == "bitmask":
        _write_bits_kernel[(blocks,)](src, snap_bits, words, ends - counts, pos, new, old, n, base, CAST=cast,
                                      BLOCK=BLOCK)
    elif k:
        _write_kernel[(blocks,)](src, snap_bits, ends - counts, pos, new, old, n, base, CAST=cast, BLOCK=BLOCK)
    return pos, new.view(dtype), old.view(dtype)


def _check_flat(what: str, *tensors: torch.Tensor) -> None:
    """1-D contiguous tensors on one device: the kernels index them as flat arrays."""
    for t in tensors:
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{what}: tensors must be 1-D and contiguous, got shape {tuple(t.shape)} "
                             f"with strides {t.stride()}")
        if t.device != tensors[0].device:
            raise ValueError(f"{what}: tensors on {tensors[0].device} and {t.device}")


def _check_changes(what: str, flat: torch.Tensor, positions: torch.Tensor, *per_change: torch.Tensor) -> None:
    _check_flat(what, flat, positions, *per_change)
    if positions.dtype != torch.int64 or any(t.numel() != positions.numel() for t in per_change):
        raise ValueError(f"{what}: int64 positions and one entry per position in each of the others")
    if positions.numel() >= MAX_NUMEL:
        raise ValueError(f"{what}: {positions.numel()} changes; the kernels take fewer than {MAX_NUMEL}")


def scatter(flat: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """``flat.index_copy_(0, positions, values)`` for positions already validated (in range,
    unique): one program per ``BLOCK`` changes, no bounds checks on the GPU.

    Raises:
        ValueError: tensors not 1-D contiguous on one device, positions not int64, lengths that
            differ, or :data:`MAX_NUMEL` changes or more.
    """
    _check_changes("scatter", flat, positions, values)
    k = positions.numel()
    if k:
        _scatter_kernel[(triton.cdiv(k, BLOCK),)](_int_view(flat), positions, _int_view(values), k, BLOCK=BLOCK)


def apply_steps(flat: torch.Tensor, positions: torch.Tensor, steps: torch.Tensor,
                relative: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
    """Apply a step-coded delta in place: ``flat[p] = bits(flat[p]) + step`` (wrapped) where
    ``relative`` (all when ``None``), else ``values`` (:meth:`TensorDelta.resolve
    <torch_deltasync.codecs.TensorDelta.resolve>` followed by the write, in one pass; the caller
    checks the base checksum first when it needs to).

    Raises:
        ValueError: as :func:`scatter`.
    """
    _check_changes("apply_steps", flat, positions, steps, *(t for t in (relative, values) if t is not None))
    k = positions.numel()
    if not k:
        return
    dst = _int_view(flat)
    has_rel = relative is not None
    rel = relative.view(torch.uint8) if has_rel else positions
    val = _int_view(values) if has_rel else steps
    _steps_kernel[(triton.cdiv(k, BLOCK),)](dst, positions, steps.to(dst.dtype), rel, val, k, HAS_REL=has_rel,
                                             BLOCK=BLOCK)
