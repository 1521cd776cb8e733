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
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from shuffledp.transport import grpc_options

log = logging.getLogger("shuffledp.cli.serve")
SHUFFLER_WAIT_S = 60.0
# glibc serves a freed block's size from its heaps from then on (the mmap threshold rises with each large free, up to
# 32 MiB), and a thread's heap keeps what it once held: after one large round a service held ~400 MB more than its
# users' data between rounds (issue 30 item 3). A fixed threshold maps every block of at least this size on its own
# and unmaps it when freed; smaller ones (a round's 1 MiB encoding blocks) are reused from the heaps.
MMAP_THRESHOLD_BYTES = 4 * 2**20
# a fixed threshold also fixes the trim threshold (glibc's default 128 KiB): every free at a heap's top gave its pages
# back, and the next round's 1 MiB blocks faulted them in again (d = 650: a node's CPU per round 21 -> 35 ms). Up to
# this much free space stays at each heap's top.
TRIM_THRESHOLD_BYTES = 64 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h
# --parent-fd: after the parent is gone, the process exits this long after at the latest (a stop that hangs, a start-up
# still waiting for the shuffler's port file); an orderly stop takes up to the servers' 5 s grace
PARENT_GONE_EXIT_S = 30.0
PARENT_GONE = "cancelled: its CLI (shuffledp run) is gone"


def return_large_blocks() -> bool:
    """A fixed mmap threshold (mallopt, glibc; with it glibc adjusts nothing by itself). False elsewhere. Every
    service calls it at start; the benchmarks call it too, so that a round in one process runs as the services'."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and bool(
            libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        )
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own allocator's policy stays
        return False


# Every BLAS library numpy and scipy load reads one of these at load; a service respects any the operator set.
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def one_blas_thread() -> int | None:
    """Use one BLAS thread in this process unless the operator set a BLAS_THREAD_VARS; returns the BLAS pools' largest
    thread count after it (None: no BLAS loaded). Why: several services share a machine, and OpenBLAS's threads
    spin-wait between calls; with its default (one thread per core) a client node at d = 10^4 spent 143 ms of CPU
    per round instead of 49, and the round took 151 ms instead of 58 (bench_round, 2 nodes on 2 cores, 2026-11-27).
    A service parallelises across processes (nodes, users' rounds), not inside one matrix product."""
    from threadpoolctl import threadpool_info, threadpool_limits

    ours = not any(v in os.environ for v in BLAS_THREAD_VARS)
    if ours:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"  # for a BLAS loaded later (scipy's own OpenBLAS)
    import numpy  # noqa: F401  (loads numpy's BLAS now, every service uses it: the count below includes it)

    if ours:
        threadpool_limits(limits=1, user_api="blas")  # a BLAS loaded before the variable was set
    counts = [pool["num_threads"] for pool in threadpool_info() if pool.get("user_api") == "blas"]
    return max(counts) if counts else None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="run one service (analyzer, shuffler, client node, or a fleet of single-user device nodes)"
    )
    parser.add_argument("service", choices=["analyzer", "shuffler", "client", "fleet"])
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
    parser.add_argument("--num-nodes", type=int, default=1, help="client, fleet: number of client nodes")
    parser.add_argument("--first-index", type=int, default=0, help="fleet: index of its first device node")
    parser.add_argument(
        "--count",
        type=int,
        default=1,
        help="fleet: its device nodes, --first-index .. --first-index + COUNT - 1, one user each (node i hosts the "
        "data's user i: --num-nodes must be the number of users), each with its own certificate client-<i>",
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="fleet: threads that compute the devices' rounds (default 2)"
    )
    parser.add_argument(
        "--max-nodes",
        type=int,
        default=None,
        help="shuffler: client nodes connected at once; one more is refused (RESOURCE_EXHAUSTED) and reported by name "
        "in the run's output and metrics (default 10000: ~1 GB of idle mTLS connections)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        default=os.environ.get("SHUFFLEDP_METRICS_PORT", "0"),  # a string default goes through type=int too
        help="serve Prometheus metrics (plain HTTP, /metrics) on this port of the --listen host; 0 = off (default; "
        "env SHUFFLEDP_METRICS_PORT). Scrapable by anyone who reaches that address: bind to loopback or a private "
        "network (docs/how-to/monitoring.md)",
    )
    parser.add_argument(
        "--simulation-seed",
        type=int,
        metavar="N",
        help="a replayable local simulation (`shuffledp run --seed N` passes it): every generator of this service is "
        "keyed from N and the party, so the run replays bit for bit and its noise is known to anyone who holds N; "
        "plain text on loopback only (--insecure), refused with --pki",
    )
    parser.add_argument(
        "--parent-fd",
        type=int,
        metavar="FD",
        help="stop once this inherited file descriptor (a pipe's read end) reaches end of file, i.e. once the process "
        "holding the write end ended in any way; an analyzer first cancels its running runs. `shuffledp run` passes "
        "one, so that its services end with it (also after kill -9)",
    )
    parser.set_defaults(func=_serve)


