"""clear_local_bucket: what a fresh run (the demo, the recipes' default buckets) may delete."""

from __future__ import annotations

import pytest
import torch

from torch_deltasync import DeltaSender
from torch_deltasync.bucket import clear_local_bucket
from torch_deltasync.errors import PrefixInUseError


def _files(root):
    return sorted(p.relative_to(root) for p in root.rglob("*"))


def _runs(root):
    """A bucket with a run at its root and two under prefixes, one nested; every writer closed."""
    for prefix, n in (("", 2), ("grpo-1", 3), ("team/grpo-2", 1)):
        with DeltaSender({"w": torch.zeros(4)}, str(root), prefix=prefix) as sender:
            for _ in range(n):
                sender.publish()
    (root / "grpo-1" / "versions" / "000000000009.json.tmp-0123456789abcdef0123456789abcdef").write_bytes(b"{")
    (root / "LATEST.tmp-0123456789abcdef0123456789abcdef").write_bytes(b"")


def test_a_bucket_of_closed_runs_is_deleted_and_its_versions_counted(tmp_path):
    root = tmp_path / "bucket"
    _runs(root)
    assert clear_local_bucket(root) == 6 and not root.exists()
    assert clear_local_bucket(root) == 0  # nothing there: nothing to do


def test_a_live_writer_under_any_prefix_stops_it_before_anything_is_deleted(tmp_path):
    root = tmp_path / "bucket"
    _runs(root)
    before = _files(root)
    live = DeltaSender({"w": torch.zeros(4)}, str(root), prefix="team/live")
    try:
        live.publish()
        before = _files(root)
        with pytest.raises(PrefixInUseError, match=rf"{root}/team/live is in use by a running writer: run .*nothing in "
                                                   rf"{root} was deleted"):
            clear_local_bucket(root)
        assert _files(root) == before
    finally:
        live.close()
    assert clear_local_bucket(root) == 7


@pytest.mark.parametrize("where", ["notes.txt", "grpo-1/notes.txt", "team/data/x.bin"])
def test_a_file_no_run_writes_stops_it_before_anything_is_deleted(tmp_path, where):
    root = tmp_path / "bucket"
    _runs(root)
    (root / where).parent.mkdir(parents=True, exist_ok=True)
    (root / where).write_text("precious")
    before = _files(root)
    with pytest.raises(FileExistsError, match=rf"{root} holds {where}, which no run writes; .*move them, or give "
                                              r"this run another bucket"):
        clear_local_bucket(root)
    assert _files(root) == before and (root / where).read_text() == "precious"
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(FileExistsError, match="is a file, not a bucket folder"):
        clear_local_bucket(afile)
