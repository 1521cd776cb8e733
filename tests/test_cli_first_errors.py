"""What a new user's first mistakes get from the CLI (issue 43 items 16 and 19): one clear line, soon, and nothing
left behind that makes the next try fail. Real processes and sockets."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)


def _cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", *argv], capture_output=True, text=True, timeout=timeout
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("out_exists", [False, True])
@pytest.mark.parametrize("fetch", [False, True])
def test_an_analyzer_where_nothing_listens_is_one_line_within_seconds_and_out_stays_as_it_was(
    tmp_path, out_exists, fetch
):
    out = tmp_path / "out"
    if out_exists:
        out.mkdir()
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    started = time.monotonic()
    proc = _cli("run", "--analyzer", address, "--out", str(out), "--quiet", *(["--fetch", "abc"] if fetch else []))
    took = time.monotonic() - started
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert took < 30, took  # the first contact is tried for 10 s, not the 120 s a run's calls are retried
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("shuffledp run:")]
    assert len(lines) == 1 and lines[0].startswith(f"shuffledp run: cannot reach the analyzer at {address} ("), lines
    assert "for 10 s; no run was created" in lines[0], lines
    # absent or empty as before: the next try (at the right address) is not refused for a used --out
    assert out.exists() == out_exists and (not out_exists or not any(out.iterdir()))
