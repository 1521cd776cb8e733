"""The first set-up installs what the command run needs (issue 43 item 18): scripts/run-default the project without
extras (the first one built a 1.2 GB .venv with the dev and JAX extras in 138 s), scripts/test and .ci/run the dev and
jax extras, upgrading a .venv made by run-default. The real scripts run over a copy of the repository's layout with a
fake .venv (its `shuffledp` and `python` only say how they were called) and SHUFFLEDP_VENV_DRY_RUN=1, under which
scripts/_venv.sh prints what it would install instead of installing it.

The Prio3 binding (native/, issue 45) is built before the project's install: required by the prio3 extra (refused with
one line where no cargo is found, before anything is installed), where cargo exists for the tests' set-up (dev), and
never for the default run's. Whether cargo "exists" is set by the PATH the scripts get: the host's tools, without its
cargo, and a fake one or none."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the scripts are bash")
NATIVE_SOURCES = ("native/Cargo.toml", "native/Cargo.lock", "native/pyproject.toml", "native/src/lib.rs")
NO_CARGO = "Prio3 transport unavailable: no Rust toolchain (cargo) found"
BUILD_NATIVE = "would install: pip install ./native"


@pytest.fixture(scope="module")
def host_tools(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of links to every command on this PATH but cargo: the PATH of a machine without Rust."""
    tools = tmp_path_factory.mktemp("path")
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not d or not os.path.isdir(d):
            continue
        for entry in os.scandir(d):
            link = tools / entry.name
            if entry.name != "cargo" and not os.path.lexists(link) and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    return tools


