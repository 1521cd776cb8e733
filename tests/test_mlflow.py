"""MLflow tracking (issue 46 item 4): `shuffledp run` with `[tracking] mlflow = true`, or `--mlflow URI`, over real
local processes logs the run, and MLflow's own client (MlflowClient) reads it back from the offline store: the
configuration and the plan as params, every round of metrics.json as a metric history, the final spend of ledger.json,
the results directory's files as artifacts. A bad [tracking] value or a missing extra is one line before anything
starts; a store that fails at the end costs the run nothing but that line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _runs import digits_pgd

pytest.importorskip("mlflow", reason="the optional extra 'mlflow' (the dev extra has it)")
from mlflow.tracking import MlflowClient  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ROUNDS = 4
CONFIG = digits_pgd(ROUNDS)
RESULTS = {"config.toml", "ledger.json", "metrics.csv", "metrics.json", "model.npz", "plot.png", "summary.json"}


def _run(tmp_path: Path, config: str, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cfg = tmp_path / "run.toml"
    cfg.write_text(config)
    cmd = [sys.executable, "-m", "shuffledp.cli", "run", str(cfg), "--out", str(tmp_path / "exp1"), "--quiet", *extra]
    # cwd: a store's default locations (MLflow's ./mlruns) would be the test's, not the repository's
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


@pytest.fixture(scope="module")
def migrated_store(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, its schema made once (MLflow's migrations take seconds): copied per test."""
    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


def _store(tmp_path: Path, migrated: Path) -> str:
    db = tmp_path / "project.db"
    shutil.copyfile(migrated, db)
    return f"sqlite:///{db}"


def _mlflow_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "MLflow" in line or "mlflow" in line]


