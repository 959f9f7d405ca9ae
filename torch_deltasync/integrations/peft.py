"""LoRA adapter sync: versions of a PEFT adapter as anchors and deltas, in PEFT's own names.

A LoRA run publishes only the adapter, the tensors ``peft.get_peft_model_state_dict`` returns
(``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``,
without the adapter name), so any version materialises as the folder PEFT and vLLM load::

    <out_dir>/adapter_model.safetensors   # the adapter tensors of that version (inference dtype)
    <out_dir>/adapter_config.json         # PEFT's LoraConfig, as LoraConfig.save_pretrained writes it

The adapter's ``LoraConfig`` travels with the run as one JSON object next to the manifests,
``<prefix>/adapter/adapter_config.json``, written by the sender before its first version (so a
reader that sees a manifest finds it) and never changed afterwards: a sender on a prefix holding
another adapter structure refuses to start. Readers validate it as untrusted input (size, JSON
types, ``peft_type``, ranks against the published shapes) and never unpickle anything.

Adapters change densely: at the learning rates LoRA is trained with, most adapter elements change
their bf16 bits every step (``lora_B`` starts at zero), and a raw delta costs 6 bytes per changed
bf16 element with the ``raw`` codec against 2 for a full copy (``packed``, the default codec, stores
the small Adam steps in far fewer). So :class:`AdapterSender` uses ``AnchorPolicy(max_delta_ratio=1.0)``
by default: each version ships as a delta when that is smaller than the adapter and as a full adapter
otherwise; receivers download the cheaper path.

Pieces:

* :class:`AdapterSender` (a :class:`~torch_deltasync.DeltaSender`): publishes a ``PeftModel``'s adapter.
* :class:`AdapterReceiver` (a :class:`~torch_deltasync.DeltaReceiver`): applies versions in place to
  a ``PeftModel`` on any device, bit-exactly, or holds the adapter tensors itself (``model=None``).
* :func:`materialize_adapter`: writes the PEFT folder of one version (never half-written).
* :func:`adapter_state_dict`, :func:`read_adapter_config`, :func:`parse_adapter_config`; without
  PEFT, :func:`read_adapter_config_dict` and :func:`check_adapter_config` (the config as a ``dict``).

``peft`` is imported lazily (the ``models`` extra), and only where a ``PeftModel`` or a
``LoraConfig`` is involved: a receiver without a model (:func:`materialize_adapter`, the vLLM
loader) runs without it, as vLLM does. See ``docs/lora.md``.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import CorruptObjectError, IncompatibleTargetError, ObjectNotFoundError, VersionNotFoundError
from ..receiver import DeltaReceiver, ReceiverConfig
from ..sender import AnchorPolicy, DeltaSender, SenderConfig
from ..store import Store, open_store
from ..targets import ModuleTarget
from ._adapter_config import (
    ADAPTER_CONFIG_KEY, MAX_ADAPTER_CONFIG_BYTES, STRUCTURAL_FIELDS, adapter_config_json, config_dict_json,
    check_adapter_config, check_init_method, lora_config_class, lora_config_from, parse_adapter_config, peft_config,
    read_adapter_config, read_adapter_config_dict, structure_diff,
)
from ._adapter_dir import check_replaceable, write_adapter_dir
from ._sender_options import receiver_config as _receiver_config
from ._sender_options import sender_config as _sender_config

__all__ = [
    "ADAPTER_CONFIG_KEY",
    "MAX_ADAPTER_CONFIG_BYTES",
    "STRUCTURAL_FIELDS",
    "AdapterSender",
    "AdapterReceiver",
    "AdapterTarget",
    "adapter_state_dict",
    "adapter_config_json",
    "check_adapter_config",
    "parse_adapter_config",
    "read_adapter_config",
    "read_adapter_config_dict",
    "check_adapter_tensors",
    "materialize_adapter",
]

for _f in (adapter_config_json, check_adapter_config, parse_adapter_config, read_adapter_config, read_adapter_config_dict):
    _f.__module__ = __name__  # the public path (defined in ._adapter_config)
del _f

# A PEFT adapter tensor name: "base_model.model." then a dotted module path.
_NAME_RE = re.compile(r"base_model\.model\.[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
# (suffix, which dim holds the rank)
_RANK_DIMS = ((".lora_A.weight", 0), (".lora_B.weight", 1), (".lora_embedding_A", 0), (".lora_embedding_B", 1))


# --- names and tensors ---------------------------------------------------------------------------


def adapter_state_dict(model: Any, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The live adapter tensors of a PEFT model, in PEFT's saved names.

    Uses ``peft.get_peft_model_state_dict``, so the names and the set of tensors are exactly those
    ``PeftModel.save_pretrained`` writes (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``,
    the adapter name removed). The tensors share storage with the model's parameters (no copy), so a
    sender reads the current weights and a receiver writes into the model.

    Args:
        model: a ``peft.PeftModel``.
        adapter_name: which adapter (PEFT's default is ``"default"``).

    Returns:
        ``{name: tensor}``: ``lora_A.weight`` ``[r, in_features]``, ``lora_B.weight``
        ``[out_features, r]`` (and whatever else the adapter trains, e.g. ``modules_to_save``).

    Raises:
        TypeError: ``model`` is not a PEFT model.
        ValueError: it has no adapter called ``adapter_name``.
    """
    from peft.utils import get_peft_model_state_dict

    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping):
        raise TypeError(f"expected a peft.PeftModel, got {type(model).__name__}; wrap the model with peft.get_peft_model")
    if adapter_name not in configs:
        raise ValueError(f"the model has no adapter {adapter_name!r}; it has {sorted(configs)}")
    # Never the base model's embedding layers (PEFT adds them when target_modules name an
    # embedding, save_embedding_layers="auto"): a run ships adapter tensors only, and a receiver on
    # another base (or an fp32 one) would have its base embedding replaced.
    sd = get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False)
    if not sd:
        raise ValueError(f"adapter {adapter_name!r} has no tensors")
    return sd


