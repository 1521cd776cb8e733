"""shuffledp.api (issue 46 item 1) over real services, as `shuffledp run` starts them (separate processes on
loopback, no mocks): a run from a dict, the rounds streamed (iterator and callback), the Result (DataFrame, released
model's predict, spend, summary.json), Ctrl-C in a callback (cancelled, results written, spend printed), a refused
configuration (one line, nothing started), and a run against an already running deployment."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import shuffledp.api as sdp
from shuffledp.cli.run import start_local_cluster

pytestmark = pytest.mark.timeout(300)

SMALL = {
    "data": {"dataset": "digits", "max_users": 200},
    "model": {"task": "logreg", "radius": 10.0},
    "privacy": {"eps": 4.0},
    "schedule": {"rounds": 4, "learning_rate": 4.0},
    "deployment": {"client_nodes": 2, "round_deadline_seconds": 20},
}


def test_run_from_a_dict_streams_rounds_and_returns_the_result(tmp_path, capsys):
    seen = []
    result = sdp.run(SMALL, {"privacy.eps": 2.0}, out=tmp_path / "r", on_round=seen.append)
    out = capsys.readouterr().out
    assert [r.round for r in seen] == [1, 2, 3, 4] and all(r.rounds_planned == 4 for r in seen)
    assert all(isinstance(r, sdp.RoundResult) and r.released for r in seen)
    # the command's lines: the start, one per round, the summary
    assert "shuffledp run: config: 2 client node(s); results in" in out
    assert out.count("round    ") == 4 and "state: COMPLETED" in out and "privacy spent: eps = " in out
    assert result.state == "COMPLETED" and result.exit_status == 0 and not result.interrupted
    assert result.out == tmp_path / "r"
    # summary.json, as written
    assert result.summary == json.loads((tmp_path / "r" / "summary.json").read_text())
    assert result.summary["plan"]["eps"] == 2.0
    # the DataFrame: one row per round, the streamed figures
    frame = result.metrics
    assert list(frame.index) == [1, 2, 3, 4]
    assert np.allclose(frame["eps_spent"], [r.eps_spent for r in seen])
    assert np.allclose(frame["accuracy"], [r.accuracy for r in seen])
    # the spend: the ledger's
    spend = result.spend
    assert 0 < spend.eps <= 2.0 and spend.eps_limit == 2.0 and spend.trust_model == "SHUFFLE"
    assert math.isclose(spend.eps, seen[-1].eps_spent)
    assert math.isclose(spend.eps, result.ledger["totals"]["eps_spent"])
    # the released model predicts as the analyzer evaluated it
    X, y = result.test_data()
    pred = result.model.predict(X)
    assert pred.shape == (len(y),) and set(np.unique(pred)) <= set(range(10))
    assert math.isclose(float(np.mean(pred == y)), result.accuracy)
    assert result.model.arrays["W"].shape == (10, 65) and result.model.class_labels == list(range(10))
    # and reading the directory again gives the same
    again = sdp.load_result(tmp_path / "r")
    assert again.summary == result.summary and np.array_equal(again.model.params, result.model.params)
    assert "accuracy=" in repr(result)


def test_start_iterates_the_rounds_then_gives_the_result(tmp_path):
    with sdp.start(SMALL, {"schedule.rounds": 3}, out=tmp_path / "r", quiet=True) as exp:
        assert exp.run_id and not exp.done  # rounds_planned: once the analyzer planned (its population known)
        rounds = [r.round for r in exp]
        assert exp.done and exp.rounds_planned == 3
    assert rounds == [1, 2, 3]
    result = exp.result()
    assert result.run_id == exp.run_id and len(result.rows) == 3 and result.state == "COMPLETED"


def test_ctrl_c_in_a_callback_cancels_writes_and_prints_the_spend(tmp_path, capsys):
    def stop_at_2(r: sdp.RoundResult) -> None:
        if r.round == 2:
            raise KeyboardInterrupt

    config = {**SMALL, "schedule": {"rounds": 12, "learning_rate": 4.0}}
    with pytest.raises(sdp.RunInterrupted) as caught:
        sdp.run(config, out=tmp_path / "r", on_round=stop_at_2)
    assert isinstance(caught.value, KeyboardInterrupt)
    captured = capsys.readouterr()
    assert "interrupted: cancelling the run and fetching what it has" in captured.out
    assert "stopped by Ctrl-C: run " in captured.err and "privacy spent: eps = " in captured.out
    partial = caught.value.result
    assert partial is not None and partial.interrupted and partial.exit_status == 130
    assert partial.state == "CANCELLED" and 2 <= len(partial.rows) < 12
    assert partial.spend.eps > 0
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["interrupted"] is True


def test_a_refused_configuration_starts_nothing(tmp_path):
    with pytest.raises(sdp.RunRefused) as refused:
        sdp.run(SMALL, {"privacy.eps": 100.0}, out=tmp_path / "r")
    assert "privacy.eps" in str(refused.value) and refused.value.status == 2
    assert not (tmp_path / "r").exists()
    with pytest.raises(TypeError, match="no option 'colour'"):
        sdp.run(SMALL, out=tmp_path / "r", colour=True)


def test_a_run_on_a_running_deployment(tmp_path, capsys):
    from shuffledp.api.settings import dumps

    work = tmp_path / "deployment"
    work.mkdir()
    (work / "config.toml").write_text(dumps(SMALL))
    cluster, _, analyzer = start_local_cluster(work / "config.toml", work, 2)
    try:
        result = sdp.run(SMALL, {"schedule.rounds": 2}, analyzer=analyzer, out=tmp_path / "r")
    finally:
        cluster.stop()
    out = capsys.readouterr().out
    assert f"on the deployment at {analyzer}" in out and f"--analyzer {analyzer} --fetch" in out
    assert result.state == "COMPLETED" and len(result.rows) == 2 and result.model is not None
    assert not (tmp_path / "r" / "logs").exists()  # the deployment's services are not this run's
