"""Argument types and the help formatter of the ``deltasync`` command line (:mod:`torch_deltasync.cli`)
and of the recipes' command lines (each type refuses a bad value with argparse's usage error), and
:func:`printable`, how the command line shows text read from a store."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def version_arg(text: str) -> int:
    from .keys import check_version

    v = int(text)  # not a number: argparse's own "invalid ... value"
    try:
        return check_version(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def metrics_file(text: str) -> str:
    from ._metrics import check_metrics_path

    try:
        check_metrics_path("the path", text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {text}")
    return v


def number(text: str, *, positive: bool = False, finite: bool = False) -> float:
    """An option's number (never NaN): ``> 0`` if ``positive``, not infinite if ``finite``."""
    v = float(text)
    if math.isnan(v) or (positive and not v > 0) or (finite and math.isinf(v)):
        raise argparse.ArgumentTypeError(f"must be a {'positive ' * positive}{'finite ' * finite}number, got {text}")
    return v


def positive_float(text: str) -> float:
    return number(text, positive=True)


def positive_finite_float(text: str) -> float:
    return number(text, positive=True, finite=True)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (``None``, ``False``, ``""``):
    the help text says what leaving the option out means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)


def printable(value: object) -> str:
    """``str(value)`` with every non-printable character escaped (``\\x1b``): store data is
    untrusted, and a terminal must not run its control sequences."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in str(value))
