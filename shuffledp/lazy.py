"""Modules imported at their first use (issue 15: a service's imports are most of its start-up).

The default run's PVEC path needs neither dp_accounting nor scipy's optimizers, which the other seeds' accountants
use; a module that needs them only on some paths names them with OnFirstUse instead of importing them.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["OnFirstUse"]


class OnFirstUse:
    """Stands for module `name`, imported at the first attribute access (sys.modules serves every later one)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)
