"""The ``deltasync`` command.

``deltasync inspect FILE``   metadata, tensors, changed counts and density of an object or manifest
``deltasync ls STORE``       versions in a store: kind, base, bytes, density
``deltasync verify STORE``   replay the chain and check every per-tensor checksum
``deltasync gc STORE``       delete old versions under a retention policy (see retention.py)
``deltasync follow STORE``   apply versions as they appear; density, bytes, apply latency per update
``deltasync demo``           trainer + receiver process through a local bucket (see demo.py)
``deltasync serve-buffer``   HTTP rollout service: workers POST episodes, the trainer samples

``STORE`` is anything :func:`torch_deltasync.open_store` accepts (a folder, ``file://``,
``memory://``, ``s3://``, ``hf://buckets/...``); ``--prefix`` selects a run inside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

from ._units import format_bytes

__all__ = ["main", "command"]

_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Register ``deltasync <name>``: decorate ``run(args) -> exit code``."""

    def deco(fn: Callable[[argparse.Namespace], int]):
        _COMMANDS[name] = (help, add_arguments, fn)
        return fn

    return deco


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def _port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {text}")
    return v


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def _open_existing(uri: str, prefix: str):
    """Open a store for reading; a local folder that does not exist is an error, not an empty store."""
    from .store import LocalStore, open_store

    store = open_store(uri)
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise FileNotFoundError(f"{store.describe()} does not exist")
    return store.sub(prefix)


# --- inspect -----------------------------------------------------------------------------------


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="an anchor/delta .safetensors object or a versions/*.json manifest")


@command("inspect", "show an object's or manifest's metadata, tensors and changed counts", _inspect_args)
def _inspect(args: argparse.Namespace) -> int:
    from .errors import CorruptObjectError
    from .format import _json_meta, read_header
    from .manifest import Manifest

    path = Path(args.file)
    data = path.read_bytes()
    if path.suffix == ".json":
        m = Manifest.from_json(data)
        _print_manifest(m)
        return 0
    header, meta = read_header(data, str(path))
    print(f"{path} ({format_bytes(len(data))})")
    for k, v in meta.items():
        if k not in ("counts", "slices"):
            print(f"  {k}: {v}")
    manifest = None
    try:  # objects/<v>/x.safetensors -> versions/<v>.json next to it, for numel and density
        manifest = Manifest.from_json((path.parent.parent.parent / "versions" / f"{path.parent.name}.json").read_bytes())
    except (OSError, ValueError):
        pass
    numel = {t.name: t.numel for t in manifest.tensors} if manifest else {}
    if meta.get("kind") == "delta":
        counts = _json_meta(meta, "counts", str(path))
        if not all(type(c) is int for c in counts.values()):
            raise CorruptObjectError(f"{path}: metadata 'counts' must map tensor names to integers")
        print(f"  {len(counts)} changed tensors, {sum(counts.values()):,} changed elements")
        for name, c in counts.items():
            dens = f"{c / numel[name]:8.3%}" if name in numel and numel[name] else "       ?"
            parts = ", ".join(f"{k.rpartition(':')[2]} {v['dtype']}{v['shape']}" for k, v in header.items()
                              if k.rpartition(":")[0] == name)
            print(f"    {name:<60s} {c:>12,} {dens}  [{parts}]")
    else:
        slices = _json_meta(meta, "slices", str(path))
        print(f"  {len(header)} tensors")
        for name, v in header.items():
            s = slices.get(name) if isinstance(slices.get(name), dict) else {}
            print(f"    {name:<60s} {v['dtype']:>5} {str(v['shape']):<18} offsets {s.get('offsets')}")
    return 0


def _print_manifest(m) -> None:
    print(f"version {m.version} ({m.kind}, base {m.base_version}, anchor {m.anchor_version}), codec {m.codec}, "
          f"{m.inference_dtype}, run {m.run_id}")
    print(f"  {len(m.objects)} objects, {format_bytes(m.nbytes)}; {m.changed:,} of {m.numel:,} elements changed "
          f"({m.changed / max(m.numel, 1):.3%})")
    for o in m.objects:
        print(f"    {o.key}  {o.nbytes:,} B  sha256 {o.sha256[:16]}...")
    for t in m.tensors:
        print(f"    {t.name:<60s} {str(list(t.shape)):<18} changed {t.changed:>12,}  checksum {t.checksum:016x}")
    if m.aliases:
        print(f"  aliases: {m.aliases}")