def _security(args: argparse.Namespace, role: str):
    """(server_credentials, channel_credentials, interceptors) for this party; Nones in insecure mode. Every PKI
    file this party uses is checked here, before anything starts: SystemExit with one line naming a bad one."""
    from shuffledp.transport import tls

    if args.insecure:
        # one rule for every party (tls.check_plain_text), on what is bound and on what is dialled
        try:
            tls.check_plain_text(args.listen, "--listen")
            if role != "shuffler" and args.shuffler_port_file is None:  # a port file means 127.0.0.1
                tls.check_plain_text(args.shuffler, "--shuffler")
        except ValueError as exc:
            raise SystemExit(f"shuffledp serve {role}: --insecure: {exc}") from exc
        log.warning("serving %s WITHOUT TLS (--insecure): loopback only, no authentication", role)
        return None, None, (tls.DecodeInterceptor(),)
    if args.pki is None:
        raise SystemExit(f"shuffledp serve {role}: give --pki DIR (mTLS) or --insecure (loopback experiments only)")

    name = _party_name(args, role)
    try:
        # both read the same three files, each checked by pki.load_party (the shuffler dials nobody: unused there)
        server_creds = tls.server_credentials(args.pki, role, name)
        channel_creds = tls.channel_credentials(args.pki, role, name)
    except (OSError, ValueError) as exc:  # pki.load_party: one line naming the file and the problem
        raise SystemExit(f"shuffledp serve {role}: {exc}") from exc
    return server_creds, channel_creds, (tls.RoleInterceptor(tls.DEFAULT_POLICY),)


def _signer(args: argparse.Namespace, role: str):
    """The analyzer's spec signer (its role certificate's key, checked by _security), None in insecure mode."""
    if args.pki is None:
        return None
    from shuffledp.transport.spec_signing import SpecSigner

    return SpecSigner.from_pki(args.pki, _party_name(args, role))


def _check_listen(args: argparse.Namespace, role: str) -> None:
    """Refuse an address in use before any state is opened (issue 24 item 6): a second instance of a running service
    must not touch its state files, let alone share its address."""
    try:
        grpc_options.check_address_free(args.listen)
    except grpc_options.BindError as exc:
        raise SystemExit(f"shuffledp serve {role}: {exc}") from exc


def _check_metrics(args: argparse.Namespace, role: str) -> None:
    """With --metrics-port: its address (the --listen host) is checked free before any state is opened."""
    if not args.metrics_port:
        return
    from shuffledp.observability.metrics import metrics_host

    try:
        if not 0 < args.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in 1..65535 (0 = off), got {args.metrics_port}")
        host = metrics_host(args.listen)
        if args.listen.rsplit(":", 1)[1] == str(args.metrics_port):
            raise ValueError(f"--metrics-port {args.metrics_port} is the --listen port")
        grpc_options.check_address_free(
            f"[{host}]:{args.metrics_port}" if ":" in host else f"{host}:{args.metrics_port}"
        )
    except (ValueError, grpc_options.BindError) as exc:
        raise SystemExit(f"shuffledp serve {role}: metrics: {exc}") from exc


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


def _simulate(args: argparse.Namespace, role: str) -> None:
    """--simulation-seed: key this process's generators from it (shuffledp.security.rng.start_simulation), before
    any is made. Only without a PKI: a deployment's noise must never be known to whoever knows a seed."""
    if args.simulation_seed is None:
        return
    if not args.insecure:
        raise SystemExit(
            f"shuffledp serve {role}: --simulation-seed is for local simulations in plain text (--insecure): a seeded "
            "service's noise is known to anyone who holds the seed"
        )
    from shuffledp.security import rng

    party = f"fleet-{args.first_index}" if args.service == "fleet" else _party_name(args, role)
    try:
        rng.start_simulation(args.simulation_seed, f"{args.service}:{party}")
    except ValueError as exc:
        raise SystemExit(f"shuffledp serve {role}: --simulation-seed: {exc}") from exc
    log.warning(
        "serving %s as a seeded simulation (seed %d): its noise is known to anyone who holds it",
        role,
        args.simulation_seed,
    )


