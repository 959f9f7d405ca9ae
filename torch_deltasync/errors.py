"""All errors raised by torch_deltasync.

Every error subclasses :class:`DeltaSyncError` *and* the builtin it refines, so callers can write
``except torch_deltasync.DeltaSyncError`` to catch everything from this library, or keep catching
``ValueError`` / ``FileNotFoundError`` / ``OSError`` as they would for any other library.

Messages name the store key, tensor, version and bad value where they exist, and say what to do.
"""

from __future__ import annotations

from typing import Iterator

__all__ = [
    "DeltaSyncError",
    "CorruptObjectError",
    "ChecksumMismatchError",
    "VersionNotFoundError",
    "IncompatibleTargetError",
    "UnsupportedLayoutError",
    "StoreError",
    "PublishError",
    "PrefixInUseError",
    "ObjectNotFoundError",
    "ObjectExistsError",
    "StoreNotFoundError",
    "SyncTimeoutError",
    "StaleUpdateError",
    "TransientStoreError",
    "EpisodeError",
    "RolloutServiceError",
    "ServiceClosedError",
    "WorkerError",
]


class DeltaSyncError(Exception):
    """Base class of every error raised by torch_deltasync."""


class CorruptObjectError(DeltaSyncError, ValueError):
    """A store object or manifest is malformed, truncated, tampered with or malicious.

    Raised before any live parameter changes. Typical causes: a sha256 or size that does not match
    the manifest, an index out of range, unsorted or duplicate indices, a wrong dtype or shape, a
    key that escapes the run prefix, or an unknown format version.
    """


class ChecksumMismatchError(CorruptObjectError):
    """The state a version would produce does not match the per-tensor checksum in its manifest."""


class VersionNotFoundError(DeltaSyncError, FileNotFoundError):
    """A requested version (or any version at all) is not visible in the store, or no longer retained."""


class IncompatibleTargetError(DeltaSyncError, ValueError):
    """The receiving model does not match the published tensors (unknown name, shape or dtype)."""


class UnsupportedLayoutError(DeltaSyncError, NotImplementedError):
    """A tensor layout the library does not understand (e.g. a ``Partial`` DTensor placement,
    quantized or repacked weights). Refused before anything is read or written."""


class StaleUpdateError(DeltaSyncError, RuntimeError):
    """A staged update's base is no longer what the target holds (another version was committed,
    or the state was reset since it was prepared): nothing was written; prepare it again."""


class StoreError(DeltaSyncError, OSError):
    """A store operation failed. The message names the store, the key and the cause."""


class PublishError(DeltaSyncError, RuntimeError):
    """Publishing a version failed. No partial version is visible; the next publish recovers."""


class PrefixInUseError(PublishError):
    """Another live writer owns the run prefix (``<prefix>/OWNER``, see :mod:`torch_deltasync.lease`),
    or took it over from this sender. Two writers on one prefix would interleave their versions."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """A key does not exist in the store."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The store itself does not exist: an S3 bucket (``NoSuchBucket``), a Hugging Face bucket, or a
    local path one of whose components is a file. Unlike a missing key, waiting does not help: the
    message names the store and says what to check (the URI, the endpoint, the bucket)."""


class ObjectExistsError(StoreError, FileExistsError):
    """``Store.put_new`` found the key already taken (e.g. another writer published that version)."""


class TransientStoreError(StoreError):
    """A store operation failed in a way that may succeed if retried: a timeout, a dropped or
    refused connection, throttling (HTTP 429, S3 ``SlowDown``) or a server error (HTTP 5xx).

    Remote stores retry these with exponential backoff (:class:`~torch_deltasync.store.RetryPolicy`)
    and raise this error only once every attempt has failed.
    """


class EpisodeError(DeltaSyncError, ValueError):
    """A rollout episode (or a batch of them) posted to the rollout service is malformed: a missing
    or unknown field, a wrong type, a token outside the vocabulary, a length over the limit, or
    log-probs that do not match the completion. The message names the episode index and the field.
    Nothing of the batch is stored."""


class RolloutServiceError(DeltaSyncError, RuntimeError):
    """The rollout service refused a request or could not be reached; the message has the HTTP status
    and the service's own explanation."""


class ServiceClosedError(RolloutServiceError):
    """The rollout service was closed by the trainer (HTTP 410): rollout workers should stop."""


class WorkerError(DeltaSyncError, RuntimeError):
    """A receiver worker died, or reported that it could not apply a version (its message is
    included; the worker keeps serving the version it held before)."""


class SyncTimeoutError(DeltaSyncError, TimeoutError):
    """Waiting timed out: for a version to appear (``DeltaReceiver.wait_for``), or for receivers to
    confirm a version (they may still be downloading, be stuck, or have been started with another
    store or prefix)."""


# --- exception chains ----------------------------------------------------------------------------


def exception_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from (``__cause__``, else ``__context__``),
    outermost first; each once, so a chain that loops back ends."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def interrupted(error: BaseException) -> bool:
    """Whether ``error`` is a Ctrl-C in disguise: a ``KeyboardInterrupt`` that arrived while a
    compiled kernel was returning is raised by numba as ``SystemError: ... returned a result with
    an exception set``, the interrupt in its chain. Broad ``except Exception`` handlers check this
    and stop instead of reporting a failure (and carrying on)."""
    return isinstance(error, KeyboardInterrupt) or (
        isinstance(error, SystemError) and any(isinstance(e, KeyboardInterrupt) for e in exception_chain(error)))
