"""The deltasync command: inspect, ls, verify (incl. a tampered store), demo."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_mlp, train_step

from torch_deltasync import DeltaSender
from torch_deltasync.cli import main
from torch_deltasync.format import sha256_hex


@pytest.fixture
def run(store):
    trainer = make_mlp(0)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, store, anchor_every=3, codec="raw")  # the forgery below edits raw values
    states = []  # bf16 bit patterns of every published version, for expectations that are not the sender's
    for _ in range(5):
        train_step(trainer, opt, gen)
        sender.publish()
        states.append({n: t.detach().to(torch.bfloat16).view(torch.int16).clone() for n, t in trainer.state_dict().items()})
    return store, sender, states


def test_ls(run, capsys):
    store, _, _ = run
    assert main(["ls", str(store.root)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[1:]]
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4"]
    assert [r[1] for r in rows] == ["anchor", "delta", "delta", "anchor", "delta"]
    assert rows[4][2] == "3"  # base of version 4


def test_inspect_delta_and_manifest(run, capsys):
    store, _, states = run
    obj = store.root / "objects" / f"{4:012d}" / "delta-r00000-of00001.safetensors"
    assert main(["inspect", str(obj)]) == 0
    out = capsys.readouterr().out
    changed = sum(int((states[4][n] != states[3][n]).sum()) for n in states[4])  # bits that differ, 3 -> 4
    assert f"{changed:,} changed elements" in out and "kind: delta" in out and "%" in out
    assert main(["inspect", str(store.root / "versions" / f"{4:012d}.json")]) == 0
    assert "version 4 (delta, base 3, anchor 3)" in capsys.readouterr().out


def test_verify_ok_and_tampered(run, capsys):
    store, _, _ = run
    assert main(["verify", str(store.root)]) == 0
    assert "5/5 versions verified" in capsys.readouterr().out
    # forge version 4: flip a value and fix its sha256 so only the checksum can tell
    from safetensors.torch import load, save

    from torch_deltasync.format import read_header

    key = f"objects/{4:012d}/delta-r00000-of00001.safetensors"
    data = store.get(key)
    _, meta = read_header(data)
    ts = load(data)
    k = next(k for k in ts if k.endswith(":val"))
    v = ts[k].clone()
    v.view(torch.int16)[0] ^= 1
    ts[k] = v
    data = save(ts, metadata=meta)
    store.put(key, data)
    m = json.loads(store.get(f"versions/{4:012d}.json"))
    for o in m["objects"]:
        if o["key"] == key:
            o.update(nbytes=len(data), sha256=sha256_hex(data))
    store.put(f"versions/{4:012d}.json", json.dumps(m).encode())
    assert main(["verify", str(store.root)]) == 1
    out = capsys.readouterr().out
    assert "version        4: FAILED: ChecksumMismatchError" in out and "4/5 versions verified" in out


def test_verify_reports_every_version_past_an_unreadable_newest_manifest(run, capsys):
    store, _, _ = run
    store.put(f"versions/{4:012d}.json", b"{not json")
    assert main(["verify", str(store.root)]) == 1
    out = capsys.readouterr().out
    assert "version        3: ok" in out and "version        4: FAILED: CorruptObjectError" in out
    assert "4/5 versions verified" in out


@pytest.mark.parametrize("command", [["verify"], ["follow", "--idle-timeout", "2"]])
def test_untrusted_shapes_are_checked_before_allocating(run, capsys, command):
    store, _, _ = run
    key = f"versions/{4:012d}.json"
    m = json.loads(store.get(key))
    m["tensors"][0]["shape"] = [2**24, 2**24]  # 2**48 elements: far beyond any machine's memory
    store.put(key, json.dumps(m).encode())
    assert main([command[0], str(store.root), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert "declares" in err and "bytes of memory" in err and "Traceback" not in err


def test_errors_are_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.safetensors")]) == 2
    assert "error" in capsys.readouterr().err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    assert main(["inspect", str(bad)]) == 2


def test_demo_runs_bit_exact(tmp_path, capsys):
    assert main(["demo", "--steps", "3", "--size", "tiny", "--run-dir", str(tmp_path), "--anchor-every", "2"]) == 0
    out = capsys.readouterr().out
    assert "bit-exact: YES (3/3" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["event"] == "publish" for r in rows) == 3 and all(r["bit_exact"] for r in rows if r["event"] == "receiver")


def test_reading_a_missing_folder_is_an_error_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "bucket"
    for cmd in (["ls", str(missing)], ["verify", str(missing)]):
        assert main(cmd) == 2
        assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("content,match", [
    (b"\xff" * 64, "not a safetensors file"),
    (b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"a": {"x": 1}}'.ljust(16), "malformed header entry"),
    (b"\x08\x00\x00\x00\x00\x00\x00\x00" + b"[[[[[[[[", "not JSON"),
])
def test_inspect_reports_malformed_objects_in_one_line(tmp_path, capsys, content, match):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    assert main(["inspect", str(bad)]) == 2
    assert match in capsys.readouterr().err


def test_bad_arguments_are_refused_by_the_parser(capsys):
    for argv in (["demo", "--size", "nope"], ["demo", "--steps", "0"], ["follow", "x", "--poll", "-1"],
                 ["serve-buffer", "--port", "-1"], ["serve-buffer", "--port", "70000"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
