"""The ``Target`` interface: where a receiver writes the weights it applies.

All positions a target sees are **global flat indices** of the full HF-layout tensor. A target that
holds only part of a tensor (a vLLM TP rank) maps them to its own storage and reports which ones it
owns; a target that holds everything (:class:`~torch_deltasync.targets.ModuleTarget`) owns all.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from .._dtypes import bits, narrow, widen
from ..errors import ChecksumMismatchError

__all__ = ["Target", "TARGET_MEMBERS", "PreparedCommit", "allows_concurrent", "prepare_commit", "narrow_exactly"]

#: The members a :class:`Target` has (what ``isinstance(obj, Target)`` checks).
TARGET_MEMBERS = ("holds_all", "check", "read", "owned", "write", "assign", "finish", "checksum")


@runtime_checkable
class Target(Protocol):
    """Live tensors a :class:`~torch_deltasync.DeltaReceiver` updates in place.

    A protocol: any object with these members is a target (``isinstance`` checks them); subclass it
    to inherit the defaults of :meth:`owned` and :meth:`finish` and to have the abstract members
    enforced.

    Receivers call :meth:`check` once per manifest, then, only after everything was downloaded,
    decoded and verified, :meth:`write` (deltas) or :meth:`assign` (anchors), then :meth:`finish`. Implementations must
    write in place into the existing storage (CUDA graphs and engines keep pointers to it) and must
    not change anything in :meth:`check`, :meth:`read` or :meth:`checksum`.

    Threads: a target that sets the class attribute ``concurrent_reads = True`` (optional, not
    part of the ``isinstance`` check; the library's targets set it) lets a receiver call
    :meth:`owned` and :meth:`read` for different tensors on several threads at once while it
    stages an update (``ReceiverConfig.threads``); other targets get every call on the receiver's
    calling thread. Likewise a true ``concurrent_writes`` (:class:`ModuleTarget` has it for a
    model in host memory) lets a commit call :meth:`write` for different tensors on several
    threads at once (each name once per commit); :meth:`assign` and :meth:`finish` always come
    from the calling thread, and so do the writes of other targets. (Reads of a ``prepare`` that
    another thread runs may overlap a commit's writes, with or without these flags.)

    Work ahead of a commit: a target may also define ``prepare_commit(sparse, dense)`` (optional,
    not part of the ``isinstance`` check; see :func:`prepare_commit`), which a receiver calls at
    the end of :meth:`~torch_deltasync.DeltaReceiver.prepare`, off the engine's pause, to build
    what a commit would otherwise build inside it (e.g. :class:`VLLMEngineTarget` re-packs the
    changed vLLM modules there). It returns a :class:`PreparedCommit` or ``None``.
    """

    #: True when the target holds every element of every tensor (so the receiver can verify the
    #: full per-tensor checksum itself); False for partial holders such as one vLLM TP rank.
    holds_all: bool = True

    @abstractmethod
    def check(self, shapes: dict[str, tuple[int, ...]], aliases: dict[str, str], dtype: torch.dtype) -> None:
        """Validate that the published tensors (HF name -> full shape, tied ``{alias: canonical}``,
        values in ``dtype``) fit this target. Called before anything is downloaded.

        Raises:
            IncompatibleTargetError: unknown names, missing tensors, or shapes that differ.
        """

    @abstractmethod
    def read(self, name: str, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Current values at ``positions`` (int64 ``(k,)`` global flat), ``(k,)`` in ``dtype``.

        Only positions this target owns may be passed (see :meth:`owned`). With
        ``concurrent_reads``, called for different names from several threads at once.
        """

    def owned(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        """Bool ``(k,)``: which of ``positions`` this target holds (all, by default)."""
        return torch.ones_like(positions, dtype=torch.bool)

    @abstractmethod
    def write(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the elements at owned ``positions`` (int64 ``(k,)``, global flat indices,
        strictly increasing) with ``values`` (``(k,)``, the inference dtype), in place.

        Raises:
            IncompatibleTargetError: the target no longer fits (e.g. a tensor replaced since
                :meth:`check`), raised before anything is written: the receiver then keeps the
                version it held.
        """

    @abstractmethod
    def assign(self, name: str, full: torch.Tensor) -> None:
        """Overwrite the whole tensor with ``full`` (full HF shape, inference dtype), in place.

        Raises:
            IncompatibleTargetError: as :meth:`write`, before anything is written.
        """

    def finish(self, written: frozenset[str]) -> None:
        """Called once after the writes of one commit (``written``: the HF names written), before
        the receiver reports the new version. Targets whose live weights are derived copies of
        what :meth:`write` updates (e.g. vLLM modules re-packed for a kernel) rebuild them here.
        A raise leaves the receiver's state unknown (the next update takes an anchor path)."""

    @abstractmethod
    def checksum(self, name: str, dtype: torch.dtype) -> int:
        """Partial checksum (:mod:`torch_deltasync.checksum`) of the elements this target holds,
        each counted once, in ``dtype``.

        Raises:
            ChecksumMismatchError: the target holds no one set of values for ``name`` that a
                checksum could stand for (e.g. copies of it that differ), naming what differs.
        """


@runtime_checkable
class PreparedCommit(Protocol):
    """What a target's ``prepare_commit`` built ahead of one commit (see :class:`Target`)."""

    def commit(self) -> bool:
        """Do what the commit's :meth:`Target.write` / :meth:`Target.assign` calls and
        :meth:`Target.finish` would do, from what was built ahead. Returns ``False``, having
        written nothing, when that no longer applies (the target changed since), so the receiver
        writes the usual way. A raise leaves the state unknown, as a failed write does."""

    def release(self) -> None:
        """Free what was built (memory); :meth:`commit` then returns ``False``."""


def prepare_commit(target: object, sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None,
                   dense: Mapping[str, torch.Tensor] | None) -> Any:
    """``target.prepare_commit(sparse, dense)`` where the target defines it, else ``None``.

    Args:
        sparse: HF name -> (positions ``(k,)`` int64 global flat, values ``(k,)``) of a delta
            path's staged writes (``None`` on an anchor path).
        dense: HF name -> full tensor (HF shape, inference dtype) of an anchor path (``None`` on
            a delta path).

    Returns:
        A :class:`PreparedCommit`, or ``None`` (nothing built: the commit writes the usual way).
    """
    fn = getattr(target, "prepare_commit", None)
    return None if fn is None else fn(sparse, dense)


def allows_concurrent(target: object, calls: str) -> bool:
    """Whether ``target`` declares ``concurrent_<calls>`` (``"reads"``: :meth:`Target.read` and
    ``owned``; ``"writes"``: :meth:`Target.write`) true, so a receiver may make those calls for
    several tensors at once (see :class:`Target`, "Threads")."""
    return bool(getattr(target, f"concurrent_{calls}", False))


def narrow_exactly(values: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``values``, held in a wider floating dtype (vLLM parameters in fp32 for a bf16 run), back in
    ``dtype`` for a checksum (:func:`~torch_deltasync._dtypes.narrow`), after checking bit for bit
    that each one is a ``dtype`` value: widening it again (:func:`~torch_deltasync._dtypes.widen`,
    what the target's writes do) gives the same bits, NaNs included. A wider value that merely
    rounds to the published one (or a NaN whose dropped payload bits are not zero) would pass the
    checksum while the engine computes with another number.

    Raises:
        ChecksumMismatchError: naming tensor ``name`` and how many of its elements are no ``dtype``
            values.
    """
    if values.dtype == dtype:
        return values
    values = values.contiguous()
    out = narrow(values, dtype)
    if dtype == torch.bfloat16 and values.dtype == torch.float32:  # a bf16 value's low half is zero
        off = int((bits(values) & 0xFFFF).count_nonzero())
    else:
        off = int((bits(widen(out, values.dtype)) != bits(values)).sum())
    if off:
        raise ChecksumMismatchError(
            f"tensor {name!r} is held in {values.dtype} and {off} of these {values.numel()} elements are no {dtype} "
            f"values: it holds no published version (something else wrote it); update from an anchor "
            "(verify_or_forget(), then update())")
    return out
