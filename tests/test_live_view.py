"""The live terminal view of `shuffledp run` (issue 29 item 4), over real local processes: on a terminal (a pty) a
status line redrawn in place shows the rounds with a bar and ETA and the eps spent against the limit, below the same
per-round lines as before; on a pipe the output is today's lines only, without control sequences; --quiet prints
only the summary either way."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _runs import digits_pgd

from shuffledp.observability.live import status_line

pytestmark = pytest.mark.timeout(300)

ROUNDS = 4
CONFIG = digits_pgd(ROUNDS)
STATUS = re.compile(r"rounds \[[#.]{20}\] (\d+)/(\d+|\?)  ETA (\d+:\d\d|--:--)  eps (\d+\.\d{3})/8 \[[#.]{10}\]")
ROUND_LINE = re.compile(r"^round +(\d+)/4  contributors", re.M)


def _cmd(tmp_path: Path, name: str, *extra: str) -> list[str]:
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG)
    return [sys.executable, "-m", "shuffledp.cli", "run", str(cfg), "--out", str(tmp_path / name), *extra]


def _run_on_pty(cmd: list[str]) -> tuple[int, str]:
    """Run with stdout on a pseudo-terminal (stderr too: a person's terminal); (exit status, all it printed)."""
    main, sub = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=sub, stderr=sub, stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "120"})
    os.close(sub)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    return proc.wait(timeout=240), b"".join(chunks).decode(errors="replace")


def test_on_a_terminal_a_status_line_shows_rounds_eta_and_eps_against_the_limit(tmp_path):
    code, text = _run_on_pty(_cmd(tmp_path, "tty"))
    assert code == 0, text
    rows = json.loads((tmp_path / "tty" / "metrics.json").read_text())
    # today's per-round lines are all there
    assert [int(n) for n in ROUND_LINE.findall(text.replace("\r\x1b[2K", "\n"))] == list(range(1, ROUNDS + 1))
    drawn = STATUS.findall(text)
    assert "\r\x1b[2K" in text and drawn, text
    # the status line followed the run: rounds done never go back, an ETA once a round ended, and its last state
    # is every round with the eps metrics.json ends with
    done = [int(d) for d, planned, _, _ in drawn if planned != "?"]
    assert done == sorted(done) and done[-1] == ROUNDS
    assert any(eta != "--:--" for _, _, eta, _ in drawn)
    assert drawn[-1][3] == f"{rows[-1]['eps_spent']:.3f}"
    # the summary follows the erased status line
    assert re.search(r"\r\x1b\[2K(state: COMPLETED|\r?\n)", text) and "privacy spent: eps = " in text


def test_not_a_terminal_prints_todays_lines_only(tmp_path):
    proc = subprocess.run(_cmd(tmp_path, "pipe"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\x1b" not in proc.stdout and "\r" not in proc.stdout and not STATUS.search(proc.stdout)
    assert [int(n) for n in ROUND_LINE.findall(proc.stdout)] == list(range(1, ROUNDS + 1))


def test_quiet_prints_only_the_summary_on_a_terminal_too(tmp_path):
    code, text = _run_on_pty(_cmd(tmp_path, "quiet", "--quiet"))
    assert code == 0, text
    assert "\x1b" not in text and not STATUS.search(text) and not ROUND_LINE.search(text)
    assert "privacy spent: eps = " in text


def test_status_line_layout():
    assert status_line(3, 10, 2.5, 8.0, 42.4) == (
        "rounds [######..............] 3/10  ETA 0:42  eps 2.500/8 [###.......]"
    )
    assert status_line(0, 0, 0.0, 0.0, None) == "rounds [....................] 0/?  ETA --:--  eps 0.000/0 [..........]"
    assert status_line(10, 10, 8.0, 8.0, 3725.0, width=40) == "rounds [####################] 10/10  ETA"[:40]
