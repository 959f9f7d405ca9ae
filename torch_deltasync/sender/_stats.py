"""``PublishStats``: the numbers of one publish, as written to the sender's metrics JSONL."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class PublishStats:
    """Numbers of one publish (``DeltaSender.last_stats`` / ``history``; the ``publish`` events of
    ``SenderConfig.metrics_path``).

    Attributes:
        version: the version published.
        kind: ``"anchor"`` (full weights) or ``"delta"``.
        base_version: the version the delta part applies to (``None``: an anchor without one).
        changed: elements whose bits changed since ``base_version``, all ranks (an anchor without a
            base: every element).
        numel: elements of the model (all ranks, each element once).
        nbytes: bytes of this version's objects and manifest, all ranks.
        full_nbytes: bytes of the model in the inference dtype (a full copy).
        detect_ms: reading the weights: change detection (and the cast of an anchor), ms.
        encode_ms, upload_ms: encoding the objects and uploading them, ms (this rank).
        publish_ms: the whole publish, from ``publish()`` until the manifest was written, ms.
        coalesced: background publishes folded into this one because an upload was in flight.
    """

    version: int
    kind: str
    base_version: int | None
    changed: int
    numel: int
    nbytes: int
    full_nbytes: int
    detect_ms: float = 0.0
    encode_ms: float = 0.0
    upload_ms: float = 0.0
    publish_ms: float = 0.0
    coalesced: int = 0

    @property
    def density(self) -> float:
        """Changed fraction of the model's elements, ``changed / numel`` (0 for an empty model)."""
        return self.changed / self.numel if self.numel else 0.0

    @property
    def ratio(self) -> float:
        """Bytes shipped / bytes of a full copy."""
        return self.nbytes / self.full_nbytes if self.full_nbytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The fields and ``density`` and ``ratio``, as one JSON-ready dict (the metrics line)."""
        d = asdict(self)
        d["density"] = self.density
        d["ratio"] = self.ratio
        return d