# --- ls ----------------------------------------------------------------------------------------


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="folder, file://, memory://, s3://... or hf://buckets/...")
    p.add_argument("--prefix", default="", help="run prefix inside the store")


@command("ls", "list the versions in a store", _store_args)
def _ls(args: argparse.Namespace) -> int:
    from .manifest import list_versions, load_manifest
    store = _open_existing(args.store, args.prefix)
    versions = list_versions(store)
    if not versions:
        print(f"{store.describe()}: no versions")
        return 0
    print(f"{'version':>8} {'kind':<6} {'base':>6} {'bytes':>12} {'changed':>12} {'density':>8}  created")
    for v in versions:
        try:
            m = load_manifest(store, v)
        except Exception as e:  # noqa: BLE001 - one bad manifest should not hide the rest
            print(f"{v:>8} {'?':<6} {'':>6} {'':>12} {'':>12} {'':>8}  unreadable: {e}")
            continue
        base = "" if m.base_version is None else str(m.base_version)
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_at)) if m.created_at else ""
        print(f"{v:>8} {m.kind:<6} {base:>6} {m.nbytes:>12,} {m.changed:>12,} {m.changed / max(m.numel, 1):>8.3%}  {created}")
    return 0


# --- verify ------------------------------------------------------------------------------------


def _verify_args(p: argparse.ArgumentParser) -> None:
    _store_args(p)
    p.add_argument("--from-version", type=int, default=None, help="first version to check (default: oldest)")


@command("verify", "replay every version and check every checksum", _verify_args)
def _verify(args: argparse.Namespace) -> int:
    from .errors import DeltaSyncError
    from .manifest import list_versions, load_manifest
    from .receiver import DeltaReceiver
    store = _open_existing(args.store, args.prefix)
    versions = list_versions(store)
    if args.from_version is not None:
        versions = [v for v in versions if v >= args.from_version]
    if not versions:
        print(f"{store.describe()}: no versions to verify")
        return 1
    # The target is shaped by the newest manifest that parses; an unreadable one still gets its line.
    shapes, unreadable = None, {}
    for v in reversed(versions):
        try:
            shapes = load_manifest(store, v)
            break
        except DeltaSyncError as e:
            unreadable[v] = e
    receiver = DeltaReceiver(shapes.zeros(), store) if shapes is not None else None
    failures = 0
    for v in versions:
        try:
            if receiver is None:
                raise unreadable[v]  # no manifest of this store parses
            receiver.update(v)
            st = receiver.last_stats
            print(f"version {v:>8}: ok ({st.path} path, {st.versions_applied} applied, {st.nbytes:,} B)")
        except Exception as e:  # noqa: BLE001 - report every failing version, then exit non-zero
            failures += 1
            print(f"version {v:>8}: FAILED: {type(e).__name__}: {e}")
    print(f"{len(versions) - failures}/{len(versions)} versions verified")
    return 1 if failures else 0


# --- gc ----------------------------------------------------------------------------------------


def _gc_args(p: argparse.ArgumentParser) -> None:
    _store_args(p)
    p.add_argument("--keep-anchors", type=int, default=0, help="older anchors to keep below the newest one")
    p.add_argument("--grace-s", type=float, default=60.0,
                   help="only anchors visible this long count as the newest (readers get this long to finish)")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")


@command("gc", "delete versions no receiver needs (keeps the newest anchor and everything after it)", _gc_args)
def _gc(args: argparse.Namespace) -> int:
    from .retention import RetentionPolicy, collect_garbage
    store = _open_existing(args.store, args.prefix)
    plan = collect_garbage(store, RetentionPolicy(keep_anchors=args.keep_anchors, grace_s=args.grace_s),
                           dry_run=args.dry_run)
    print(plan)
    print("dry run: nothing deleted" if args.dry_run else
          f"deleted {len(plan.manifest_keys)} manifests and {len(plan.object_keys)} objects")
    return 0


# --- demo --------------------------------------------------------------------------------------


