"""Issue 11: the new configuration keys (optimizer, phases, smoothing, smoothness, l2, honest_fraction, synthetic
data) are refused with one line naming the key, and bad combinations with one line naming both keys."""

from __future__ import annotations

import pytest

from shuffledp.config import DEFAULT_TOML, ConfigError, parse_config

SEQ = '[schedule]\nkind = "sequential"\n'


@pytest.mark.parametrize(
    "text, names",
    [
        ('[schedule]\noptimizer = "adam"\n', ["schedule.optimizer"]),
        ('[schedule]\nkind = "fully_interactive"\noptimizer = "acsa"\n', ["schedule.optimizer", "schedule.kind"]),
        ('[schedule]\nkind = "fully_interactive"\noptimizer = "psgd"\n', ["schedule.optimizer", "schedule.kind"]),
        ('[schedule]\nkind = "sequential"\noptimizer = "pgd"\n', ["schedule.optimizer", "schedule.kind"]),
        (SEQ + "phases = -1\n", ["schedule.phases"]),
        (SEQ + "phases = 3\n", ["schedule.phases", "model.l2"]),
        ("[model]\nl2 = 0.1\n[schedule]\nphases = 2\n", ["schedule.phases", "schedule.kind"]),
        ("[model]\nl2 = -1.0\n", ["model.l2"]),
        ('[model]\nsmoothing = "auto"\n', ["model.smoothing"]),
        ("[model]\nsmoothing = 5.0\n", ["model.smoothing", "model.task"]),  # logreg is smooth
        ('[model]\ntask = "hinge"\nsmoothing = "paper"\n' + SEQ, ["model.smoothing", "schedule.optimizer"]),
        (
            '[model]\ntask = "distance"\nsmoothing = "paper"\n[privacy]\nprotocol = "rr"\n[schedule]\n'
            'kind = "subsampled"\ncohort_size = 10\n[transport]\nmode = "sealed"\n',
            ["model.smoothing", "schedule.optimizer", '"sgd"'],
        ),
        ("[model]\nsmoothness = 2.0\n", ["model.smoothness", "schedule.optimizer"]),
        ('[model]\ntask = "hinge"\n' + SEQ + 'optimizer = "acsa"\n', ["schedule.optimizer", "model.task"]),
        ("[privacy]\nhonest_fraction = 0.0\n", ["privacy.honest_fraction"]),
        ("[privacy]\nhonest_fraction = 1.5\n", ["privacy.honest_fraction"]),
        ('[data]\ndataset = "synthetic"\nn = 0\n', ["data.n"]),
        ('[data]\ndataset = "synthetic"\nnoise = 0.0\n', ["data.noise", "model.task"]),
        ('[data]\ndataset = "digits"\nn = 100\n', ["data.n"]),
    ],
)
def test_bad_new_keys_are_refused_with_one_line_naming_them(text, names):
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in names), message


def test_good_combinations_parse():
    cfg = parse_config('[model]\ntask = "hinge"\nsmoothing = "paper"\n' + SEQ + 'optimizer = "acsa"\n')
    assert cfg.model.smoothing == "paper" and cfg.schedule.optimizer == "acsa"
    cfg = parse_config('[model]\ntask = "absolute"\nsmoothing = "paper"\n')  # auto -> pgd (Thm 4.9)
    assert cfg.schedule.optimizer == "auto" and cfg.schedule.kind == "fully_interactive"
    cfg = parse_config("[model]\nl2 = 0.1\n" + SEQ + "phases = 3\n")
    assert cfg.schedule.phases == 3 and cfg.model.l2 == 0.1
    cfg = parse_config('[data]\ndataset = "synthetic"\nn = 500\ndim = 3\nseed = 7\n')
    assert (cfg.data.n, cfg.data.dim, cfg.data.seed) == (500, 3, 7)


def test_new_keys_are_in_print_default_with_a_comment():
    lines = DEFAULT_TOML.splitlines()
    for key in ("optimizer", "phases", "smoothing", "smoothness", "l2", "honest_fraction", "n", "dim", "noise", "seed"):
        hits = [ln for ln in lines if ln.lstrip("# ").startswith(f"{key} =")]
        assert hits and all("#" in ln.split("=", 1)[1] for ln in hits), key
