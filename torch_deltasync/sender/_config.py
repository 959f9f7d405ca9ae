"""``SenderConfig``: a :class:`~torch_deltasync.sender.DeltaSender`'s publish options, declared,
documented and checked in one place.

The sender's runtime objects (the model, the store, the run prefix and the process group) are
constructor arguments, not fields. The options of the receiving side are in
:class:`~torch_deltasync.receiver.ReceiverConfig`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .._dtypes import as_dtype
from .._metrics import check_metrics_path
from .._pool import check_threads
from ..codecs import get_codec, sender_codec
from .._units import is_real_number
from ..lease import DEFAULT_LEASE_S, MAX_RUN_ID_CHARS, MIN_LEASE_S
from ..retention import RetentionPolicy
from ._policy import AnchorPolicy


@dataclass(frozen=True, kw_only=True)
class SenderConfig:
    """How a :class:`~torch_deltasync.sender.DeltaSender` publishes: anchors, dtype, codec, upload,
    ownership of the prefix, metrics and retention.

    Pass it as ``DeltaSender(model, store, config=SenderConfig(...))``, or give the fields as
    keyword arguments (``DeltaSender(model, store, anchor_every=10)``); keyword arguments override
    the config's fields. It pickles (the torchrl scheme sends it to its workers).

    Raises:
        TypeError: a field of the wrong type (the message names the field and what it takes).
        ValueError: a value out of range (e.g. ``threads`` outside ``[1, 256]``), an unsupported
            ``inference_dtype``, an unknown ``codec``, ``codec="auto"`` without a valid
            ``link_gbps``, or ``link_gbps`` with another codec.

    Example:
        >>> config = SenderConfig(anchor_every=50, codec="raw")
        >>> sender = DeltaSender(model, "runs/x/bucket", config=config, background=True)
        >>> sender.config.anchor_every, sender.config.background
        (50, True)
    """

    anchor_every: int | None = 10
    """Anchor cadence in versions, shorthand for ``AnchorPolicy(every=anchor_every)``: an int
    ``>= 0``; ``0`` or ``None``: never by cadence. Ignored when ``anchor_policy`` is set."""

    anchor_policy: AnchorPolicy | None = None
    """The full :class:`~torch_deltasync.sender.AnchorPolicy` (cadence, chain size, delta size);
    overrides ``anchor_every``. ``None``: ``AnchorPolicy(every=anchor_every)``."""

    inference_dtype: torch.dtype | str = torch.bfloat16
    """The dtype receivers serve; receivers hold the trainer's weights cast to it, bit-exactly.
    ``torch.bfloat16`` (default), ``torch.float16``, ``torch.float32``, ``torch.float64``, the
    float8 dtypes, or their names (``"bf16"``, ``"float16"``, ``"fp32"``, ...)."""

    snapshot_device: torch.device | str | None = None
    """Where the snapshot of the last published state lives: ``None``: on each tensor's own device;
    ``"cpu"``: host memory (pinned when CUDA is available). Costs ``element_size`` bytes of the
    inference dtype per element there."""

    codec: str = "packed"
    """Name of the delta codec (:func:`torch_deltasync.codecs.codec_names`): ``"packed"`` (default,
    about 1 byte per changed bf16 element) or ``"raw"`` (format 1, 6 bytes); ``"auto"`` picks one
    by ``link_gbps`` (:func:`torch_deltasync.codecs.auto_codec`); ``codec`` keeps ``"auto"``, and
    :attr:`codec_name` names the codec it publishes with."""

    link_gbps: float | None = None
    """For ``codec="auto"`` only (and required there): the bandwidth each receiver gets from the
    store, in Gbit/s, a positive finite number. ``None`` with any other codec."""

    threads: int | None = None
    """Tensors read for changes (cast, compared, positions extracted, checksum updated) and encoded
    at once, on the library's helper threads and the calling one: an int in ``[1, 256]``, or
    ``None`` for one per CPU core available to the process (within its cgroup CPU quota), at most 8 (under ``torchrun`` the
    cores shared out among its ``LOCAL_WORLD_SIZE`` ranks on the host unless each is pinned to its
    own: :func:`torch_deltasync._pool.default_threads`). ``1`` keeps it all on the
    calling thread, in order. Only large tensors are shared out (read: 64K elements or more, in
    host memory; encoded: 16K changes or more); the others run on the calling thread. Each reading
    thread keeps its own detection temporaries (``ChangeDetector.chunk_numel``)."""

    background: bool = False
    """Default for ``publish(background=...)``: return once the changes are detected, and encode and
    upload on a worker thread."""

    run_id: str | None = None
    """Identifies this writer in manifests and in the prefix's owner record, at most 256
    characters. ``None`` (or ``""``): random. Receivers cross from one run to another only by an anchor."""

    metrics_path: str | os.PathLike | None = None
    """File to append one JSON line of :class:`~torch_deltasync.sender.PublishStats` to per
    published version (rank 0). ``None`` (or ``""``): none."""

    retention: RetentionPolicy | None = None
    """After each published anchor, rank 0 deletes old versions under this
    :class:`~torch_deltasync.retention.RetentionPolicy`; a failed collection is logged and never
    fails the publish. ``None``: keep everything."""

    takeover: bool = False
    """Claim the prefix even if another writer's lease on it is live (that writer then fails its
    next publish with :class:`~torch_deltasync.errors.PrefixInUseError`)."""

    lease_s: float = DEFAULT_LEASE_S
    """Seconds the prefix stays owned after this sender stops renewing its lease, a finite number
    of at least 0.1 (default 60; any other value, of any type, is a ``ValueError``). The sender renews every ``lease_s / 4`` while open; ``close()`` releases
    it at once."""

    def __post_init__(self) -> None:
        if self.anchor_every is not None:
            if type(self.anchor_every) is not int:
                raise TypeError(f"SenderConfig.anchor_every must be an int >= 0 or None, got {self.anchor_every!r}")
            if self.anchor_every < 0:
                raise ValueError(f"SenderConfig.anchor_every must be an int >= 0 or None, got {self.anchor_every}")
        _check_optional("anchor_policy", self.anchor_policy, AnchorPolicy, "an AnchorPolicy or None")
        if not isinstance(self.inference_dtype, (torch.dtype, str)):
            raise TypeError(f"SenderConfig.inference_dtype must be a torch.dtype or its name, got {self.inference_dtype!r}")
        try:
            as_dtype(self.inference_dtype)
        except ValueError as e:
            raise ValueError(f"SenderConfig.inference_dtype: {e}") from None
        if self.snapshot_device is not None:
            if not isinstance(self.snapshot_device, (torch.device, str)):
                raise TypeError(f"SenderConfig.snapshot_device must be a torch.device, a device string such as "
                                f"'cpu', or None, got {self.snapshot_device!r}")
            try:
                device = torch.device(self.snapshot_device)
            except (RuntimeError, ValueError):
                raise ValueError(f"SenderConfig.snapshot_device must be a device such as 'cpu' or 'cuda:0', got "
                                 f"{self.snapshot_device!r}") from None
            accelerator = torch.accelerator.current_accelerator(check_available=True)  # None: no device here
            if device.type != "cpu" and (accelerator is None or device.type != accelerator.type):
                why = ("(meta tensors hold no data)" if device.type == "meta" else
                       f"on this machine (no {'CUDA' if device.type == 'cuda' else device.type} device)")
                raise ValueError(f"SenderConfig.snapshot_device {self.snapshot_device!r} cannot hold a snapshot "
                                 f"{why}; use 'cpu' or None (each tensor's own device)")
        if not isinstance(self.codec, str):
            raise TypeError(f"SenderConfig.codec must be a codec name (str), got {self.codec!r}")
        name = self.codec_name  # "auto" without a valid link_gbps, or link_gbps with another codec
        try:
            get_codec(name)
        except ValueError as e:
            raise ValueError(f"SenderConfig.codec: {e}") from None
        check_threads(self.threads, "SenderConfig.threads")
        for name in ("background", "takeover"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SenderConfig.{name} must be True or False, got {getattr(self, name)!r}")
        _check_optional("run_id", self.run_id, str, "a string or None")
        if self.run_id is not None and len(self.run_id) > MAX_RUN_ID_CHARS:
            raise ValueError(f"SenderConfig.run_id must be at most {MAX_RUN_ID_CHARS} characters, got "
                             f"{len(self.run_id)}")
        check_metrics_path("SenderConfig.metrics_path", self.metrics_path)
        _check_optional("retention", self.retention, RetentionPolicy, "a RetentionPolicy or None")
        if not is_real_number(self.lease_s) or not (math.isfinite(self.lease_s) and self.lease_s >= MIN_LEASE_S):
            raise ValueError(f"SenderConfig.lease_s must be a positive number of seconds (finite, at least "
                             f"{MIN_LEASE_S:g}), got {self.lease_s!r}")

    @property
    def effective_anchor_policy(self) -> AnchorPolicy:
        """The anchor policy in force: ``anchor_policy``, else ``AnchorPolicy(every=anchor_every)``."""
        return self.anchor_policy or AnchorPolicy(every=self.anchor_every)

    @property
    def codec_name(self) -> str:
        """The registered codec this config publishes with: ``codec``, or for ``"auto"`` the one
        :func:`~torch_deltasync.codecs.auto_codec` picks for ``link_gbps``."""
        return sender_codec(self.codec, self.link_gbps)


def _check_optional(name: str, value: object, types: type | tuple[type, ...], what: str) -> None:
    if value is not None and not isinstance(value, types):
        raise TypeError(f"SenderConfig.{name} must be {what}, got {value!r}")
