"""``Job``: everything a publish carries from reading the live weights to the commit."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..detect import Changes
from ..layout import Source
from ._stats import PublishStats


@dataclass
class Job:
    """Everything a publish needs after the live weights have been read."""

    version: int
    kind: str
    base_version: int | None
    anchor_version: int
    sources: list[Source] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    changes: dict[str, Changes] = field(default_factory=dict)
    global_positions: dict[str, torch.Tensor] = field(default_factory=dict)
    anchors: dict[str, torch.Tensor] = field(default_factory=dict)
    partials: dict[str, int] = field(default_factory=dict)  # name -> local partial checksum after v
    counts: dict[str, int] = field(default_factory=dict)  # name -> changed elements (local, uploaded)
    delta_parts: dict[str, dict[str, torch.Tensor]] | None = None  # encoded early (max_delta_ratio)
    stats: PublishStats | None = None
