"""The deltasync command: inspect, ls, verify (incl. a tampered store), demo."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers import make_mlp, train_step

from torch_deltasync import DeltaSender, LocalStore
from torch_deltasync.cli import main
from torch_deltasync.format import sha256_hex
from torch_deltasync.manifest import seal_manifest


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


def _record_reads(monkeypatch, store) -> list[tuple[str, int | None, int | None]]:
    """Every ``get`` of the store's class from now on, as ``(key, start, end)`` (the command opens
    its own store object)."""
    reads = []
    get = type(store).get

    def recording(self, key, *, start=None, end=None):
        reads.append((key, start, end))
        return get(self, key, start=start, end=end)

    monkeypatch.setattr(type(store), "get", recording)
    return reads


def test_inspect_reads_no_object_larger_than_its_manifest_says(run, capsys, monkeypatch):
    """An object whose size differs from its manifest entry is reported without being read (a
    hostile one may be of any size); a manifest is read within its size limit."""
    store, _, _ = run
    key = f"objects/{4:012d}/delta-r00000-of00001.safetensors"
    store.put(key, store.get(key) + b"\0" * (1 << 20))
    reads = _record_reads(monkeypatch, store)
    assert main(["inspect", str(store.root), key]) == 1
    assert "size DOES NOT match the manifest of version 4" in capsys.readouterr().out
    assert reads and all(k != key for k, _, _ in reads)  # only its manifest was read
    assert all(end is not None for _, _, end in reads)  # in ranges


def test_inspect_reads_only_the_header_of_an_object_no_manifest_lists(run, capsys, tmp_path, monkeypatch):
    """Without a manifest entry there is nothing to check the bytes against: one ranged read of the
    safetensors header, whatever the object's size (in a store or a plain local file)."""
    import struct

    from safetensors.torch import save

    store, _, _ = run
    padded = save({"w": torch.zeros(8 << 20, dtype=torch.uint8)}, metadata={"kind": "anchor", "slices": "{}"})
    (n,) = struct.unpack("<Q", padded[:8])  # 8 MiB of tensor data nobody needs to read
    orphan = f"objects/{4:012d}/orphan.safetensors"
    store.put(orphan, padded)
    reads = _record_reads(monkeypatch, store)
    assert main(["inspect", str(store.root), orphan]) == 1  # not listed: reported as such
    out = capsys.readouterr().out
    assert "NOT listed in the manifest of version 4" in out and "kind: anchor" in out and "8.0 MiB" in out
    assert [(start, end) for k, start, end in reads if k == orphan] == [(0, 8), (0, 8 + n)]

    plain = tmp_path / "copy.safetensors"  # outside any store layout: no manifest at all
    plain.write_bytes(padded)
    assert main(["inspect", str(plain)]) == 0
    assert "w                " in capsys.readouterr().out
    plain.write_bytes(padded[:8 + n - 1])  # a header cut short: the object's own size in the message
    assert main(["inspect", str(plain)]) == 2
    assert f"says {n} bytes, the object has {8 + n - 1} bytes" in capsys.readouterr().err


@pytest.mark.parametrize("keep", [4, 64])
def test_inspect_of_an_object_cut_short_while_read_says_so(run, capsys, monkeypatch, keep):
    """The object shrinks between the size the store reported and the reads (cut to 4 bytes, or
    in its header): a one-line error naming it, not a struct.error or ValueError traceback."""
    from safetensors.torch import save

    store, _, _ = run
    whole = save({"w": torch.zeros(64, dtype=torch.uint8)}, metadata={"kind": "anchor", "slices": "{}"})
    key = f"objects/{4:012d}/shrinking.safetensors"
    store.put(key, whole[:keep])
    size = type(store).size
    monkeypatch.setattr(type(store), "size", lambda self, k: len(whole) if k == key else size(self, k))
    assert main(["inspect", str(store.root), key]) == 2
    err = capsys.readouterr().err
    assert key in err and ("4 bytes is too short" in err if keep == 4 else "changed or was cut short while it was read" in err)


