"""The documentation's examples are what the code does (docs match behaviour): the README and the site's pages.

Each `$ shuffledp ...` line of a page's code blocks (the `shuffledp account` examples live in
docs/concepts/accountants.md since the README became a front page) is run as a real process. A JSON example's
`"key": value` pairs ("..." elides the rest) must equal the printed object's; a table example's lines must each
be a line of the printed table (spacing normalized). Every ```toml block of the README and of docs/ is a whole
configuration that parses, plans and passes the users' own policy.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the pages a reader sees: the README and every page of the documentation site (docs/_gen/ is the site's generator)
PAGES = [README, *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_gen" not in p.parts)]
ACCOUNT_PAGE = ROOT / "docs" / "concepts" / "accountants.md"


def _examples() -> list[tuple[str, list[str]]]:
    examples, current = [], None
    for page in PAGES:
        for line in page.read_text().splitlines():
            if line.startswith("$ shuffledp "):
                current = (line[2:], [])
                examples.append(current)
            elif current is not None and line.strip() and not line.startswith("```"):
                current[1].append(line)
            else:
                current = None
    return examples


EXAMPLES = _examples()


def test_readme_has_account_examples():
    assert len(EXAMPLES) >= 5 and all(out for _, out in EXAMPLES)
    on_page = [line for line in ACCOUNT_PAGE.read_text().splitlines() if line.startswith("$ shuffledp account ")]
    assert len(on_page) >= 5, ACCOUNT_PAGE  # the accountants' page keeps its examples, all of them run here


@pytest.mark.parametrize("command, shown", EXAMPLES, ids=[c.split(" --")[0] for c, _ in EXAMPLES])
def test_readme_account_example_matches_the_cli(command: str, shown: list[str]):
    argv = shlex.split(command)
    res = subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", *argv[1:]], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    if shown[0].startswith("{"):
        printed = json.loads(res.stdout)
        pairs = re.findall(r'"(\w+)": ("[^"]*"|[^,}]+)', " ".join(shown))
        assert pairs, shown
        for key, value in pairs:
            assert printed[key] == json.loads(value), (key, printed[key], value)
    else:
        lines = {" ".join(line.split()) for line in res.stdout.splitlines()}
        for line in shown:
            assert " ".join(line.split()) in lines, (line, res.stdout)


# ---------------------------------------------------------------------------------------------- TOML examples
def _toml_blocks() -> list[str]:
    return [block for page in PAGES for block in re.findall(r"```toml\n(.*?)```", page.read_text(), flags=re.S)]


TOML_BLOCKS = _toml_blocks()


def test_readme_has_toml_examples():
    assert len(TOML_BLOCKS) >= 5


@pytest.mark.parametrize("block", TOML_BLOCKS, ids=[f"toml{i}" for i in range(len(TOML_BLOCKS))])
def test_readme_toml_example_validates_and_plans(block: str):
    """Every TOML block of the README and the docs runs as written (issue 24 C18): the configuration is valid, the
    analyzer's planner sizes it for the data's users without starting a service, and the users' own policy accepts
    its rounds (a round's claimed eps, from the plan, within [policy] max_eps_per_round)."""
    from shuffledp.config import parse_config
    from shuffledp.data import load_dataset, num_users
    from shuffledp.models import make_model
    from shuffledp.planning import plan_run

    cfg = parse_config(block)
    ds = load_dataset(cfg.data, cfg.model.task)
    users = num_users(ds, cfg.data.examples_per_user, cfg.data.max_users)
    model = make_model(cfg.model.task, ds.num_features, ds.num_classes, l2=cfg.model.l2, hidden=cfg.model.hidden)
    plan = plan_run(cfg, users, users, model, ds.feature_norm_bound)
    assert plan["rounds"] >= 1
    params = plan["params"] or {}
    # what one round claims from each user: an LDP randomizer's eps0; a one-pass run (PNSGD) its whole eps
    claim = params.get("eps0") or (plan["eps"] if plan["hidden_iterates"] else 0.0)
    assert claim <= cfg.policy.max_eps_per_round, (claim, cfg.policy.max_eps_per_round)
