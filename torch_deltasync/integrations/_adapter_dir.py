"""A PEFT adapter folder on disk (``adapter_model.safetensors`` + ``adapter_config.json``, what
``PeftModel.from_pretrained`` and vLLM's LoRA loader read), written so that no reader sees it half
written and nothing that is not an adapter folder is ever replaced
(:func:`~torch_deltasync.integrations.peft.materialize_adapter`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..store import file_in_the_way

#: File names PEFT (``PeftModel.from_pretrained``) and vLLM (``LoRAModel.from_local_checkpoint``) read.
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"


def write_adapter_dir(out_dir: Path, tensors: dict[str, torch.Tensor], config_json: bytes, *, version: int) -> Path:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` into a temporary sibling folder,
    then rename it to ``out_dir``: readers (vLLM) never see a half-written adapter (while an existing
    ``out_dir`` is replaced, it is briefly absent: moved aside, then the new folder renamed in)."""
    from safetensors.torch import save_file

    check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    old = None
    try:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt", "deltasync_version": str(version)})
        (tmp / ADAPTER_CONFIG_NAME).write_bytes(config_json)
        if out_dir.exists():  # moved aside, not deleted, until the new folder is in place
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None and not out_dir.exists() and any(old.iterdir()):
            os.replace(old, out_dir)
        for leftover in (tmp, old):
            if leftover is not None:
                shutil.rmtree(leftover, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def check_replaceable(out_dir: Path) -> None:
    """Refuse an ``out_dir`` that is not an adapter folder: only a new path, an empty folder, or one
    that holds the two files an adapter folder has, is replaced (never the current folder or
    one above it, a file, a path under a file, or a folder with anything else in it).

    Raises:
        ValueError: naming the folder and what is in it.
    """
    where = out_dir.resolve()
    if where == Path.cwd().resolve() or where in Path.cwd().resolve().parents:
        raise ValueError(f"{str(out_dir)!r} is the current folder or one above it; give the adapter folder's own path "
                         "(e.g. adapters/v12)")
    if out_dir.is_symlink():
        raise ValueError(f"{str(out_dir)!r} is a symbolic link; give the folder itself (a link would be replaced by a "
                         "folder)")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{str(out_dir)!r} is a file; give a folder path for the adapter")
    above = file_in_the_way(out_dir.parent)
    if above is not None:
        raise ValueError(f"{str(out_dir)!r} lies under {str(above)!r}, which is a file; give a folder path for the adapter")
    names = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    odd = [n for n in names if not (out_dir / n).is_file() or (out_dir / n).is_symlink()]
    if names and names != sorted([ADAPTER_WEIGHTS_NAME, ADAPTER_CONFIG_NAME]):
        raise ValueError(f"{str(out_dir)!r} is no adapter folder (it holds {names[:5]}{' ...' if len(names) > 5 else ''}, "
                         f"not just the files {ADAPTER_WEIGHTS_NAME} and {ADAPTER_CONFIG_NAME}) and would be replaced "
                         "whole. Give a new or empty folder, or an adapter folder written before")
    if odd:
        raise ValueError(f"{str(out_dir)!r} is no adapter folder: {odd} {'is' if len(odd) == 1 else 'are'} not a plain "
                         "file (a folder or a link) and would be replaced. Give a new or empty folder")
