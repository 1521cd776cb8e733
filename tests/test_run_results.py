"""What `shuffledp run` leaves behind (issue 24 B12, C15), over real processes: a run stopped by Ctrl-C writes what
exists and prints the eps spent; summary.json holds the released model's figures, the plan and the spend; model.npz
carries its layout; no NaN is printed as a test accuracy; the plot of a hidden-iterate run is not empty."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _runs import run_cli

from shuffledp.cli.run import _plot
from shuffledp.config import parse_config
from shuffledp.data import load_dataset

pytestmark = pytest.mark.timeout(240)


def _lines(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_writes_what_exists_and_prints_the_spend(tmp_path: Path, how: str):
    """A terminal's Ctrl-C goes to the whole foreground process group: the CLI and, before, every service it had
    started, which stopped at once and took the results with them. A SIGTERM of the CLI alone (a `kill`, a closed
    terminal's SIGHUP likewise) does the same instead of leaving the services running."""
    cfg = tmp_path / "long.toml"
    cfg.write_text("[schedule]\nrounds = 300\n")  # digits, about 0.15 s a round: far from its end after 3 rounds
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shuffledp.cli", "run", str(cfg), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own process group, as a shell's foreground job
        # as a terminal's job gets it: a test run started in the background by a non-interactive shell (`... &`)
        # has SIGINT ignored, which every child would inherit, and no Ctrl-C would reach the CLI
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    shown, deadline = [], time.monotonic() + 120
    try:
        while sum(line.startswith("round ") for line in shown) < 3:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "".join(shown) + proc.stderr.read()
            shown.append(line)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:  # whatever is left in the group (services of a CLI that did not stop them)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = proc.stderr.read()
    while (line := lines.get(timeout=5)) is not None:
        shown.append(line)
    stdout = "".join(shown)
    assert proc.returncode == 130, stdout + stderr
    ledger = json.loads((out / "ledger.json").read_text())
    rows = json.loads((out / "metrics.json").read_text())
    assert (out / "metrics.csv").is_file() and (out / "plot.png").is_file() and (out / "model.npz").is_file()
    assert 3 <= len(rows) < 300
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["state"] == "CANCELLED"
    eps = ledger["totals"]["eps_spent"]
    assert eps > 0 and f"privacy spent: eps = {eps:.4f}" in stdout, stdout
    assert "stopped by Ctrl-C" in stderr and "Traceback" not in stderr, stderr
    for name in ("shuffler", "analyzer", "client-0", "client-1"):  # every service stopped, by the CLI
        assert "stopping" in (out / "logs" / f"{name}.log").read_text(), name


def test_summary_and_model_layout_of_a_completed_run(tmp_path: Path):
    toml = "[schedule]\nrounds = 3\n[data]\nclasses = [8, 3, 5]\n"
    _, rows, stdout = run_cli(tmp_path, "small", toml)
    out = tmp_path / "small"
    summary = json.loads((out / "summary.json").read_text())
    model = summary["released_model"]
    assert summary["state"] == "COMPLETED" and summary["spend"]["eps"] == pytest.approx(rows[-1]["eps_spent"])
    assert summary["plan"]["rounds"] == 3 and summary["plan"]["protocol_params"]["m"] > 0  # PVEC's noise size
    assert f"test accuracy: {model['accuracy']:.4f}" in stdout
    with np.load(out / "model.npz") as npz:
        layout = json.loads(str(npz["layout"]))
        assert layout["task"] == "logreg" and layout["class_labels"] == [8, 3, 5]
        W = npz["W"]
        assert W.shape == (3, 65) and np.array_equal(W.ravel(), npz["params"])
    # the docs' recipe: scores = W @ [x, 1], class index -> label; it reproduces the reported test accuracy
    ds = load_dataset(parse_config(toml).data)
    pred = np.argmax(np.c_[ds.X_test, np.ones(len(ds.X_test))] @ W.T, axis=1)
    assert np.mean(pred == ds.y_test) == pytest.approx(model["accuracy"], abs=1e-12)


def test_a_regression_run_prints_no_nan_accuracy(tmp_path: Path):
    toml = '[data]\ndataset = "synthetic"\nn = 2000\ndim = 3\n[model]\ntask = "leastsq"\n[schedule]\nrounds = 2\n'
    _, _, stdout = run_cli(tmp_path, "lsq", toml, quiet=False)
    assert "nan" not in stdout.lower(), stdout
    assert "accuracy    n/a" in stdout  # the progress lines too
    assert "test accuracy: not evaluated (the targets are not integer labels" in stdout
    summary = json.loads((tmp_path / "lsq" / "summary.json").read_text())
    assert summary["released_model"]["accuracy"] is None and summary["released_model"]["excess_risk"] is not None


def test_the_plot_of_hidden_iterates_says_so_and_shows_the_released_model(tmp_path: Path):
    rows = [{"round": 1, "released": True, "loss": float("nan"), "accuracy": float("nan"), "eps_spent": 1.1}]
    summary = {
        "plan": {"protocol": "pnsgd"},
        "released_model": {"loss": 0.61, "accuracy": 0.7, "excess_risk": 0.02},
    }
    drawn = _plot(tmp_path / "plot.png", rows, summary)
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert any("iterates are hidden" in t and "loss 0.61" in t for t in drawn["notes"]), drawn
    assert {"loss", "excess_risk", "accuracy", "eps_spent"} <= set(drawn["panels"])
