"""``AnchorPolicy``: when a version is an anchor (full weights) instead of a delta."""

from __future__ import annotations

from dataclasses import dataclass

from .._units import is_real_number


@dataclass(frozen=True, kw_only=True)
class AnchorPolicy:
    """When a version is an anchor (full weights) instead of a delta.

    The first version of a sender is always an anchor, and so is the first one after a failed
    anchor. Otherwise a version is an anchor when either rule fires.
    """

    every: int | None = 10
    """Anchor when ``version - last_anchor >= every`` (versions). ``None`` or ``0``: never by cadence."""

    chain_ratio: float | None = None
    """Anchor when the bytes of the delta objects published since the last anchor reach
    ``chain_ratio`` times that anchor's bytes (e.g. ``1.0``: a fresh receiver never downloads more than about two
    anchors' worth). ``None``: off."""

    max_delta_ratio: float | None = None
    """Decided per version, after change detection: publish a full anchor *without* a delta when this
    version's delta, as the sender's codec encodes it (the bytes of its encoded tensors), would take at
    least ``max_delta_ratio`` times the bytes of a full copy in the inference dtype (e.g. ``1.0``:
    never ship a delta larger than the weights; with the ``raw`` codec, 4 + 2 bytes per changed bf16
    element, that is about 1/3 density). An anchor due by ``every`` / ``chain_ratio`` then drops the
    delta it would carry, too. The delta is then encoded in ``publish()`` itself (also
    with ``background=True``; the upload stays in the background). Dense updates are the norm for
    LoRA adapters (``docs/lora.md``). With several ranks, one rank over the ratio makes the version
    an anchor on all. ``None``: off."""

    def __post_init__(self) -> None:
        if self.every is not None and (type(self.every) is not int):
            raise TypeError(f"AnchorPolicy.every must be an int or None, got {self.every!r}")
        if self.every is not None and self.every < 0:
            raise ValueError(f"AnchorPolicy.every must be >= 0 or None, got {self.every}")
        for name in ("chain_ratio", "max_delta_ratio"):
            value = getattr(self, name)
            if value is not None and not is_real_number(value):
                raise TypeError(f"AnchorPolicy.{name} must be a number > 0 or None, got {type(value).__name__} {value!r}")
            if value is not None and not value > 0:
                raise ValueError(f"AnchorPolicy.{name} must be > 0 or None, got {value}")

    def wants_anchor(self, version: int, last_anchor: int, chain_nbytes: int, anchor_nbytes: int) -> bool:
        """Whether ``version`` should be an anchor: ``every`` versions after ``last_anchor``, or once
        the deltas since it (``chain_nbytes``, bytes) reach ``chain_ratio`` x the anchor's bytes
        (``anchor_nbytes``)."""
        if self.every and version - last_anchor >= self.every:
            return True
        return bool(self.chain_ratio and anchor_nbytes and chain_nbytes >= self.chain_ratio * anchor_nbytes)