def _ranks_allowed(config) -> set[int]:
    d = config if isinstance(config, Mapping) else {"r": config.r, "rank_pattern": config.rank_pattern}
    return {int(d["r"]), *(int(v) for v in (d.get("rank_pattern") or {}).values())}


def check_adapter_tensors(config, shapes: Mapping[str, tuple[int, ...]], where: str = "adapter") -> None:
    """Check published tensor names and shapes against an adapter config.

    Every name must be a PEFT adapter name (``base_model.model.`` and a dotted module path), at
    least one must be a LoRA factor, each factor's rank dimension (``lora_A`` dim 0, ``lora_B``
    dim 1) must be ``config.r`` or a ``rank_pattern`` value, and every module's ``lora_A`` must have
    its ``lora_B`` of the same rank (PEFT's ``B @ A``; vLLM would load a lone or mismatched factor
    and serve it).

    Args:
        config: a ``peft.LoraConfig`` or the config as :func:`check_adapter_config` returns it.
        shapes: ``{PEFT name: shape}`` of the published tensors.

    Raises:
        CorruptObjectError: a name or rank that does not belong to this adapter, or a module
            without both factors of one rank.
    """
    ranks = _ranks_allowed(config)
    pairs: dict[tuple[str, str], dict[str, int]] = {}  # (module, factor kind) -> {"A"/"B": rank}
    for name, shape in shapes.items():
        if not _NAME_RE.fullmatch(name):
            raise CorruptObjectError(f"{where}: {name!r} is not a PEFT adapter tensor name (base_model.model.<module>...)")
        for suffix, dim in _RANK_DIMS:
            if name.endswith(suffix):
                if len(shape) != 2 or shape[dim] not in ranks:
                    raise CorruptObjectError(
                        f"{where}: {name!r} has shape {tuple(shape)}; a LoRA factor of rank {sorted(ranks)} "
                        f"is 2-D with the rank in dim {dim}"
                    )
                kind = suffix.split(".")[1]  # lora_A / lora_B / lora_embedding_A / lora_embedding_B
                pairs.setdefault((name[: -len(suffix)], kind[:-2]), {})[kind[-1]] = shape[dim]
    if not pairs:
        raise CorruptObjectError(f"{where}: none of the {len(shapes)} tensors is a LoRA factor (lora_A / lora_B)")
    for (module, kind), got in pairs.items():
        if len(got) != 2 or got["A"] != got["B"]:
            found = ", ".join(f"{kind}_{f} of rank {r}" for f, r in sorted(got.items()))
            raise CorruptObjectError(f"{where}: module {module!r} has {found}; a LoRA module has both factors, "
                                     "of one rank")


