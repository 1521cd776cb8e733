"""Run tracking (issue 29 item 3): `shuffledp run --tensorboard DIR` over real local processes writes a TensorBoard
log that TensorBoard's own reader (EventAccumulator) reads back with every round of metrics.json, the configuration
and the final spend of ledger.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _runs import digits_pgd
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.timeout(300)

ROUNDS = 4
CONFIG = digits_pgd(ROUNDS)


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG)
    cmd = [sys.executable, "-m", "shuffledp.cli", "run", str(cfg), "--out", str(tmp_path / "exp1"), "--quiet", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def test_tensorboard_log_holds_every_round_the_config_and_the_final_spend(tmp_path):
    tb = tmp_path / "tb"
    proc = _run(tmp_path, "--tensorboard", str(tb))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "exp1"
    rows = json.loads((out / "metrics.json").read_text())
    ledger = json.loads((out / "ledger.json").read_text())
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))

    assert [p.name for p in tb.iterdir()] == ["exp1"]  # one TensorBoard run per results directory
    acc = EventAccumulator(str(tb / "exp1"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    for tag, key in (
        ("round/loss", "loss"),
        ("round/accuracy", "accuracy"),
        ("privacy/eps_spent", "eps_spent"),
        ("privacy/delta_spent", "delta_spent"),
        ("round/contributors", "contributors"),
        ("round/refused", "refused"),
        ("round/seconds", "seconds"),
    ):
        assert sorted(scalars[tag]) == [r["round"] for r in rows], tag  # every round, once
        for r in rows:
            assert scalars[tag][r["round"]] == pytest.approx(r[key], rel=1e-6, abs=1e-9), (tag, r["round"])
    assert scalars["round/released"] == {r["round"]: float(r["released"]) for r in rows}
    eps = ledger["totals"]["eps_spent"]
    assert scalars["final/eps_spent"] == {ROUNDS: pytest.approx(eps, rel=1e-6)}
    assert scalars["final/eps_limit"] == {ROUNDS: pytest.approx(ledger["totals"]["eps_limit"], rel=1e-6)}

    texts = {tag: acc.Tensors(tag)[-1].tensor_proto.string_val[0].decode() for tag in acc.Tags()["tensors"]}
    config = texts["run/config/text_summary"]
    assert [line.strip() for line in config.strip().splitlines()] == [
        line.strip() for line in CONFIG.strip().splitlines()
    ]
    final = texts["run/final_spend/text_summary"]
    assert "state: COMPLETED" in final and f"eps spent: {eps:.6g} of 8" in final, final


def test_tensorboard_without_the_tracking_extra_is_one_line_before_anything_starts(tmp_path):
    # the extra missing, as on an install without it: tensorboardX cannot be imported
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG)
    out = tmp_path / "exp1"
    code = (
        "import sys; sys.modules['tensorboardX'] = None\n"
        "from shuffledp.cli import main\n"
        f"sys.exit(main(['run', {str(cfg)!r}, '--out', {str(out)!r}, '--tensorboard', {str(tmp_path / 'tb')!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "shuffledp run: --tensorboard needs the optional extra 'tracking': pip install 'shuffledp[tracking]' "
        "(tensorboardX)"
    ]
    assert not out.exists() and not (tmp_path / "tb").exists()