def _party_name(args: argparse.Namespace, role: str) -> str:
    """This party's name: its certificate's name with --pki (a client node's id at the shuffler is that name)."""
    return args.name or (f"client-{args.node_index}" if role == "client-node" else role)


def _start(
    args: argparse.Namespace, role: str
) -> tuple[int, Callable[[], object], Callable[[], object], Callable[[], object]]:
    """Start the service: (bound port, stop function, its metrics registry's maker, what to do before stopping when
    the --parent-fd parent is gone). Checks first what needs nothing started (the PKI files, the listen addresses),
    then waits for the shuffler's port file, then opens state and binds."""
    _simulate(args, role)
    if args.service == "fleet":
        return _start_fleet(args)
    if args.service == "client" and (args.num_nodes < 1 or not 0 <= args.node_index < args.num_nodes):
        raise SystemExit(
            f"--node-index must be in [0, --num-nodes) and --num-nodes >= 1, got {args.node_index} of {args.num_nodes}"
        )
    server_creds, channel_creds, interceptors = _security(args, role)
    _check_listen(args, role)
    _check_metrics(args, role)
    if args.service == "client":
        _require_config(args, role)
    if args.service == "analyzer":
        from shuffledp.services.analyzer import start_analyzer

        args.shuffler = _shuffler_address(args)
        args.state_dir.mkdir(parents=True, exist_ok=True)
        server, port = start_analyzer(
            args.listen, args.shuffler, args.state_dir, server_creds, channel_creds, interceptors, _signer(args, role)
        )
        return (
            port,
            lambda: server.stop(grace=5).wait(),
            lambda: _registry("analyzer_registry", server.manager),
            lambda: server.manager.cancel_running(PARENT_GONE),  # nobody drives them now: no further round
        )
    if args.service == "shuffler":
        from shuffledp.services.shuffler import DEFAULT_MAX_NODES, start_shuffler
        from shuffledp.transport import tls

        max_nodes = DEFAULT_MAX_NODES if args.max_nodes is None else args.max_nodes
        if max_nodes < 1:
            raise SystemExit(f"shuffledp serve {role}: --max-nodes must be >= 1, got {max_nodes}")
        args.state_dir.mkdir(parents=True, exist_ok=True)
        # with --pki: the CA's revocation list (pki.CRL_FILE), checked as each call opens
        try:
            revocations = None if args.pki is None else tls.RevocationList(args.pki)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"shuffledp serve {role}: {exc}") from exc
        server, port = start_shuffler(
            args.listen,
            args.state_dir / "shuffler.sqlite",
            server_creds,
            [i.aio() for i in interceptors],  # its server is a grpc.aio one
            revocations=revocations,
            max_nodes=max_nodes,
        )

        def registry():
            return _registry("shuffler_registry", server.shuffler_state, server.call_limits)

        return port, lambda: server.stop(grace=5).wait(), registry, _nothing
    from shuffledp.clients.node import start_node
    from shuffledp.transport.spec_signing import SpecVerifier

    config = _node_config(args, role)
    args.shuffler = _shuffler_address(args)
    handle = start_node(
        _party_name(args, role),
        config,
        args.node_index,
        args.num_nodes,
        args.shuffler,
        args.listen,
        channel_creds,
        server_creds,
        interceptors=interceptors,
        state_dir=args.state_dir,  # the users' spend (clients/spend_store.py)
        spec_verifier=None if args.pki is None else SpecVerifier.from_pki(args.pki),  # _security checked the CA
    )
    return handle.port, handle.stop, lambda: _registry("node_registry", handle), _nothing


def _nothing() -> None:
    return None


def _require_config(args: argparse.Namespace, role: str) -> None:
    if args.config is None:  # else it would serve the embedded default's data
        raise SystemExit(
            f"shuffledp serve {role}: give --config CONFIG.toml: the run's configuration, whose [data] section holds "
            "this node's users"
        )


def _node_config(args: argparse.Namespace, role: str):
    """The run configuration a client node or a fleet computes with; its model plug-in, if any, must be installed
    here (loaded from what is installed, before any state)."""
    from shuffledp.config import ConfigError, load_config

    config = load_config(args.config)
    if config.model.module:
        from shuffledp.models.plugin import load_factory

        try:
            load_factory(config.model.module)  # importable and a marked factory (built once the data is loaded)
        except ConfigError as exc:
            raise SystemExit(f"shuffledp serve {role}: {args.config}: {exc}") from exc
    return config


