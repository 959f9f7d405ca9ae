"""``PublishStats``: the numbers of one publish, as written to the sender's metrics JSONL."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class PublishStats:
    """Numbers of one publish (all ranks summed where it says so). Times in milliseconds."""

    version: int
    kind: str
    base_version: int | None
    changed: int  # elements whose bits changed since the base version (all ranks)
    numel: int  # elements of the model
    nbytes: int  # bytes of this version's objects + manifest (all ranks)
    full_nbytes: int  # bytes of the model in the inference dtype
    detect_ms: float = 0.0
    encode_ms: float = 0.0
    upload_ms: float = 0.0
    publish_ms: float = 0.0
    coalesced: int = 0  # publishes skipped into this one because an upload was in flight

    @property
    def density(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def ratio(self) -> float:
        """Bytes shipped / bytes of a full copy."""
        return self.nbytes / self.full_nbytes if self.full_nbytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["density"] = self.density
        d["ratio"] = self.ratio
        return d
