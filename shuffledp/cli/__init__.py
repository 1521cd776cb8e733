"""`shuffledp` command line: one dispatcher, each subcommand in the module named for it.

A subcommand module exposes `add_parser(subparsers) -> None` (which sets `func` on its parser) and is
listed in SUBCOMMANDS. Bad arguments exit with status 2 and one clear line (argparse's convention).
Ctrl-C exits with status 130 and one line; a server that cannot listen on its address says why in one line (status 1).

The faces: `run` (a local run, or one against a deployment), `serve` (one party as a service), `account` (the
ledger's and a user's accounts), `sweep` (a grid of runs). This package and `shuffledp.api` are the top floor: they may
import anything, and nothing below them imports either (the API drives runs through `run`'s machinery).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module implementing it
SUBCOMMANDS = {
    "account": "shuffledp.cli.account",
    "run": "shuffledp.cli.run",
    "serve": "shuffledp.cli.serve",
    "sweep": "shuffledp.cli.sweep",
    "pki": "shuffledp.security.pki",
    "health": "shuffledp.transport.health",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with `only` (a subcommand name), only that subcommand's module is imported: a service
    started with `shuffledp serve ...` must not pay for the accountants' imports that `account` needs (~1 s)."""
    parser = argparse.ArgumentParser(prog="shuffledp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    names = [SUBCOMMANDS[only]] if only in SUBCOMMANDS else SUBCOMMANDS.values()
    for module_name in names:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # subcommand not built yet
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = f"shuffledp {argv[0]}" if argv and argv[0] in SUBCOMMANDS else "shuffledp"
    try:
        parser = build_parser(argv[0] if argv else None)
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C in a command that does not handle it (e.g. a long `account` query)
        print(f"{command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except OSError as exc:  # a server that cannot listen (grpc_options.bind_server): one line, not a traceback
        from shuffledp.transport.grpc_options import BindError

        if not isinstance(exc, BindError):
            raise
        print(f"{command}: {exc}", file=sys.stderr)
        return 1
