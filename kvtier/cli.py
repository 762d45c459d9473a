"""The `kvtier` command: maintenance and benchmarking tools around the tiers."""

from __future__ import annotations

import argparse
import logging
import sys

from kvtier.errors import KVTierError


def build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__
    from kvtier.bench import tier_bench
    from kvtier.fsck import add_fsck_parser

    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    add_fsck_parser(sub)
    tier_bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        code: int = args.func(args)
    except KVTierError as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
