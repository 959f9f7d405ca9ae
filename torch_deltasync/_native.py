"""Compiled CPU kernels (numba) for the hot loops of the codec, change detection and checksums.

Each kernel here is a one-pass loop over the elements of one tensor that the numpy/torch code in
the ``packed`` codec (:mod:`~torch_deltasync.codecs`), :mod:`~torch_deltasync.detect` and :mod:`~torch_deltasync.checksum`
does in several vectorised passes (each a full read and write of temporaries). That numpy/torch
code stays the executable specification: the modules call these kernels only when
:func:`enabled` is true and fall back to it otherwise, and ``tests/unit/test_native.py`` checks every
kernel against it bit for bit, on random and adversarial inputs.

The ``packed`` codec's own kernels live next to it (``codecs/_packed_kernels.py``,
``codecs/_packed_decode.py``) and the apply kernels in :mod:`._native_apply`; they use :func:`jit`
and the intrinsics :func:`prefetch` and :func:`trailing_zeros` from here.

Kernels never raise on bad data. Decoding kernels validate every byte they read and return a
non-zero status instead; the caller then runs the reference decoder on the same input, which
raises the specific :class:`~torch_deltasync.errors.CorruptObjectError` (so the error messages
are the specification's; ``tests/unit/test_native.py`` checks that the kernels accept exactly the blobs
the reference accepts, including every corruption the reference refuses). Encoding kernels write
only into buffers the caller sized from exact counts or upper bounds, and check them.

Why numba: it ships manylinux/macOS/Windows wheels (with llvmlite) for every supported Python, so
a fresh machine installs it without a compiler, and the kernels stay Python source next to the
numpy they mirror. Kernels compile on first use, once per machine: about 20 s for the bf16 paths
on a 2-core machine, then cached on disk next to this file (``cache=True``; numba falls back to a
per-user cache directory when that is not writable), which later processes load in ~0.5 s. They are compiled with ``nogil=True``, so threads that encode or decode several
tensors at once run in parallel.

Set ``TORCH_DELTASYNC_NATIVE=0`` to use the numpy/torch paths only (e.g. to compare, or on a
platform without numba wheels: numba is then simply absent and :func:`enabled` is false). A numba
that is installed but does not import (one built for an older numpy) turns the kernels off the
same way, with one ``RuntimeWarning`` that gives its reason (:func:`enabled`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import types
import warnings

import numpy as np

__all__ = ["enabled", "set_enabled", "AVAILABLE"]


def _numba_installed() -> bool:
    if "numba" in sys.modules:
        return sys.modules["numba"] is not None
    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError):  # pragma: no cover
        return False


#: Whether numba is installed (a dependency, but a platform without its wheels still works, slower).
AVAILABLE = _numba_installed()

# numba itself is imported on the first call of a kernel, not with this module: vLLM 0.32's CPU
# workers scan every imported module at start-up for Triton kernels to override
# (vllm/triton_utils/dispatcher.py), and that scan fails on an llvmlite object, so a script that
# imports torch_deltasync before it starts a vLLM engine (spawned workers re-import it) would stop
# every engine from starting.
numba = None
_IMPORT_ERROR: str | None = None  # why an installed numba did not import (the kernels are then off)
_DEFERRED: list["_Deferred"] = []
_MATERIALIZE = threading.Lock()
_WANTED = os.environ.get("TORCH_DELTASYNC_NATIVE", "1") != "0"  # not switched off by the environment
_enabled = AVAILABLE and _WANTED
_REINSTALL = "reinstall numba and llvmlite in versions that match each other and this numpy (pip install -U numba)"


def enabled() -> bool:
    """Whether callers should use the compiled kernels (numba importable and not switched off by
    ``TORCH_DELTASYNC_NATIVE=0`` or :func:`set_enabled`).

    The first call that would answer yes imports numba (:func:`_materialize`), as does the first
    call of code that both paths share (the codec's size estimates, :func:`jit`). Where numba is
    installed but does not import (a numba built for an older numpy raises ``ImportError: Numba
    needs NumPy 2.x or less``; an llvmlite that does not match it), that call warns once with the
    reason, unless ``TORCH_DELTASYNC_NATIVE=0`` chose the numpy/torch paths already, and the
    kernels stay off for the process: every caller then takes those paths, which write and read
    the same bytes, several times slower.
    """
    if _enabled and numba is None:
        _materialize()
    return _enabled


def set_enabled(on: bool) -> bool:
    """Switch the compiled kernels on or off for this process (tests compare both paths).

    Returns:
        The previous setting, as :func:`enabled` gives it (so that ``prev = set_enabled(False)``
        ... ``set_enabled(prev)`` restores it, also where numba turns out not to import).

    Raises:
        RuntimeError: ``on`` is true but numba is not installed or does not import.
    """
    global _enabled
    if on and not AVAILABLE:
        raise RuntimeError("numba is not installed: the compiled kernels are unavailable (pip install numba)")
    prev = enabled()
    if on and numba is None:
        _materialize()
    if on and _IMPORT_ERROR is not None:
        raise RuntimeError(f"numba is installed but does not import ({_IMPORT_ERROR}): the compiled kernels "
                           f"are unavailable; {_REINSTALL}")
    _enabled = bool(on)
    return prev


# Functions returning ``{Python stand-in: numba intrinsic}`` for :func:`_materialize`, from modules
# that give kernels more intrinsics (:func:`register_intrinsics`).
_INTRINSICS: list = []


def register_intrinsics(provider) -> None:
    """Have :func:`provider` (``() -> {Python stand-in: numba intrinsic}``) called when numba is
    imported; every stand-in in the package's modules is then replaced by its intrinsic, as
    :func:`prefetch` is. Register at import, before any kernel runs (kernels are compiled, or
    loaded from the disk cache, against what is registered then); when numba is already imported,
    the stand-ins are replaced at once (kernels defined from then on compile against them).
    """
    with _MATERIALIZE:
        if numba is None:
            _INTRINSICS.append(provider)
            return
    _substitute(provider())


class _Deferred:
    """A kernel whose numba dispatcher is made on the first call of any kernel (:func:`jit`)."""

    def __init__(self, fn, options: dict) -> None:
        self.fn, self.options, self.dispatcher = fn, options, None
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__

    def __call__(self, *args, **kwargs):
        if self.dispatcher is None:
            _materialize()
        return self.dispatcher(*args, **kwargs)


def _materialize() -> None:
    """Import numba and give every deferred kernel its dispatcher, also in the namespace that
    defines it, so kernels that call each other compile against dispatchers."""
    global numba, _enabled, _IMPORT_ERROR
    with _MATERIALIZE:
        if numba is not None:
            return
        if _IMPORT_ERROR is None:
            try:
                import numba as nb
                from numba.cpython.unsafe.numbers import trailing_zeros as cttz  # an LLVM intrinsic
            except Exception as e:  # installed, but broken here: numpy too new for it, llvmlite missing
                _IMPORT_ERROR = f"{type(e).__name__}: {e}"
                if _WANTED:
                    warnings.warn(f"torch_deltasync: numba is installed but does not import ({_IMPORT_ERROR}); "
                                  "the compiled kernels are off and the numpy/torch paths run instead (the "
                                  f"same bytes, several times slower). {_REINSTALL[0].upper()}{_REINSTALL[1:]}, "
                                  "or set TORCH_DELTASYNC_NATIVE=0 to choose those paths.",
                                  RuntimeWarning, stacklevel=3)
        if _IMPORT_ERROR is not None:  # as without numba: kernels off, shared code (estimates) as Python
            _enabled = False
            for proxy in _DEFERRED:
                proxy.dispatcher = proxy.fn
            _substitute({}, {id(p.fn.__globals__): p.fn.__globals__ for p in _DEFERRED})
            return

        compiled = {prefetch: _prefetch_intrinsic(), trailing_zeros: cttz}  # Python stand-ins -> intrinsics
        for provider in _INTRINSICS:  # e.g. libzstd's functions (:mod:`._native_zstd`)
            compiled.update(provider())
        for proxy in _DEFERRED:
            proxy.dispatcher = nb.njit(**proxy.options)(proxy.fn)
        # Every module that defines kernels, or imported one by name (``from .._native import
        # checksum_at``), now sees dispatchers, so kernels compile against each other's and
        # Python callers skip the proxy (modules imported later get the dispatchers directly).
        namespaces = {id(p.fn.__globals__): p.fn.__globals__ for p in _DEFERRED}
        _substitute(compiled, namespaces)
        numba = nb


def _substitute(compiled: dict, namespaces: dict | None = None) -> None:
    """In ``namespaces`` and every imported module of the package: deferred kernels by their
    dispatchers, Python stand-ins by their intrinsics (``compiled``)."""
    namespaces = dict(namespaces or {})
    namespaces.update((id(vars(m)), vars(m)) for name, m in list(sys.modules.items())
                      if m is not None and (name == __package__ or name.startswith(__package__ + ".")))
    for namespace in namespaces.values():
        for name, value in list(namespace.items()):
            if isinstance(value, _Deferred):
                namespace[name] = value.dispatcher
            elif isinstance(value, types.FunctionType) and value in compiled:
                namespace[name] = compiled[value]


#: Changes ahead that the apply and read kernels (:mod:`._native_apply`) prefetch: reads at 0.2-1%
#: density went from ~9.5 to ~4.3 ns per element (docs/benchmarks.md, "Prefetching the target lines").
PREFETCH_AHEAD = 64


def trailing_zeros(w):
    """Trailing zero bits of ``w`` > 0 (``llvm.cttz`` when compiled, :func:`_materialize`)."""
    return (int(w) & -int(w)).bit_length() - 1


def prefetch(arr, i):
    """Hint the CPU to cache ``arr[i]`` (``llvm.prefetch`` when compiled, never faults; Python: a no-op)."""


def _prefetch_intrinsic():
    """:func:`prefetch` as a numba intrinsic (made when numba is imported, :func:`_materialize`)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, arr, i):
        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            # arr.data + i * itemsize as an integer: i may be out of range (no in-bounds GEP)
            index = context.cast(builder, args[1], signature.args[1], types.int64)
            size = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
            address = builder.add(builder.ptrtoint(array.data, ir.IntType(64)),
                                  builder.mul(index, ir.Constant(ir.IntType(64), size)))
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
            builder.call(fn, [builder.inttoptr(address, i8p)] + [ir.Constant(i32, c) for c in (0, 3, 1)])
            return context.get_dummy_value()

        if not isinstance(arr, types.Array) or not isinstance(i, types.Integer):
            return None
        return types.void(arr, i), codegen

    return prefetch