def _path(repo: Path, host_tools: Path, cargo: bool) -> str:
    """PATH for the scripts: the host's tools, and a fake cargo (it only says how it was called) if `cargo`."""
    if not cargo:
        return str(host_tools)
    fake = repo / "fake-cargo"
    fake.mkdir(exist_ok=True)
    (fake / "cargo").write_text('#!/bin/sh\necho "cargo $*"\n')
    (fake / "cargo").chmod(0o755)
    return f"{fake}{os.pathsep}{host_tools}"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """The files scripts/_venv.sh looks at, and a fake .venv installed after them (with the binding built)."""
    for name in ("scripts/_venv.sh", "scripts/run-default", "scripts/test", ".ci/run"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    for name in (
        "pyproject.toml",
        "setup.py",
        "shuffledp/mechanisms/_ldp_kernels.c",
        *NATIVE_SOURCES,
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
        os.utime(tmp_path / name, (1_000_000, 1_000_000))  # older than the .venv's markers
    os.utime(tmp_path / "native" / "src", (1_000_000, 1_000_000))  # find -newer looks at the directory too
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    for tool in ("shuffledp", "python", "ruff", "mkdocs"):  # what the scripts call in .venv/bin
        (bin_ / tool).write_text(f'#!/bin/sh\necho "{tool} $*"\n')
        (bin_ / tool).chmod(0o755)
    for marker in (".installed", ".native-installed"):  # the project, and the binding (where it was built)
        (tmp_path / ".venv" / marker).write_text("")
        os.utime(tmp_path / ".venv" / marker, (2_000_000, 2_000_000))
    return tmp_path


def _call(repo: Path, script: str, extras: str | None, **env: str) -> subprocess.CompletedProcess:
    """Run `script` (dry run) with `env` added. extras None: a .venv/.extras-less (older) .venv."""
    if extras is not None:
        (repo / ".venv" / ".extras").write_text(extras + "\n")
    base = {k: v for k, v in os.environ.items() if k != "SHUFFLEDP_EXTRAS"}
    return subprocess.run(
        ["bash", str(repo / script)], capture_output=True, text=True, env={**base, "SHUFFLEDP_VENV_DRY_RUN": "1", **env}
    )


def _run(repo: Path, script: str, extras: str | None, **env: str) -> list[str]:
    """Run `script` (dry run); the lines it printed on stdout."""
    proc = _call(repo, script, extras, **env)
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


# ------------------------------------------------------------------------------- the Prio3 binding (native/)
def _fresh(repo: Path) -> None:
    """Nothing installed yet: neither the project nor the binding."""
    for marker in (".installed", ".native-installed"):
        (repo / ".venv" / marker).unlink()


def test_the_default_run_never_builds_the_binding_even_where_cargo_exists(repo, host_tools):
    _fresh(repo)
    proc = _call(repo, "scripts/run-default", None, PATH=_path(repo, host_tools, cargo=True))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["would install: pip install -e '.'", "shuffledp run"]
    assert "native" not in proc.stderr and "Prio3" not in proc.stderr


def test_the_tests_set_up_builds_the_binding_first_where_cargo_exists(repo, host_tools):
    _fresh(repo)
    lines = _run(repo, "scripts/test", None, PATH=_path(repo, host_tools, cargo=True))
    assert lines == [BUILD_NATIVE, "would install: pip install -e '.[dev,jax]'", "python -m pytest -q"]


def test_the_tests_set_up_goes_on_without_cargo_saying_so_in_one_line(repo, host_tools):
    _fresh(repo)
    proc = _call(repo, "scripts/test", None, PATH=_path(repo, host_tools, cargo=False))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["would install: pip install -e '.[dev,jax]'", "python -m pytest -q"]
    assert [line for line in proc.stderr.splitlines() if "cargo" in line] == [
        NO_CARGO + "; install rustup (https://rustup.rs) and run this again to build native/ (shuffledp_prio)"
    ]


def test_the_binding_is_rebuilt_when_its_sources_change(repo, host_tools):
    path = _path(repo, host_tools, cargo=True)
    assert _run(repo, "scripts/test", "dev,jax", PATH=path) == ["python -m pytest -q"]  # built, up to date
    os.utime(repo / "native" / "src" / "lib.rs")  # now: newer than the marker
    assert _run(repo, "scripts/test", "dev,jax", PATH=path) == [BUILD_NATIVE, "python -m pytest -q"]


def test_the_prio3_extra_builds_the_binding_before_the_project_so_the_extra_resolves_to_it(repo, host_tools):
    (repo / ".venv" / ".native-installed").unlink()  # the tests' .venv, made where there was no cargo
    lines = _run(repo, "scripts/_venv.sh", "dev,jax", SHUFFLEDP_EXTRAS="prio3", PATH=_path(repo, host_tools, True))
    assert lines == [BUILD_NATIVE, "would install: pip install -e '.[dev,jax,prio3]'"]
    # from scratch, with nothing else: still the binding first
    (repo / ".venv" / ".installed").unlink()
    lines = _run(repo, "scripts/_venv.sh", "", SHUFFLEDP_EXTRAS="prio3", PATH=_path(repo, host_tools, True))
    assert lines == [BUILD_NATIVE, "would install: pip install -e '.[prio3]'"]


def test_the_prio3_extra_is_refused_in_one_line_without_cargo_and_nothing_is_installed(repo, host_tools):
    _fresh(repo)
    proc = _call(repo, "scripts/_venv.sh", None, SHUFFLEDP_EXTRAS="dev,prio3", PATH=_path(repo, host_tools, False))
    assert proc.returncode != 0
    assert proc.stdout == ""  # neither the binding nor the project
    assert proc.stderr.splitlines() == [
        "the prio3 extra needs a Rust toolchain to build native/ (shuffledp_prio) and no cargo was found: install "
        "rustup (https://rustup.rs) and run this again; nothing was installed"
    ]


def test_a_venv_with_the_prio3_extra_and_its_binding_keeps_them_without_cargo(repo, host_tools):
    """cargo gone later: the installed binding stays; a change of native/ says in one line that it was not rebuilt."""
    path = _path(repo, host_tools, cargo=False)
    proc = _call(repo, "scripts/run-default", "dev,jax,prio3", PATH=path)
    assert (proc.returncode, proc.stdout.splitlines(), proc.stderr) == (0, ["shuffledp run"], "")
    os.utime(repo / "native" / "Cargo.lock")
    proc = _call(repo, "scripts/run-default", "dev,jax,prio3", PATH=path)
    assert proc.returncode == 0 and proc.stdout.splitlines() == ["shuffledp run"]
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(NO_CARGO)


def test_the_prio3_extra_pins_the_version_native_builds():
    """pyproject's extra names the distribution and version native/pyproject.toml builds (else it would resolve to
    nothing installed, and pip would look on PyPI), and the dev extra does not need it (no Rust for the tests)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    native = tomllib.loads((ROOT / "native" / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["prio3"] == [f"{native['name']}=={native['version']}"]
    assert not any(req.startswith(native["name"]) for req in extras["dev"] + project["dependencies"])
