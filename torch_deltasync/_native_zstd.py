"""zstd called from the compiled kernels, so a tensor's streams are coded in one call.

The ``packed`` codec compresses up to six streams per tensor. Called from Python (the ``zstandard``
package) each stream is one more return to Python, and a thread returning to Python waits for the
GIL: two threads encoding 1% change sets of 50K changes each lost ~50-65 us of a 394-us encode to
those waits (``docs/benchmarks.md``, issue 14, twelfth part). Here libzstd's functions are numba
intrinsics (calls of external symbols), so :func:`compress` and :func:`decompress` run inside the
codec's kernels, which release the GIL once per tensor.

Which libzstd: the one ``zstandard`` itself runs. Its CFFI backend (``zstandard/_cffi*.so``, in
the package's wheels next to the C backend) exports libzstd's API; its symbols are registered with
LLVM under the prefix ``torch_deltasync_`` when the kernels are compiled (:func:`intrinsics`), so
the kernels' on-disk cache holds names, not addresses. Same library, same parameters
(:data:`~torch_deltasync.codecs._bits.LEVEL1_PARAMS`), same calls as ``zstandard``'s
``compress`` and ``decompress``: the frames are byte for byte those of the Python path and the
same frames are refused (``tests/unit/test_native_zstd.py``). Where that module is missing or reports
another zstd version than ``zstandard``, :data:`AVAILABLE` is false and the codec calls zstd from
Python, as before.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading

import numpy as np

from ._native import AVAILABLE as _NUMBA, BAD, OK, jit, register_intrinsics

__all__ = ["AVAILABLE", "compression_context", "decompression_context", "compress", "compress_bound", "decompress"]

_PREFIX = "torch_deltasync_"
# libzstd functions the kernels call: name -> (result, argument count); every argument is a
# 64-bit integer (a pointer, a size_t or an enum widened), as is every result but ZSTD_isError's.
_KERNEL_CALLS = {
    "ZSTD_compress2": (64, 5),
    "ZSTD_isError": (32, 1),
    "ZSTD_getFrameContentSize": (64, 2),
    "ZSTD_DCtx_reset": (64, 2),
    "ZSTD_decompressStream": (64, 3),
}
# zstd.h's enum values (stable API since zstd 1.4.0).
_C_COMPRESSION_LEVEL = 100
_C_PARAMETERS = {"window_log": 101, "hash_log": 102, "chain_log": 103, "search_log": 104, "min_match": 105,
                 "target_length": 106, "strategy": 107}
_RESET_SESSION_ONLY = 1


def _load() -> ctypes.CDLL | None:
    """``zstandard``'s CFFI extension as a shared library, or ``None`` (absent, or another zstd
    version than the one ``zstandard`` runs: its frames could differ)."""
    if not _NUMBA:
        return None
    try:
        import zstandard

        spec = importlib.util.find_spec("zstandard._cffi")
        if spec is None or not spec.origin:
            return None
        lib = ctypes.CDLL(spec.origin)
        for name in list(_KERNEL_CALLS) + ["ZSTD_versionNumber", "ZSTD_createCCtx", "ZSTD_freeCCtx",
                                           "ZSTD_CCtx_setParameter", "ZSTD_createDCtx", "ZSTD_freeDCtx"]:
            getattr(lib, name)
    except (ImportError, OSError, AttributeError, ValueError):
        return None
    major, minor, patch = zstandard.ZSTD_VERSION
    if lib.ZSTD_versionNumber() != major * 10000 + minor * 100 + patch:
        return None
    lib.ZSTD_createCCtx.restype = lib.ZSTD_createDCtx.restype = ctypes.c_void_p
    lib.ZSTD_freeCCtx.argtypes = lib.ZSTD_freeDCtx.argtypes = [ctypes.c_void_p]
    lib.ZSTD_CCtx_setParameter.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.ZSTD_CCtx_setParameter.restype = ctypes.c_size_t
    lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
    return lib


_LIB = _load()

#: Whether the kernels can call libzstd (numba installed, ``zstandard``'s CFFI module present with
#: the same zstd version). Callers use :func:`compress` and :func:`decompress` only then.
AVAILABLE = _LIB is not None


# --- contexts, one per thread (zstd contexts are not thread-safe) --------------------------------


class _Context:
    """A libzstd context owned by one thread; ``address`` is what the kernels take."""

    def __init__(self, address: int, free) -> None:
        self.address, self._free = address, free

    def __del__(self) -> None:
        self._free(self.address)


_tls = threading.local()


def compression_context(level: int) -> int:
    """This thread's compression context at ``level``, as an address for :func:`compress`.

    Level 1 runs :data:`~torch_deltasync.codecs._bits.LEVEL1_PARAMS` (as
    :func:`~torch_deltasync.codecs._bits.compressor` does); any other level is zstd's own.

    Raises:
        RuntimeError: :data:`AVAILABLE` is false.
        ValueError: zstd refuses ``level``.
    """
    if _LIB is None:
        raise RuntimeError("libzstd is not available to the compiled kernels (torch_deltasync._native_zstd.AVAILABLE)")
    ctx = getattr(_tls, "cctx", None)
    if ctx is None or _tls.level != level:
        from .codecs._bits import LEVEL1_PARAMS

        ctx = _Context(_LIB.ZSTD_createCCtx(), _LIB.ZSTD_freeCCtx)
        settings = {_C_PARAMETERS[k]: v for k, v in LEVEL1_PARAMS.items()} if level == 1 else {_C_COMPRESSION_LEVEL: level}
        for param, value in settings.items():
            if _LIB.ZSTD_isError(_LIB.ZSTD_CCtx_setParameter(ctx.address, param, value)):
                raise ValueError(f"zstd refuses parameter {param} = {value} (compression level {level})")
        _tls.cctx, _tls.level = ctx, level
    return ctx.address


def decompression_context() -> int:
    """This thread's decompression context, as an address for :func:`decompress`.

    Raises:
        RuntimeError: :data:`AVAILABLE` is false.
    """
    if _LIB is None:
        raise RuntimeError("libzstd is not available to the compiled kernels (torch_deltasync._native_zstd.AVAILABLE)")
    ctx = getattr(_tls, "dctx", None)
    if ctx is None:
        ctx = _tls.dctx = _Context(_LIB.ZSTD_createDCtx(), _LIB.ZSTD_freeDCtx)
    return ctx.address


# --- libzstd's functions: stand-ins in Python, intrinsics once compiled ---------------------------


def _stand_in(name: str):
    def call(*args):
        raise RuntimeError(f"{name} is called from compiled kernels only (torch_deltasync._native_zstd)")

    call.__name__ = call.__qualname__ = name
    return call


# The kernels' names for libzstd's functions; replaced by intrinsics in every module of the package
# when numba is imported (:func:`torch_deltasync._native.register_intrinsics`, :func:`intrinsics`).
ZSTD_compress2 = _stand_in("ZSTD_compress2")
ZSTD_isError = _stand_in("ZSTD_isError")
ZSTD_getFrameContentSize = _stand_in("ZSTD_getFrameContentSize")
ZSTD_DCtx_reset = _stand_in("ZSTD_DCtx_reset")
ZSTD_decompressStream = _stand_in("ZSTD_decompressStream")


_STUBS: dict[str, object] = {}


def _stub(name: str, n_args: int):
    """A C function that fails as ``name`` can (a zstd error, ``ZSTD_CONTENTSIZE_ERROR``)."""
    if name not in _STUBS:
        failure = {"ZSTD_isError": 1, "ZSTD_getFrameContentSize": -2}.get(name, -1)
        _STUBS[name] = ctypes.CFUNCTYPE(ctypes.c_int64, *[ctypes.c_int64] * n_args)(lambda *args: failure)
    return _STUBS[name]


def intrinsics() -> dict:
    """``{Python stand-in: numba intrinsic}`` for libzstd's functions above, their symbols registered
    with LLVM (``llvmlite.binding.add_symbol``). Where :data:`AVAILABLE` is false the symbols are
    bound to stubs that fail (callers do not call them then): kernels that call zstd still compile,
    and load from an on-disk cache written where libzstd was there."""
    import llvmlite.binding as llvm
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    def extern(name: str, result_bits: int, n_args: int):
        symbol = _PREFIX + name
        llvm.add_symbol(symbol, ctypes.cast(getattr(_LIB, name) if _LIB else _stub(name, n_args), ctypes.c_void_p).value)
        fnty = ir.FunctionType(ir.IntType(result_bits), [ir.IntType(64)] * n_args)

        def codegen(context, builder, signature, args):
            fn = cgutils.get_or_insert_function(builder.module, fnty, symbol)
            args = [context.cast(builder, a, t, types.int64) for a, t in zip(args, signature.args)]
            out = builder.call(fn, args)
            return builder.sext(out, ir.IntType(64)) if result_bits != 64 else out

        def typed(*args):
            if not all(isinstance(a, types.Integer) for a in args):
                return None
            return types.int64(*args), codegen

        # numba takes an intrinsic's arguments from its typing function's signature: one per arity
        typer = {1: lambda typingctx, a: typed(a), 2: lambda typingctx, a, b: typed(a, b),
                 3: lambda typingctx, a, b, c: typed(a, b, c),
                 5: lambda typingctx, a, b, c, d, e: typed(a, b, c, d, e)}[n_args]
        typer.__name__ = typer.__qualname__ = name
        return intrinsic(typer)

    stand_ins = {name: globals()[name] for name in _KERNEL_CALLS}
    return {stand_ins[name]: extern(name, bits, n) for name, (bits, n) in _KERNEL_CALLS.items()}


if _NUMBA:
    register_intrinsics(intrinsics)


# --- what the kernels call ----------------------------------------------------------------------


@jit
def compress_bound(n):
    """The most bytes a frame of ``n`` input bytes takes (``ZSTD_COMPRESSBOUND`` of zstd.h)."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0)