class AdapterSender(DeltaSender):
    """Publishes versions of a PEFT model's LoRA adapter (only the adapter, in PEFT's names).

    A :class:`~torch_deltasync.DeltaSender` whose tensors are :func:`adapter_state_dict` of the
    model, which first writes the adapter config to ``<prefix>/adapter/adapter_config.json``
    (rank 0). Everything else (``publish``, ``flush``, background uploads, ``last_stats``,
    metrics, retention) is the base class's.

    Args:
        model: a ``peft.PeftModel`` holding a LoRA adapter (trainable fp32 factors, typically).
        store: a store or anything :func:`~torch_deltasync.open_store` accepts.
        adapter_name: which adapter to publish.
        prefix: the run's sub-path in the store.
        anchor_policy: default ``config.anchor_policy``, else
            ``AnchorPolicy(every=None, chain_ratio=2.0, max_delta_ratio=1.0)``: a version is a
            delta when that is smaller than a full adapter, else a full adapter; and a receiver
            that joins late never downloads more than about three adapters' worth (a lower
            ``chain_ratio`` lowers that bound and costs upload bytes: ``docs/lora.md``).
            ``anchor_every=k`` as a keyword sets that default's cadence (an anchor every ``k``
            versions); a config's ``anchor_every`` is not used: pass a policy.
        config: the other publish options, as for :class:`~torch_deltasync.DeltaSender`
            (:class:`~torch_deltasync.sender.SenderConfig`; ``inference_dtype``: bf16 by default,
            ``torch.float32`` ships the fp32 factors exactly).
        kwargs: ``SenderConfig`` fields as keywords; they override ``config``'s.

    Raises:
        TypeError: not a PEFT model with a LoRA adapter; an option that is not a ``SenderConfig``
            field (the message lists them) or of the wrong type.
        ValueError: an option ``SenderConfig`` refuses.
        IncompatibleTargetError: the prefix already holds a run of an adapter with another structure
            (:data:`STRUCTURAL_FIELDS`); use a new prefix.
        CorruptObjectError: the config already in the store is invalid.

    Example:
        >>> model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        >>> sender = AdapterSender(model, "s3://bucket/runs", prefix="grpo-lora-1")
        >>> for step in range(steps):
        ...     train_step(model)
        ...     v = sender.publish()
    """

    def __init__(self, model: Any, store: Store | str, *, adapter_name: str = "default", prefix: str = "",
                 anchor_policy: AnchorPolicy | None = None, config: SenderConfig | None = None,
                 **kwargs: Any) -> None:
        config = _sender_config(kwargs, "AdapterSender", config=config, exclude=("anchor_policy",), argument="config")
        adapter_state_dict(model, adapter_name)  # fail early with a clear message
        lora_config = peft_config(model, adapter_name)
        check_init_method(lora_config, "AdapterSender")
        self.peft_model = model
        self.adapter_name = adapter_name
        # Before the prefix is claimed: a takeover would replace the running writer's lease record.
        _holds_adapter(open_store(store).sub(prefix), lora_config)
        every = kwargs["anchor_every"] if "anchor_every" in kwargs else None  # a keyword sets the cadence
        policy = anchor_policy or config.anchor_policy or AnchorPolicy(every=every, chain_ratio=2.0, max_delta_ratio=1.0)
        super().__init__(lambda: adapter_state_dict(model, adapter_name), store, prefix=prefix,
                         config=config, anchor_policy=policy)
        self.adapter_config = lora_config
        if self.group.rank == 0:
            self._write_config(lora_config)

    def publish(self, *, background: bool | None = None) -> int | None:
        """:meth:`DeltaSender.publish <torch_deltasync.DeltaSender.publish>` of the adapter, after
        checking that the model's adapter still has the run's structure (the adapter can be
        replaced under the sender, e.g. ``delete_adapter`` + ``add_adapter``).

        Raises:
            IncompatibleTargetError: its structure changed (naming the fields); nothing is
                published. A new structure is a new run: a new sender on a new prefix.
            PublishError, TypeError: as the base class.
        """
        configs = getattr(self.peft_model, "peft_config", None)
        live = configs.get(self.adapter_name) if isinstance(configs, Mapping) else None
        diff = structure_diff(self.adapter_config, live) if isinstance(live, lora_config_class()) else []
        if diff:  # (no adapter of that name: the read below names what the model has)
            raise IncompatibleTargetError(
                f"{self.store.describe()}: adapter {self.adapter_name!r} no longer has the structure this run "
                f"publishes ({'; '.join(diff)}; run vs model); receivers and adapter_config.json follow the run's. "
                "Publish the new adapter with a new AdapterSender on a new prefix")
        return super().publish(background=background)

    def _write_config(self, config) -> None:
        """Rank 0: store the run's config unless it holds one of the same structure, and have every
        manifest record the sha256 of the stored bytes (receivers and ``deltasync verify`` check it;
        an anchor writes it again if it is gone: :attr:`DeltaSender.run_files`)."""
        data = _holds_adapter(self.store, config)
        if data is None:
            data = adapter_config_json(config)
            self.store.put(ADAPTER_CONFIG_KEY, data)
        self.run_files[ADAPTER_CONFIG_KEY] = data