def jit(fn=None, *, inline: bool = False):
    """Compile ``fn`` with numba (cached on disk, releasing the GIL) when numba is installed;
    else return it unchanged (it then runs as Python). For code that both the numpy and the
    native paths share, such as the codec's size estimates. numba is imported, and every such
    function gets its dispatcher, on the first call of any of them.

    ``@jit(inline=True)`` marks a small helper that kernels call inside their loops: numba then
    inlines its body into each kernel (``inline="always"``) instead of calling it (``equal_bits``,
    once per 64 steps: ``encode_steps`` 15-30% faster; ``docs/benchmarks.md``, issue 14, seventh
    part)."""
    if fn is None:
        return lambda f: jit(f, inline=inline)
    if not AVAILABLE or _IMPORT_ERROR is not None:
        return fn
    options = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False)
    if inline:
        options["inline"] = "always"
    if numba is not None:  # defined after the first call
        return numba.njit(**options)(fn)
    proxy = _Deferred(fn, options)
    _DEFERRED.append(proxy)
    return proxy


_jit = jit


_u64 = np.uint64

# splitmix64 constants (checksum.py): golden-ratio increment, the two multipliers, and K3.
_K0 = _u64(0x9E3779B97F4A7C15)
_K1 = _u64(0xBF58476D1CE4E5B9)
_K2 = _u64(0x94D049BB133111EB)
_K3 = _u64(0x5BD1E995)
_S30, _S27, _S31 = _u64(30), _u64(27), _u64(31)
_U0, _U1, _U7, _U8 = _u64(0), _u64(1), _u64(7), _u64(8)
_U7F, _U80 = _u64(0x7F), _u64(0x80)