@jit
def compress(ctx, src, dst):
    """``src`` (uint8 ``(n,)``) as one zstd frame in ``dst`` (uint8, contiguous, at least
    :func:`compress_bound` ``(n)`` bytes: zstd's output depends on the room it is given, and
    ``zstandard`` gives it that), with the context at address ``ctx``
    (:func:`compression_context`), as ``zstandard``'s ``compress`` writes it.

    Returns:
        The frame's length in bytes, or -1 when zstd fails.
    """
    m = ZSTD_compress2(ctx, dst.ctypes.data, dst.size, src.ctypes.data, src.size)
    return -1 if ZSTD_isError(m) else m


@jit
def decompress(ctx, src, dst):
    """Decompress ``src`` into ``dst`` (uint8, ``(raw_len,)``), refusing exactly what
    :func:`~torch_deltasync.codecs._bits.unpack_stream` refuses: ``src`` must be one zstd frame
    that declares ``raw_len`` > 0 bytes of content, holds them and has nothing after it. The same
    calls as ``zstandard``'s ``ZstdDecompressor.decompress`` (reset the session, one
    ``ZSTD_decompressStream`` into a buffer of the declared size).

    Args:
        ctx: the address of a decompression context (:func:`decompression_context`).

    Returns:
        ``OK`` or ``BAD``. Nothing is written past ``dst`` (zstd's output buffer is ``dst``).
    """
    n, raw_len = src.size, dst.size
    if raw_len == 0 or n == 0 or ZSTD_getFrameContentSize(src.ctypes.data, n) != raw_len:
        return BAD  # (unknown and error sizes are -1 and -2 as int64)
    ZSTD_DCtx_reset(ctx, _RESET_SESSION_ONLY)
    buffers = np.empty(6, np.int64)  # ZSTD_outBuffer {dst, size, pos}, ZSTD_inBuffer {src, size, pos}
    buffers[0], buffers[1], buffers[2] = dst.ctypes.data, raw_len, 0
    buffers[3], buffers[4], buffers[5] = src.ctypes.data, n, 0
    rc = ZSTD_decompressStream(ctx, buffers.ctypes.data, buffers.ctypes.data + 24)
    if ZSTD_isError(rc) or rc != 0 or buffers[2] != raw_len or buffers[5] != n:
        return BAD
    return OK
