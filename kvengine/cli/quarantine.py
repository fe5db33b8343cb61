"""``kvengine quarantine``: list or purge the namespaces of a disk tier that failed a provenance check.

    kvengine quarantine list  --disk /var/cache/kv          # what, why, since when, how many records
    kvengine quarantine purge --disk /var/cache/kv ROOT...  # delete their records and markers
    kvengine quarantine purge --disk /var/cache/kv --all

A purge deletes every record stored under the quarantined root (all its
cache salts and keyed sub-namespaces, from the namespace notes every engine
leaves on the disk) and then the marker. Engines that run on that disk keep
refusing the namespace until they restart; stop them first, or restart them
after, to have the namespace cached again.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvengine.cli.arguments import OneLineParser
from kvengine.transports.local_disk import delete_namespace_records, records_per_namespace
from kvengine.trust.quarantine import QuarantineEntry, read_markers, read_namespace_notes, remove_marker


def _bindings_of(disk: Path, root: str) -> list[str]:
    return sorted({n.binding for n in read_namespace_notes(disk) if n.root == root})


def _describe(entry: QuarantineEntry, disk: Path, counts: dict[str, int]) -> str:
    bindings = _bindings_of(disk, entry.root)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.since))
    lines = [f"{entry.root}  model {entry.model!r}  since {since}",
             f"    reason: {entry.reason}",
             f"    {sum(counts.get(b, 0) for b in bindings)} records under {len(bindings)} namespaces"]
    lines += [f"    {k}: {v}" for k, v in sorted(entry.details.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="kvengine quarantine", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("list", help="show the quarantined namespaces of a disk tier")
    ls.add_argument("--disk", type=Path, required=True, help="the disk tier's directory (disk.path)")
    purge = sub.add_parser("purge", help="delete the records and markers of quarantined namespaces")
    purge.add_argument("--disk", type=Path, required=True, help="the disk tier's directory (disk.path)")
    purge.add_argument("roots", nargs="*", help="roots to purge (as 'list' shows them); or --all")
    purge.add_argument("--all", action="store_true", help="purge every quarantined namespace")
    args = parser.parse_args(argv)

    disk: Path = args.disk
    if not disk.is_dir():
        print(f"kvengine quarantine: --disk {disk}: {'not a directory' if disk.exists() else 'no such directory'}",
              file=sys.stderr)
        return 2
    entries = {e.root: e for e in read_markers(disk)}
    counts = records_per_namespace(disk)
    if args.action == "list":
        if not entries:
            print(f"no quarantined namespaces in {disk}")
        for entry in entries.values():
            print(_describe(entry, disk, counts))
        return 0
    roots = sorted(entries) if args.all else args.roots
    unknown = [r for r in roots if r not in entries]
    if unknown or not roots:
        print(f"kvengine quarantine purge: {'unknown roots ' + ', '.join(unknown) if unknown else 'name roots or --all'}"
              f" (quarantined: {', '.join(sorted(entries)) or 'none'})", file=sys.stderr)
        return 2
    for root in roots:
        deleted = sum(delete_namespace_records(disk, binding) for binding in _bindings_of(disk, root))
        remove_marker(disk, root)
        print(f"purged {root} ({entries[root].model!r}): {deleted} records deleted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
