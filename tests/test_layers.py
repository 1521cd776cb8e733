"""The package's shape (issue 47): every import of every module goes down the floors (or stays on its own), the two
kinds of party never import each other, no module-level import cycle, and only the stated modules sit loose in
shuffledp/. Read from the source with ast (no module is imported), so a forbidden import fails here even on a path
no other test runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> its directory (pyproject.toml's package-dir: services/ and clients/ are subpackages of the core)
SOURCES = {
    "shuffledp": ROOT / "shuffledp",
    "shuffledp.services": ROOT / "services",
    "shuffledp.clients": ROOT / "clients",
}

# The floors, lowest first: a module imports only from its own floor or the ones below (shuffledp/__init__.py says the
# same in words; test_the_package_docstring_lists_these_floors keeps the two in step)
FLOORS: list[tuple[str, ...]] = [
    ("shuffledp", "shuffledp._moved", "shuffledp.settings", "shuffledp.lazy", "shuffledp.durable", "shuffledp.v1"),
    ("shuffledp.security",),
    ("shuffledp.mechanisms",),
    ("shuffledp.accountants",),
    ("shuffledp.models",),
    ("shuffledp.optimizers",),
    ("shuffledp.protocols",),
    ("shuffledp.config", "shuffledp.data"),
    ("shuffledp.planning",),
    ("shuffledp.transport",),
    ("shuffledp.services", "shuffledp.clients"),
    ("shuffledp.observability",),
    ("shuffledp.cli", "shuffledp.api"),
]
# the modules directly in shuffledp/ besides __init__.py: the foundation, the configuration and the data, and the
# table of moved modules' old paths (one release)
LOOSE_MODULES = {"settings", "lazy", "durable", "config", "data", "_moved"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, root in SOURCES.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("").parts
            if pkg == "shuffledp" and rel[0] in ("services", "clients"):
                continue
            parts = [p for p in rel if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path, module_level_only: bool = False) -> set[str]:
    """The project modules `name` imports (each import resolved to the longest known module name)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if module_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("shuffledp"):
                found.add(t)
    return found


def _floor(module: str) -> int:
    best, floor = "", -1
    for i, names in enumerate(FLOORS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > len(best):
                best, floor = n, i
    if floor < 0:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS (and to shuffledp/__init__.py's list)")
    return floor


def test_every_module_is_on_a_floor():
    assert len(MODULES) > 100
    for name in MODULES:
        _floor(name)


def test_no_import_climbs_a_floor():
    climbs = []
    for name, path in sorted(MODULES.items()):
        mine = _floor(name)
        for target in sorted(_imports(name, path)):
            if _floor(target) > mine:
                climbs.append(f"{name} (floor {mine + 1}) imports {target} (floor {_floor(target) + 1})")
    assert not climbs, "\n".join(climbs)


def test_the_parties_never_import_each_other():
    crossing = [
        f"{name} imports {t}"
        for name, path in MODULES.items()
        for t in _imports(name, path)
        for a, b in (("shuffledp.clients", "shuffledp.services"), ("shuffledp.services", "shuffledp.clients"))
        if name.startswith(a) and t.startswith(b)
    ]
    assert not crossing, crossing


def test_no_module_level_import_cycle():
    graph = {name: _imports(name, path, module_level_only=True) for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                # a package importing its own submodule (re-exports) is how Python packages work, not a cycle
                if not all(
                    b.startswith(a + ".") or a.startswith(b + ".") for a, b in zip(cycle, cycle[1:], strict=False)
                ):
                    cycles.append(" -> ".join(cycle))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def test_only_the_stated_modules_are_loose_in_the_package():
    loose = {p.stem for p in (ROOT / "shuffledp").glob("*.py")} - {"__init__"}
    assert loose == LOOSE_MODULES, f"modules directly in shuffledp/: {sorted(loose)}; stated: {sorted(LOOSE_MODULES)}"
    assert len(LOOSE_MODULES) <= 6


def test_the_package_docstring_lists_these_floors():
    import shuffledp

    listed = [line for line in shuffledp.__doc__.splitlines() if line[:3].strip().rstrip(".").isdigit()]
    assert len(listed) == len(FLOORS)
    for line, names in zip(listed, FLOORS, strict=True):
        for n in names:
            if n not in ("shuffledp", "shuffledp._moved"):
                assert f"`{n.removeprefix('shuffledp.')}`" in line, (n, line)


@pytest.mark.parametrize("module", ["services", "clients"])
def test_no_party_file_over_800_lines(module: str):
    long = {p.name: n for p in (ROOT / module).glob("*.py") if (n := len(p.read_text().splitlines())) > 800}
    assert not long, long


def test_an_old_import_path_still_works_with_a_deprecation_warning():
    import subprocess
    import sys

    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import shuffledp.security.pki as new\n"
        "try:\n    import shuffledp.pki\nexcept DeprecationWarning as w:\n    print('warned:', w)\n"
        "warnings.simplefilter('ignore')\n"
        "import shuffledp.pki as old\n"
        "from shuffledp import tls\n"
        "print(old is new, old.__spec__.name, tls.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "warned: shuffledp.pki moved to shuffledp.security.pki" in out
    assert "True shuffledp.security.pki shuffledp.transport.tls" in out


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages (package-dir maps services/ and clients/): a subpackage missing there works
    in the editable install and is absent from the wheel the images install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert packages == listed, {
        "not listed": sorted(packages - listed),
        "listed, not packages": sorted(listed - packages),
    }
