"""The rollout service's limits and policies (one frozen config, every field checked when built)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
import math
from typing import Any, Literal

#: Token ids and counts must stay below this (int32 range).
INT32_LIMIT = 2**31


def is_number(x: Any) -> bool:
    """A finite JSON number that a float holds: an ``int`` (not ``bool``) below ``2**63`` (one of 400
    digits made ``math.isfinite`` raise ``OverflowError``) or a finite ``float`` (``inf`` seconds made
    the ``Retry-After`` header raise)."""
    if type(x) is int:
        return abs(x) < 2**63
    return type(x) is float and math.isfinite(x)


#: The largest ring (``capacity``) a service allocates.
MAX_CAPACITY = 1 << 24


@dataclass(frozen=True, kw_only=True)
class RolloutServiceConfig:
    """Limits and policies of a rollout service. Every field is checked when the config is built."""

    capacity: int = 4096
    """Episodes the ring holds (live, not yet sampled), at most :data:`MAX_CAPACITY`."""

    max_lag: int = 2
    """Staleness threshold in versions: ``trainer_version - policy_version > max_lag`` is dropped."""

    on_full: Literal["reject", "evict"] = "reject"
    """What a POST gets when the ring is full: ``"reject"`` = HTTP 429 + Retry-After (nothing lost),
    ``"evict"`` = the oldest buffered episodes are evicted (counted)."""

    max_episodes_per_post: int = 512
    """Episodes in one ``POST /episodes``."""

    max_prompt_tokens: int = 8192
    """Tokens in one episode's prompt."""

    max_completion_tokens: int = 8192
    """Tokens in one episode's completion (and log-probs)."""

    vocab_size: int | None = None
    """Token ids must be in ``[0, vocab_size)``; ``None``: in ``[0, 2**31)``."""

    max_body_bytes: int = 32 << 20
    """Largest request body in bytes (HTTP 413 above)."""

    max_sample: int = 4096
    """Largest ``batch_size`` of one ``/sample``."""

    max_wait_s: float = 30.0
    """Longest ``wait_s`` a ``/sample`` may ask for (seconds)."""

    retry_after_s: float = 1.0
    """How long a 429 asks producers to wait (seconds): the ``Retry-After`` header rounds it up to a
    whole second (RFC 9110); the JSON body's ``retry_after_s`` has the exact value."""

    token: str | None = None
    """Shared secret for the write endpoints (``Authorization: Bearer <token>``); ``None``: open."""

    def __post_init__(self) -> None:
        for name in ("capacity", "max_episodes_per_post", "max_prompt_tokens", "max_completion_tokens",
                     "max_body_bytes", "max_sample"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"RolloutServiceConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.capacity > MAX_CAPACITY:  # (the slots' versions are allocated up front: 8 bytes each, and more)
            raise ValueError(f"RolloutServiceConfig.capacity must be at most {MAX_CAPACITY:,} episodes, got "
                             f"{self.capacity:,}; a ring a few trainer batches deep is enough")
        if type(self.max_lag) is not int or self.max_lag < 0:
            raise ValueError(f"RolloutServiceConfig.max_lag must be an integer >= 0, got {self.max_lag!r}")
        if self.on_full not in ("reject", "evict"):
            raise ValueError(f"RolloutServiceConfig.on_full must be 'reject' or 'evict', got {self.on_full!r}")
        if self.vocab_size is not None and (type(self.vocab_size) is not int or not 1 <= self.vocab_size <= INT32_LIMIT):
            raise ValueError(f"RolloutServiceConfig.vocab_size must be in [1, 2**31] or None, got {self.vocab_size!r}")
        if not is_number(self.retry_after_s) or not self.retry_after_s > 0 or not is_number(self.max_wait_s) \
                or not self.max_wait_s >= 0:
            raise ValueError(f"RolloutServiceConfig.retry_after_s must be a finite number > 0 and max_wait_s one >= 0, "
                             f"got {self.retry_after_s!r} and {self.max_wait_s!r}")
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < 8):
            raise ValueError("RolloutServiceConfig.token must be a string of at least 8 characters (or None)")

    def public(self) -> dict[str, Any]:
        """The config without the token (for ``/stats`` and logs)."""
        d = asdict(self)
        d["token"] = "<set>" if self.token else None
        return d
