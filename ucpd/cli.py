"""The ``ucpd`` command: one sub-command per job, each registered by the module that owns it."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ucpd",
        description="Per-node asynchronous in-memory checkpoint daemon and universal-format tools.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from .daemon import cli as daemon_cli
    from .format import cli as format_cli

    format_cli.add_commands(sub)
    daemon_cli.add_commands(sub)
    from . import launch

    launch.add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .errors import UcpdError

    try:
        return int(args.func(args) or 0)
    except UcpdError as exc:
        print(f"ucpd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