# Status codes of the decoding kernels (the caller re-runs the reference decoder to raise).
OK = 0
BAD = 1


# --- checksums (checksum.py section 6 of docs/format.md) -----------------------------------------


@_jit
def _mix(p):
    """splitmix64's finaliser of ``p + K0`` (uint64), as ``checksum._mix_``."""
    h = p + _K0
    h = (h ^ (h >> _S30)) * _K1
    h = (h ^ (h >> _S27)) * _K2
    return h ^ (h >> _S31)


@_jit
def checksum_at(pos, vals):
    """``sum mix(pos[i]) * (vals[i] + K3) mod 2**64``; ``pos`` int64 ``(k,)``, ``vals`` the
    unsigned bit patterns ``(k,)``. Returns uint64."""
    s = _U0
    for i in range(pos.size):
        s += _mix(_u64(pos[i])) * (_u64(vals[i]) + _K3)
    return s


@_jit
def checksum_range(start, vals):
    """:func:`checksum_at` with positions ``start, start + 1, ...``."""
    s = _U0
    p = _u64(start)
    for i in range(vals.size):
        s += _mix(p) * (_u64(vals[i]) + _K3)
        p += _U1
    return s


@_jit
def checksum_diff(pos, old, new):
    """``sum mix(pos[i]) * (new[i] - old[i]) mod 2**64`` (``checksum.checksum_change``)."""
    s = _U0
    for i in range(pos.size):
        s += _mix(_u64(pos[i])) * (_u64(new[i]) - _u64(old[i]))
    return s


