"""``ChangeDetector``: which elements of a tensor changed since the last *published* state.

The detector keeps, per tensor, a snapshot of the bit patterns that were last published (2 bytes per
element for bf16), on the tensor's device (fastest) or in (pinned) CPU memory. ``detect`` casts the
live tensor to the inference dtype chunk by chunk into a reused buffer, compares the integer bit
views with the snapshot and returns the changed positions and their new values. ``commit`` advances
the snapshot only once the version carrying those changes is visible, so deltas are always relative
to what receivers can have (docs/design.md invariant 4): a failed or skipped publish is folded into the next.

Why bit views: ``-0.0 == 0.0`` and ``NaN != NaN`` make a float comparison lose a sign flip or report
every NaN as changed forever; comparing ``view(torch.int16)`` sees exactly the bytes a receiver holds.

Why chunks: the naive ``(x.to(bf16).view(i16) != snap).nonzero()`` allocates a cast copy and a mask
of the whole tensor; reusing 4M-element buffers halves its time on CPU (docs/research/baselines.md §4).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from . import _gpu, _native
from ._dtypes import as_dtype, bits, canonical_nans_, cast, int_view_dtype

__all__ = ["Changes", "ChangeDetector"]

log = logging.getLogger(__name__)


def _flatnonzero(mask: torch.Tensor) -> torch.Tensor:
    """int64 positions of the true elements of a 1-D bool tensor.

    On CPU, numpy's ``flatnonzero`` is 4-5x faster than ``torch.nonzero`` (0.8 vs 3.1 ns per
    element on the 2-core benchmark host at 4% density) and shares memory with the result.
    """
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().squeeze(1)


def _grown(x: np.ndarray, k: int, cap: int) -> np.ndarray:
    """A new array of ``cap`` elements holding ``x[:k]``; the rest is never written (no memory)."""
    out = np.empty(cap, x.dtype)
    out[:k] = x[:k]
    return out


@dataclass(frozen=True)
class Changes:
    """The changed elements of one tensor (or one local shard of it).

    Attributes:
        positions: int64 ``(k,)``, sorted, unique flat positions into the tensor the detector saw
            (local shard positions for a sharded sender; see :class:`~torch_deltasync.layout.TensorSlice`).
        values: ``(k,)`` new values in the inference dtype, on the tensor's device.
        old_values: ``(k,)`` the published values at the same positions (inference dtype).
    """

    positions: torch.Tensor
    values: torch.Tensor
    old_values: torch.Tensor

    @property
    def numel(self) -> int:
        return self.positions.numel()


class ChangeDetector:
    """Bit-exact change detection against a snapshot of the last published state.

    Args:
        inference_dtype: dtype receivers serve (``torch.bfloat16`` default; fp16, fp32, fp64 and
            fp8 work the same way through integer views of their width).
        snapshot_device: where snapshots live. ``None``: on each tensor's own device (fastest,
            costs ``element_size`` bytes per element there). ``"cpu"``: host memory, pinned when
            CUDA is available so chunks stream to the device asynchronously.
        chunk_numel: elements compared per step (bounds temporary memory to ~3 bytes x chunk for
            bf16, per thread that calls :meth:`detect`). ``None``: 4M on CPU, 64M on accelerators.

    Example:
        >>> det = ChangeDetector()
        >>> w = torch.randn(1000)
        >>> det.reset("w", w)                  # snapshot = det.cast(w): w in bf16
        >>> w[3] += 1.0
        >>> ch = det.detect("w", w)
        >>> ch.positions
        tensor([3])
        >>> det.commit("w", ch)                # after the version is visible
    """

    def __init__(
        self,
        *,
        inference_dtype: torch.dtype | str = torch.bfloat16,
        snapshot_device: torch.device | str | None = None,
        chunk_numel: int | None = None,
    ) -> None:
        self.dtype = as_dtype(inference_dtype)
        self.snapshot_device = None if snapshot_device is None else torch.device(snapshot_device)
        self.chunk_numel = chunk_numel
        self._snap: dict[str, torch.Tensor] = {}  # name -> flat integer bit view
        # Temporaries, one set per thread (several threads may detect different tensors at once):
        # ``buf``: {device: (cast, mask)} chunk buffers of torch's path; ``scratch``: the compiled
        # path's per-block scratch.
        self._local = threading.local()
        self._last_count: dict[str, int] = {}  # changes found last time, to size the next result
        self._gpu_failed = False  # the Triton kernels failed once: torch's path from then on

    # --- snapshots -------------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self._snap

    def names(self) -> list[str]:
        return list(self._snap)

    def snapshot(self, name: str) -> torch.Tensor:
        """The published values of ``name``, flat, in the inference dtype (a view; do not modify)."""
        return self._snap[name].view(self.dtype)

    def snapshot_nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._snap.values())

    def cast(self, tensor: torch.Tensor) -> torch.Tensor:
        """A new flat copy of ``tensor`` in the inference dtype (used for anchors): the published
        cast, :func:`~torch_deltasync._dtypes.cast` (NaNs made canonical), the bits that
        :meth:`detect` compares for any layout of ``tensor``."""
        return cast(tensor.reshape(-1), self.dtype)

    def reset(self, name: str, tensor: torch.Tensor | None = None, *, cast: torch.Tensor | None = None) -> None:
        """Make the snapshot of ``name`` equal to ``tensor`` cast to the inference dtype.

        Pass ``cast`` (a flat tensor already in the inference dtype, e.g. the anchor just
        published) to adopt it without another copy when it lives where snapshots should.

        Raises:
            TypeError: ``cast`` is not in the inference dtype (its bit patterns would be read at
                another width).
        """
        if cast is None:
            cast = self.cast(tensor)
        elif cast.dtype != self.dtype:
            raise TypeError(f"ChangeDetector.reset({name!r}): cast must be in the inference dtype {self.dtype}, "
                            f"got {cast.dtype}; pass the weights as `tensor` to have them cast")
        device = self.snapshot_device or cast.device
        snap = bits(cast.reshape(-1))
        if snap.device != device:
            pin = device.type == "cpu" and torch.cuda.is_available()
            host = torch.empty(snap.shape, dtype=snap.dtype, device=device, pin_memory=pin)
            host.copy_(snap)
            snap = host
        self._snap[name] = snap

    def drop(self, name: str | None = None) -> None:
        """Forget the snapshot of ``name`` (or all of them)."""
        if name is None:
            self._snap.clear()
            self._local = threading.local()
            self._last_count.clear()
        else:
            self._snap.pop(name, None)
            self._last_count.pop(name, None)

    # --- detection -------------------------------------------------------------------------------

    def _buffers(self, device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's cast and mask chunk buffers on ``device``, at least ``n`` elements."""
        bufs = getattr(self._local, "buf", None)
        if bufs is None:
            bufs = self._local.buf = {}
        buf = bufs.get(device)
        if buf is None or buf[0].numel() < n:
            buf = (torch.empty(n, dtype=self.dtype, device=device), torch.empty(n, dtype=torch.bool, device=device))
            bufs[device] = buf
        return buf

    def detect(self, name: str, tensor: torch.Tensor) -> Changes:
        """Compare ``tensor`` (any floating dtype, any layout) with the snapshot of ``name``.

        Several threads may detect *different* tensors at once (each thread has its own
        temporaries; the compiled kernels release the GIL); ``reset``, ``drop`` and ``commit``
        must not run at the same time as a ``detect``.

        Args:
            name: the snapshot to compare against (must have been :meth:`reset`).
            tensor: the live tensor, same number of elements as the snapshot. Non-contiguous
                tensors are copied once to a contiguous layout (row-major order).

        Returns:
            :class:`Changes` with positions in row-major order of ``tensor``.

        Raises:
            KeyError: no snapshot for ``name``.
            ValueError: the element count differs from the snapshot.
        """
        snap = self._snap[name]
        src = tensor.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        flat = src.view(-1)
        n = flat.numel()
        if n != snap.numel():
            raise ValueError(f"{name}: tensor has {n} elements, snapshot has {snap.numel()}")
        device = flat.device
        if _native.enabled() and device.type == "cpu" and snap.device.type == "cpu":
            ch = self._detect_native(name, flat, snap)
            if ch is not None:
                return ch
        if device.type == "cuda" and snap.device == device and _gpu.available(device) and not self._gpu_failed:
            try:
                found = _gpu.detect(flat, snap, self.dtype)  # Triton: two passes, no mask or cast copy
            except Exception as e:  # noqa: BLE001 - e.g. no C compiler for Triton's launcher: torch path
                log.warning("Triton change detection failed (%s: %s); using torch's", type(e).__name__, e)
                self._gpu_failed, found = True, None
            if found is not None:
                return Changes(*found)
        chunk = self.chunk_numel or (1 << 22 if device.type == "cpu" else 1 << 26)
        chunk = max(1, min(chunk, n))
        same_dtype = flat.dtype == self.dtype
        cast_buf, mask_buf = self._buffers(device, chunk)
        positions, values = [], []
        for a in range(0, n, chunk):
            m = min(chunk, n - a)
            if same_dtype:
                cur = flat[a : a + m]
            else:
                cur = canonical_nans_(cast_buf[:m].copy_(flat[a : a + m]))  # the bits of cast()
            ref = snap[a : a + m]
            if ref.device != device:
                ref = ref.to(device, non_blocking=True)
            mask = mask_buf[:m]
            torch.ne(bits(cur), ref, out=mask)
            idx = _flatnonzero(mask)
            if idx.numel():
                positions.append(idx + a)
                values.append(cur[idx])
        if positions:
            pos = torch.cat(positions)
            val = torch.cat(values)
        else:
            pos = torch.empty(0, dtype=torch.int64, device=device)
            val = torch.empty(0, dtype=self.dtype, device=device)
        old = snap[pos.to(snap.device)].view(self.dtype).to(device)
        return Changes(pos, val, old)

    def _detect_native(self, name: str, flat: torch.Tensor, snap: torch.Tensor) -> Changes | None:
        """:meth:`detect` on the CPU in one compiled pass (cast, compare, extract), writing
        straight into the result arrays, for an fp32 tensor with a bf16 inference dtype (cast
        as :meth:`cast` does, NaNs included) or a tensor already in the inference dtype; ``None``
        for other dtypes.

        The result arrays start at 1.125x the changes this tensor had last time (1/16 of its
        elements the first time) and grow by doubling when the kernel stops before a block that
        might not fit; their sizes barely change between versions, so the allocator can reuse the
        memory of the last ones (glibc keeps it per thread arena: with several reading threads a
        tensor read by another thread than last time may take fresh memory)."""
        to_bf16 = flat.dtype == torch.float32 and self.dtype == torch.bfloat16
        if not to_bf16 and flat.dtype != self.dtype:
            return None
        n = flat.numel()
        w = self.dtype.itemsize
        src = flat.view(torch.int32 if to_bf16 else self.int_dtype).numpy().view(f"u{flat.element_size()}")
        ref = snap.numpy().view(f"u{w}")
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:  # this thread's
            scratch = self._local.scratch = (np.empty(_native.BLOCK, np.uint16), np.empty(_native.BLOCK // 64, np.uint64))
        cast_tmp, bits_tmp = scratch
        last = self._last_count.get(name)
        cap = (n // 16 if last is None else last + last // 8) + _native.BLOCK
        pos, new, old = np.empty(cap, np.int64), np.empty(cap, f"u{w}"), np.empty(cap, f"u{w}")
        k = done = 0
        while done < n:
            if cap - k < _native.BLOCK:  # grow, keeping the k entries found so far (the rest untouched)
                cap = max(2 * cap, k + _native.BLOCK)
                pos, new, old = (_grown(x, k, cap) for x in (pos, new, old))
            if to_bf16:
                found, seen = _native.detect_f32_bf16(src[done:], ref[done:], done, pos[k:], new[k:], old[k:],
                                                      cast_tmp, bits_tmp)
            else:
                found, seen = _native.detect_same(src[done:], ref[done:], done, pos[k:], new[k:], old[k:], bits_tmp)
            k += found
            done += seen
        self._last_count[name] = k
        as_values = lambda u: torch.from_numpy(u[:k].view(f"i{w}")).view(self.dtype)  # noqa: E731
        return Changes(torch.from_numpy(pos[:k]), as_values(new), as_values(old))

    def commit(self, name: str, changes: Changes) -> None:
        """Advance the snapshot of ``name`` by ``changes`` (call once their version is visible)."""
        snap = self._snap[name]
        if changes.numel:
            snap.index_copy_(0, changes.positions.to(snap.device), bits(changes.values).to(snap.device))

    @property
    def int_dtype(self) -> torch.dtype:
        return int_view_dtype(self.dtype)
