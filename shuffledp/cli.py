"""`shuffledp` command line: one dispatcher, each subcommand in the module named for it.

A subcommand module exposes `add_parser(subparsers) -> None` (which sets `func` on its parser) and is
listed in SUBCOMMANDS. Bad arguments exit with status 2 and one clear line (argparse's convention).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module implementing it
SUBCOMMANDS = {
    "account": "shuffledp.account_cli",
    "run": "shuffledp.run",
    "serve": "shuffledp.serve",
    "pki": "shuffledp.pki",
    "health": "shuffledp.health",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shuffledp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # subcommand not built yet
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
