"""``fabric`` command line: ``fabric bench transfer ...``, ``fabric version``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="fabric", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the fabric version")
    bench = sub.add_parser("bench", help="benchmarks (fabric bench transfer --help)")
    bench.add_argument("what", choices=["transfer"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.command == "version":
        from fabric import __version__

        print(__version__)
    elif ns.command == "bench":
        from fabric.bench.transfer import main as bench_transfer

        bench_transfer(ns.rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
