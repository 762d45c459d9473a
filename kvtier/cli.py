"""The `kvtier` command: serve with kvtier, the demo, and maintenance and benchmarking tools."""

from __future__ import annotations

import argparse
import logging
import sys

from kvtier.errors import KVTierError


def build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__
    from kvtier.bench import demo, tier_bench
    from kvtier.bench.multiturn import cli as multiturn_cli
    from kvtier.integrations.vllm.serving import trace_record
    from kvtier.integrations.vllm.serving.serve import add_parser as add_serve_parser
    from kvtier.ops import control_client
    from kvtier.tiers.fs.fsck import add_fsck_parser
    from kvtier.trace import commands as plan_commands

    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    add_fsck_parser(sub)
    tier_bench.add_parser(sub)
    demo.add_parser(sub)
    add_serve_parser(sub, default_model=embedded_model)
    multiturn_cli.add_parser(sub)
    plan_commands.add_parser(sub)
    trace_record.add_parser(sub)
    control_client.add_parser(sub)
    return parser


def embedded_model() -> str:
    """The embedded SmolLM2 directory, converted on first use; a failure is a `KVTierError`."""
    from kvtier.tools.models import ModelPrepError, prepare_smollm2

    try:
        return str(prepare_smollm2())
    except ModelPrepError as e:
        raise KVTierError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    passthrough: list[str] = []
    if "--" in argv:  # everything after the first "--" is for the program a command starts
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if passthrough and not getattr(args, "accepts_passthrough", False):
        parser.error(f"kvtier {args.command} takes no arguments after --")
    args.passthrough = passthrough
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
