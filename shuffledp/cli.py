"""`shuffledp` command line: one dispatcher, each subcommand in the module named for it.

A subcommand module exposes `add_parser(subparsers) -> None` (which sets `func` on its parser) and is
listed in SUBCOMMANDS. Bad arguments exit with status 2 and one clear line (argparse's convention).
Ctrl-C exits with status 130 and one line; a server that cannot listen on its address says why in one line (status 1).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import re
import socket
import sys

# name -> module implementing it
SUBCOMMANDS = {
    "account": "shuffledp.account_cli",
    "run": "shuffledp.run",
    "serve": "shuffledp.serve",
    "pki": "shuffledp.pki",
    "health": "shuffledp.health",
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
    except RuntimeError as exc:
        address = _unbound_address(exc)
        if address is None:
            raise
        print(f"{command}: cannot listen on {address}: {_why_unbound(address)}", file=sys.stderr)
        return 1


_GRPC_BIND_FAILED = re.compile(r"^Failed to bind to address (\S+?);")  # grpc's RuntimeError when add_*_port fails


def _unbound_address(exc: RuntimeError) -> str | None:
    """The address of gRPC's "Failed to bind to address ADDR" error (a server could not listen), else None."""
    match = _GRPC_BIND_FAILED.match(str(exc))
    return match.group(1) if match else None


def _why_unbound(address: str) -> str:
    """Why gRPC could not listen on `address`, as far as a plain bind of the same address tells: in use by another
    program, not an address of this host, or something gRPC alone refused (e.g. an unusable TLS key)."""
    host, _, port = address.rpartition(":")
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host.strip("[]") or None, int(port), 0, socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(sockaddr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return "the address is in use (another program listens there): choose another port"
        return f"{exc.strerror or exc}"
    except ValueError:
        return "not a HOST:PORT address"
    return "gRPC refused it (with --pki: are the party's key and certificate valid?)"


if __name__ == "__main__":
    sys.exit(main())