def _holds_adapter(store: Store, config) -> bytes | None:
    """The config of an adapter run ``store`` (a run prefix) holds already, as stored (``None``: none).

    Raises:
        IncompatibleTargetError: it holds a run of an adapter of another structure (naming the fields).
    """
    try:
        existing = store.get(ADAPTER_CONFIG_KEY)
    except ObjectNotFoundError:
        return None
    old = parse_adapter_config(existing, f"{store.describe()}/{ADAPTER_CONFIG_KEY}")
    diff = structure_diff(old, config)
    if diff:
        raise IncompatibleTargetError(
            f"{store.describe()} holds a run of another adapter ({'; '.join(diff)}); publish to a new prefix"
        )
    return existing


# --- receiver ----------------------------------------------------------------------------------


def _warn_other_base(run_base: str | None, local_base: str | None) -> None:
    """Warn when the run's adapter was trained on another base model than the receiving model's
    adapter names (compared by their last path component: a local copy of a hub model is the same)."""
    def name(x: str | None) -> str:
        return os.path.basename(str(x).rstrip("/")) if x else ""

    if name(run_base) and name(local_base) and name(run_base) != name(local_base):
        warnings.warn(f"the run's adapter was trained on base model {run_base!r}, the receiving model's adapter "
                      f"names {local_base!r}: LoRA factors compute the trained function only on the base weights "
                      "they were trained on", UserWarning, stacklevel=3)


