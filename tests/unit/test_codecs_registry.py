"""The codec registry: names in, instances out, clear errors for everything else."""

from __future__ import annotations

import pytest

from torch_deltasync.codecs import RawCodec, codec_names, get_codec, register_codec


def test_built_in_codecs_are_registered():
    assert {"raw", "packed"} <= set(codec_names())
    assert isinstance(get_codec("raw"), RawCodec)


@pytest.mark.parametrize("name", ["zstd", "", None, ["raw"]])
def test_unknown_names_list_the_registered_ones(name):
    with pytest.raises(ValueError, match=r"unknown codec .*registered codecs: \[.*'packed'.*'raw'"):
        get_codec(name)


def test_a_codec_that_cannot_be_built_says_so():
    @register_codec
    class NeedsArgs(RawCodec):
        name = "needs-args-test"

        def __init__(self, level):
            self.level = level

    with pytest.raises(TypeError, match="level"):
        get_codec("needs-args-test")


def test_register_refuses_non_classes_reserved_and_taken_names():
    with pytest.raises(TypeError, match="codec class with encode"):
        register_codec(get_codec("raw"))
    with pytest.raises(TypeError, match="codec class with encode"):
        register_codec(object())

    class Auto(RawCodec):
        name = "auto"

    with pytest.raises(ValueError, match="'auto' is reserved"):
        register_codec(Auto)

    class Impostor(RawCodec):
        name = "raw"

    with pytest.raises(ValueError, match="'raw' is taken by .*RawCodec"):
        register_codec(Impostor)
    assert type(get_codec("raw")) is RawCodec
    assert register_codec(RawCodec) is RawCodec  # registering the same class again is harmless
