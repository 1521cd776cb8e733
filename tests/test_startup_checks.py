"""Issue 24 items 6 and 11: a service refuses an address in use, and PKI mistakes are one line before anything starts.

Over real processes (`shuffledp serve ...`, `shuffledp run ...` in subprocesses) where the defect is in the services;
the bind of each server (shuffler, analyzer, client node) is also tried in-process past the CLI's early check, since
gRPC's SO_REUSEPORT default is what let a second server share an address.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from _procs import log_text, serve, stop
from shuffledp.clients.node import UserShard, start_node_with_shard
from shuffledp.services.analyzer import start_analyzer
from shuffledp.services.shuffler import start_shuffler

from shuffledp.cli.serve import BLAS_THREAD_VARS
from shuffledp.security import pki
from shuffledp.transport import grpc_options, health

QUICK_S = 10.0  # a PKI mistake used to take ~34 s and end in "shuffler exited during start-up"


def _cli(argv: list[str], cwd: Path, timeout: float = 30.0) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ.copy(),
    )
    return proc, time.monotonic() - started


def _lines(stderr: str, prefix: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(prefix)]


# --- item 6: an address in use is refused -------------------------------------------------------------------------


@pytest.fixture
def running_shuffler(tmp_path: Path):
    proc, port = serve(tmp_path, "first", ["shuffler", "--insecure", "--state-dir", str(tmp_path / "first-state")])
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.mark.parametrize("service", ["shuffler", "analyzer", "client"])
def test_a_second_service_on_a_running_shufflers_address_exits_with_one_line(service, running_shuffler, tmp_path):
    address = running_shuffler
    state = tmp_path / "second-state"
    argv = ["serve", service, "--insecure", "--listen", address, "--state-dir", str(state)]
    if service != "shuffler":
        argv += ["--shuffler", address]
    # old code: the second process bound the same address (SO_REUSEPORT) and served on: the timeout expired
    proc, _ = _cli(argv, tmp_path, timeout=30.0)
    role = {"client": "client-node"}.get(service, service)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert _lines(proc.stderr, "shuffledp serve") == [
        f"shuffledp serve {role}: cannot listen on {address}: "
        "the address is already in use (is this service already running?)"
    ], proc.stderr
    assert not state.exists()  # refused before its state was opened
    # the first one still serves, alone
    assert health.check(address, insecure=True) == "SERVING"
    assert health.check(address, service="shuffledp.v1.Shuffler", insecure=True) == "SERVING"


def test_every_server_refuses_a_bound_address_past_the_cli_check(tmp_path):
    """The CLI's early check can lose a race: gRPC itself must then refuse, which it did not with SO_REUSEPORT."""
    first, port = start_shuffler("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    try:
        with pytest.raises(grpc_options.BindError, match=f"cannot listen on {address}: the address is already in use"):
            server, _ = start_shuffler(address)
            server.stop(None)
        with pytest.raises(grpc_options.BindError, match=f"cannot listen on {address}"):
            server, _ = start_analyzer(address, address, tmp_path / "analyzer")
            server.stop(None)
        rng = np.random.default_rng(0)
        shard = UserShard(["u0", "u1"], rng.normal(size=(2, 1, 3)), rng.normal(size=(2, 1)))
        with pytest.raises(grpc_options.BindError, match=f"cannot listen on {address}"):
            start_node_with_shard("client-0", shard, address, listen=address).stop()
        assert health.check(address, insecure=True) == "SERVING"
    finally:
        first.stop(None)


def test_check_address_free_names_the_address(tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(grpc_options.BindError, match=f"^cannot listen on {address}: the address is already in use"):
            grpc_options.check_address_free(address)
    grpc_options.check_address_free(address)  # free again once closed
    grpc_options.check_address_free("127.0.0.1:0")  # any free port: nothing to check
    grpc_options.check_address_free("127.0.0.1:x")  # not "in use": left to gRPC, whose failure bind_server words
    with pytest.raises(grpc_options.BindError, match="^cannot listen on 192.0.2.1:50051: Cannot assign requested"):
        grpc_options.bind_server(grpc.server(futures.ThreadPoolExecutor(1)), "192.0.2.1:50051")  # not this host's


# --- item 11: PKI mistakes are one line, before anything starts -----------------------------------------------------


def _break(kind: str, tmp_path: Path) -> tuple[Path, str]:
    """A PKI folder with one mistake, and what the error line must say."""
    d = tmp_path / "pki"
    if kind == "missing":
        return d, f"PKI folder {d} does not exist"
    if kind == "empty":
        d.mkdir()
        return d, f"PKI folder {d} is empty"
    if kind == "file":
        d.write_text("not a folder\n")
        return d, f"PKI folder {d} is a file"
    pki.init_pki(d, client_nodes=1)  # the run below needs two client nodes
    if kind == "too_few_nodes":
        return d, f"{d / 'client-1' / 'cert.pem'} not found: {d} has certificates for 1 client node(s), 2 or more"
    key = pki.party_paths(d, "shuffler")[1]
    if kind == "corrupt_key":
        key.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot base64 at all\n-----END PRIVATE KEY-----\n")
        return d, f"{key} is not an unencrypted PEM private key"
    if kind == "empty_key":
        key.write_bytes(b"")
        return d, f"{key} is not an unencrypted PEM private key"
    if kind == "other_key":
        shutil.copyfile(pki.party_paths(d, "analyzer")[1], key)
        return d, f"{key} is not the key of {pki.party_paths(d, 'shuffler')[0]}"
    if kind == "corrupt_ca":
        (d / pki.CA_CERT_FILE).write_text("garbage\n")
        return d, f"{d / pki.CA_CERT_FILE} is not a PEM certificate"
    if kind == "other_ca":
        pki.init_pki(tmp_path / "other", client_nodes=1)
        shutil.copyfile(tmp_path / "other" / pki.CA_CERT_FILE, d / pki.CA_CERT_FILE)
        return d, f"{pki.party_paths(d, 'analyzer')[0]} is not signed by {d / pki.CA_CERT_FILE}"
    raise AssertionError(kind)


KINDS = ["missing", "empty", "file", "too_few_nodes", "corrupt_key", "empty_key", "other_key", "corrupt_ca", "other_ca"]


@pytest.mark.parametrize("kind", KINDS)
def test_run_names_the_pki_mistake_in_one_line_before_starting_anything(kind, tmp_path):
    pki_dir, expected = _break(kind, tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(f'[deployment]\nclient_nodes = 2\ninsecure = false\npki_dir = "{pki_dir}"\n')
    out = tmp_path / "results"
    proc, took = _cli(["run", str(config), "--out", str(out)], tmp_path, timeout=60.0)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = _lines(proc.stderr, "shuffledp run:")
    assert len(errors) == 1 and expected in errors[0], proc.stderr
    assert errors[0].startswith(f"shuffledp run: {config}: deployment.pki_dir: ")
    assert not out.exists()  # nothing started, nothing written
    assert took < QUICK_S, f"{took:.1f} s"


@pytest.mark.parametrize("kind", ["missing", "file", "corrupt_key", "other_key"])
def test_serve_names_the_pki_mistake_in_one_line(kind, tmp_path):
    pki_dir, expected = _break(kind, tmp_path)
    state = tmp_path / "state"
    argv = ["serve", "shuffler", "--pki", str(pki_dir), "--listen", "127.0.0.1:0", "--state-dir", str(state)]
    proc, took = _cli(argv, tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = _lines(proc.stderr, "shuffledp serve")
    assert len(errors) == 1 and errors[0].startswith("shuffledp serve shuffler: ") and expected in errors[0], (
        proc.stderr
    )
    assert not state.exists()
    assert took < QUICK_S, f"{took:.1f} s"


def test_a_client_node_without_its_certificate_says_which_and_how_many_exist(tmp_path):
    pki.init_pki(tmp_path / "pki", client_nodes=2)
    with pytest.raises(FileNotFoundError, match=r"client-4/cert.pem not found: .* 2 client node\(s\), 5 or more"):
        pki.load_party(tmp_path / "pki", pki.ROLE_CLIENT_NODE, "client-4")
    pki.check_local_run(tmp_path / "pki", 2)  # a complete PKI passes


def test_the_pki_advice_of_a_local_run_names_every_node_it_needs_and_following_it_works(tmp_path):
    """Issue 43 item 15: a run of 4 client nodes over a PKI of 2 was told `--client-nodes 3` (the first node missing),
    and following that advice failed again. The advice names the run's 4, and running it makes the check pass."""
    d = tmp_path / "pki"
    with pytest.raises(
        FileNotFoundError, match=f"does not exist: create it with `shuffledp pki init --out {d} --client-nodes 4`"
    ):
        pki.check_local_run(d, 4)
    pki.init_pki(d, client_nodes=2)
    with pytest.raises(FileNotFoundError) as caught:
        pki.check_local_run(d, 4)
    assert "2 client node(s), 4 or more are needed" in str(caught.value), caught.value
    advice = str(caught.value).split("`")[1].split()  # shuffledp pki init --out DIR --client-nodes N --force
    assert advice[:3] == ["shuffledp", "pki", "init"] and advice[advice.index("--client-nodes") + 1] == "4"
    proc, _ = _cli(advice[1:], tmp_path)
    assert proc.returncode == 0, proc.stderr
    pki.check_local_run(d, 4)  # the advice followed: the run's PKI is complete


@pytest.mark.parametrize("operator_set", [None, "2"])
def test_a_service_uses_one_blas_thread_unless_its_operator_sets_one(operator_set, tmp_path, monkeypatch):
    # OpenBLAS's default (a spin-waiting thread per core) in every service cost a client node at d = 10^4 ~3x the
    # CPU of its round and the round ~2.6x its time (serve.one_blas_thread). The log states what threadpoolctl reads
    # back from the loaded BLAS, not what was asked for.
    for var in BLAS_THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    if operator_set:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", operator_set)
    proc, _port = serve(tmp_path, "shuffler", ["shuffler", "--insecure", "--state-dir", str(tmp_path / "s")])
    stop(proc)
    lines = [line for line in log_text(tmp_path, "shuffler").splitlines() if "BLAS threads:" in line]
    assert len(lines) == 1 and lines[0].endswith(f"BLAS threads: {operator_set or 1}"), lines