def _only_run(client: MlflowClient, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, experiment
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, runs
    return runs[0]


def test_mlflow_run_reads_back_with_params_every_round_and_the_results_as_artifacts(tmp_path):
    proc = _run(tmp_path, CONFIG + "\n[tracking]\nmlflow = true\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _mlflow_lines(proc) == [], proc.stderr  # MLflow's own INFO lines and warnings stay out of the output
    out = tmp_path / "exp1"
    rows = json.loads((out / "metrics.json").read_text())
    ledger = json.loads((out / "ledger.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))

    # the offline store of `mlflow = true`: in the results directory, read by MLflow's own client
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow' / 'mlflow.db'}")
    run = _only_run(client, "shuffledp")
    run_id = run.info.run_id
    assert run.info.run_name == "exp1" and run.info.status == "FINISHED"
    assert run.data.tags["shuffledp.run_id"] == summary["run_id"]
    assert run.data.tags["shuffledp.state"] == "COMPLETED" and run.data.tags["shuffledp.protocol"] == "pvec"

    params = run.data.params
    # the configuration, every key resolved (set, defaulted or unset), and the analyzer's plan
    assert params["privacy.eps"] == "8.0" and params["privacy.protocol"] == "pvec"
    assert params["schedule.rounds"] == str(ROUNDS) and params["schedule.kind"] == "fully_interactive"
    assert params["data.max_users"] == "60" and params["privacy.delta"] == "unset"
    assert params["privacy.pvec.calibration"] == "calibrated"  # the protocol's own table
    assert not any(k.startswith("tracking.") for k in params)
    plan = summary["plan"]
    assert params["plan.protocol"] == "pvec" and params["plan.optimizer"] == plan["optimizer"]
    assert float(params["plan.eps"]) == plan["eps"] and float(params["plan.delta"]) == plan["delta"]
    assert params["plan.rounds"] == str(ROUNDS)
    assert params["plan.protocol_params.g"] == str(plan["protocol_params"]["g"])
    assert params["spend.accountant"] == summary["spend"]["accountant"]

    # every round, once, at its step (metrics.json's round numbers), with metrics.json's values
    for key in ("loss", "accuracy", "eps_spent", "delta_spent", "contributors", "refused", "seconds"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert [step for step, _ in history] == [r["round"] for r in rows], key
        for (_, value), r in zip(history, rows, strict=True):
            assert value == pytest.approx(r[key], rel=1e-9, abs=1e-12), (key, r["round"])
    released = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "released"))
    assert released == [(r["round"], float(r["released"])) for r in rows]
    final = run.data.metrics
    assert final["final/eps_spent"] == pytest.approx(ledger["totals"]["eps_spent"], rel=1e-9)
    assert final["final/eps_limit"] == pytest.approx(ledger["totals"]["eps_limit"], rel=1e-9)
    assert final["final/accuracy"] == pytest.approx(summary["released_model"]["accuracy"], rel=1e-9)
    assert final["final/loss"] == pytest.approx(summary["released_model"]["loss"], rel=1e-9)

    # the results directory's files (not its logs, state nor this store) as artifacts, byte for byte
    assert {a.path for a in client.list_artifacts(run_id)} == RESULTS
    back = Path(client.download_artifacts(run_id, "model.npz", str(tmp_path / "back")))
    assert back.read_bytes() == (out / "model.npz").read_bytes()


def test_mlflow_flag_with_a_uri_logs_into_that_store_and_experiment_next_to_tensorboard(tmp_path, migrated_store):
    store = _store(tmp_path, migrated_store)
    config = CONFIG + '\n[tracking]\nexperiment = "digits-pgd"\n'  # mlflow left false: the flag turns it on
    proc = _run(tmp_path, config, "--mlflow", store, "--tensorboard", str(tmp_path / "tb"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "exp1"
    assert not (out / "mlflow").exists()  # the URI's store, not one in the results directory
    assert (tmp_path / "tb" / "exp1").is_dir()  # both trackers
    client = MlflowClient(tracking_uri=store)
    run = _only_run(client, "digits-pgd")
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "eps_spent"))
    assert steps == list(range(1, ROUNDS + 1))
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == RESULTS
    # beside the database, not in the working directory's ./mlruns
    assert run.info.artifact_uri.startswith((tmp_path / "artifacts").as_uri() + "/"), run.info.artifact_uri
    assert not (tmp_path / "mlruns").exists()


def test_a_store_that_fails_at_the_end_costs_one_line_and_not_the_results(tmp_path, migrated_store):
    # the experiment's artifacts go where nobody can write (/proc): the run's params and rounds are logged, its
    # artifacts fail at the end, after the results directory was written
    store = _store(tmp_path, migrated_store)
    MlflowClient(tracking_uri=store).create_experiment("broken", artifact_location="file:///proc/shuffledp-none")
    config = CONFIG + '\n[tracking]\nmlflow = "' + store + '"\nexperiment = "broken"\n'
    proc = _run(tmp_path, config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "exp1"
    assert RESULTS <= {p.name for p in out.iterdir()}
    assert len(json.loads((out / "metrics.json").read_text())) == ROUNDS
    lines = _mlflow_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("MLflow tracking failed (the end, "), proc.stderr
    assert lines[0].endswith(f"the run's results are in {out} all the same")
    assert "state: COMPLETED" in proc.stdout
    client = MlflowClient(tracking_uri=store)
    run = _only_run(client, "broken")
    assert run.info.status == "FAILED"  # ended as such, with what was logged before
    assert len(client.get_metric_history(run.info.run_id, "loss")) == ROUNDS


@pytest.mark.parametrize(
    ("tracking", "flags", "line"),
    [
        (
            'mlflow = "yes"',
            (),
            "tracking.mlflow must be true, false or an MLflow tracking URI "
            '("sqlite:///PATH/mlflow.db", "http://HOST:5000"), got \'yes\'',
        ),
        ("mlflow = 1", (), "tracking.mlflow must be true, false or an MLflow tracking URI, got 1"),
        ('mlflow = "https://me:secret@mlflow.example:5000"', (), "tracking.mlflow: no credentials in the URI"),
        ('experiment = ""', (), "tracking.experiment must not be empty"),
        ("mlfow = true", (), "unknown key tracking.mlfow; allowed: experiment, mlflow"),
    ],
)
def test_a_bad_tracking_value_is_one_line_naming_the_key_before_anything_starts(tmp_path, tracking, flags, line):
    proc = _run(tmp_path, CONFIG + f"\n[tracking]\n{tracking}\n", *flags, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [got] = proc.stderr.strip().splitlines()
    assert got.startswith(f"shuffledp run: {tmp_path / 'run.toml'}: {line}"), got
    assert not (tmp_path / "exp1").exists()


def test_mlflow_flag_that_took_the_configuration_file_is_one_line(tmp_path):
    # `shuffledp run --mlflow run.toml`: the optional URI took the file; refused, not a run of the default config
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG)
    out = tmp_path / "exp1"
    cmd = [sys.executable, "-m", "shuffledp.cli", "run", "--out", str(out), "--mlflow", str(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"shuffledp run: --mlflow URI must be an MLflow tracking URI (sqlite:///PATH/mlflow.db, http://HOST:5000), "
        f"got {str(cfg)!r}: a configuration file? put --mlflow after it, or write --mlflow=URI"
    ]
    assert not out.exists()


@pytest.mark.parametrize("how", ["config", "flag"])
def test_mlflow_without_the_extra_is_one_line_before_anything_starts(tmp_path, how):
    # the extra missing, as on an install without it: mlflow cannot be imported
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG + ("\n[tracking]\nmlflow = true\n" if how == "config" else ""))
    out = tmp_path / "exp1"
    flag = ", '--mlflow'" if how == "flag" else ""
    code = (
        "import sys; sys.modules['mlflow'] = None\n"
        "from shuffledp.cli import main\n"
        f"sys.exit(main(['run', {str(cfg)!r}, '--out', {str(out)!r}{flag}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    who = "tracking.mlflow" if how == "config" else "--mlflow"
    assert proc.stderr.strip().splitlines() == [
        f"shuffledp run: {who} needs the optional extra 'mlflow' (no module mlflow): pip install 'shuffledp[mlflow]' "
        "(mlflow-skinny, SQLAlchemy, alembic)"
    ]
    assert not out.exists()
