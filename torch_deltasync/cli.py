"""The ``deltasync`` command.

``deltasync inspect OBJECT`` metadata, tensors, changed counts and density of an object or manifest
                             (a local file, a path or URI inside a store, or ``STORE KEY``)
``deltasync ls STORE``       versions in a store: kind, base, bytes, density
``deltasync verify STORE``   replay the chain, check every per-tensor checksum and every object
``deltasync gc STORE``       delete old versions under a retention policy (see retention.py)
``deltasync follow STORE``   apply versions as they appear; density, bytes, apply latency per update
``deltasync demo``           trainer + receiver process through a local bucket (see demo.py)
``deltasync serve-buffer``   HTTP rollout service: workers POST episodes, the trainer samples

``STORE`` is anything :func:`torch_deltasync.open_store` accepts (a folder, ``file://``,
``memory://``, ``s3://``, ``hf://buckets/...``); ``--prefix`` selects a run inside it and
``--timeout`` bounds every store call. ``--help`` shows every option with its default.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path
from typing import Callable

from ._cli_types import (
    HelpFormatter, metrics_file, number, port, positive_finite_float, positive_float, positive_int, printable,
    version_arg,
)
from ._units import format_bytes

__all__ = ["main", "command"]

_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Register ``deltasync <name>``: decorate ``run(args) -> exit code``."""

    def deco(fn: Callable[[argparse.Namespace], int]):
        _COMMANDS[name] = (help, add_arguments, fn)
        return fn

    return deco


def _open(uri: str, args: argparse.Namespace):
    """Open ``uri`` with the command's ``--timeout`` (the deadline of one store call)."""
    from .store import open_store
    return open_store(uri, timeout_s=args.timeout)


def _runs_elsewhere(args: argparse.Namespace) -> list[str]:
    """The runs the store holds under other prefixes than ``--prefix`` (lists the whole store)."""
    from .keys import runs_in

    return [r for r in _quietly(lambda: runs_in(_open(args.store, args))) or [] if r != args.prefix.strip("/")]


def _where_runs_are(args: argparse.Namespace, runs: list[str] | None = None) -> str:
    """After "no versions": the runs the store holds under other prefixes (``runs``, else listed), else a hint."""
    runs = _runs_elsewhere(args) if runs is None else runs
    named = (", ".join("the store's root (no --prefix)" if r == "" else repr(r) for r in runs[:10])
             + (f" and {len(runs) - 10} more" if len(runs) > 10 else ""))
    return f"; this store holds runs under {named}: give one as --prefix" if runs else " (check the path and --prefix)"


