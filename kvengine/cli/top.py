"""``kvengine top``: :mod:`kvengine.cli.stats`, refreshed, with rates per second between refreshes.

On a terminal the screen is redrawn in place (ANSI escapes, no curses) until Ctrl-C;
otherwise (a pipe, a log file, a test) each snapshot is printed after the last.
``--count``/``--once`` stop after that many snapshots.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvengine.cli.arguments import positive_int, positive_seconds
from kvengine.cli.stats import Snapshot, add_endpoint_arguments, endpoint, fetch, render, unreachable

_CLEAR = "\x1b[H\x1b[2J"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvengine top", description="Watch a running engine's cache statistics, read from its Prometheus "
        "metrics endpoint every --interval seconds, with rates per second since the previous refresh. Runs "
        "until Ctrl-C (or --count snapshots). Exit 2 when the endpoint cannot be read.")
    add_endpoint_arguments(parser)
    parser.add_argument("--interval", type=positive_seconds, default=2.0,
                        help="seconds between refreshes (default 2)")
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--count", type=positive_int, help="stop after this many snapshots (default: until Ctrl-C)")
    stop.add_argument("--once", action="store_const", const=1, dest="count", help="one snapshot (as --count 1)")
    args = parser.parse_args(argv)
    url = endpoint(parser, args)
    redraw = sys.stdout.isatty()
    previous: Snapshot | None = None
    shown = 0
    try:
        while True:
            try:
                snap = fetch(url, timeout=args.timeout)
            except (OSError, ValueError) as exc:
                return unreachable("top", url, exc)
            text = render(snap, previous, url=url)
            shown += 1
            if redraw:
                sys.stdout.write(_CLEAR + text + f"\n\nrefresh every {args.interval:g} s; Ctrl-C to quit\n")
            else:
                sys.stdout.write(("\n" if shown > 1 else "") + time.strftime("%H:%M:%S  ") + text + "\n")
            sys.stdout.flush()
            if args.count is not None and shown >= args.count:
                return 0
            previous = snap
            time.sleep(args.interval)
    except KeyboardInterrupt:
        if redraw:
            sys.stdout.write("\n")
        return 0


if __name__ == "__main__":
    sys.exit(main())
