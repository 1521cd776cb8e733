"""Shared helper of the multi-process tests: start one `shuffledp serve ...` as an OS process and wait for its port."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

STARTUP_S = 60.0


def serve(workdir: Path, name: str, argv: list[str], program: list[str] | None = None) -> tuple[subprocess.Popen, int]:
    """`shuffledp serve ARGV --port-file ...` (give --insecure or --pki in argv); returns (process, bound port).
    `program` instead of `python -m shuffledp.cli serve`: a test's own wrapper of a service (e.g. a dishonest
    shuffler script taking `serve shuffler`'s arguments). The log is workdir/<name>.log (appended, so a restarted
    service keeps one log)."""
    port_file = workdir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 (the process owns it)
    program = program or [sys.executable, "-m", "shuffledp.cli", "serve"]
    cmd = [*program, *argv, "--port-file", str(port_file)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    end = time.monotonic() + STARTUP_S
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise RuntimeError(f"{name} did not start:\n{log_text(workdir, name)[-3000:]}")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def log_text(workdir: Path, name: str) -> str:
    path = workdir / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def write_blobs(path: Path, n: int = 300, seed: int = 2024) -> str:
    """Two Gaussian blobs in R^3 (labels 0/1), n examples; returns the [data] section for it (d = 8 for logreg)."""
    rng = make_rng(seed)
    y = np.arange(n) % 2
    X = rng.normal(size=(n, 3)) * 0.5 + np.where(y[:, None] == 1, 0.6, -0.6)
    np.savez(path, X=X, y=y)
    return f'[data]\ndataset = "path"\npath = "{path}"\n'


def wait_connected(shuffler: str, nodes: int, timeout: float = 60.0) -> None:
    """Until the shuffler itself counts `nodes` connected nodes (each registered its users before connecting): a
    node's own view that it is connected, or a ghost's open stream, is not yet the shuffler's."""
    with grpc.insecure_channel(shuffler) as channel:
        stub, end = pbg.ShufflerStub(channel), time.monotonic() + timeout
        while (pop := stub.GetPopulation(pb.PopulationRequest(), timeout=10)).connected_nodes < nodes:
            assert time.monotonic() < end, f"the shuffler counts {pop.connected_nodes} of {nodes} nodes connected"
            time.sleep(0.05)


class GhostNode:
    """A node that registers users and subscribes but never answers: rounds then last until their deadline."""

    def __init__(self, shuffler: str, users: int):
        self.channel = grpc.insecure_channel(shuffler)
        stub = pbg.ShufflerStub(self.channel)
        stub.RegisterUsers(pb.RegisterUsersRequest(node_id="ghost", user_ids=[f"g-u{i}" for i in range(users)]))
        self.stream = stub.Subscribe(pb.SubscribeRequest(node_id="ghost"))
        self.pool = futures.ThreadPoolExecutor(1)
        self.pool.submit(lambda: [None for _ in self.stream])

    def close(self) -> None:
        self.stream.cancel()
        self.pool.shutdown(wait=False)
        self.channel.close()


class CheckInGhost:
    """A node whose users check in (payload-free answers to a check-in invitation) and then never send: dropouts
    after check-in (mechanisms/check_in.py). Keeps every RoundSpec it was sent."""

    def __init__(self, shuffler: str, users: int):
        self.channel = grpc.insecure_channel(shuffler)
        self.stub = pbg.ShufflerStub(self.channel)
        self.stub.RegisterUsers(pb.RegisterUsersRequest(node_id="ci-ghost", user_ids=[f"c-u{i}" for i in range(users)]))
        self.stream = self.stub.Subscribe(pb.SubscribeRequest(node_id="ci-ghost"))
        self.specs: list[pb.RoundSpec] = []

        def pump() -> None:
            try:
                for inv in self.stream:
                    self.specs.append(inv.spec)
                    if inv.spec.check_in.noise_trials and not inv.spec.check_in.checked_in:
                        c = pb.Contribution(run_id=inv.spec.run_id, round=inv.spec.round, node_id="ci-ghost")
                        for u in inv.user_ids:
                            c.messages.add(user_id=u, nonce=secrets.token_bytes(16))
                        self.stub.Submit(c, timeout=10)
            except grpc.RpcError:
                pass  # closed at the end of the test

        self.thread = threading.Thread(target=pump, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()
