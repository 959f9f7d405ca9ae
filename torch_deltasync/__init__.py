"""torch_deltasync: lossless sparse delta weight sync for asynchronous RL.

After an optimizer step at RL learning rates about 99% of bf16 weights are bit-identical, so a
trainer ships only the changed elements (positions + new values) through an object store, and
rollout replicas apply them in place, bit-exactly. See ``docs/`` and ``docs/design.md``.
"""

from __future__ import annotations

# Errors
from .errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    DeltaSyncError,
    IncompatibleTargetError,
    ObjectExistsError,
    ObjectNotFoundError,
    EpisodeError,
    PrefixInUseError,
    PublishError,
    RolloutServiceError,
    ServiceClosedError,
    StoreError,
    StaleUpdateError,
    StoreNotFoundError,
    SyncTimeoutError,
    TransientStoreError,
    UnsupportedLayoutError,
    VersionNotFoundError,
    WorkerError,
)

# Stores
from .store import LocalStore, RetryPolicy, Store, open_store
from .retention import RetentionPolicy, collect_garbage

# Detection, codecs, wire format
from .detect import ChangeDetector, Changes
from .codecs import Codec, PackedCodec, TensorDelta, codec_names, get_codec, register_codec
from .layout import TensorSlice
from .manifest import Manifest

# Sender and receiver
from .sender import AnchorPolicy, DeltaSender, PublishStats
from .receiver import DeltaReceiver, StagedUpdate, UpdatePlan, UpdateStats
from .targets import ModuleTarget, Target, VLLMTarget

# LoRA adapters (peft is imported lazily)
from .lora import AdapterReceiver, AdapterSender, materialize_adapter

__version__ = "0.1.0"

__all__ = [
    # sender / receiver
    "DeltaSender",
    "DeltaReceiver",
    "AnchorPolicy",
    "PublishStats",
    "UpdatePlan",
    "StagedUpdate",
    "UpdateStats",
    # LoRA adapters
    "AdapterSender",
    "AdapterReceiver",
    "materialize_adapter",
    # targets
    "Target",
    "ModuleTarget",
    "VLLMTarget",
    # stores
    "Store",
    "LocalStore",
    "open_store",
    "RetryPolicy",
    "RetentionPolicy",
    "collect_garbage",
    # detection, codecs, format
    "ChangeDetector",
    "Changes",
    "Codec",
    "TensorDelta",
    "PackedCodec",
    "register_codec",
    "get_codec",
    "codec_names",
    "TensorSlice",
    "Manifest",
    # errors
    "DeltaSyncError",
    "CorruptObjectError",
    "ChecksumMismatchError",
    "VersionNotFoundError",
    "IncompatibleTargetError",
    "UnsupportedLayoutError",
    "StoreError",
    "ObjectNotFoundError",
    "ObjectExistsError",
    "StoreNotFoundError",
    "SyncTimeoutError",
    "StaleUpdateError",
    "TransientStoreError",
    "PublishError",
    "PrefixInUseError",
    "EpisodeError",
    "RolloutServiceError",
    "ServiceClosedError",
    "WorkerError",
]

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("torch_deltasync."):
        try:
            _obj.__module__ = "torch_deltasync"
        except (AttributeError, TypeError):
            pass
del _name, _obj
