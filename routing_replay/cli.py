"""`routing-replay`: list the node's routing stores and sweep the ones whose owner died."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from routing_replay.errors import RoutingReplayError
from routing_replay.store import (
    RoutingStore,
    StoreInfo,
    list_stores,
    sweep_spill_dirs,
    sweep_stores,
)
from routing_replay.store.segment import SHM_DIR
from routing_replay.store.sweep import skipped


def _shown(text: str) -> str:
    """`text` as printed: control characters (of a file name another user chose) escaped."""
    return text if text.isprintable() else ascii(text)[1:-1]


def _row(info: StoreInfo) -> str:
    owner = f"{info.owner_pid}{'' if info.owner_alive else ' (dead)'}" if info.owner_pid else "?"
    if info.stats is None:
        use = "not used (skipped)" if skipped(info) else info.problem or "not readable"
    else:
        s = info.stats
        use = (
            f"{s.samples} samples, {s.pages_used + s.pages_pending}/{s.pages_total} pages, "
            f"{s.dedup_saved_bytes / 2**20:.1f} MiB saved by sharing"
        )
        if s.spill_budget:
            use += (
                f", {s.samples_spilled} spilled ({s.spilled_bytes / 2**20:.1f} of "
                f"{s.spill_budget / 2**20:.0f} MiB)"
            )
        use += (
            f", {_timing(s.puts, s.put_seconds, 'put')}, {_timing(s.reads, s.read_seconds, 'read')}"
        )
    return f"{_shown(info.name):<40} {info.size_bytes / 2**20:>9.1f} MiB  owner {owner:<14} {use}"


def _timing(count: int, seconds: float, what: str) -> str:
    """`12 puts (0.41 ms each)`: how many, and their mean time."""
    mean = f" ({seconds / count * 1e3:.2f} ms each)" if count else ""
    return f"{count} {what}{'' if count == 1 else 's'}{mean}"


def _verify(name: str) -> str:
    try:
        store = RoutingStore.attach(name)
    except RoutingReplayError as e:
        return f"cannot attach: {e}"
    try:
        store.verify()
        return "ok"
    except RoutingReplayError as e:
        return str(e)
    finally:
        store.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `routing-replay` console command."""
    parser = argparse.ArgumentParser(prog="routing-replay", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    ls = commands.add_parser("ls", help=f"list routing stores in {SHM_DIR} with their use")
    ls.add_argument(
        "--verify", action="store_true", help="also check every invariant of each store's tables"
    )
    sweep = commands.add_parser("sweep", help="remove stores whose owner process is dead")
    sweep.add_argument("--dry-run", action="store_true", help="only print what would go")
    sweep.add_argument(
        "--min-age", type=float, default=60.0, help="seconds before a half-made segment is stale"
    )
    sweep.add_argument(
        "--spill-dir",
        action="append",
        default=[],
        metavar="DIR",
        help=(
            "also remove store directories under DIR (a spill_dir) that no live store owns: "
            "no process holds the store open and its segment is gone (another pod's: no "
            "process holds it open)"
        ),
    )
    args = parser.parse_args(argv)
    if args.command == "ls":
        infos = list_stores()
        for info in infos:
            print(_row(info))
            if skipped(info):
                print(f"  skipped {_shown(info.path)}: {info.problem}")
            if args.verify and info.stats is not None:
                print(f"  verify: {_verify(info.name)}")
        print(f"{len(infos)} store(s) in {SHM_DIR}")
        return 0
    for info in list_stores():
        if skipped(info):
            print(f"skipped {_shown(info.path)}: {info.problem}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said above, once
        stale = sweep_stores(dry_run=args.dry_run, min_age_s=args.min_age)
    verb = "would remove" if args.dry_run else "removed"
    for info in stale:
        print(f"{verb} {info.path} (its owner, pid {info.owner_pid or '?'}, is dead)")
    print(f"{verb} {len(stale)} stale store(s)")
    for spill_dir in args.spill_dir:
        orphans = sweep_spill_dirs(spill_dir, dry_run=args.dry_run)
        for path in orphans:
            print(f"{verb} {_shown(path)} (no live store owns it)")
        print(f"{verb} {len(orphans)} orphaned spill director{'y' if len(orphans) == 1 else 'ies'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