def _start_fleet(
    args: argparse.Namespace,
) -> tuple[int, Callable[[], object], Callable[[], object], Callable[[], object]]:
    """`serve fleet`: device nodes --first-index .. + --count - 1 of --num-nodes on one event loop
    (clients/device.py), each with its own certificate client-<i> from --pki and its user's spend in --state-dir. It
    serves nothing: the port file gets 0 once the devices have started."""
    from shuffledp.clients.device import start_fleet

    role, first, count = "fleet", args.first_index, args.count
    if args.num_nodes < 1 or count < 1 or first < 0 or first + count > args.num_nodes:
        raise SystemExit(
            f"shuffledp serve {role}: --first-index and --count must name nodes in [0, --num-nodes), got "
            f"{first}..{first + count - 1} of {args.num_nodes}"
        )
    if args.workers < 1:
        raise SystemExit(f"shuffledp serve {role}: --workers must be >= 1, got {args.workers}")
    if args.metrics_port:
        raise SystemExit(f"shuffledp serve {role}: --metrics-port: a fleet serves no metrics")
    if args.pki is None:
        _security(args, role)  # --insecure: the plain-text checks (or the line asking for --pki)
    _require_config(args, role)
    config = _node_config(args, role)
    args.shuffler = _shuffler_address(args)
    try:
        fleet = start_fleet(
            config,
            first,
            count,
            args.num_nodes,
            args.shuffler,
            pki_dir=args.pki,
            state_dir=args.state_dir,
            workers=args.workers,
        )
    except (OSError, ValueError) as exc:  # a device's PKI files (pki.load_party), a node hosting other than one user
        raise SystemExit(f"shuffledp serve {role}: {exc}") from exc
    log.info("fleet: devices %d..%d of %d started", first, first + count - 1, args.num_nodes)
    return 0, fleet.stop, _nothing, _nothing


def _watch_parent(fd: int, gone: threading.Event, stop: threading.Event) -> None:
    """Block until `fd` reaches end of file (every copy of the pipe's write end closed: the parent ended, also by
    SIGKILL or the OOM killer, which no signal handler of the parent sees), then stop the service; exit at the latest
    PARENT_GONE_EXIT_S later. A pipe, not prctl(PR_SET_PDEATHSIG): portable, and tied to the parent process, not to
    the thread that started this one."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError as exc:
        log.warning("--parent-fd %d: %s", fd, exc)
    log.warning("the parent process is gone (--parent-fd %d closed): stopping", fd)
    gone.set()
    stop.set()
    time.sleep(PARENT_GONE_EXIT_S)
    log.error("not stopped %.0f s after the parent was gone: exiting", PARENT_GONE_EXIT_S)
    os._exit(1)


def _registry(maker: str, *targets: object):
    from shuffledp.observability import metrics

    return getattr(metrics, maker)(*targets)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return_large_blocks()
    blas_threads = one_blas_thread()  # before the service's own imports and data
    stop = threading.Event()
    interrupted = threading.Event()  # Ctrl-C (SIGINT), not a stop asked for by SIGTERM (docker stop)

    def on_signal(signum: int, _frame: object) -> None:
        if signum == signal.SIGINT:
            interrupted.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    role = {"analyzer": "analyzer", "shuffler": "shuffler", "client": "client-node", "fleet": "fleet"}[args.service]
    gone = threading.Event()
    if args.parent_fd is not None:  # watched from the start: a parent gone during start-up stops the service too
        threading.Thread(target=_watch_parent, args=(args.parent_fd, gone, stop), daemon=True).start()
    try:
        port, stopper, registry, abandon = _start(args, role)
    except grpc_options.BindError as exc:
        # the address was taken between the check and the bind: gRPC refuses it too (no SO_REUSEPORT)
        raise SystemExit(f"shuffledp serve {role}: {exc}") from exc
    metrics_server = None
    if args.metrics_port:
        from shuffledp.observability.metrics import metrics_host, serve_metrics

        try:
            metrics_server, mport = serve_metrics(registry(), metrics_host(args.listen), args.metrics_port)
        except OSError as exc:  # taken since the check
            stopper()
            raise SystemExit(
                f"shuffledp serve {role}: metrics: cannot listen on port {args.metrics_port}: {exc}"
            ) from exc
        log.info("%s metrics (Prometheus, plain HTTP) on port %d", args.service, mport)

    if args.port_file:
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)  # atomic: readers never see a partial file
    log.info("%s serving on port %d", args.service, port)
    log.info("BLAS threads: %s", blas_threads)  # logged once started: a refused start prints one line only
    stop.wait()
    if gone.is_set():
        abandon()
    log.info("%s stopping", args.service)
    if metrics_server is not None:
        metrics_server.shutdown()
    stopper()
    if interrupted.is_set():  # the CLI's convention (shuffledp/cli/__init__.py): one line, status 130
        print(f"shuffledp serve {role}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    return 0