class AdapterTarget(ModuleTarget):
    """Where an :class:`AdapterReceiver` writes: a PEFT model's adapter tensors, or its own.

    Args:
        tensors: ``{PEFT name: live tensor}`` (:func:`adapter_state_dict`), or ``None`` to hold the
            adapter itself: tensors of zeros in the inference dtype, shaped from the first manifest
            it is checked against (a rollout worker that only materialises versions for vLLM needs
            no model).
        config: called on :meth:`check` to get the run's validated config: a ``LoraConfig``, or
            without ``local_config`` the ``dict`` :func:`check_adapter_config` returns (no PEFT needed).
        local_config: the receiving model's ``LoraConfig``; it must agree with the run's on
            :data:`STRUCTURAL_FIELDS` (else the same weights would compute something else).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None, config, local_config=None) -> None:
        super().__init__(dict(tensors or {}), strict=True)
        self.owns = tensors is None
        self._config = config
        self._local_config = local_config

    def check(self, shapes: dict[str, tuple[int, ...]], aliases: dict[str, str], dtype: torch.dtype) -> None:
        config = self._config()
        check_adapter_tensors(config, shapes)
        if self._local_config is not None:
            diff = structure_diff(config, self._local_config)
            if diff:
                raise IncompatibleTargetError(
                    f"the run's adapter config differs from the receiving model's: {'; '.join(diff)}"
                )
            _warn_other_base(config.base_model_name_or_path, self._local_config.base_model_name_or_path)
        if self.owns and not self.tensors:
            # Allocated once, before anything is downloaded; later manifests must fit these shapes.
            self.tensors = {n: torch.zeros(s, dtype=dtype) for n, s in shapes.items()}
        super().check(shapes, aliases, dtype)


class AdapterReceiver(DeltaReceiver):
    """Follows an adapter run and applies its versions, bit-exactly, to a PEFT model or to itself.

    Args:
        model: a ``peft.PeftModel`` with the same adapter structure (its adapter tensors are
            overwritten in place; fp32 factors hold bf16 versions exactly), or ``None``: the
            receiver holds the adapter tensors (:attr:`tensors`), e.g. to materialise versions.
        store: a store or anything :func:`~torch_deltasync.open_store` accepts.
        adapter_name: the model's adapter to write.
        prefix: the run's sub-path in the store.
        receiver_config: the download options, as ``DeltaReceiver``'s ``config``
            (:class:`~torch_deltasync.receiver.ReceiverConfig`); named apart because
            :attr:`config` is the run's ``LoraConfig``.
        kwargs: ``ReceiverConfig`` fields as keywords (``max_workers``, ``threads``, ``metrics_path``); they
            override ``receiver_config``'s.

    Raises:
        TypeError / ValueError: ``model`` is not a PEFT model with that LoRA adapter; an option
            ``ReceiverConfig`` does not have or refuses (the message lists the valid names).

    Updates raise what :meth:`DeltaReceiver.update` raises, and also
    ``IncompatibleTargetError`` (the run's adapter structure differs from the model's) and
    ``CorruptObjectError`` (invalid config, or tensors that do not fit it); nothing changes then.

    Example:
        >>> receiver = AdapterReceiver(peft_model, "s3://bucket/runs", prefix="grpo-lora-1")
        >>> receiver.update()                    # newest version, in place
        >>> receiver.save("adapters/v12")        # adapter_model.safetensors + adapter_config.json
    """

    def __init__(self, model: Any | None, store: Store | str, *, adapter_name: str = "default", prefix: str = "",
                 receiver_config: ReceiverConfig | None = None, **kwargs: Any) -> None:
        receiver_config = _receiver_config(kwargs, "AdapterReceiver", config=receiver_config)
        tensors = local = None
        if model is not None:
            tensors = adapter_state_dict(model, adapter_name)
            local = peft_config(model, adapter_name)
        # (run, config sha256) -> [the config as check_adapter_config returns it, its LoraConfig or None]
        self._configs: dict[tuple[str, str | None], list] = {}
        self._checking = None  # the manifest _check_target checks (AdapterTarget.check reads its config)
        self._model, self._adapter_name = model, adapter_name
        # Without a model the receiver only needs the config dict, not PEFT (a vLLM rollout worker).
        run_config = self._config_dict_of if model is None else self._config_of
        super().__init__(AdapterTarget(tensors, lambda: run_config(self._checking), local), store, prefix=prefix,
                         config=receiver_config)

    def _cached(self, m) -> list:
        """The cache entry of version ``m``'s run: its config, checked against the sha256 ``m``
        records, read once per run (a new run on a wiped prefix has its own)."""
        key = (m.run_id, m.run_files.get(ADAPTER_CONFIG_KEY))
        with self._lock:  # (an update and save() or config on other threads)
            if key not in self._configs:
                if len(self._configs) >= 4:  # runs followed long ago
                    self._configs.clear()
                doc = read_adapter_config_dict(self.store, manifest=m)
                check_init_method(doc, f"{self.store.describe()}/{ADAPTER_CONFIG_KEY}")  # (the sender warned too)
                self._configs[key] = [doc, None]
            return self._configs[key]

    def _config_dict_of(self, m) -> dict[str, Any]:
        """Version ``m``'s run config as :func:`check_adapter_config` returns it (no PEFT needed)."""
        return self._cached(m)[0]

    def _config_of(self, m):
        """Version ``m``'s run config as a ``peft.LoraConfig`` (PEFT's own checks run once per run)."""
        entry = self._cached(m)
        with self._lock:
            if entry[1] is None:
                entry[1] = lora_config_from(entry[0], f"{self.store.describe()}/{ADAPTER_CONFIG_KEY}")
            return entry[1]

    def _check_target(self, m) -> None:
        self._checking = m
        super()._check_target(m)

    def commit(self, staged):
        """:meth:`DeltaReceiver.commit`, refused while the model's adapter is merged into its base
        weights (``merge_adapter()``: the adapter tensors would change while the base kept the
        merged old ones, and the merged model would serve neither version) or no longer holds the
        tensors this receiver writes (``merge_and_unload()``, another adapter loaded in its place).

        Raises:
            IncompatibleTargetError: as above (``unmerge_adapter()`` first, or a new receiver);
                nothing is written.
        """
        if self._model is not None and staged.plan.path != "noop":
            merged = [n for n, mod in self._model.named_modules() if self._adapter_name in
                      (getattr(mod, "merged_adapters", None) or ())]
            if merged:
                raise IncompatibleTargetError(
                    f"adapter {self._adapter_name!r} is merged into the model's base weights ({len(merged)} layers, "
                    f"e.g. {merged[0]!r}): an update would change the adapter tensors but not the merged base. Call "
                    "unmerge_adapter() before updating (and merge_adapter() again after, if you serve merged)")
            try:
                live = adapter_state_dict(self._model, self._adapter_name)
            except (TypeError, ValueError):
                live = {}
            if {n: t.data_ptr() for n, t in live.items()} != {n: t.data_ptr() for n, t in self.tensors.items()}:
                raise IncompatibleTargetError(
                    f"the model no longer holds the adapter tensors this receiver writes (merge_and_unload(), or "
                    f"adapter {self._adapter_name!r} replaced): an update would change nothing the model computes "
                    "with. Build a new AdapterReceiver for the model as it is now")
        return super().commit(staged)

    @property
    def config(self):
        """The validated ``peft.LoraConfig`` of the held version's run (before the first update: the
        config the store holds now, unchecked). Needs ``peft``; receivers without a model do not
        otherwise."""
        held = self._held_manifest()
        return read_adapter_config(self.store) if held is None else self._config_of(held)

    def _held_manifest(self):
        """The manifest of the held version (that of the run the target received it from), or ``None``."""
        with self._lock:
            version = self.version
            return None if version is None else self._held or self.manifest(version)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter tensors the receiver writes, ``{PEFT name: tensor}`` (empty before the first update)."""
        return self.target.tensors

    def save(self, out_dir: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> Path:
        """Write the held version as a PEFT adapter folder (see :func:`materialize_adapter`).

        Raises:
            VersionNotFoundError: nothing is held yet.
        """
        with self._lock:  # the tensors and the manifest of one commit
            m = self._held_manifest()
            if m is None:
                raise VersionNotFoundError("nothing is held yet; call update() first")
            tensors = {n: self.target.values(n, m.inference_dtype).contiguous().clone() for n in self.tensors}
        return write_adapter_dir(Path(out_dir), tensors, config_dict_json(self._config_dict_of(m), base_model_name_or_path),
                                 version=m.version)


def materialize_adapter(store: Store | str, out_dir: str | os.PathLike, version: int | None = None, *,
                        prefix: str = "", base_model_name_or_path: str | None = None) -> Path:
    """Write one version of an adapter run as a folder ``PeftModel.from_pretrained`` and vLLM load.

    The version is rebuilt from the store (newest anchor at or before it, then its deltas), checked
    against the manifest's per-tensor checksums, and written as ``adapter_model.safetensors`` (the
    tensors in the run's inference dtype, PEFT names, metadata ``format=pt``) and
    ``adapter_config.json`` (the run's config as the trainer wrote it, ``init_lora_weights``
    included: PEFT and vLLM treat the folder as they treat the trainer's own checkpoint), never
    half-written (a temporary folder renamed into place; an existing adapter folder at ``out_dir``
    is briefly absent while it is replaced).

    Args:
        store: a store or anything :func:`~torch_deltasync.open_store` accepts.
        out_dir: the folder to write (replaced if it exists).
        version: the version; ``None`` = the newest.
        prefix: the run's sub-path in the store.
        base_model_name_or_path: recorded in the config (PEFT's field; the trainer's value otherwise).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        VersionNotFoundError: no such version, or not an adapter run.
        CorruptObjectError / ChecksumMismatchError: invalid objects, or a config that breaks
            :func:`check_adapter_config`'s rules (PEFT's own checks run when the folder is loaded:
            this needs no PEFT).
        ValueError: ``out_dir`` is no folder this may replace (a file, under a file, a folder with
            other files, the current folder): checked before anything is downloaded.

    Example:
        >>> materialize_adapter("s3://bucket/runs", "adapters/v12", 12, prefix="grpo-lora-1")
        >>> PeftModel.from_pretrained(base_model, "adapters/v12")
    """
    check_replaceable(Path(out_dir))  # before anything is downloaded
    receiver = AdapterReceiver(None, store, prefix=prefix)
    try:
        receiver.update(version)
        return receiver.save(out_dir, base_model_name_or_path=base_model_name_or_path)
    finally:
        receiver.close()
