"""``recipes/torchrun_fsdp2.py`` under real ``torchrun`` (2 ranks, gloo, CPU), followed live by
``deltasync follow``: the follower ends bit-identical to the trainer's gathered bf16 weights."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from torch_deltasync.testing import first_difference

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


def _torchrun(bucket: Path, final: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "recipes" / "torchrun_fsdp2.py"), "--bucket", str(bucket), "--steps", "3",
           "--anchor-every", "2", "--save-final", str(final), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)


def test_recipe_publishes_every_step_and_follow_keeps_up(tmp_path):
    from safetensors.torch import load_file

    from torch_deltasync.follow import follow

    bucket, final = tmp_path / "bucket", tmp_path / "final.safetensors"
    box: dict = {}
    out = io.StringIO()

    def follower():
        try:
            box["report"] = follow(str(bucket), idle_timeout_s=120, max_updates=None, poll_s=0.05, out=out,
                                   until_version=3)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = e

    t = threading.Thread(target=follower)
    t.start()
    proc = _torchrun(bucket, final)
    t.join(300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert '"last_version": 3' in proc.stdout
    assert "error" not in box, box.get("error")
    report = box["report"]
    assert report.failures == [] and report.versions[-1] == 3
    assert report.versions == sorted(report.versions)
    assert "density" in out.getvalue() and "apply" in out.getvalue()
    expected = load_file(str(final))
    got = {n: t for n, t in report.model.items()}
    assert first_difference(got, expected) is None
    # every version has one object per rank
    assert sorted(p.name for p in (bucket / "objects" / f"{1:012d}").iterdir()) == [
        "delta-r00000-of00002.safetensors", "delta-r00001-of00002.safetensors"]


def test_follow_into_an_hf_checkpoint_and_cli(tmp_path):
    """``follow(..., model=CKPT)``: a differently initialised checkpoint of the same architecture ends
    up holding the trainer's weights; ``deltasync follow`` prints one line per update."""
    from safetensors.torch import load_file

    from torch_deltasync.cli import main
    from torch_deltasync.follow import follow
    from torch_deltasync.testing import tiny_qwen3

    bucket, final = tmp_path / "bucket", tmp_path / "final.safetensors"
    proc = _torchrun(bucket, final, "--background")  # uploads overlap training; may coalesce steps
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])["last_version"]
    assert last >= 2
    ckpt = tmp_path / "ckpt"
    tiny_qwen3("tiny", seed=99, dtype=torch.bfloat16).save_pretrained(ckpt)
    report = follow(str(bucket), model=str(ckpt), idle_timeout_s=0.5, verify=True, out=io.StringIO())
    assert report.versions == [last] and report.failures == []
    assert first_difference(report.model.state_dict(), load_file(str(final))) is None
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["follow", str(bucket), "--until", str(last), "--metrics", str(tmp_path / "follow.jsonl")])
    assert rc == 0, buf.getvalue()
    lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith("version")]
    assert len(lines) == 1 and f"version {last:>7}" in lines[0] and "path anchor" in lines[0], buf.getvalue()
    assert "density" in lines[0] and "apply" in lines[0]
    assert (tmp_path / "follow.jsonl").read_text().count('"event": "follow"') == 1


@pytest.mark.parametrize("args, message", [
    (["--steps", "-1"], "--steps must be at least 1, got -1"),  # used to exit 0 having published nothing
    (["--size", "nonsense"], "invalid choice: 'nonsense' (choose from '100m'"),  # was a KeyError on every rank
    (["--batch", "0"], "--batch must be at least 1"),  # was a reshape error inside the model
    (["--seq", "0"], "--seq must be at least 1"),
    (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    (["--save-final", "/etc/hostname/final.safetensors"], "/etc/hostname is a file, not a folder"),  # after training
    (["--metrics", "/etc/hostname/m/p.jsonl"], "--metrics '/etc/hostname/m/p.jsonl': /etc/hostname is a file"),
    (["--save-final", "/tmp"], "--save-final '/tmp' is a folder: give a file's path"),
])
def test_bad_arguments_are_named_before_any_rank_starts(args, message, capsys):
    from recipes.torchrun_fsdp2 import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--bucket", "b", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_mesh_that_does_not_fit_the_world_is_a_usage_error_of_rank_0(monkeypatch, capsys):
    """It was a ValueError traceback on every rank, after the process group and the model."""
    from recipes.torchrun_fsdp2 import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, said in (("0", "--tp 3 x --dp-replicate 1 must divide the world size 2 (torchrun --nproc-per-node)"),
                       ("1", "")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            parse_args(["--bucket", "b", "--tp", "3"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and (said in err if said else err == "")
    assert parse_args(["--bucket", "b", "--tp", "2"]).tp == 2


def test_a_prefix_in_use_names_the_recipes_takeover_flag(tmp_path):
    """The library's message says ``takeover=True``; the recipe's flag is ``--takeover``."""
    from torch_deltasync import DeltaSender

    bucket = tmp_path / "bucket"
    holder = DeltaSender({"w": torch.zeros(4)}, str(bucket))  # a live writer holds the prefix
    try:
        proc = _torchrun(bucket, tmp_path / "final.safetensors")
    finally:
        holder.close()
    assert proc.returncode != 0
    assert "pass takeover=True" in proc.stderr and "(here: --takeover)" in proc.stderr, proc.stderr[-3000:]
