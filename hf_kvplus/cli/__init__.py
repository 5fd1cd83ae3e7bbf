"""The `kvplus` command: `kvplus ppl`, `kvplus needle`, `kvplus bench`, `kvplus plan`, `kvplus calibrate`,
`kvplus check-formats`, `kvplus train-surrogate`, `kvplus key-scale`, `kvplus demo`, `kvplus context`."""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..errors import KVPlusError
from . import bench, calibrate, check_formats, context, demo, key_scale, needle, plan, ppl, surrogate

COMMANDS = (ppl, needle, bench, plan, calibrate, check_formats, surrogate, key_scale, demo, context)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplus", description="hf_kvplus: KV caches for Transformers.")
    parser.add_argument("--version", action="version", version=f"hf_kvplus {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KVPlusError as error:
        print(f"kvplus {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
