"""The bucket key layout of a run (format 1): where objects, manifests and ``LATEST`` live.

Keys are relative to the run's prefix (``docs/format.md`` §2)::

    objects/<version:012d>/anchor-r<rank:05d>-of<world:05d>.safetensors
    objects/<version:012d>/delta-r<rank:05d>-of<world:05d>.safetensors
    versions/<version:012d>.json      # the manifest, written last, immutable
    LATEST                            # advisory pointer to the newest version
    acks/<model>/worker-<worker:05d>.json   # a receiver's acknowledgement (torch_deltasync.acks)

A version exists for readers exactly when its manifest key exists (:mod:`torch_deltasync.manifest`).
"""

from __future__ import annotations

import re
from typing import Literal

LATEST_KEY = "LATEST"
VERSIONS_DIR = "versions"
OBJECTS_DIR = "objects"
#: Largest version number (fits the 12-digit key field).
MAX_VERSION = 10**12 - 1

Kind = Literal["anchor", "delta"]
_MANIFEST_RE = re.compile(r"versions/([0-9]{12})\.json")
#: One key segment (as :func:`torch_deltasync.store.check_key` allows them).
_SEGMENT_RE = re.compile(r"[A-Za-z0-9._=+@,-]+")
_OBJECT_RE = re.compile(r"objects/([0-9]{12})/(anchor|delta)-r([0-9]{5})-of([0-9]{5})\.safetensors")


def object_key(version: int, kind: Kind, rank: int = 0, world: int = 1) -> str:
    """Key of one rank's object of a version, relative to the run prefix."""
    return f"objects/{version:012d}/{kind}-r{rank:05d}-of{world:05d}.safetensors"


def manifest_key(version: int) -> str:
    """Key of a version's manifest, relative to the run prefix."""
    return f"{VERSIONS_DIR}/{version:012d}.json"


def ack_key(model: str, worker: int) -> str:
    """Key of one receiver's acknowledgement object (:class:`torch_deltasync.acks.StoreAcks`),
    relative to the run prefix: ``acks/<model>/worker-<worker:05d>.json``.

    Args:
        model: the acknowledging model's name, already a safe key segment (no ``/``;
            :func:`check_ack_model`).
        worker: the receiver's index, ``>= 0`` (5 digits in the key; larger indices get more;
            :func:`check_worker`).

    Raises:
        TypeError, ValueError: ``model`` or ``worker`` is not one (see the two checks).
    """
    return f"acks/{check_ack_model(model)}/worker-{check_worker(worker):05d}.json"


def check_ack_model(model: object, where: str = "ack_key") -> str:
    """A model name for acknowledgement keys: one key segment (``[A-Za-z0-9._=+@,-]+``, not ``.``
    or ``..``; in particular no ``/``) of at most 255 characters (a folder name in a local store).

    Raises:
        TypeError: not a ``str``.
        ValueError: not one key segment.
    """
    if not isinstance(model, str):
        raise TypeError(f"{where}: the model name must be a str, got {type(model).__name__} {model!r}")
    if model in (".", "..") or not _SEGMENT_RE.fullmatch(model) or len(model) > 255:
        if "/" in model:
            why = "contains '/'"
        elif len(model) > 255:
            why = f"is {len(model)} characters long (a folder name takes 255 at most)"
        else:
            why = "is not one key segment"
        raise ValueError(f"{where}: model name {model!r:.300} {why}; pass the model's name as a single key segment "
                         "(letters, digits and ._=+@,- only, e.g. 'policy')")
    return model


def check_worker(worker: object, where: str = "ack_key") -> int:
    """A receiver's (worker's) index: an ``int`` ``>= 0`` (``bool`` is not one).

    Raises:
        TypeError: not an ``int``.
        ValueError: negative.
    """
    if type(worker) is not int:
        raise TypeError(f"{where}: worker must be an int >= 0 (the receiver's index), got "
                        f"{type(worker).__name__} {worker!r}")
    if worker < 0:
        raise ValueError(f"{where}: worker must be >= 0 (the receiver's index), got {worker}")
    return worker


def list_versions(store) -> list[int]:
    """Every version whose manifest is visible in ``store`` (a run's prefix), ascending."""
    return sorted(v for v in (parse_manifest_key(k) for k in store.list(VERSIONS_DIR)) if v is not None)


def runs_in(store) -> list[str]:
    """The prefixes of ``store`` under which manifests sit (the runs it holds; ``""`` for its root),
    sorted. Lists every key of the store: meant for messages, not for every update."""
    found = set()
    for key in store.list():
        head, sep, tail = key.rpartition(f"/{VERSIONS_DIR}/")
        if _MANIFEST_RE.fullmatch(f"{VERSIONS_DIR}/{tail}" if sep else key):
            found.add(head if sep else "")
    return sorted(found)


def next_free_version(store) -> int:
    """The first version number nothing in ``store`` uses yet: after the newest manifest and after
    any objects a crashed or concurrent writer left without a manifest."""
    used = list_versions(store)
    for key in store.list(OBJECTS_DIR):
        parsed = parse_object_key(key)
        if parsed is not None:
            used.append(parsed[0])
    return max(used) + 1 if used else 0


def parse_manifest_key(key: str) -> int | None:
    """The version named by a manifest key, or ``None`` for any other key."""
    m = _MANIFEST_RE.fullmatch(key)
    return int(m.group(1)) if m else None


def parse_object_key(key: str) -> tuple[int, Kind, int, int] | None:
    """``(version, kind, rank, world)`` named by an object key, or ``None`` for any other key."""
    m = _OBJECT_RE.fullmatch(key)
    return (int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))) if m else None


def check_version(version: object) -> int:
    """A version number from the caller: an ``int`` in ``[0, MAX_VERSION]`` (``bool`` is not a version).

    Raises:
        TypeError: not an ``int``.
        ValueError: outside ``[0, MAX_VERSION]`` (as the vLLM and HTTP helpers refuse it).
    """
    if type(version) is not int:
        raise TypeError(f"a version is an int, got {type(version).__name__} {version!r}")
    if not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version must be a published version (int in 0 ... {MAX_VERSION}), got {version}")
    return version
