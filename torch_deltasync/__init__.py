"""torch_deltasync: lossless sparse delta weight sync for asynchronous RL.

After an optimizer step at RL learning rates about 99% of bf16 weights are bit-identical, so a
trainer ships only the changed elements (positions + new values) through an object store, and
rollout replicas apply them in place, bit-exactly. See ``docs/architecture.md``.

The face is small: the sender and receiver, their targets and stores, the codec registry and the
manifest. Everything else lives in its package: errors in :mod:`torch_deltasync.errors`, codecs in
:mod:`torch_deltasync.codecs`, change detection in :mod:`torch_deltasync.detect`, host frameworks
in :mod:`torch_deltasync.integrations` (vLLM, torchrl, PEFT, HTTP rollouts).
"""

from __future__ import annotations

from .codecs import Codec, get_codec, register_codec
from .errors import DeltaSyncError
from .manifest import Manifest
from .receiver import DeltaReceiver, StagedUpdate, UpdateStats
from .retention import RetentionPolicy, collect_garbage
from .sender import AnchorPolicy, DeltaSender, PublishStats
from .store import LocalStore, RetryPolicy, Store, open_store
from .targets import ModuleTarget, Target, VLLMTarget

__version__ = "0.1.0"

__all__ = [
    # publish
    "DeltaSender",
    "AnchorPolicy",
    "PublishStats",
    # receive
    "DeltaReceiver",
    "StagedUpdate",
    "UpdateStats",
    # targets
    "Target",
    "ModuleTarget",
    "VLLMTarget",
    # stores and retention
    "Store",
    "LocalStore",
    "open_store",
    "RetryPolicy",
    "RetentionPolicy",
    "collect_garbage",
    # codecs and the manifest
    "Codec",
    "register_codec",
    "get_codec",
    "Manifest",
    # the base of every error (the others: torch_deltasync.errors)
    "DeltaSyncError",
]

# Names that left the root (0.1 -> 0.2): still found, with a warning that says where they live now.
_MOVED = {
    "ChangeDetector": "torch_deltasync.detect",
    "Changes": "torch_deltasync.detect",
    "TensorDelta": "torch_deltasync.codecs",
    "PackedCodec": "torch_deltasync.codecs",
    "codec_names": "torch_deltasync.codecs",
    "TensorSlice": "torch_deltasync.layout",
    "UpdatePlan": "torch_deltasync.receiver",
    "AdapterSender": "torch_deltasync.integrations.peft",
    "AdapterReceiver": "torch_deltasync.integrations.peft",
    "materialize_adapter": "torch_deltasync.integrations.peft",
}


def __getattr__(name: str):
    import importlib
    import warnings

    from . import errors

    where = _MOVED.get(name) or ("torch_deltasync.errors" if isinstance(getattr(errors, name, None), type) else None)
    if where is None:
        raise AttributeError(f"module 'torch_deltasync' has no attribute {name!r}")
    warnings.warn(f"torch_deltasync.{name} moved to {where}.{name}; import it from there", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(where), name)


# Reprs, docs and pickles name the public path (as torch.distributed.tensor does for DTensor).
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