def _quietly(fn: Callable[[], object]) -> object:
    """``fn()``, or ``None`` when it fails (for hints only)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - only a hint
        return None


def _open_existing(args: argparse.Namespace, uri: str | None = None):
    """Open ``uri`` (default ``args.store``) for reading, under ``args.prefix``; a store that is not
    there (a missing folder; a missing bucket fails on its first call) is an error, not an empty store."""
    store = _open(args.store if uri is None else uri, args)
    why = store.absent()
    if why is not None:
        raise FileNotFoundError(f"{store.describe()}: {why}")
    return store.sub(args.prefix)


def _timeout_arg(p: argparse.ArgumentParser) -> None:
    from .store import DEFAULT_TIMEOUT_S

    p.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S,
                   help="deadline of one store call in seconds (per attempt on remote stores, plus time for "
                        "large transfers); a call past it fails instead of hanging")


# --- inspect -----------------------------------------------------------------------------------


_KEY_IN_PATH = re.compile(r"(?:(.*)/)?(versions/[0-9]{12}\.json|objects/[0-9]{12}/[^/]+\.safetensors)")


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="an object or manifest: a local file, or its path or URI inside a store "
                                   "(runs/b/versions/000000000004.json, s3://b/run/objects/000000000004/"
                                   "delta-r00000-of00001.safetensors); or a store, with KEY or --version")
    p.add_argument("key", nargs="?", default=None,
                   help="key inside the store and --prefix (versions/<v>.json or objects/<v>/<file>)")
    p.add_argument("--prefix", default="", help="run prefix inside the store (with KEY or --version)")
    p.add_argument("--version", type=int, default=None, help="inspect this version's manifest")
    _timeout_arg(p)


def _locate(args: argparse.Namespace):
    """``(store, key)`` of what ``deltasync inspect`` names, or ``(None, path)`` for a plain local
    file outside any store layout."""
    from .keys import MAX_VERSION, manifest_key

    if args.key is not None or args.version is not None:
        if args.key is not None and args.version is not None:
            raise ValueError("give KEY or --version, not both")
        if args.version is not None and not 0 <= args.version <= MAX_VERSION:
            raise ValueError(f"--version must be in 0 ... {MAX_VERSION}, got {args.version}")
        return _open_existing(args, args.target), args.key if args.key is not None else manifest_key(args.version)
    if args.prefix:
        raise ValueError("--prefix needs KEY or --version (a full path or URI already names the run)")
    m = _KEY_IN_PATH.fullmatch(args.target)
    if m is not None:
        return _open(m.group(1) or ".", args), m.group(2)
    if "://" in args.target:
        raise ValueError(f"{args.target!r} does not end in versions/<v>.json or objects/<v>/<file>.safetensors; "
                         "give the store and the key: deltasync inspect STORE KEY")
    return None, args.target


@command("inspect", "show an object's or manifest's metadata, tensors and changed counts", _inspect_args)
def _inspect(args: argparse.Namespace) -> int:
    from .errors import CorruptObjectError, DeltaSyncError
    from .format import json_meta, read_header, sha256_hex
    from .keys import parse_manifest_key
    from .manifest import MAX_MANIFEST_BYTES, Manifest, load_manifest

    store, key = _locate(args)
    manifest = entry = unavailable = None
    if store is None:
        path = Path(key)
        if path.exists() and not path.is_file():  # a folder, or a device or pipe that never ends
            raise ValueError(f"{key} is not a regular file: give an object or a manifest (or STORE KEY)")
        if key.endswith(".json") and path.stat().st_size > MAX_MANIFEST_BYTES:
            raise CorruptObjectError(f"{key} is {path.stat().st_size:,} bytes, above the {MAX_MANIFEST_BYTES:,}-byte "
                                     "limit of a manifest; not read")
        where, version, size = key, None, path.stat().st_size

        def read(start: int, end: int) -> bytes:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read(end - start)
    else:
        where, version = f"{store.describe()}/{key}", parse_manifest_key(key)
        if version is not None:  # read within the manifest size limit
            _print_manifest(load_manifest(store, version))
            return 0
        obj = re.fullmatch(r"objects/([0-9]{12})/[^/]+", key)
        if obj is not None:  # the version's manifest: numel, density, size and sha256
            version = int(obj.group(1))
            try:
                manifest = load_manifest(store, version)
            except DeltaSyncError as e:
                unavailable = f"  manifest of version {version}: unavailable ({type(e).__name__}: {printable(e)})"
            entry = next((o for o in manifest.objects if o.key == key), None) if manifest else None
        size = store.size(key)
        if entry is not None and size != entry.nbytes:  # not read: it may be of any size
            print(f"{where} ({format_bytes(size)})\n  size DOES NOT match the manifest of version {version} "
                  f"({entry.nbytes:,} B, the object {size:,} B): the object is corrupt; not read")
            return 1
        if key.endswith(".json") and size > MAX_MANIFEST_BYTES:
            raise CorruptObjectError(f"{where} is {size:,} bytes, above the {MAX_MANIFEST_BYTES:,}-byte limit of a "
                                     "manifest; not read")

        def read(start: int, end: int) -> bytes:
            return store.get(key, start=start, end=end)
    # The whole object when the manifest lists it (its sha256 is checked) or it is a manifest; else
    # its safetensors header only (two small ranged reads), whatever the object's size.
    data = read(0, size) if entry is not None or key.endswith(".json") else _header_bytes(read, size)
    if key.endswith(".json"):
        _print_manifest(Manifest.from_json(data, expected_version=version, where=where))
        return 0
    header, meta = read_header(data, where, size=size)
    print(f"{where} ({format_bytes(size)})")
    for k, v in meta.items():
        if k not in ("counts", "slices"):
            print(f"  {printable(k)}: {printable(v)}")
    ok = True
    if unavailable:
        print(unavailable)
    if manifest is not None and entry is None:
        ok = False
        print(f"  NOT listed in the manifest of version {version}")
    elif entry is not None:
        ok = len(data) == entry.nbytes and sha256_hex(data) == entry.sha256
        print(f"  size and sha256 {'match' if ok else 'DO NOT match'} the manifest of version {version}"
              + ("" if ok else f" ({entry.nbytes:,} B, sha256 {entry.sha256}): the object is corrupt"))
    numel = {t.name: t.numel for t in manifest.tensors} if manifest else {}
    if meta.get("kind") == "delta":
        counts = json_meta(meta, "counts", where)
        if not all(type(c) is int for c in counts.values()):
            raise CorruptObjectError(f"{where}: metadata 'counts' must map tensor names to integers")
        print(f"  {len(counts)} changed tensors, {sum(counts.values()):,} changed elements")
        for name, c in counts.items():
            dens = f"{c / numel[name]:8.3%}" if name in numel and numel[name] else "       ?"
            if c < 0 or c > numel.get(name, c):
                ok, dens = False, "CORRUPT (more changes than elements)" if c > 0 else "CORRUPT (negative)"
            parts = ", ".join(f"{printable(k.rpartition(':')[2])} {v['dtype']}{v['shape']}" for k, v in header.items()
                              if k.rpartition(":")[0] == name)
            print(f"    {printable(name):<60s} {c:>12,} {dens}  [{parts}]")
    else:
        slices = json_meta(meta, "slices", where)
        print(f"  {len(header)} tensors")
        for name, v in header.items():
            s = slices.get(name) if isinstance(slices.get(name), dict) else {}
            print(f"    {printable(name):<60s} {v['dtype']:>5} {str(v['shape']):<18} offsets {printable(s.get('offsets'))}")
    return 0 if ok else 1


def _header_bytes(read, size: int) -> bytes:
    """The first bytes of a safetensors object of ``size`` bytes through the end of its header
    (``read(start, end)`` reads a range): the header too when its 8-byte length is within
    :data:`~torch_deltasync.format.MAX_HEADER_BYTES` and the object, else only those 8 bytes
    (:func:`~torch_deltasync.format.read_header` then says why the object is corrupt)."""
    import struct

    from .format import MAX_HEADER_BYTES

    head = read(0, min(size, 8))
    if len(head) < 8:
        return head
    (n,) = struct.unpack("<Q", head)
    return head if n > MAX_HEADER_BYTES or 8 + n > size else read(0, 8 + n)


def _print_manifest(m) -> None:
    print(f"version {m.version} ({m.kind}, base {m.base_version}, anchor {m.anchor_version}), codec {m.codec}, "
          f"{m.inference_dtype}, run {printable(m.run_id)}")
    print(f"  {len(m.objects)} objects, {format_bytes(m.nbytes)}; {m.changed:,} of {m.numel:,} elements changed "
          f"({m.changed / max(m.numel, 1):.3%})")
    for o in m.objects:
        print(f"    {o.key}  {o.nbytes:,} B  sha256 {o.sha256[:16]}...")
    for t in m.tensors:
        print(f"    {printable(t.name):<60s} {str(list(t.shape)):<18} changed {t.changed:>12,}  checksum {t.checksum:016x}")
    if m.aliases:
        print(f"  aliases: {printable(m.aliases)}")


# --- ls ----------------------------------------------------------------------------------------


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="folder, file://, memory://, s3://... or hf://buckets/...")
    p.add_argument("--prefix", default="", help="run prefix inside the store (none: the store's root)")
    _timeout_arg(p)


@command("ls", "list the versions in a store", _store_args)
def _ls(args: argparse.Namespace) -> int:
    from .errors import VersionNotFoundError
    from .keys import list_versions
    from .manifest import load_manifest
    store = _open_existing(args)
    versions = list_versions(store)
    if not versions:
        print(f"{store.describe()}: no versions{_where_runs_are(args)}")
        return 0
    print(f"{'version':>8} {'kind':<6} {'base':>6} {'bytes':>12} {'changed':>12} {'density':>8}  created")
    unreadable = 0
    for v in versions:
        try:
            m = load_manifest(store, v)
        except VersionNotFoundError:  # deleted by retention since the listing: not an error
            print(f"{v:>8} {'-':<6} {'':>6} {'':>12} {'':>12} {'':>8}  deleted meanwhile")
            continue
        except Exception as e:  # noqa: BLE001 - one bad manifest should not hide the rest
            _stop_if_interrupted(e)
            print(f"{v:>8} {'?':<6} {'':>6} {'':>12} {'':>12} {'':>8}  unreadable: {printable(e)}")
            unreadable += 1
            continue
        base = "" if m.base_version is None else str(m.base_version)
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_at)) if m.created_at else ""
        print(f"{v:>8} {m.kind:<6} {base:>6} {m.nbytes:>12,} {m.changed:>12,} {m.changed / max(m.numel, 1):>8.3%}  {created}")
    if unreadable:
        print(f"{unreadable} of {len(versions)} manifests unreadable; `deltasync verify` checks each version's objects",
              file=sys.stderr)
    return 1 if unreadable else 0


# --- verify ------------------------------------------------------------------------------------


def _verify_args(p: argparse.ArgumentParser) -> None:
    _store_args(p)
    p.add_argument("--from-version", type=version_arg, default=None, help="first version to check (none: the oldest)")


@command("verify", "replay every version, check every checksum and every object", _verify_args)
def _verify(args: argparse.Namespace) -> int:
    """Replay the versions in order with one receiver, as a follower would, and check what the
    replay did not read: an anchor reached through its delta part is also rebuilt from its anchor
    objects (a new receiver's only way in once older versions are collected), and the delta part
    of an anchor reached through the anchor has its objects checked (size, sha256, structure). A
    version the replay reaches only by recovering (its planned path failed) is reported FAILED
    with why; the replay goes on from it, as a follower would. A version the replay cannot reach
    also has its own objects checked (size, sha256, a delta part decoded), so the report names every
    damaged object, not only the first one a path needs."""
    from ._cli_verify import check_rest, failure, own_objects
    from .errors import ObjectNotFoundError, VersionNotFoundError
    from .keys import list_versions, manifest_key
    from .manifest import load_manifest
    from .receiver import DeltaReceiver

    store = _open_existing(args)
    listed = list_versions(store)
    versions = [v for v in listed if args.from_version is None or v >= args.from_version]
    if not versions:
        why = f" from version {args.from_version} (the newest is {listed[-1]})" if listed else _where_runs_are(args)
        print(f"{store.describe()}: no versions to verify{why}")
        return 1
    # The target is shaped by each version's manifest: a store may hold runs of different models
    # (a writer restarted with another model), and a damaged manifest must not fail the others.
    layout, target, receiver = None, None, None
    failures = deleted = 0
    run_files_seen: set[tuple[str, str]] = set()
    for v in versions:
        try:
            m = load_manifest(store, v)
            if (m.inference_dtype, [(t.name, t.shape) for t in m.tensors]) != layout:
                if receiver is not None:
                    receiver.close()
                layout, target = (m.inference_dtype, [(t.name, t.shape) for t in m.tensors]), m.zeros()
                receiver = DeltaReceiver(target, store)
            receiver.update(v)
            st = receiver.last_stats
            if st.recovered:  # the replay held a checked version: what its path read is damaged
                failures += 1  # recovered_from is "Type: message" of what failed
                print(f"version {v:>8}: FAILED: {printable(st.recovered_from)} (a follower gets past it along another path: "
                      f"{st.path} path, {st.versions_applied} applied)")
                continue
            checked = check_rest(target, store, receiver.manifest(v), st.path, run_files_seen)
            print(f"version {v:>8}: ok ({st.path} path, {st.versions_applied} applied, {st.nbytes:,} B{checked})")
        except Exception as e:  # noqa: BLE001 - report every failing version, then exit non-zero
            _stop_if_interrupted(e)
            if isinstance(e, (VersionNotFoundError, ObjectNotFoundError)) and not store.exists(manifest_key(v)):
                deleted += 1  # collected (retention) since it was listed, or during its replay
                print(f"version {v:>8}: deleted meanwhile")
            else:  # a version still there, or damaged: what it needs is gone or wrong
                failures += 1
                print(f"version {v:>8}: FAILED: {failure(e)}")
                own = own_objects(store, v)
                if own:
                    print(f"{'':>17}{own}")
    if receiver is not None:
        receiver.close()
    print(f"{len(versions) - failures - deleted}/{len(versions)} versions verified"
          + (f", {deleted} deleted meanwhile" if deleted else ""))
    return 1 if failures else 0


# --- gc ----------------------------------------------------------------------------------------


def _gc_args(p: argparse.ArgumentParser) -> None:
    _store_args(p)
    p.add_argument("--keep-anchors", type=int, default=0, help="older anchors to keep below the newest one")
    p.add_argument("--grace-s", type=number, default=60.0,
                   help="only anchors visible this long count as the newest (readers get this long to finish)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not read the cut anchor back before deleting below it (see RetentionPolicy.verify_cut)")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")


@command("gc", "delete versions no receiver needs (keeps the newest sound anchor and everything after it)", _gc_args)
def _gc(args: argparse.Namespace) -> int:
    from .retention import RetentionPolicy, collect_garbage
    store = _open_existing(args)
    policy = RetentionPolicy(keep_anchors=args.keep_anchors, grace_s=args.grace_s, verify_cut=not args.no_verify)
    plan = collect_garbage(store, policy, dry_run=args.dry_run)
    if plan.newest is None:
        print(f"{store.describe()}: no versions here{_where_runs_are(args)}; nothing to delete")
        return 1
    print(plan)
    if plan.empty:
        print("nothing to delete")
    else:
        print("dry run: nothing deleted" if args.dry_run else
              f"deleted {len(plan.manifest_keys)} manifests and {len(plan.object_keys)} objects")
    return 0


# --- demo --------------------------------------------------------------------------------------


def _demo_args(p: argparse.ArgumentParser) -> None:
    from .testing import QWEN3_SIZES

    p.add_argument("--steps", type=positive_int, default=50, help="versions to publish (one Adam step each)")
    p.add_argument("--size", default="small", choices=sorted(QWEN3_SIZES),
                   help="Qwen3 config (the demo prints the memory it needs and refuses one that does not fit)")
    p.add_argument("--lr", type=positive_finite_float, default=3e-6, help="Adam learning rate")
    p.add_argument("--anchor-every", type=int, default=10, help="publish an anchor every this many versions")
    p.add_argument("--bucket", default=None, help="local bucket folder (none: RUN_DIR/bucket, emptied first when it holds only a store)")
    p.add_argument("--codec", default=None, help="delta codec (none: the sender's, packed)")
    p.add_argument("--run-dir", default="runs/demo", help="folder for the bucket and metrics.jsonl")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the training data")


@command("demo", "train a small Qwen3 and follow it from a receiver process, bit-exactly", _demo_args)
def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    try:
        ok = run_demo(steps=args.steps, size=args.size, lr=args.lr, anchor_every=args.anchor_every,
                      bucket=args.bucket, codec=args.codec, seed=args.seed, run_dir=args.run_dir)
    except (MemoryError, FileExistsError) as e:  # refused before anything was built
        print(f"deltasync demo: error: {e}", file=sys.stderr)
        return 2
    return 0 if ok else 1


# --- follow ------------------------------------------------------------------------------------


def _follow_args(p: argparse.ArgumentParser) -> None:
    _store_args(p)
    p.add_argument("--model", default=None, help="HF checkpoint to receive into (none: zeros shaped from the first manifest)")
    p.add_argument("--poll", type=positive_finite_float, default=0.2, help="seconds between polls")
    p.add_argument("--idle-timeout", type=number, default=60.0,
                   help="stop after this many seconds without a new version (<= 0 or inf: never)")
    p.add_argument("--max-updates", type=positive_int, default=None, help="stop after this many updates (none: never)")
    p.add_argument("--until", type=version_arg, default=None,
                   help="stop once this version (or a newer one) is held (none: never)")
    p.add_argument("--metrics", type=metrics_file, default=None,
                   help="append one JSON line per update to this file (none: no file)")
    p.add_argument("--verify", action="store_true", help="also recompute every checksum after each update")


@command("follow", "apply versions as they appear; report density, bytes and apply latency", _follow_args)
def _follow(args: argparse.Namespace) -> int:
    from .follow import follow
    from .keys import list_versions

    elsewhere = [] if _quietly(lambda: list_versions(_open_existing(args))) else _runs_elsewhere(args)
    if elsewhere:
        print(f"deltasync follow: no version under {repr(args.prefix) if args.prefix else 'the root'} yet"
              f"{_where_runs_are(args, elsewhere)} (waiting here)", file=sys.stderr)
    report = follow(_open(args.store, args), prefix=args.prefix, model=args.model, poll_s=args.poll,
                    idle_timeout_s=args.idle_timeout if 0 < args.idle_timeout < math.inf else None,
                    max_updates=args.max_updates, until_version=args.until, metrics_path=args.metrics, verify=args.verify)
    print(f"{len(report.versions)} updates, {len(report.failures)} failed"
          + (f", store unavailable {report.outages} times (ridden out)" if report.outages else ""))
    return 1 if report.failures else 0


# --- serve-buffer ------------------------------------------------------------------------------


def _serve_buffer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (plain HTTP: loopback or a private network)")
    p.add_argument("--port", type=port, default=8088, help="TCP port (0: any free one, see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port to this file once listening (none: no file)")
    p.add_argument("--capacity", type=int, default=4096, help="episodes the ring holds")
    p.add_argument("--max-lag", type=int, default=2, help="drop episodes more than this many versions behind the trainer")
    p.add_argument("--on-full", choices=("reject", "evict"), default="reject",
                   help="full ring: 429 + Retry-After (nothing lost) or evict the oldest (counted)")
    p.add_argument("--vocab-size", type=int, default=None, help="token ids must be below this (none: unchecked)")
    p.add_argument("--max-prompt-tokens", type=int, default=8192, help="longest prompt an episode may have")
    p.add_argument("--max-completion-tokens", type=int, default=8192, help="longest completion an episode may have")
    p.add_argument("--max-episodes-per-post", type=int, default=512, help="episodes one POST may carry")
    p.add_argument("--max-body-bytes", type=int, default=32 << 20, help="largest request body, in bytes")
    p.add_argument("--retry-after", type=float, default=1.0, help="seconds a 429 asks producers to wait")
    p.add_argument("--token-file", default=None, help="file holding the shared token for write endpoints "
                   "(else $DELTASYNC_BUFFER_TOKEN; unset: open)")
    p.add_argument("--log-level", default="info", help="uvicorn log level",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


@command("serve-buffer", "HTTP rollout service: workers POST episodes, the trainer samples (FastAPI)", _serve_buffer_args)
def _serve_buffer(args: argparse.Namespace) -> int:
    from .integrations.rollout import RolloutServiceConfig, read_token, serve

    config = RolloutServiceConfig(
        capacity=args.capacity, max_lag=args.max_lag, on_full=args.on_full, vocab_size=args.vocab_size,
        max_prompt_tokens=args.max_prompt_tokens, max_completion_tokens=args.max_completion_tokens,
        max_episodes_per_post=args.max_episodes_per_post, max_body_bytes=args.max_body_bytes,
        retry_after_s=args.retry_after, token=read_token(args.token_file))
    serve(config, host=args.host, port=args.port, log_level=args.log_level, port_file=args.port_file)
    return 0


# --- entry point -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltasync", description="Lossless sparse delta weight sync.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, add, fn) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        add(p)
        p.set_defaults(_run=fn)
    return parser


def _stop_if_interrupted(e: Exception) -> None:
    """Raise ``KeyboardInterrupt`` for a Ctrl-C in disguise (:func:`torch_deltasync.errors.interrupted`)."""
    from .errors import interrupted

    if interrupted(e):
        raise KeyboardInterrupt from e


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `deltasync ls ... | head`: the reader left, nothing to report
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # noqa: BLE001 - a CLI prints a one-line error, not a traceback
        from .errors import DeltaSyncError, interrupted

        if interrupted(e):  # a Ctrl-C while a compiled kernel returned
            return 130
        if isinstance(e, (DeltaSyncError, OSError, ValueError)):
            print(f"deltasync {args.command}: error: {printable(e)}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
