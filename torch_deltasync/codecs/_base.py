"""Codecs: how one tensor's change set (positions + new values) is stored in a delta object.

A codec turns the changes of one tensor into a few named tensors (stored in the delta object as
``<name>:<part>``) and back. Decoders treat their input as untrusted: every size, dtype and index is
checked, and a malformed part raises :class:`~torch_deltasync.errors.CorruptObjectError` before
anything is applied.

Codecs register by name with :func:`register_codec`; the manifest names the codec of a version and
receivers look it up with :func:`get_codec`. Built in:

* ``raw`` (format 1, the seed format): ``<name>:idx`` holds the sorted, unique global flat indices
  (int32 when the tensor has fewer than ``2**31`` elements, else int64) and ``<name>:val`` the new
  values in the inference dtype. 4 + 2 = 6 bytes per changed bf16 element.
* ``packed`` (``torch_deltasync/codecs/_packed.py``, the default of ``DeltaSender``): ``<name>:packed``,
  gap-coded positions and step-coded values with zstd, about 1 byte per changed bf16 element.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from .. import _native, _native_apply
from .._dtypes import bits, index_copy_, int_view_dtype
from .._pool import map_largest_first
from ..errors import ChecksumMismatchError, CorruptObjectError



@dataclass(frozen=True)
class TensorDelta:
    """The decoded changes of one tensor.

    Attributes:
        positions: int64 ``(k,)``, strictly increasing global flat indices in ``[0, numel)``
            (positions in the full HF-layout tensor, never local shard offsets).
        values: ``(k,)`` in the inference dtype: the new values (absolute overwrite semantics).
            Where ``steps`` is given and ``relative`` selects an entry, that entry's value is a
            placeholder and the new value is computed from the receiver's old value.
        steps: optional ``(k,)`` signed integers of the inference dtype's width: the new bit pattern
            minus the old one, with two's-complement wrap-around (integer arithmetic only, so
            applying a step is exact). ``None`` for codecs that ship absolute values only.
        relative: optional bool ``(k,)``: which entries use ``steps`` (``None`` = all of them when
            ``steps`` is given).
        base_checksum: optional partial checksum (:func:`torch_deltasync.checksum.checksum`) of
            the values at ``positions`` in the base version, as the sender saw them. Steps are
            relative, so a receiver whose own old value was wrong would silently stay wrong, and
            the manifest's checksums cannot tell (they are linear in the bit patterns, so a step
            changes them by the same amount whatever the old value). :meth:`resolve` compares the
            old values it is given with this checksum and refuses a mismatch. ``None``: unchecked.
    """

    positions: torch.Tensor
    values: torch.Tensor
    steps: torch.Tensor | None = None
    relative: torch.Tensor | None = None
    base_checksum: int | None = None

    @property
    def numel(self) -> int:
        return self.positions.numel()

    @property
    def needs_base(self) -> bool:
        """Whether :meth:`resolve` needs the receiver's old values at ``positions``."""
        return self.steps is not None

    def resolve(self, old_values: torch.Tensor | None = None) -> torch.Tensor:
        """The new values at ``positions``, ``(k,)`` in the inference dtype.

        Args:
            old_values: the values before this delta at ``positions`` (required iff ``needs_base``).

        Raises:
            ValueError: ``old_values`` missing or of the wrong shape.
            ChecksumMismatchError: ``old_values`` differ from the base the sender computed the
                steps against (``base_checksum``): the receiver's state has drifted, or the delta
                is applied to the wrong version. Nothing is returned to apply.
        """
        if self.steps is None:
            return self.values
        if old_values is None or old_values.shape != self.values.shape:
            raise ValueError("this delta stores steps; pass the old values at its positions")
        if _native.enabled() and old_values.is_cpu and self.positions.is_cpu and self.steps.is_cpu:
            if old_values.dtype != self.values.dtype:
                old_values = old_values.to(self.values.dtype)
            return self._resolve_native(old_values if old_values.is_contiguous() else old_values.contiguous())
        if self.base_checksum is not None:
            from ..checksum import checksum  # lazy: checksum is independent of codecs

            got = checksum(old_values.to(self.values.dtype).reshape(-1), self.positions.to(old_values.device))
            if got != self.base_checksum:
                self._mismatch(old_values)
        new_bits = bits(old_values.to(self.values.dtype)) + self.steps.to(int_view_dtype(self.values.dtype))
        if self.relative is None:
            return new_bits.view(self.values.dtype)
        return torch.where(self.relative, new_bits, bits(self.values)).view(self.values.dtype)

    def _check_lengths(self) -> None:
        """Every per-entry tensor has ``numel`` entries (the kernels index them without checks)."""
        for t in (self.values, self.steps, self.relative):
            if t is not None and t.shape != self.positions.shape:
                raise ValueError(f"delta parts of shapes {tuple(t.shape)} and {tuple(self.positions.shape)}")

    def _resolve_native(self, old: torch.Tensor) -> torch.Tensor:
        """:meth:`resolve` in one compiled pass (checksum of the old values and new values)."""
        self._check_lengths()
        u = _UNSIGNED[old.element_size()]
        new = np.empty(self.numel, u)
        if self.relative is None:  # values are placeholders
            rel, vals = _NO_MASK, np.empty(0, u)
        else:
            rel, vals = self.relative.contiguous().numpy(), bits(self.values.contiguous()).numpy().view(u)
        check = self.base_checksum is not None
        ok = _native.resolve_steps(self.positions.contiguous().numpy(), bits(old).numpy().view(u),
                                   self.steps.contiguous().numpy(), rel, vals, check,
                                   np.uint64(self.base_checksum or 0), new)
        if not ok:
            self._mismatch(old)
        return torch.from_numpy(new).view(self.values.dtype)

    def apply_to(self, flat: torch.Tensor) -> None:
        """Write this delta into ``flat`` in place: the same as
        ``flat.index_copy_(0, positions, self.resolve(flat[positions]))`` (or ``self.values`` for a
        delta without steps), in one pass on the CPU with the compiled kernels.

        Args:
            flat: the whole tensor, 1-D contiguous, in the inference dtype (the ``values`` dtype).

        Raises:
            ValueError: ``flat`` is not 1-D contiguous of the values' dtype, or the positions are
                not strictly increasing inside it (a repeated one would take two steps).
            ChecksumMismatchError: as :meth:`resolve`; nothing was written.
        """
        if flat.dim() != 1 or not flat.is_contiguous() or flat.dtype != self.values.dtype:
            raise ValueError(f"apply_to needs a 1-D contiguous {self.values.dtype} tensor, got "
                             f"{flat.dtype} {tuple(flat.shape)}")
        what = f"apply_to (a tensor of {flat.numel()} elements)"
        native = _native.enabled() and flat.device.type == "cpu" and self.positions.device.type == "cpu"
        if not native or self.positions.dtype != torch.int64 or self.positions.dim() != 1:
            check_positions(self.positions, flat.numel(), what, ValueError)  # (the kernel checks int64 ones)
        self._check_lengths()
        if not native:
            new = self.resolve(flat[self.positions]) if self.needs_base else self.values
            index_copy_(flat, self.positions.to(flat.device), new)
            return
        u = _UNSIGNED[flat.element_size()]
        no_values = self.relative is None and self.steps is not None  # placeholders
        vals = np.empty(0, u) if no_values else bits(self.values.contiguous()).numpy().view(u)
        steps = self.steps.contiguous().numpy() if self.steps is not None else np.empty(0, u)
        rel = self.relative.contiguous().numpy() if self.relative is not None else _NO_MASK
        check = self.steps is not None and self.base_checksum is not None
        status = _native_apply.apply_at(bits(flat).numpy().view(u), self.positions.contiguous().numpy(), steps, rel,
                                        vals, check, np.uint64(self.base_checksum or 0))
        if status == _native_apply.BAD_POSITIONS:
            check_positions(self.positions, flat.numel(), what, ValueError)  # raises, naming the entry
        if status == _native_apply.MISMATCH:
            self._mismatch(flat[self.positions])

    def _mismatch(self, old_values: torch.Tensor) -> None:
        """Raise the :class:`ChecksumMismatchError` of :meth:`resolve` for ``old_values``."""
        from ..checksum import checksum  # lazy: checksum is independent of codecs

        got = checksum(old_values.to(self.values.dtype).reshape(-1), self.positions.to(old_values.device))
        raise ChecksumMismatchError(
            f"the old values at the {self.numel} changed positions have checksum {got:016x}, the "
            f"delta was made against {self.base_checksum:016x}: the held weights differ from the "
            "delta's base version, so its steps cannot be applied"
        )

    def select(self, mask: torch.Tensor) -> "TensorDelta":
        """The entries where ``mask`` (bool ``(k,)``) is true (``base_checksum`` covers all
        entries, so the subset carries none)."""
        return TensorDelta(
            self.positions[mask],
            self.values[mask],
            None if self.steps is None else self.steps[mask],
            None if self.relative is None else self.relative[mask],
        )


