"""Old import paths of the modules that moved into subpackages (issue 47), kept for one release.

`import shuffledp.pki` (or `from shuffledp import pki`) still works and gives the module at its new path, with a
DeprecationWarning naming that path. A finder on sys.meta_path serves only the names in MOVED, so nothing else is
shadowed; the module object is the new one (one copy of its state, whatever path imported it first).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

# old module -> new module; drop this table (and this file) in the release after 0.2
MOVED = {
    "shuffledp.account_cli": "shuffledp.cli.account",
    "shuffledp.run": "shuffledp.cli.run",
    "shuffledp.serve": "shuffledp.cli.serve",
    "shuffledp.pki": "shuffledp.security.pki",
    "shuffledp.rng": "shuffledp.security.rng",
    "shuffledp.sealing": "shuffledp.security.sealing",
    "shuffledp.tls": "shuffledp.transport.tls",
    "shuffledp.grpc_options": "shuffledp.transport.grpc_options",
    "shuffledp.health": "shuffledp.transport.health",
    "shuffledp.spec_signing": "shuffledp.transport.spec_signing",
    "shuffledp.metrics": "shuffledp.observability.metrics",
    "shuffledp.tracking": "shuffledp.observability.tracking",
    "shuffledp.live": "shuffledp.observability.live",
    "shuffledp.model_plugin": "shuffledp.models.plugin",
    "shuffledp.flax_model": "shuffledp.models.flax_adapter",
    "shuffledp.examples": "shuffledp.models.examples",
    "shuffledp.examples.flax_models": "shuffledp.models.examples.flax_models",
    "shuffledp.events": "shuffledp.accountants.events",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self._real_specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        # stacklevel: past importlib's frames, to the importing line where possible
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in the next release", DeprecationWarning, 2)
        module = importlib.import_module(new)
        self._real_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # importlib set module.__spec__ to the alias's spec; the module keeps its own (reload, pickling, -m)
        module.__spec__ = self._real_specs[module.__spec__.name]


def install() -> None:
    """Put the finder on sys.meta_path once (shuffledp/__init__.py calls it)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
