"""The first set-up installs what the command run needs (issue 43 item 18): scripts/run-default the project without
extras (the first one built a 1.2 GB .venv with the dev and JAX extras in 138 s), scripts/test and .ci/run the dev and
jax extras, upgrading a .venv made by run-default. The real scripts run over a copy of the repository's layout with a
fake .venv (its `shuffledp` and `python` only say how they were called) and SHUFFLEDP_VENV_DRY_RUN=1, under which
scripts/_venv.sh prints what it would install instead of installing it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the scripts are bash")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """The files scripts/_venv.sh looks at, and a fake .venv installed after them."""
    for name in ("scripts/_venv.sh", "scripts/run-default", "scripts/test", ".ci/run"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    for name in ("pyproject.toml", "setup.py", "shuffledp/mechanisms/_ldp_kernels.c"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
        os.utime(tmp_path / name, (1_000_000, 1_000_000))  # older than the .venv's marker
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    for tool in ("shuffledp", "python", "ruff", "mkdocs"):  # what the scripts call in .venv/bin
        (bin_ / tool).write_text(f'#!/bin/sh\necho "{tool} $*"\n')
        (bin_ / tool).chmod(0o755)
    (tmp_path / ".venv" / ".installed").write_text("")
    os.utime(tmp_path / ".venv" / ".installed", (2_000_000, 2_000_000))
    return tmp_path


def _run(repo: Path, script: str, extras: str | None) -> list[str]:
    """Run `script` (dry run); the lines it printed on stdout. extras None: a .venv/.extras-less (older) .venv."""
    if extras is not None:
        (repo / ".venv" / ".extras").write_text(extras + "\n")
    env = {k: v for k, v in os.environ.items() if k != "SHUFFLEDP_EXTRAS"}
    proc = subprocess.run(
        ["bash", str(repo / script)], capture_output=True, text=True, env={**env, "SHUFFLEDP_VENV_DRY_RUN": "1"}
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_run_default_installs_the_project_without_extras_the_first_time(repo):
    (repo / ".venv" / ".installed").unlink()  # nothing installed yet
    assert _run(repo, "scripts/run-default", None) == ["would install: pip install -e '.'", "shuffledp run"]


def test_scripts_test_installs_the_dev_and_jax_extras_the_first_time(repo):
    (repo / ".venv" / ".installed").unlink()
    assert _run(repo, "scripts/test", None) == ["would install: pip install -e '.[dev,jax]'", "python -m pytest -q"]


def test_a_venv_made_by_run_default_is_upgraded_by_scripts_test_and_ci(repo):
    assert _run(repo, "scripts/test", "") == ["would install: pip install -e '.[dev,jax]'", "python -m pytest -q"]
    # .ci/run sources _venv.sh itself (then ruff, the site's build), and calls scripts/test
    assert _run(repo, ".ci/run", "")[0] == "would install: pip install -e '.[dev,jax]'"


@pytest.mark.parametrize("extras", ["dev,jax", "dev,jax,mnist", None])
def test_a_venv_with_the_tests_extras_is_used_as_it_is_by_every_script(repo, extras):
    assert _run(repo, "scripts/run-default", extras) == ["shuffledp run"]
    assert _run(repo, "scripts/test", extras) == ["python -m pytest -q"]


def test_a_changed_pyproject_reinstalls_keeping_the_extras_there(repo):
    os.utime(repo / "pyproject.toml")  # now: newer than the marker
    assert _run(repo, "scripts/run-default", "dev,jax,mnist")[0] == "would install: pip install -e '.[dev,jax,mnist]'"
