"""``ModuleTarget``: an ``nn.Module`` or state dict in Hugging Face naming (CPU generation, tests,
torchrl policies)."""

from __future__ import annotations

import threading
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from .. import _native, _native_apply
from .._dtypes import bits, int_view_dtype, narrow, widen
from ..checksum import tensor_checksum
from ..errors import ChecksumMismatchError, CorruptObjectError, IncompatibleTargetError
from ._base import TARGET_MEMBERS, Target
from ._overlap import overlaps_itself, refuse_shared_memory

__all__ = ["ModuleTarget"]


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _refuse_unwritable(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor a commit would write that holds no data (meta), is not strided (sparse) or
    whose elements overlap.

    Raises:
        IncompatibleTargetError: naming it and what to do.
    """
    if t.device.type == "meta":
        raise IncompatibleTargetError(f"tensor {name!r} is on the meta device; materialise the model first")
    if t.layout != torch.strided:
        raise IncompatibleTargetError(f"tensor {name!r} has layout {t.layout}; only strided tensors receive "
                                      "(make it dense: .to_dense())")
    if overlaps_itself(t):
        raise IncompatibleTargetError(
            f"tensor {name!r} has overlapping memory (shape {tuple(t.shape)}, stride {t.stride()}, e.g. from "
            "expand() or as_strided()), or a layout too fine-grained to prove it has none: two of its elements "
            "would take one value; give it storage of its own (.contiguous())"
        )


def holds_exactly(storage: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a tensor of ``storage`` dtype holds every ``dtype`` value bit-exactly, as
    :class:`ModuleTarget` stores them: the same dtype, or bf16 in fp32 (see :class:`_Codec`)."""
    return storage == dtype or (dtype == torch.bfloat16 and storage == torch.float32)


class _Codec:
    """How values of the inference dtype live in a tensor's storage, bit for bit.

    * same dtype: the storage holds the values; reads and writes go through the integer view of
      the width, so every bit pattern (NaN payloads, fp8) is copied as is;
    * bf16 values in fp32 storage: a bf16 number is the high half of the fp32 with the same value
      (:func:`~torch_deltasync._dtypes.widen` / :func:`~torch_deltasync._dtypes.narrow`, exact for
      every pattern). Float casts would not do: torch's fp32 -> bf16 cast rewrites a NaN's bits
      (0xFFFF in vector lanes, 0x7FC0 in scalar code).
    """

    def __init__(self, storage: torch.dtype, dtype: torch.dtype) -> None:
        self.storage, self.dtype = storage, dtype
        self.widened = storage != dtype

    def to_storage_bits(self, values: torch.Tensor) -> torch.Tensor:
        v = values.to(self.dtype)
        return bits(widen(v, self.storage) if self.widened else v)

    def from_storage_bits(self, stored: torch.Tensor) -> torch.Tensor:
        return narrow(stored.view(self.storage), self.dtype) if self.widened else stored.view(self.dtype)


class ModuleTarget(Target):
    """Applies versions in place to the floating tensors of a module or state dict.

    Tensors are stored in the inference dtype (bit-identical copies of the sender's cast), or, for
    bf16, in fp32 (CPU generation often runs in fp32): a bf16 value is stored as the fp32 whose
    high 16 bits are its bit pattern, which is exactly its value. Every read and write goes through
    integer views, so NaN payloads, ``-0.0`` and fp8 values are copied bit for bit and checksums
    prove bit-exactness in the inference dtype. Writes use ``index_copy_`` into the existing storage
    (never rebinding ``.data``), so optimizers, CUDA graphs and other references keep seeing the
    live tensor.

    **Live tensors.** The target keeps the module (or mapping), not the tensors it saw when it was
    built: every call looks each tensor up again by name (``module.get_submodule(path)`` and its
    ``_parameters`` / ``_buffers``; ``mapping[name]``). A tensor replaced since the last check
    (``module.to(torch.bfloat16)``, ``load_state_dict(..., assign=True)``, a new dict entry) is
    noticed on its next use: the whole target is checked again (shapes, dtypes, ties) before
    anything is read or written, and updates and :meth:`checksum` (``DeltaReceiver.verify``) then
    work on what the module actually serves. Before the first write of an update and before every
    anchor ``assign``, every tensor is looked up, so a replacement that no longer fits is refused
    before any weight changes. A replacement of the same shape and dtype keeps the receiver's
    version: the receiver assumes nobody else writes the weights (``verify()`` checks that).
    A mapping can only be followed by its entries: ``module.state_dict()`` given as a mapping is
    the module's tensors as they were then, and after ``module.to(...)`` or
    ``load_state_dict(..., assign=True)`` the module serves other memory than the one written and
    verified. Pass the module itself to follow it.

    Args:
        model: an ``nn.Module`` (its ``state_dict`` names) or a ``{name: tensor}`` mapping.
        strict: require the published tensors and the target's floating tensors to match exactly
            (like ``load_state_dict(strict=True)``), and refuse non-floating tensors (integer or bool
            buffers): the sender publishes floating-point tensors only, so such a tensor would
            silently keep its own value while ``verify()`` reported a match. With ``False`` extra
            tensors, floating or not, are left alone: neither synced nor verified.

    Raises:
        TypeError: ``model`` is neither a module nor a mapping; ``strict`` is not a bool.
        IncompatibleTargetError: (``strict``) the model holds a non-floating tensor.
    """

    concurrent_reads = True  # see Target: reads only look up and gather (the lookup takes a lock)

    def __init__(self, model: nn.Module | Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        if not isinstance(model, (nn.Module, Mapping)):
            missing = [m for m in TARGET_MEMBERS if not hasattr(model, m)]
            hint = ""
            if len(missing) < len(TARGET_MEMBERS):  # it looks like a target: say what it lacks
                hint = (f"; as a Target it lacks {missing} (subclass torch_deltasync.Target for the defaults "
                        "of owned, finish and holds_all)")
            raise TypeError(f"expected an nn.Module, a state dict or a Target, got {type(model).__name__}{hint}")
        if not isinstance(strict, bool):
            raise TypeError(f"ModuleTarget(strict=...) must be True or False, got {strict!r}")
        self._source = model
        self.strict = strict
        # A receiver reads tensors on several threads: a lookup that finds a replaced tensor (and
        # checks the whole target again, or finds every tensor again) must not be seen half done.
        self._lookup_lock = threading.RLock()
        self._write_lock = threading.Lock()  # a commit writes tensors on several threads
        self._bind()
        self._mirrors: dict[str, list[str]] = {}  # canonical -> untied aliases to write as well
        self._codecs: dict[str, _Codec] = {}
        self._checked: tuple | None = None  # the arguments of the last successful check()
        self._keys: dict[str, tuple] = {}  # name -> identity of the tensor that check validated
        self._refused: str | None = None  # why a re-check failed (every use refuses until check())
        self._writing = False  # the last call wrote (an update's apply is under way)
        self._written: set[str] = set()  # names written since the last scan

    @property
    def concurrent_writes(self) -> bool:
        """See :class:`Target`: a commit may write different tensors on several threads at once
        when every checked tensor is in host memory now (:meth:`check` refuses written tensors
        that share memory, so they scatter into disjoint storage). Accelerator tensors are written
        from the calling thread, on its stream. A subclass that overrides :meth:`write` gets its
        writes on the calling thread (torch's grad mode and streams are per thread); it can
        override this property to opt in."""
        if self._checked is None or type(self).write is not ModuleTarget.write:
            return False
        with self._lookup_lock:
            return all(self._get(n).device.type == "cpu" for n in list(self._keys))

    # --- live lookup -------------------------------------------------------------------------------

    def _bind(self) -> None:
        """Read the model's names and where each tensor lives (again after a submodule was replaced).

        Raises:
            IncompatibleTargetError: (``strict``) a non-floating tensor.
        """
        model = self._source
        tensors = model.state_dict(keep_vars=True) if isinstance(model, nn.Module) else model
        other = [(n, t.dtype) for n, t in tensors.items() if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        if other and self.strict:
            n, dt = other[0]
            more = f" (and {len(other) - 1} more non-floating tensors)" if len(other) > 1 else ""
            raise IncompatibleTargetError(
                f"receiving model tensor {n!r} is {dt}{more}: torch_deltasync publishes floating-point tensors "
                "only, so it would never be synced and no verification could cover it. Register derived state as "
                "a non-persistent buffer (register_buffer(..., persistent=False)), or pass "
                "ModuleTarget(model, strict=False) as the receiver's target to leave non-floating tensors alone "
                "(neither synced nor verified); if it is a weight the sender publishes, hold it in a floating "
                "dtype (the inference dtype, e.g. torch.bfloat16), not as an integer view"
            )
        self._other = {n for n, _ in other}
        self._names = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_floating_point()]
        self._owners = _owners(model, tensors) if isinstance(model, nn.Module) else {}
        # Entries the owner lookup cannot reach (state-dict hooks that rename them): kept as given
        # (check() refuses the written ones that are no memory of the module: copies).
        self._fixed = ({n: tensors[n] for n in self._names if n not in self._owners}
                       if isinstance(model, nn.Module) else {})

    def _get(self, name: str) -> torch.Tensor:
        """The tensor (or parameter) the model holds under ``name`` now."""
        if name in self._fixed:
            return self._fixed[name]
        if not isinstance(self._source, nn.Module):
            t = self._source.get(name)
        else:
            found = self._owners.get(name)
            if found is not None and any(parent._modules.get(key) is not child for parent, key, child in found[0]):
                self._bind()  # a submodule on the way was replaced: find every tensor again
                found = self._owners.get(name)
            t = None if found is None else (found[1]._parameters if found[3] else found[1]._buffers).get(found[2])
        if not isinstance(t, torch.Tensor):
            raise IncompatibleTargetError(
                f"tensor {name!r} is no longer in the receiving model (it was removed or replaced by a "
                f"{type(t).__name__}); build a new receiver for the new model"
            )
        return t

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The floating tensors the model holds now, by name (detached, sharing its storage)."""
        return {n: self._get(n).detach() for n in list(self._names)}

    @tensors.setter
    def tensors(self, value: Mapping[str, torch.Tensor]) -> None:
        """Point the target at other tensors (a ``{name: tensor}`` mapping); check it again before use."""
        self._source = dict(value)
        self._bind()

    def _live(self, name: str) -> torch.Tensor:
        """``name``'s live tensor, detached; the whole target is checked again first if any checked
        tensor was replaced since (one thread at a time)."""
        with self._lookup_lock:
            t = self._get(name)
            key = self._keys.get(name)
            if self._refused is not None or (key is not None and _identity(t) != key):
                self._recheck()
                t = self._get(name)
        return t.detach()

    def _scan(self) -> None:
        """Look up every checked tensor; check the whole target again if any was replaced."""
        if self._refused is not None or any(_identity(self._get(n)) != key for n, key in list(self._keys.items())):
            self._recheck()

    def _start_write(self, name: str) -> None:
        """Before a write or assign: the first one of an update (after a read or check, or a name
        written again: a new update) looks every tensor up, so that a replacement that no longer
        fits is refused before any weight changes, not halfway through. Writes of one commit may
        come from several threads: the first to arrive scans while the others wait."""
        with self._write_lock:
            if not self._writing or name in self._written:
                self._scan()
                self._written = set()
            self._writing = True
            self._written.add(name)

    def _recheck(self) -> None:
        """Check the whole target again (a checked tensor was replaced). A target that no longer
        fits refuses every read and write from then on, until :meth:`check` passes again: other
        threads of the same commit must not write what this one refused."""
        if self._refused is not None:
            raise IncompatibleTargetError(self._refused)
        if self._checked is None:
            return
        try:
            self.check(*self._checked)
        except IncompatibleTargetError as e:
            self._refused = (
                f"the receiving model's tensors were replaced since they were checked (e.g. module.to(dtype) "
                f"or load_state_dict(..., assign=True)) and no longer fit the published version: {e}"
            )
            raise IncompatibleTargetError(self._refused) from None

    # --- Target ------------------------------------------------------------------------------------

    def check(self, shapes: dict[str, tuple[int, ...]], aliases: dict[str, str], dtype: torch.dtype) -> None:
        self._writing = False
        self._checked, self._keys, self._refused = None, {}, None
        self._mirrors, self._codecs = {}, {}
        tensors = self.tensors
        missing = [n for n in shapes if n not in tensors]
        if missing:
            not_float = [n for n in missing if n in self._other]
            if not_float:
                raise IncompatibleTargetError(
                    f"receiving model tensor {not_float[0]!r} is not a floating-point tensor, but the sender "
                    f"publishes it as {dtype}"
                )
            raise IncompatibleTargetError(
                f"published tensors unknown to the receiving model: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all); build the receiver "
                "from the same architecture and naming as the sender"
            )
        bad = [(n, s, tuple(tensors[n].shape)) for n, s in shapes.items() if tuple(tensors[n].shape) != s]
        if bad:
            n, s, have = bad[0]
            raise IncompatibleTargetError(
                f"tensor {n!r}: published shape {s}, receiver has {have} ({len(bad)} mismatches); build the receiver "
                "from the sender's architecture and configuration")
        owners: dict[tuple, str] = {}  # the sender shipped these separately: they must not be tied here
        for n in shapes:
            t = tensors[n]
            _refuse_unwritable(n, t)
            if t.numel() == 0:
                continue
            key = _storage_key(t)
            if key in owners:
                raise IncompatibleTargetError(
                    f"the receiver ties {owners[key]!r} and {n!r} but the sender publishes them as separate tensors"
                )
            owners[key] = n
        mirrors: dict[str, list[str]] = {}
        for alias, canon in aliases.items():
            t = tensors.get(alias)
            if t is not None and _storage_key(t) != _storage_key(tensors[canon]):
                if tuple(t.shape) != shapes[canon]:
                    raise IncompatibleTargetError(
                        f"alias {alias!r} has shape {tuple(t.shape)}, but the sender publishes it as a tie to {canon!r} "
                        f"of shape {shapes[canon]}; build the receiver from the sender's architecture and configuration")
                _refuse_unwritable(alias, t)
                mirrors.setdefault(canon, []).append(alias)
        written = [n for n in shapes if tensors[n].numel()] + [a for m in mirrors.values() for a in m]
        refuse_shared_memory(tensors, written)
        self._refuse_copies([n for n in written if n in self._fixed])
        if self.strict:
            covered = set(shapes) | set(aliases)
            extra = [n for n in tensors if n not in covered]
            if extra:
                raise IncompatibleTargetError(
                    f"receiving model tensors not published by the sender: {extra[:5]} ({len(extra)} in all); "
                    "to leave them alone, pass ModuleTarget(model, strict=False) as the receiver's target "
                    "(torchrl: DeltaWeightSyncScheme(..., strict=False))"
                )
        codecs = {}
        for n in list(shapes) + [a for m in mirrors.values() for a in m]:
            storage = tensors[n].dtype
            if not holds_exactly(storage, dtype):
                hint = f"{dtype} or torch.float32" if dtype == torch.bfloat16 else f"{dtype}"
                raise IncompatibleTargetError(
                    f"tensor {n!r} is {storage}, which cannot hold every {dtype} bit pattern; store it as {hint}"
                )
            codecs[n] = _Codec(storage, dtype)
        self._mirrors, self._codecs = mirrors, codecs
        self._keys = {n: _identity(tensors[n]) for n in codecs}
        self._checked = (dict(shapes), dict(aliases), dtype)

    def _refuse_copies(self, names: list[str]) -> None:
        """Refuse written ``state_dict()`` entries of a module that are none of its parameters' or
        buffers' memory (a state-dict hook that casts or copies): every write would be lost.

        Raises:
            IncompatibleTargetError: naming the first such entry.
        """
        if not names:
            return
        model = self._source
        own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel()}
        copies = [n for n in names if self._fixed[n].untyped_storage().data_ptr() not in own]
        if copies:
            raise IncompatibleTargetError(
                f"the receiving module's state_dict() returns {copies[0]!r} in memory that is none of its parameters "
                f"or buffers ({len(copies)} such tensors; e.g. a state-dict hook that casts or copies): writes to it "
                "would not reach the model. Pass a {name: live tensor} mapping instead")

    def _targets(self, name: str) -> list[str]:
        return [name] + self._mirrors.get(name, [])

    def _stored_bits(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(int_view_dtype(t.dtype))

    def read(self, name: str, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The values at ``positions`` (int64 ``(k,)`` global flat) in ``dtype``, ``(k,)``, bit-exactly.

        Raises:
            CorruptObjectError: a position outside the tensor.
        """
        self._writing = False
        t = self._live(name)
        stored = self._stored_bits(t)
        codec = self._codec(name, t, dtype)
        if t.is_contiguous():
            out = _gather_native(stored.view(-1), positions, codec)
            if out is not None:
                return out
        if positions.numel():
            lo, hi = (int(x) for x in torch.aminmax(positions))
            if lo < 0 or hi >= t.numel():
                raise CorruptObjectError(f"{name!r}: positions outside [0, {t.numel()}) (min {lo}, max {hi})")
        pos = positions.to(t.device)
        vals = stored.reshape(-1)[pos] if t.is_contiguous() else stored[torch.unravel_index(pos, t.shape)]
        return codec.from_storage_bits(vals)

    def _codec(self, name: str, t: torch.Tensor, dtype: torch.dtype) -> _Codec:
        c = self._codecs.get(name)
        if c is None or c.dtype != dtype or c.storage != t.dtype:
            if not holds_exactly(t.dtype, dtype):
                raise IncompatibleTargetError(f"tensor {name!r} is {t.dtype}, which cannot hold {dtype} values bit-exactly; "
                                              f"read and write it as {t.dtype}" + (" (or store it as torch.float32)"
                                                                                   if dtype == torch.bfloat16 else ""))
            c = _Codec(t.dtype, dtype)
        return c

    @torch.no_grad()
    def write(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the elements at ``positions`` (int64 ``(k,)`` global flat) with ``values``
        (``(k,)``, inference dtype), in place, in every tensor tied to ``name``.

        Raises:
            CorruptObjectError: a position outside the tensor or ``values`` of another length;
                nothing is written.
        """
        self._start_write(name)
        if values.shape != positions.shape:
            raise CorruptObjectError(f"{name!r}: {positions.numel()} positions but values of shape {tuple(values.shape)}")
        if positions.numel():
            numel = self._live(name).numel()
            lo, hi = (int(x) for x in torch.aminmax(positions))
            if lo < 0 or hi >= numel:
                raise CorruptObjectError(f"{name!r}: positions outside [0, {numel}) (min {lo}, max {hi}); nothing written")
        for n in self._targets(name):
            t = self._live(n)
            stored = self._stored_bits(t)
            pos = positions.to(t.device)
            codec = self._codec(n, t, values.dtype)
            if t.is_contiguous() and _scatter_native(stored.view(-1), pos, values, codec):
                continue  # the compiled scatter, one pass (bf16 into fp32 storage too)
            vals = codec.to_storage_bits(values).to(t.device)
            if t.is_contiguous():
                # index_copy_ costs ~1.4-2.3 ns per changed element; scatter_ grows with the tensor size.
                stored.view(-1).index_copy_(0, pos, vals)
            else:
                stored.index_put_(torch.unravel_index(pos, t.shape), vals)

    @torch.no_grad()
    def assign(self, name: str, full: torch.Tensor) -> None:
        self._start_write(name)
        for n in self._targets(name):
            t = self._live(n)
            stored = self._stored_bits(t)
            stored.copy_(self._codec(n, t, full.dtype).to_storage_bits(full).reshape(t.shape))

    def values(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The held tensor ``name`` in ``dtype``, bit-exactly (bf16 held in fp32 comes back with its
        exact bit patterns, NaN payloads included; a float cast could rewrite those). Shares memory
        with the target where ``dtype`` is the storage dtype; copy before keeping it."""
        self._writing = False
        t = self._live(name)
        return self._codec(name, t, dtype).from_storage_bits(self._stored_bits(t))

    def checksum(self, name: str, dtype: torch.dtype) -> int:
        """Checksum of ``name``'s values in ``dtype``, after checking that the target holds one set
        of such values for it: every untied alias written beside it (:meth:`check`'s mirrors)
        bit-identical to it, and bf16 values held in fp32 with their low 16 bits zero (else the
        model computes with numbers that are no bf16 values, whose checksum could still match).

        Raises:
            ChecksumMismatchError: an alias differs, or an fp32 tensor holds non-bf16 values
                (naming the tensor and how many elements; ``verify_or_forget()`` then ``update()``
                rebuilds it from an anchor).
        """
        values = self.values(name, dtype)
        for n in self._targets(name):
            t = self._live(n)
            codec = self._codec(n, t, dtype)
            if codec.widened:
                low = int(torch.count_nonzero(self._stored_bits(t).bitwise_and(0xFFFF)))
                if low:
                    raise ChecksumMismatchError(
                        f"tensor {n!r} is held in {t.dtype} and {low} of its {t.numel()} elements are no {dtype} values "
                        f"(their low 16 bits are set): it holds no published version. Load {dtype} weights, or call "
                        "verify_or_forget() and update() to rebuild it from an anchor")
            if n != name:
                other = codec.from_storage_bits(self._stored_bits(t))
                differ = int(torch.count_nonzero(bits(other).to(values.device) != bits(values)))
                if differ:
                    raise ChecksumMismatchError(
                        f"tensor {n!r}, written as an untied copy of {name!r}, differs from it at {differ} of "
                        f"{t.numel()} elements (something else wrote one of them); call verify_or_forget() and "
                        "update() to rebuild both from an anchor")
        return tensor_checksum(values)

    def state_dict(self) -> dict[str, Any]:
        return self.tensors


def _scatter_native(flat: torch.Tensor, pos: torch.Tensor, values: torch.Tensor, codec: _Codec) -> bool:
    """``flat.index_copy_(0, pos, codec.to_storage_bits(values))`` with the compiled kernel, in one
    pass (the widened bf16-in-fp32 case without the cast and shift temporaries); False, writing
    nothing, where the torch path must run instead: no kernels, not on the CPU, values of another
    dtype. The caller checked that every position is inside ``flat``."""
    if (not _native.enabled() or flat.device.type != "cpu" or pos.device.type != "cpu"
            or values.dtype != codec.dtype or pos.dtype != torch.int64 or pos.dim() != 1):
        return False
    p, v = pos.contiguous().numpy(), _native_apply.np_bits(values.contiguous())
    if codec.widened:
        _native_apply.scatter_widened(flat.numpy().view(np.uint32), p, v)
    else:
        _native_apply.scatter(_native_apply.np_bits(flat), p, v, 0)
    return True


def _gather_native(flat: torch.Tensor, pos: torch.Tensor, codec: _Codec) -> torch.Tensor | None:
    """``codec.from_storage_bits(flat[pos])`` with the compiled kernel, in one pass; ``None`` where
    the torch path must run (no kernels, not on the CPU, not int64 positions) or where a position
    is outside ``flat`` (the caller's torch path then raises the specific error)."""
    if (not _native.enabled() or flat.device.type != "cpu" or pos.device.type != "cpu" or pos.dtype != torch.int64
            or pos.dim() != 1):
        return None
    out = torch.empty(pos.shape, dtype=codec.dtype)
    p, o = pos.contiguous().numpy(), _native_apply.np_bits(out)
    if codec.widened:
        bad = _native_apply.gather_widened(flat.numpy().view(np.uint32), p, o)
    else:
        bad = _native_apply.gather(_native_apply.np_bits(flat), p, o, 0)
    return out if bad < 0 else None


def _identity(t: torch.Tensor) -> tuple:
    """What changes when a tensor is replaced or its ``.data`` rebound (``module.to``), and not when
    its values are written in place. Read from the parameter itself (no ``detach``: this runs for
    every tensor at the start of every update)."""
    return (t.device, t.data_ptr(), t.dtype, t.shape, t.stride())


def _owners(model: nn.Module, state: Mapping[str, Any]) -> dict[str, tuple]:
    """``{state-dict name: (chain, owner module, attribute, is_parameter)}`` for every entry of
    ``state`` that ``model`` holds under its own name (the default ``state_dict`` naming; entries
    renamed by state-dict hooks are left out). ``chain`` is the ``(parent, key, child)`` links from
    ``model`` to the owner, so a replaced submodule is noticed with a few dict lookups."""
    out: dict[str, tuple] = {}

    def walk(mod: nn.Module, prefix: str, chain: tuple) -> None:
        for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for attr, t in table.items():
                name = prefix + attr
                if t is not None and name not in out and state.get(name) is t:
                    out[name] = (chain, mod, attr, is_param)
        for key, child in mod._modules.items():
            if child is not None:
                walk(child, f"{prefix}{key}.", chain + ((mod, key, child),))

    walk(model, "", ())
    return out
