"""Checks the benchmark tools run on their arguments before any work: a bad flag fails in a second,
not after a run of minutes."""

from __future__ import annotations

import argparse
from pathlib import Path


def check_writable(parser: argparse.ArgumentParser, flag: str, path: str) -> None:
    """``parser.error`` (exit status 2, naming ``flag``) unless ``path`` can be written: its folder
    is created and the file opened for appending (and removed again when it did not exist)."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        existed = out.exists()
        open(out, "ab").close()
        if not existed:
            out.unlink()
    except OSError as e:
        parser.error(f"{flag}: cannot write {path}: {e}")