def _demo_args(p: argparse.ArgumentParser) -> None:
    from .testing import QWEN3_SIZES

    p.add_argument("--steps", type=_positive_int, default=50, help="versions to publish (one Adam step each)")
    p.add_argument("--size", default="small", choices=sorted(QWEN3_SIZES), help="Qwen3 config")
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--anchor-every", type=int, default=10)
    p.add_argument("--bucket", default=None, help="local bucket folder (default: RUN_DIR/bucket, emptied first)")
    p.add_argument("--codec", default=None, help="delta codec (default: the sender's, packed)")
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--seed", type=int, default=0)


@command("demo", "train a small Qwen3 and follow it from a receiver process, bit-exactly", _demo_args)
def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    ok = run_demo(steps=args.steps, size=args.size, lr=args.lr, anchor_every=args.anchor_every,
                  bucket=args.bucket, codec=args.codec, seed=args.seed, run_dir=args.run_dir)
    return 0 if ok else 1


# --- follow ------------------------------------------------------------------------------------


def _follow_args(p: argparse.ArgumentParser) -> None:
    _store_args(p)
    p.add_argument("--model", default=None,
                   help="HF checkpoint to receive into (default: zeros shaped from the first manifest)")
    p.add_argument("--poll", type=_positive_float, default=0.2, help="seconds between polls")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="stop after this many seconds without a new version (<= 0: never)")
    p.add_argument("--max-updates", type=int, default=None, help="stop after this many updates")
    p.add_argument("--until", type=int, default=None, help="stop once this version (or a newer one) is held")
    p.add_argument("--metrics", default=None, help="append one JSON line per update to this file")
    p.add_argument("--verify", action="store_true", help="also recompute every checksum after each update")


@command("follow", "apply versions as they appear; report density, bytes and apply latency", _follow_args)
def _follow(args: argparse.Namespace) -> int:
    from .follow import follow

    report = follow(args.store, prefix=args.prefix, model=args.model, poll_s=args.poll,
                    idle_timeout_s=args.idle_timeout if args.idle_timeout > 0 else None,
                    max_updates=args.max_updates, until_version=args.until, metrics_path=args.metrics, verify=args.verify)
    print(f"{len(report.versions)} updates, {len(report.failures)} failed")
    return 1 if report.failures else 0


# --- serve-buffer ------------------------------------------------------------------------------


def _serve_buffer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (plain HTTP: loopback or a private network)")
    p.add_argument("--port", type=_port, default=8088, help="TCP port (0: any free one, see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port to this file once listening")
    p.add_argument("--capacity", type=int, default=4096, help="episodes the ring holds")
    p.add_argument("--max-lag", type=int, default=2, help="drop episodes more than this many versions behind the trainer")
    p.add_argument("--on-full", choices=("reject", "evict"), default="reject",
                   help="full ring: 429 + Retry-After (nothing lost) or evict the oldest (counted)")
    p.add_argument("--vocab-size", type=int, default=None, help="token ids must be below this")
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--max-completion-tokens", type=int, default=8192)
    p.add_argument("--max-episodes-per-post", type=int, default=512)
    p.add_argument("--max-body-bytes", type=int, default=32 << 20)
    p.add_argument("--retry-after", type=float, default=1.0, help="seconds a 429 asks producers to wait")
    p.add_argument("--token-file", default=None,
                   help="file holding the shared token for write endpoints (else $DELTASYNC_BUFFER_TOKEN; "
                        "unset: open)")
    p.add_argument("--log-level", default="info")


@command("serve-buffer", "HTTP rollout service: workers POST episodes, the trainer samples (FastAPI)", _serve_buffer_args)
def _serve_buffer(args: argparse.Namespace) -> int:
    from .integrations.rollout_service import RolloutServiceConfig, read_token, serve

    config = RolloutServiceConfig(
        capacity=args.capacity, max_lag=args.max_lag, on_full=args.on_full, vocab_size=args.vocab_size,
        max_prompt_tokens=args.max_prompt_tokens, max_completion_tokens=args.max_completion_tokens,
        max_episodes_per_post=args.max_episodes_per_post, max_body_bytes=args.max_body_bytes,
        retry_after_s=args.retry_after, token=read_token(args.token_file),
    )
    serve(config, host=args.host, port=args.port, log_level=args.log_level, port_file=args.port_file)
    return 0


# --- entry point -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltasync", description="Lossless sparse delta weight sync.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, add, fn) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        add(p)
        p.set_defaults(_run=fn)
    return parser


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
        from .errors import DeltaSyncError

        if isinstance(e, (DeltaSyncError, OSError, ValueError)):
            print(f"deltasync {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
