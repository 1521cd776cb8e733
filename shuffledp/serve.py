"""`shuffledp serve analyzer|shuffler|client`: run one party as a long-lived gRPC service.

Used by `shuffledp run` (three kinds of OS processes on loopback), by docker compose (one container each) and on
real hosts. Every connection is mutually authenticated TLS from `--pki DIR`; plain text needs `--insecure`, which is
meant for loopback experiments only.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger("shuffledp.serve")
SHUFFLER_WAIT_S = 60.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run one service (analyzer, shuffler or client node)")
    parser.add_argument("service", choices=["analyzer", "shuffler", "client"])
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port to bind (port 0 = any free port)")
    parser.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    sec = parser.add_mutually_exclusive_group()
    sec.add_argument("--pki", type=Path, help="PKI directory made by `shuffledp pki init` (mTLS)")
    sec.add_argument("--insecure", action="store_true", help="plain text, for loopback experiments only")
    parser.add_argument("--name", help="certificate name of this party (default: the service name, client-<i>)")
    parser.add_argument(
        "--shuffler",
        default=os.environ.get("SHUFFLEDP_SHUFFLER", "127.0.0.1:50052"),
        help="shuffler address (analyzer and client)",
    )
    parser.add_argument(
        "--shuffler-port-file",
        type=Path,
        help="analyzer and client: the shuffler is at 127.0.0.1:<the port in this file> (its --port-file), "
        "waiting for the file after start-up (`shuffledp run` starts all services at once this way)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path("state"),
        help="analyzer: ledger and checkpoints; shuffler: participation record; client: the users' spend",
    )
    parser.add_argument("--config", type=Path, help="client: run configuration TOML (its [data] section)")
    parser.add_argument("--node-index", type=int, default=0, help="client: index of this node")
    parser.add_argument("--num-nodes", type=int, default=1, help="client: number of client nodes")
    parser.set_defaults(func=_serve)


def _security(args: argparse.Namespace, role: str):
    """(server_credentials, channel_credentials, interceptors) for this party; Nones in insecure mode."""
    from shuffledp import tls

    if args.insecure:
        # one rule for every party (tls.check_plain_text), on what is bound and on what is dialled
        try:
            tls.check_plain_text(args.listen, "--listen")
            if role != "shuffler":
                tls.check_plain_text(args.shuffler, "--shuffler")
        except ValueError as exc:
            raise SystemExit(f"shuffledp serve {role}: --insecure: {exc}") from exc
        log.warning("serving %s WITHOUT TLS (--insecure): loopback only, no authentication", role)
        return None, None, (tls.DecodeInterceptor(),)
    if args.pki is None:
        raise SystemExit(f"shuffledp serve {role}: give --pki DIR (mTLS) or --insecure (loopback experiments only)")

    name = _party_name(args, role)
    return (
        tls.server_credentials(args.pki, role, name),
        tls.channel_credentials(args.pki, role, name),
        (tls.RoleInterceptor(tls.DEFAULT_POLICY),),
    )


def _shuffler_address(args: argparse.Namespace) -> str:
    """--shuffler, or with --shuffler-port-file the loopback port the shuffler writes there once it serves; waited
    for only now, after this process's own imports, so that all services of a local run start side by side."""
    if args.shuffler_port_file is None:
        return args.shuffler
    deadline = time.monotonic() + SHUFFLER_WAIT_S
    while not args.shuffler_port_file.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no shuffler port in {args.shuffler_port_file} after {SHUFFLER_WAIT_S:.0f} s")
        time.sleep(0.02)
    return f"127.0.0.1:{int(args.shuffler_port_file.read_text())}"


def _party_name(args: argparse.Namespace, role: str) -> str:
    """This party's name: its certificate's name with --pki (a client node's id at the shuffler is that name)."""
    return args.name or (f"client-{args.node_index}" if role == "client-node" else role)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    if args.service == "analyzer":
        from shuffledp.services.analyzer import start_analyzer

        args.shuffler = _shuffler_address(args)
        server_creds, channel_creds, interceptors = _security(args, "analyzer")
        args.state_dir.mkdir(parents=True, exist_ok=True)
        server, port = start_analyzer(
            args.listen, args.shuffler, args.state_dir, server_creds, channel_creds, interceptors
        )
        stopper = lambda: server.stop(grace=5).wait()  # noqa: E731
    elif args.service == "shuffler":
        from shuffledp.services.shuffler import start_shuffler

        server_creds, _, interceptors = _security(args, "shuffler")
        args.state_dir.mkdir(parents=True, exist_ok=True)
        server, port = start_shuffler(args.listen, args.state_dir / "shuffler.sqlite", server_creds, interceptors)
        stopper = lambda: server.stop(grace=5).wait()  # noqa: E731
    else:
        from shuffledp.clients.node import start_node
        from shuffledp.config import load_config

        if args.num_nodes < 1 or not 0 <= args.node_index < args.num_nodes:
            raise SystemExit(
                f"--node-index must be in [0, --num-nodes) and --num-nodes >= 1, "
                f"got {args.node_index} of {args.num_nodes}"
            )
        config = load_config(args.config)
        args.shuffler = _shuffler_address(args)
        server_creds, channel_creds, interceptors = _security(args, "client-node")
        handle = start_node(
            _party_name(args, "client-node"),
            config,
            args.node_index,
            args.num_nodes,
            args.shuffler,
            args.listen,
            channel_creds,
            server_creds,
            interceptors=interceptors,
            state_dir=args.state_dir,  # the users' spend (clients/spend_store.py)
        )
        port = handle.port
        stopper = handle.stop

    if args.port_file:
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)  # atomic: readers never see a partial file
    log.info("%s serving on port %d", args.service, port)
    stop.wait()
    log.info("%s stopping", args.service)
    stopper()
    return 0