def test_inspect_escapes_control_characters_of_store_data(run, capsys):
    """Names and metadata come from the store: a terminal escape sequence in them is printed
    escaped, never run."""
    from torch_deltasync.manifest import seal_manifest

    store, _, _ = run
    key = f"versions/{4:012d}.json"
    m = json.loads(store.get(key))
    m.pop("digest", None)
    m["run_id"] = "abc\x1b]0;title\x07\x1b[2K\rFAKE"
    store.put(key, seal_manifest(m))
    assert main(["inspect", str(store.root), "--version", "4"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out
    assert "run abc\\x1b]0;title\\x07\\x1b[2K\\rFAKE" in out


def _forge_value(store, version):
    """Flip a value of ``version``'s delta object and fix its sha256, so only checksums can tell."""
    from safetensors.torch import load, save

    from torch_deltasync.format import read_header

    key = f"objects/{version:012d}/delta-r00000-of00001.safetensors"
    data = store.get(key)
    _, meta = read_header(data)
    ts = load(data)
    k = next(k for k in ts if k.endswith(":val"))
    v = ts[k].clone()
    v.view(torch.int16)[0] ^= 1
    ts[k] = v
    data = save(ts, metadata=meta)
    store.put(key, data)
    m = json.loads(store.get(f"versions/{version:012d}.json"))
    for o in m["objects"]:
        if o["key"] == key:
            o.update(nbytes=len(data), sha256=sha256_hex(data))
    store.put(f"versions/{version:012d}.json", seal_manifest(m))


def test_verify_ok_and_tampered(run, capsys):
    store, _, _ = run
    assert main(["verify", str(store.root)]) == 0
    assert "5/5 versions verified" in capsys.readouterr().out
    _forge_value(store, 4)
    assert main(["verify", str(store.root)]) == 1
    out = capsys.readouterr().out
    assert "version        4: FAILED: ChecksumMismatchError" in out and "4/5 versions verified" in out


def test_ls_lists_past_an_unreadable_manifest_and_exits_1(run, capsys):
    store, _, _ = run
    store.put(f"versions/{3:012d}.json", b"{not json")
    assert main(["ls", str(store.root)]) == 1
    captured = capsys.readouterr()
    lines = {line.split()[0]: line for line in captured.out.splitlines()[1:]}
    assert "unreadable" in lines["3"] and "unreadable" not in lines["2"] and "unreadable" not in lines["4"]
    assert "1 of 5 manifests unreadable" in captured.err


def test_ls_skips_a_version_retention_deleted_after_the_listing(run, capsys, monkeypatch):
    store, _, _ = run
    from torch_deltasync import manifest as manifest_mod

    real = manifest_mod.load_manifest

    def racing(st, v):  # retention deletes version 1 between the listing and its read
        if v == 1:
            st.delete(f"versions/{1:012d}.json")
        return real(st, v)

    monkeypatch.setattr(manifest_mod, "load_manifest", racing)
    assert main(["ls", str(store.root)]) == 0
    captured = capsys.readouterr()
    lines = {line.split()[0]: line for line in captured.out.splitlines()[1:]}
    assert "deleted meanwhile" in lines["1"] and "delta" in lines["2"] and not captured.err


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
    store.put(key, seal_manifest(m))
    if command[0] == "verify":  # the one version fails; the others are verified
        assert main([command[0], str(store.root), *command[1:]]) == 1
        out = capsys.readouterr().out
        assert "version        4: FAILED: IncompatibleTargetError" in out and "bytes of memory" in out
        assert "version        3: ok" in out and "4/5 versions verified" in out
        return
    assert main([command[0], str(store.root), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert "declares" in err and "bytes of memory" in err and "Traceback" not in err


def test_verify_checks_each_version_against_its_own_tensors(run, capsys):
    """A store whose versions list different tensors (a writer restarted with another model, or a
    forged manifest): each version is replayed on a target of its own tensors, so a bad newest
    manifest fails only itself, naming the store and the tensor that differs."""
    store, _, _ = run
    key = f"versions/{4:012d}.json"
    m = json.loads(store.get(key))
    m.pop("digest", None)
    name = m["tensors"][0]["name"]
    m["tensors"][0]["shape"] = m["tensors"][0]["shape"][::-1]
    store.put(key, seal_manifest(m))
    assert main(["verify", str(store.root)]) == 1
    out = capsys.readouterr().out
    assert all(f"version {v:>8}: ok" in out for v in range(4)) and "4/5 versions verified" in out
    assert f"version        4: FAILED: CorruptObjectError: {store.describe()}: versions " in out
    assert f"list different tensors (tensor {name!r}: " in out


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


def test_a_demo_deletes_only_a_store_from_its_bucket(tmp_path, capsys):
    """Its own bucket from the last run (a store, an unfinished write's temporary file) is emptied;
    a file no run writes stops the demo before anything is deleted."""
    bucket = tmp_path / "bucket"
    DeltaSender({"w": torch.zeros(4)}, str(bucket)).publish()
    (bucket / "versions" / "000000000009.json.tmp-0123456789abcdef0123456789abcdef").write_bytes(b"{")
    (bucket / "LATEST.tmp-0123456789abcdef0123456789abcdef").write_bytes(b"")
    assert main(["demo", "--steps", "1", "--size", "tiny", "--run-dir", str(tmp_path)]) == 0
    assert "bit-exact: YES (1/1" in capsys.readouterr().out
    assert not (bucket / "versions" / "000000000009.json.tmp-0123456789abcdef0123456789abcdef").exists()
    (bucket / "notes.txt").write_text("precious")
    before = sorted(p.relative_to(bucket) for p in bucket.rglob("*"))
    assert main(["demo", "--steps", "1", "--size", "tiny", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{bucket} holds notes.txt, which no run writes" in err and "another bucket" in err
    assert sorted(p.relative_to(bucket) for p in bucket.rglob("*")) == before
    assert (bucket / "notes.txt").read_text() == "precious"


def test_a_second_demo_leaves_a_running_ones_bucket_alone(tmp_path, capsys):
    """It emptied the bucket (and the metrics) of the demo running in the same folder, then refused."""
    from torch_deltasync import DeltaSender

    bucket = tmp_path / "bucket"
    running = DeltaSender({"w": torch.zeros(4)}, str(bucket))  # the running demo's writer
    try:
        running.publish()
        (tmp_path / "metrics.jsonl").write_text("{}\n")
        assert main(["demo", "--steps", "1", "--size", "tiny", "--run-dir", str(tmp_path)]) == 2
        assert f"{bucket} is in use by a running writer: run" in capsys.readouterr().err
        assert (bucket / "versions" / f"{0:012d}.json").is_file() and (tmp_path / "metrics.jsonl").read_text() == "{}\n"
    finally:
        running.close()
    with pytest.raises(SystemExit):  # --lr inf trained to NaN weights and called it bit-exact
        main(["demo", "--lr", "inf"])


def test_a_demo_killed_on_this_host_does_not_block_the_next_one(tmp_path, capsys):
    """A SIGKILLed demo leaves its lease (60 s): its process is gone, so the next demo goes ahead."""
    import subprocess

    from torch_deltasync.lease import OWNER_KEY, read_owner

    bucket = tmp_path / "bucket"
    sender = DeltaSender({"w": torch.zeros(4)}, str(bucket))
    sender.publish()
    doc = json.loads((bucket / OWNER_KEY).read_bytes())
    sender.close()  # (releases the record: it is written back below as a killed demo leaves it)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (bucket / OWNER_KEY).write_text(json.dumps({**doc, "pid": dead.pid, "renewed_at": time.time()}))
    assert read_owner(LocalStore(bucket)).live(time.time())
    assert main(["demo", "--steps", "1", "--size", "tiny", "--run-dir", str(tmp_path)]) == 0
    assert "bit-exact: YES (1/1" in capsys.readouterr().out


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


@pytest.mark.timeout(60)
def test_inspect_refuses_what_is_not_a_regular_file(tmp_path, capsys):
    # a folder, and a device that never ends (read whole, it would fill the memory)
    for path in (str(tmp_path), "/dev/zero"):
        assert main(["inspect", path]) == 2
        assert f"{path} is not a regular file: give an object or a manifest" in capsys.readouterr().err


def test_bad_arguments_are_refused_by_the_parser(capsys):
    for argv in (["demo", "--size", "nope"], ["demo", "--steps", "0"], ["follow", "x", "--poll", "-1"],
                 ["serve-buffer", "--port", "-1"], ["serve-buffer", "--port", "70000"],
                 ["verify", "x", "--from-version", "-5"], ["follow", "x", "--max-updates", "-1"],
                 ["follow", "x", "--until", "-1"], ["follow", "x", "--metrics", "."],
                 ["follow", "x", "--idle-timeout", "nan"], ["gc", "x", "--grace-s", "nan"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    assert "argument --grace-s: must be a number, got nan" in capsys.readouterr().err


def test_follow_names_a_model_path_that_is_no_folder(tmp_path, capsys):
    """``--model /nonexistent`` read as a mistyped Hugging Face repo id ("Repo id must use
    alphanumeric chars"), after waiting for the first version."""
    assert main(["follow", str(tmp_path), "--model", str(tmp_path / "nope")]) == 2
    assert f"model '{tmp_path / 'nope'}' is no folder" in capsys.readouterr().err


# --- verify and gc: every object of every version, and never the last sound way in ----------------


@pytest.fixture
def anchored(tmp_path):
    """15 versions, anchors 0, 5, 10 (5 and 10 also carry a delta from the version before)."""
    from remote_helpers import StepModel

    from torch_deltasync import LocalStore
    from torch_deltasync.manifest import load_manifest

    store = LocalStore(tmp_path / "bucket", fsync=False)
    model = StepModel(seed=11)
    sender = DeltaSender(model.tensors, store, anchor_every=5)
    for step in range(15):
        model.set_step(step)
        sender.publish()
    m = load_manifest(store, 10)
    assert m.kind == "anchor" and m.base_version == 9 and m.delta_objects and m.anchor_objects
    return store, model


def _flip(store, key, at=-100):
    data = bytearray(store.get(key))
    data[at] ^= 0x01
    store.put(key, bytes(data))


def test_verify_checks_an_anchor_reached_through_its_delta_part(anchored, capsys):
    """A byte flipped in anchor 10's anchor object: the replay reaches 10 through its delta part
    and never read the anchor; verify used to report 15/15."""
    from torch_deltasync.manifest import load_manifest

    store, _ = anchored
    assert main(["verify", str(store.root)]) == 0
    out = capsys.readouterr().out
    assert "15/15 versions verified" in out
    assert f"anchor objects rebuilt and checked, {load_manifest(store, 10).anchor_nbytes:,} B" in out
    _flip(store, load_manifest(store, 10).anchor_objects[0].key)
    assert main(["verify", str(store.root)]) == 1
    out = capsys.readouterr().out
    lines = {int(line.split()[1].rstrip(":")): line for line in out.splitlines() if line.startswith("version ")}
    assert "FAILED: CorruptObjectError" in lines[10] and "anchor-r00000-of00001.safetensors has sha256" in lines[10]
    assert all(": ok (" in lines[v] for v in range(15) if v != 10)  # 11..14 still replay through the delta part
    assert "14/15 versions verified" in out


def test_verify_checks_the_own_objects_of_a_version_it_cannot_reach(anchored, capsys):
    """Anchor 10's anchor object deleted and 12's delta object truncated: 10, 12, 13 and 14 fail
    (11 is reached through 10's delta part), and each failing version's own objects are checked:
    the report tells the damaged versions (10, 12) from those that fail on what they build on."""
    from torch_deltasync.manifest import load_manifest

    store, _ = anchored
    anchor10 = load_manifest(store, 10).anchor_objects[0].key
    delta12 = load_manifest(store, 12).delta_objects[0].key
    store.delete(anchor10)
    store.put(delta12, store.get(delta12)[:100])
    assert main(["verify", str(store.root)]) == 1
    out = capsys.readouterr().out
    report = out[out.index("version       10:"):]
    assert f"version       10: FAILED: ObjectNotFoundError: {anchor10} is missing" in report
    assert f"its own objects: 1 of 2 damaged: {anchor10} is missing" in report
    assert f"its own objects: 1 of 1 damaged: {delta12} is 100 bytes, manifest says" in report
    assert report.count("are intact: what fails is a version it builds on") == 2  # 13, 14
    assert "version       11: ok (delta path" in report
    assert "update()" not in report and "11/15 versions verified" in out


def test_verify_checks_the_delta_part_of_an_anchor_reached_through_the_anchor(anchored, capsys):
    from torch_deltasync.manifest import load_manifest

    store, _ = anchored
    _flip(store, load_manifest(store, 10).delta_objects[0].key)
    assert main(["verify", str(store.root), "--from-version", "10"]) == 1  # 10 first: the anchor path
    out = capsys.readouterr().out
    assert "version       10: FAILED: CorruptObjectError" in out and "delta-r00000-of00001.safetensors has sha256" in out
    assert "4/5 versions verified" in out


def test_verify_fails_a_damaged_delta_part_that_the_replay_recovered_past(anchored, capsys):
    """From version 0, the replay's delta path to 10 fails on 10's delta part and recovers from anchor
    10: a follower would get there, but the object is damaged, so 10 is reported FAILED; the
    replay goes on (11-14 ok)."""
    from torch_deltasync.manifest import load_manifest

    store, _ = anchored
    _flip(store, load_manifest(store, 10).delta_objects[0].key)
    assert main(["verify", str(store.root)]) == 1
    out = capsys.readouterr().out
    lines = {int(line.split()[1].rstrip(":")): line for line in out.splitlines() if line.startswith("version ")}
    assert "FAILED: CorruptObjectError" in lines[10] and "delta-r00000-of00001.safetensors has sha256" in lines[10]
    assert all(": ok (" in lines[v] for v in range(15) if v != 10)
    assert "14/15 versions verified" in out


def test_verify_fails_a_version_the_replay_reaches_only_by_recovering(tmp_path, capsys):
    """A value of anchor 10's delta part forged (raw codec, sha256 fixed): the replay's delta path
    to 10 fails its checksum and recovers from anchor 10, as a follower would; the version is still
    reported FAILED, with why."""
    from remote_helpers import StepModel

    from torch_deltasync import LocalStore

    store = LocalStore(tmp_path / "bucket", fsync=False)
    model = StepModel(seed=11)
    sender = DeltaSender(model.tensors, store, anchor_every=5, codec="raw")
    for step in range(12):
        model.set_step(step)
        sender.publish()
    _forge_value(store, 10)
    assert main(["verify", str(store.root)]) == 1
    out = capsys.readouterr().out
    lines = {int(line.split()[1].rstrip(":")): line for line in out.splitlines() if line.startswith("version ")}
    assert (f"FAILED: ChecksumMismatchError: {store.describe()}: version 10: the staged state differs" in lines[10]
            and "(a follower gets past it along another path: anchor path, 1 applied)" in lines[10])
    assert all(": ok (" in lines[v] for v in range(12) if v != 10) and "11/12 versions verified" in out


def test_gc_keeps_the_versions_below_an_anchor_that_fails_its_check(anchored, capsys):
    from remote_helpers import assert_holds, empty_target

    from torch_deltasync import DeltaReceiver
    from torch_deltasync.manifest import load_manifest
    from torch_deltasync.keys import list_versions

    store, model = anchored
    _flip(store, load_manifest(store, 10).anchor_objects[0].key)
    assert main(["gc", str(store.root), "--grace-s", "0"]) == 0
    out = capsys.readouterr().out
    assert "passed over anchor 10:" in out and "has sha256" in out and "cut anchor 5" in out
    assert list_versions(store) == list(range(5, 15))  # 0..4 went; 5..14 stay
    # the newest version is still reachable without the bad anchor: anchor 5, then deltas through 10's delta part
    target = empty_target()
    receiver = DeltaReceiver(target, store)
    receiver.update(5)
    receiver.update(9)
    assert receiver.update() == 14 and receiver.last_stats.path == "delta"
    assert_holds(target, model, 14)


def test_gc_right_after_a_run_says_there_is_nothing_to_delete(run, capsys):
    store, _, _ = run
    assert main(["gc", str(store.root)]) == 0  # default grace: 60 s, every anchor is younger
    out = capsys.readouterr().out
    assert "none" not in out and "no cut anchor: anchor 0 is only" in out
    assert "keep     5 versions (0..4)" in out and "delete   nothing" in out and "nothing to delete" in out


# --- help, inspect from a store, demo memory and bytes ------------------------------------------------


@pytest.mark.parametrize("command, shown", [
    ("follow", ["--poll POLL           seconds between polls (default: 0.2)", "(default: 60.0)", "(default: 120.0)"]),
    ("gc", ["(default: 60.0)", "(default: 0)"]),
    ("demo", ["(default: 50)", "(default: small)", "(default: 3e-06)", "(default: runs/demo)"]),
    ("ls", ["(default: 120.0)"]),
    ("verify", ["(default: 120.0)"]),
    ("serve-buffer", ["(default: 8088)", "(default: 4096)", "(default: reject)"]),
])
def test_help_shows_defaults(capsys, command, shown):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for text in shown:
        assert " ".join(text.split()) in out, text
    assert "(default: None)" not in out and "(default: False)" not in out


def test_inspect_reads_from_a_store(capsys):
    import uuid

    from torch_deltasync import open_store

    uri = f"memory://inspect-{uuid.uuid4().hex[:8]}/runs"
    store = open_store(uri)
    w = {"w": torch.zeros(64)}
    sender = DeltaSender(w, store, prefix="grpo", codec="raw")
    sender.publish()
    w["w"][:3] = 1.0
    sender.publish()
    key = "objects/000000000001/delta-r00000-of00001.safetensors"
    assert main(["inspect", f"{uri}/grpo/{key}"]) == 0
    out = capsys.readouterr().out
    assert "1 changed tensors, 3 changed elements" in out and "4.688%" in out  # 3 of 64
    assert "size and sha256 match the manifest of version 1" in out
    assert main(["inspect", uri, "--prefix", "grpo", "--version", "1"]) == 0
    assert "version 1 (delta, base 0, anchor 0)" in capsys.readouterr().out
    assert main(["inspect", uri, "versions/000000000001.json", "--prefix", "grpo"]) == 0
    assert "version 1 (delta, base 0, anchor 0)" in capsys.readouterr().out
    sub = store.sub("grpo")
    data = bytearray(sub.get(key))
    data[-1] ^= 0x01
    sub.put(key, bytes(data))
    assert main(["inspect", f"{uri}/grpo/{key}"]) == 1
    assert "size and sha256 DO NOT match the manifest of version 1" in capsys.readouterr().out
    assert main(["inspect", f"{uri}/grpo/something-else"]) == 2
    assert "give the store and the key" in capsys.readouterr().err


def _qwen3_parameters(c: dict) -> int:
    """Parameters of a Qwen3ForCausalLM config, counted from its shapes (untied head, no biases)."""
    h, hd = c["hidden_size"], c["head_dim"]
    attn = h * c["num_attention_heads"] * hd * 2 + h * c["num_key_value_heads"] * hd * 2 + 2 * hd
    layer = attn + 3 * h * c["intermediate_size"] + 2 * h
    return 2 * c["vocab_size"] * h + c["num_hidden_layers"] * layer + h


def test_demo_7b_is_refused_with_a_memory_estimate(tmp_path, capsys):
    from torch_deltasync.testing import QWEN3_SIZES

    n = _qwen3_parameters(QWEN3_SIZES["7b"])
    assert main(["demo", "--size", "7b", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    need = 28 * n + 2 * (1 << 30)  # 28 B a parameter (trainer 20, sender 4, receiver 4), 1 GiB a process
    assert f"({n / 1e9:.2f}B parameters) needs about {need / 2**30:.1f} GiB" in err
    assert "available. Pick a smaller --size" in err
    assert not (tmp_path / "run").exists()  # refused before anything was built


def test_demo_byte_counts_are_the_stored_objects(tmp_path, capsys):
    from torch_deltasync import LocalStore

    assert main(["demo", "--steps", "3", "--size", "tiny", "--run-dir", str(tmp_path), "--anchor-every", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory: about ")
    store = LocalStore(tmp_path / "bucket")
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2]
    for r in rows:
        on_disk = sum(p.stat().st_size for p in (store.root / "objects" / f"{int(r[0]):012d}").iterdir())
        assert int(r[4].replace(",", "")) == on_disk
    assert main(["ls", str(store.root)]) == 0
    listed = capsys.readouterr().out.splitlines()[1:]  # version, kind, base (blank for 0), bytes, ...
    assert [int(line[23:35].replace(",", "")) for line in listed] == [int(r[4].replace(",", "")) for r in rows]


def test_verify_reports_versions_collected_meanwhile_as_deleted(run, capsys, monkeypatch):
    """Retention collected versions 0-2 between verify's listing and their replay: they were
    reported FAILED (VersionNotFoundError) and verify exited 1, though nothing was damaged."""
    import torch_deltasync.keys as keys

    store, _, _ = run
    listed = keys.list_versions(store)
    for v in (0, 1, 2):
        store.delete(f"versions/{v:012d}.json")
    monkeypatch.setattr(keys, "list_versions", lambda s: listed)  # the listing from before the collection
    assert main(["verify", str(store.root)]) == 0
    out = capsys.readouterr().out
    lines = {int(line.split()[1].rstrip(":")): line for line in out.splitlines() if line.startswith("version ")}
    assert all(lines[v].endswith(": deleted meanwhile") for v in (0, 1, 2))
    assert all(": ok (" in lines[v] for v in (3, 4)) and "2/5 versions verified, 3 deleted meanwhile" in out


def test_verify_reports_a_version_collected_during_its_replay_as_deleted(run, capsys, monkeypatch):
    """Retention collected versions 1-2 (below anchor 3) while verify read version 1's objects: the
    missing object was reported FAILED (ObjectNotFoundError) and verify exited 1."""
    import shutil

    from torch_deltasync import LocalStore

    store, _, _ = run
    real_get = LocalStore.get

    def collecting(self, key, *a, **kw):
        if key.startswith("objects/000000000001/") and (store.root / "objects" / f"{1:012d}").exists():
            for v in (1, 2):  # as collect_garbage does: manifests first, then objects
                store.delete(f"versions/{v:012d}.json")
            for v in (1, 2):
                shutil.rmtree(store.root / "objects" / f"{v:012d}")
        return real_get(self, key, *a, **kw)

    monkeypatch.setattr(LocalStore, "get", collecting)
    assert main(["verify", str(store.root)]) == 0
    out = capsys.readouterr().out
    lines = {int(line.split()[1].rstrip(":")): line for line in out.splitlines() if line.startswith("version ")}
    assert all(lines[v].endswith(": deleted meanwhile") for v in (1, 2)), out
    assert all(": ok (" in lines[v] for v in (0, 3, 4)) and "3/5 versions verified, 2 deleted meanwhile" in out


def test_small_cli_messages(run, capsys, tmp_path):
    """ls/verify of a store whose run sits under a prefix said only "no versions"; serve-buffer
    --log-level bogus ended in a KeyError traceback; gc printed "keep 4 versions (0..6)" for 0, 4, 5, 6."""
    from torch_deltasync.retention import RetentionPlan

    store, _, _ = run
    (tmp_path / "outer").mkdir()
    (tmp_path / "outer" / "x").write_text("")
    assert main(["ls", str(tmp_path / "outer")]) == 0
    assert "no versions (check the path and --prefix)" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "outer")]) == 1
    assert "no versions to verify (check the path and --prefix)" in capsys.readouterr().out
    assert main(["verify", str(store.root), "--from-version", "99"]) == 1  # past the newest: not a path problem
    assert "no versions to verify from version 99 (the newest is" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["serve-buffer", "--log-level", "bogus"])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    assert "keep     4 versions (0, 4..6)" in str(RetentionPlan(6, 4, (0, 4, 5, 6), (1, 2, 3), (), reason="r"))


def test_no_versions_names_the_runs_the_store_holds(tmp_path, capsys):
    """A mistyped --prefix (or none, for a run published under one) printed "no versions" and ls
    exited 0 without naming the prefixes that hold runs."""
    root = LocalStore(tmp_path / "bucket", fsync=False)
    for prefix in ("grpo-7", "team/grpo-8"):
        sender = DeltaSender({"w": torch.zeros(4)}, root.sub(prefix))
        sender.publish()
        sender.close()
    runs = "this store holds runs under 'grpo-7', 'team/grpo-8': give one as --prefix"
    for argv, code in ((["ls", str(tmp_path / "bucket")], 0), (["ls", str(tmp_path / "bucket"), "--prefix", "grpo7"], 0),
                       (["verify", str(tmp_path / "bucket"), "--prefix", "grpo7"], 1),
                       (["gc", str(tmp_path / "bucket"), "--prefix", "grpo7"], 1)):
        assert main(argv) == code
        assert runs in capsys.readouterr().out, argv
    assert main(["ls", str(tmp_path / "bucket"), "--prefix", "grpo-7"]) == 0
    assert "anchor" in capsys.readouterr().out
    for i in range(10):  # 12 runs: ten named, the rest counted
        sender = DeltaSender({"w": torch.zeros(4)}, root.sub(f"more/{i}"))
        sender.publish()
        sender.close()
    assert main(["ls", str(tmp_path / "bucket"), "--prefix", "typo"]) == 0
    assert "'grpo-7', 'more/0', 'more/1', " in (out := capsys.readouterr().out) and " and 2 more: give one" in out


def _interrupt_in_a_kernel():
    """What numba raises when a Ctrl-C arrives while a compiled kernel returns."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as e:
        raise SystemError("CPUDispatcher(<function decode_compressed>) returned a result with an exception set") from e


@pytest.mark.parametrize("command", ["verify", "follow"])
def test_a_ctrl_c_inside_a_compiled_kernel_stops_the_command(run, capsys, monkeypatch, command):
    """`verify` reported such a Ctrl-C as a damaged version (FAILED: SystemError), went on and ended
    "3/4 versions verified"; `follow` ended in a 60-line traceback. Both now stop with status 130."""
    from torch_deltasync.receiver import DeltaReceiver

    store = run[0]
    calls = []

    def update(self, version=None, **kw):
        calls.append(version)
        _interrupt_in_a_kernel()

    monkeypatch.setattr(DeltaReceiver, "update", update)
    args = ["--idle-timeout", "5"] if command == "follow" else []
    assert main([command, str(store.root), *args]) == 130
    out = capsys.readouterr()
    assert "FAILED" not in out.out and "Traceback" not in out.err and len(calls) == 1


def test_follow_names_the_runs_of_a_store_whose_root_holds_none(tmp_path, capsys):
    DeltaSender({"w": torch.zeros(4)}, LocalStore(tmp_path / "b"), prefix="run-a").close()
    sender = DeltaSender({"w": torch.ones(4)}, LocalStore(tmp_path / "b"), prefix="run-a")
    sender.publish()
    sender.close()
    assert main(["follow", str(tmp_path / "b"), "--idle-timeout", "0.3"]) == 2
    err = capsys.readouterr().err
    assert "no version under the root yet; this store holds runs under 'run-a': give one as --prefix" in err
    assert main(["follow", str(tmp_path / "b"), "--prefix", "run-a", "--max-updates", "1"]) == 0
    assert "no version under" not in capsys.readouterr().err