# --- change detection (detect.py) ---------------------------------------------------------------

_BLOCK = 4096  # elements per inner block: the cast and mask of a block stay in L1
BLOCK = _BLOCK  # scratch size the detection kernels need


@_jit
def _extract(bits, groups, base, vals, ref, pos_out, new_out, old_out, k):
    """Append the entries of a block whose bit is set in ``bits`` (one uint64 per 64 entries:
    position ``base + j``, ``vals[j]``, ``ref[j]``) at index ``k`` of the outputs, in order, by
    walking the set bits (one iteration per change, none per unchanged element). Returns the new
    ``k``."""
    for g in range(groups):
        w = bits[g]
        while w:
            j = 64 * g + trailing_zeros(w)
            pos_out[k] = base + j
            new_out[k] = vals[j]
            old_out[k] = ref[j]
            k += 1
            w &= w - _U1
    return k


@_jit(inline=True)
def _f32_to_bf16(u):
    """The bf16 pattern (uint16) of the fp32 pattern ``u`` (uint32): round to nearest even, and
    0x7FC0 for every NaN (a select, no branch)."""
    c = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    return np.uint16(0x7FC0) if u & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000) else c


@_jit
def detect_f32_bf16(src, snap, base, pos_out, new_out, old_out, cast_tmp, bits):
    """Changed elements of ``src`` (fp32 bit patterns, uint32 ``(n,)``) cast to bf16 against
    ``snap`` (bf16 bit patterns, uint16 ``(n,)``).

    The cast is round-to-nearest-even on the bit pattern, which is torch's fp32 -> bf16 cast for
    every value but NaN, and a NaN becomes 0x7FC0: the published cast,
    :func:`torch_deltasync._dtypes.cast` (torch's own result for a NaN depends on its code path).

    Writes the ``k`` changed positions (``base + i``), new and old bf16 patterns to the first ``k``
    entries of ``pos_out`` (int64), ``new_out`` and ``old_out`` (uint16), block by block of
    ``BLOCK`` elements, and stops before a block that might not fit in them. ``cast_tmp``
    (uint16, ``BLOCK``) and ``bits`` (uint64, ``BLOCK / 64``) are scratch.

    Returns:
        ``(k, done)``: the changes written and the elements of ``src`` examined (``n`` when all;
        call again on the rest with larger outputs).
    """
    n = src.size
    k = 0
    for a in range(0, n, _BLOCK):
        if k + _BLOCK > pos_out.size:
            return k, a
        s = src[a : a + _BLOCK]  # slices, not offsets: numba vectorises loops over views
        ref = snap[a : a + _BLOCK]
        m = s.size
        for g in range((m + 63) // 64):  # cast, compare, and one bit per element
            w = _U0
            if 64 * g + 64 <= m:
                for q in range(64):  # vectorises
                    c = _f32_to_bf16(s[64 * g + q])
                    cast_tmp[64 * g + q] = c
                    w |= _u64(c != ref[64 * g + q]) << _u64(q)
            else:
                for q in range(m - 64 * g):
                    c = _f32_to_bf16(s[64 * g + q])
                    cast_tmp[64 * g + q] = c
                    w |= _u64(c != ref[64 * g + q]) << _u64(q)
            bits[g] = w
        k = _extract(bits, (m + 63) // 64, base + a, cast_tmp, ref, pos_out, new_out, old_out, k)
    return k, n


@_jit
def detect_same(src, snap, base, pos_out, new_out, old_out, bits):
    """:func:`detect_f32_bf16` for a source already in the inference dtype (``src`` and ``snap``
    are bit patterns of the same width). Returns ``(k, done)``."""
    n = src.size
    k = 0
    for a in range(0, n, _BLOCK):
        if k + _BLOCK > pos_out.size:
            return k, a
        s = src[a : a + _BLOCK]
        ref = snap[a : a + _BLOCK]
        m = s.size
        for g in range((m + 63) // 64):
            w = _U0
            if 64 * g + 64 <= m:
                for q in range(64):
                    w |= _u64(s[64 * g + q] != ref[64 * g + q]) << _u64(q)
            else:
                for q in range(m - 64 * g):
                    w |= _u64(s[64 * g + q] != ref[64 * g + q]) << _u64(q)
            bits[g] = w
        k = _extract(bits, (m + 63) // 64, base + a, s, ref, pos_out, new_out, old_out, k)
    return k, n


@_jit
def canonical_nans(u, mask, limit, nan):
    """Write ``nan`` over every entry of ``u`` (unsigned bit patterns, ``(n,)``) whose magnitude
    ``u & mask`` exceeds ``limit`` (a NaN of its float dtype), in place
    (:func:`torch_deltasync._dtypes.canonical_nans_`)."""
    for a in range(0, u.size, _BLOCK):
        s = u[a : a + _BLOCK]
        top = s[0] & mask
        for j in range(s.size):  # vectorises: NaNs are rare, so a block is read once, written never
            top = max(top, s[j] & mask)
        if top > limit:
            for j in range(s.size):
                if s[j] & mask > limit:
                    s[j] = nan


# --- applying steps (codecs/_base.py, TensorDelta.resolve) -------------------------------------


@_jit
def resolve_steps(pos, old, steps, relative, values, check, base, new_out):
    """New bit patterns ``old + steps`` (wrapped; ``values`` where ``relative`` is false) into
    ``new_out``, and whether the checksum of ``old`` at ``pos`` equals ``base`` (uint64; always
    true when not ``check``). ``relative`` may be empty (every entry relative)."""
    if relative.size == 0:
        for i in range(pos.size):
            new_out[i] = old[i] + steps[i]
    else:
        for i in range(pos.size):
            new_out[i] = old[i] + steps[i] if relative[i] else values[i]
    return (not check) or checksum_at(pos, old) == base
