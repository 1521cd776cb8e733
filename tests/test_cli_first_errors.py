"""What a new user's first mistakes get from the CLI (issue 43 items 16 and 19): one clear line, soon, and nothing
left behind that makes the next try fail; every mistake of a configuration at once. Real processes and sockets."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from shuffledp.config import ConfigError, parse_config

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
    outcome = "run abc was not fetched; try again later" if fetch else "no run was created"
    assert lines[0].endswith(f"for 10 s; {outcome}"), lines
    # absent or empty as before: the next try (at the right address) is not refused for a used --out
    assert out.exists() == out_exists and (not out_exists or not any(out.iterdir()))


def _errors(proc: subprocess.CompletedProcess, prefix: str = "shuffledp run:") -> list[str]:
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith(prefix)]


def test_a_model_factory_that_raises_is_one_line(tmp_path):
    (tmp_path / "brokenmodel.py").write_text(
        "from shuffledp.models import model_factory\n\n\n"
        "@model_factory\ndef broken(num_features, num_classes):\n    raise RuntimeError('no GPU here')\n"
    )
    config = tmp_path / "run.toml"
    config.write_text('[model]\nmodule = "brokenmodel:broken"\n[schedule]\nlearning_rate = 1.0\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SHUFFLEDP_MODEL_PLUGINS": "brokenmodel:broken"}
    proc = subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", "run", str(config), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert _errors(proc) == [
        f"shuffledp run: {config}: model.module = 'brokenmodel:broken': its factory raised RuntimeError: no GPU here"
    ]
    assert not (tmp_path / "out").exists()


def test_a_directory_given_as_the_configuration_is_said_to_be_one(tmp_path):
    proc = _cli("run", str(tmp_path))
    assert proc.returncode == 2
    assert _errors(proc) == [
        f"shuffledp run: '{tmp_path}' is a directory: give the configuration file (a .toml file) in it"
    ]


def test_serve_client_without_a_configuration_is_one_line(tmp_path):
    proc = _cli("serve", "client", "--insecure", "--state-dir", str(tmp_path / "state"), timeout=30)
    assert proc.returncode != 0
    assert _errors(proc, "shuffledp serve") == [
        "shuffledp serve client-node: give --config CONFIG.toml: the run's configuration, whose [data] section holds "
        "this node's users"
    ]
    assert not (tmp_path / "state").exists()


def test_ctrl_c_of_a_service_exits_130_with_one_line(tmp_path):
    port_file = tmp_path / "shuffler.port"
    cmd = [sys.executable, "-m", "shuffledp.cli", "serve", "shuffler", "--insecure", "--port-file", str(port_file)]
    proc = subprocess.Popen([*cmd, "--state-dir", str(tmp_path / "state")], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the shuffler did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert [line for line in err.splitlines() if line.startswith("shuffledp")] == [
        "shuffledp serve shuffler: interrupted (Ctrl-C)"
    ]


def _data_config(tmp_path, csv_text: str, task: str = "logreg") -> str:
    (tmp_path / "data.csv").write_text(csv_text)
    config = tmp_path / "run.toml"
    config.write_text(f'[data]\ndataset = "path"\npath = "{tmp_path / "data.csv"}"\n[model]\ntask = "{task}"\n')
    return str(config)


@pytest.mark.parametrize("text", ["", "x1,x2,label\n"])
def test_a_csv_without_data_rows_is_one_line_and_no_numpy_warning(tmp_path, text):
    config = _data_config(tmp_path, text)
    proc = _cli("run", config, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert _errors(proc) == [
        f"shuffledp run: {config}: data: {tmp_path / 'data.csv'}: no data rows (the file is empty or holds a header "
        "line only)"
    ]


def test_a_data_error_names_its_section_once(tmp_path):
    config = _data_config(tmp_path, "".join(f"{i % 3},{i % 2},{i % 3}\n" for i in range(30)), task="hinge")
    proc = _cli("run", config, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert _errors(proc) == [f"shuffledp run: {config}: data: hinge needs two classes (set data.classes), got 3"]


BAD = """
[data]
test_fraction = 2.0
examples_per_user = 0
[model]
radiuss = 3
[privacy]
eps = 100
[privacy.pvec]
foo = 1
[schedule]
kind = "fully_interactiv"
[deployment]
client_nodes = "2"
"""


def test_every_mistake_of_a_configuration_is_reported_at_once(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text(BAD)
    proc = _cli("run", str(config), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    # each in the words it had alone
    assert proc.stderr.splitlines() == [
        f"shuffledp run: {config}: 7 errors:",
        "  unknown key model.radiuss; allowed: args, hidden, l2, module, radius, smoothing, smoothness, task",
        "  data.test_fraction must lie in (0.0, 0.9], got 2.0",
        "  data.examples_per_user must lie in [1, 10000], got 0",
        "  privacy.eps must lie in (0.0, 64.0], got 100.0",
        "  unknown key privacy.pvec.foo; allowed: aggregation, calibration, check_in, prio3_vdaf, report_fraction, "
        "round_eps",
        "  schedule.kind must be one of 'sequential', 'fully_interactive', 'subsampled', got 'fully_interactiv'",
        "  deployment.client_nodes must be an integer, got '2'",
    ]
    assert not (tmp_path / "out").exists()


def test_a_wrong_value_does_not_hide_the_combination_it_stands_in_for():
    # a key left out for its wrong value takes its default: a combination error that default may cause is not
    # reported (data.n applies to the synthetic data set that data.dataset misspelt)
    with pytest.raises(ConfigError) as caught:
        parse_config('[data]\ndataset = "synthtic"\nn = 500\n[privacy]\neps = -1\n')
    assert caught.value.errors == [
        "data.dataset must be one of 'digits', 'mnist5k', 'path', 'synthetic', got 'synthtic'",
        "privacy.eps must lie in (0.0, 64.0], got -1.0",
    ]
    # one mistake: its message as it always was
    with pytest.raises(ConfigError) as caught:
        parse_config("[privacy]\neps = -1\n")
    assert str(caught.value) == "privacy.eps must lie in (0.0, 64.0], got -1.0"
