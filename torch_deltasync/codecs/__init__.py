"""Codecs: how one tensor's change set (positions + new values) is stored in a delta object.

A codec turns the changes of one tensor into a few named tensors (stored in the delta object as
``<name>:<part>``) and back; decoders treat their input as untrusted. Codecs register by name with
:func:`register_codec`; the manifest names the codec of a version and receivers look it up with
:func:`get_codec`. Built in: ``raw`` (the seed format, 6 bytes per changed bf16 element) and
``packed`` (the default, about 1 byte). ``docs/format.md`` specifies both byte for byte.
:func:`auto_codec` picks one of them by link speed, and :func:`sender_codec` resolves a sender's
``codec`` / ``link_gbps`` pair (``SenderConfig`` checks it with it).

Modules: ``_base`` (:class:`TensorDelta`, :class:`Codec`, the registry), ``_raw``, ``_packed``,
``_bits`` (the bit-stream primitives ``packed`` is built from) and ``_auto`` (the choice by link
speed).
"""

from ._auto import PACKED_BELOW_GBPS, auto_codec, sender_codec
from ._base import Codec, TensorDelta, codec_names, get_codec, register_codec
from ._packed import PackedCodec
from ._packed_header import CODE_BITS, LAYOUT_VERSION
from ._raw import RawCodec

__all__ = [
    # interface and registry
    "Codec",
    "TensorDelta",
    "register_codec",
    "get_codec",
    "codec_names",
    # choice by link speed (DeltaSender(codec="auto", link_gbps=...))
    "auto_codec",
    "sender_codec",
    "PACKED_BELOW_GBPS",
    # built-in codecs
    "RawCodec",
    "PackedCodec",
    "LAYOUT_VERSION",
    "CODE_BITS",
]

for _name in ("Codec", "TensorDelta", "register_codec", "get_codec", "codec_names", "auto_codec", "sender_codec",
              "RawCodec", "PackedCodec"):
    globals()[_name].__module__ = __name__
del _name