@runtime_checkable
class Codec(Protocol):
    """Encodes and decodes the change set of one tensor.

    A protocol: implementations set ``name`` and are registered with :func:`register_codec`;
    subclass it to inherit :meth:`encode_many` / :meth:`decode_many` (a thread pool over
    :meth:`encode` / :meth:`decode`).
    """

    name: ClassVar[str]

    @abstractmethod
    def encode(
        self, positions: torch.Tensor, values: torch.Tensor, old_values: torch.Tensor, *, numel: int
    ) -> dict[str, torch.Tensor]:
        """Encode one tensor's changes.

        Args:
            positions: int64 ``(k,)``, strictly increasing global flat indices in ``[0, numel)``.
            values: ``(k,)`` new values in the inference dtype.
            old_values: ``(k,)`` the values at the base version (for codecs that code steps).
            numel: elements of the full tensor.

        Returns:
            ``{part: tensor}``; stored as ``<tensor name>:<part>``. Parts are CPU tensors.
        """

    def encode_many(self, items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], *,
                    threads: int | None = None) -> list[dict[str, torch.Tensor]]:
        """:meth:`encode` of several tensors, on ``threads`` threads (the compiled kernels and
        zstd release the GIL, so tensors are encoded in parallel).

        Args:
            items: ``(positions, values, old_values, numel)`` per tensor, as :meth:`encode` takes them.
            threads: worker threads; ``None``: one per CPU core the process may use (within its CPU quota), at most 8
                (shared among a launcher's local ranks: :func:`~torch_deltasync._pool.default_threads`).
                1 encodes in order on the calling thread.

        Returns:
            The parts of each item, in the order of ``items`` (the same as :meth:`encode` gives).

        Raises:
            ValueError: as :meth:`encode`, for the first failing item in ``items`` order.
        """
        return map_largest_first(lambda it: self.encode(it[0], it[1], it[2], numel=it[3]), items,
                                  [it[0].numel() for it in items], threads)

    def decode_many(self, items: Sequence[tuple[Mapping[str, torch.Tensor], int, int, torch.dtype]], *,
                    threads: int | None = None) -> list[TensorDelta]:
        """:meth:`decode` of several tensors, on ``threads`` threads (see :meth:`encode_many`).

        Args:
            items: ``(parts, numel, count, dtype)`` per tensor, as :meth:`decode` takes them.
            threads: as in :meth:`encode_many`.

        Returns:
            One :class:`TensorDelta` per item, in order.

        Raises:
            CorruptObjectError: as :meth:`decode`, for the first failing item in ``items`` order.
        """
        return map_largest_first(lambda it: self.decode(it[0], numel=it[1], count=it[2], dtype=it[3]), items,
                                  [it[2] for it in items], threads)

    @abstractmethod
    def decode(
        self, parts: Mapping[str, torch.Tensor], *, numel: int, count: int, dtype: torch.dtype
    ) -> TensorDelta:
        """Decode and validate one tensor's parts from an untrusted object.

        Args:
            parts: the ``{part: tensor}`` mapping read from the object.
            numel: elements of the full tensor (from the manifest).
            count: number of changed elements the object declares for this tensor.
            dtype: the inference dtype.

        Raises:
            CorruptObjectError: missing or unexpected parts, wrong dtype or shape, a count that does
                not match, indices out of range, unsorted or duplicated.
        """


_UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_NO_MASK = np.empty(0, np.bool_)


_CODECS: dict[str, type[Codec]] = {}


#: Names a codec cannot take: ``"auto"`` is the sender's choice by link speed (``codecs/_auto.py``).
_RESERVED = frozenset({"auto"})


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec available by its ``name``.

    Raises:
        TypeError: ``cls`` is not a class with ``encode`` and ``decode`` methods and a string ``name``.
        ValueError: the name is reserved (``"auto"``), empty, or taken by another codec class (the
            built-in ``raw`` and ``packed`` are never replaced).
    """
    if not isinstance(cls, type) or not callable(getattr(cls, "encode", None)) or not callable(
            getattr(cls, "decode", None)):
        raise TypeError(f"register_codec takes a codec class with encode() and decode() methods, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"codec class {cls.__name__} needs a class attribute name: a non-empty string")
    if name in _RESERVED:
        raise ValueError(f"codec name {name!r} is reserved; choose another name for {cls.__name__}")
    if name in _CODECS and _CODECS[name] is not cls:
        raise ValueError(f"codec name {name!r} is taken by {_CODECS[name].__module__}.{_CODECS[name].__name__}; "
                         f"choose another name for {cls.__name__}")
    _CODECS[name] = cls
    return cls


def codec_names() -> list[str]:
    """The registered codec names, sorted."""
    return sorted(_CODECS)


def get_codec(name: str) -> Codec:
    """An instance of the codec registered as ``name``.

    Raises:
        ValueError: no such codec; the message lists the registered names.
    """
    try:
        cls = _CODECS[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name
        raise ValueError(f"unknown codec {name!r}; registered codecs: {codec_names()}") from None
    return cls()


def check_encoder_positions(positions: object, what: str) -> None:
    """Refuse positions an encoder would silently convert: not a 1-D integer tensor (float
    positions were truncated, bool ones read as 0 and 1, 2-D ones flattened).

    Raises:
        TypeError: naming ``what`` (the codec) and what it got.
    """
    if (not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.is_floating_point()
            or positions.is_complex() or positions.dtype == torch.bool):
        got = f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise TypeError(f"{what}: positions must be a 1-D integer tensor (int64), got {got}")


def check_positions(idx: torch.Tensor, numel: int, what: str, error: type[Exception] = CorruptObjectError) -> torch.Tensor:
    """Validate untrusted positions: 1-D integer, strictly increasing, inside ``[0, numel)``.

    Args:
        error: what to raise: :class:`CorruptObjectError` for positions read from a store,
            ``ValueError`` for a caller's.

    Returns:
        The positions as int64.

    Raises:
        CorruptObjectError (or ``error``): the first rule broken, with the offending index.
    """
    if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
        raise error(f"{what}: positions must be 1-D int32/int64, got {idx.dtype} {tuple(idx.shape)}")
    idx = idx.to(torch.int64)
    if idx.numel():
        if int(idx[0]) < 0 or int(idx[-1]) >= numel:
            bad = int(idx[0]) if int(idx[0]) < 0 else int(idx[-1])
            raise error(f"{what}: position {bad} outside [0, {numel})")
        if idx.numel() > 1:
            up = idx[1:] > idx[:-1]
            if not bool(up.all()):
                i = int((~up).nonzero()[0]) + 1
                raise error(
                    f"{what}: positions must be strictly increasing (sorted, unique); "
                    f"entry {i} is {int(idx[i])} after {int(idx[i - 1])}"
                )
    return idx


def check_parts(parts: Mapping[str, torch.Tensor], expected: set[str], what: str) -> None:
    if set(parts) != expected:
        raise CorruptObjectError(f"{what}: expected parts {sorted(expected)}, got {sorted(parts)}")
