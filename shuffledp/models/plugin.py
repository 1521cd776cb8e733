"""Model plug-ins: [model] module = "package.module:factory" with its keyword arguments in [model.args] (issue 26).

Every party loads the model from what is installed on it: importlib.import_module of the named module (found on its
own sys.path: an installed package or a directory the operator put on PYTHONPATH), never code received over the
network. A node loads the model named by its own configuration file, at start-up; a round's spec carries only the
model's name and digest (shuffledp.models.model_digest), which the node compares with its own model's and refuses
the round when they differ (clients/policy.py Refusal.MODEL_DIFFERS).

Only a REGISTERED plug-in is imported (issue 43 item 5): importing runs a module's top level, and the analyzer receives
its configuration over the network (CreateRun), so a configuration must not choose what it imports among everything
installed (numpy.f2py.__main__ runs f2py on the analyzer's argv; no denylist is complete). A party registers plug-ins
through its own installation and environment, never through a configuration it receives:
- the entry point group "shuffledp.models" of an installed package (any name = "package.module:factory", the value
  a configuration names; the project's own are in pyproject.toml), read from its metadata without importing it;
- the environment variable SHUFFLEDP_MODEL_PLUGINS of the party's process: "package.module:factory" values,
  separated by commas (a plug-in in a directory on PYTHONPATH; `shuffledp run` puts there the plug-in its own
  configuration file names, which is the operator's own, so a local run's services load it).
The rule holds for every party, a client node too: its configuration file is its own, but one rule is simpler than
two (defence in depth). And the factory must be marked with shuffledp.models.model_factory, or be a ModelPlugin
subclass, so that a registration cannot make a party call an arbitrary installed function such as os:system.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from shuffledp.models import ModelPlugin, make_model, model_digest
from shuffledp.settings import ConfigError, ModelConfig

__all__ = [
    "ModelIdentity",
    "build_model",
    "model_identity",
    "check_module_name",
    "load_factory",
    "registered_plugins",
    "register_plugin",
    "ENTRY_POINT_GROUP",
    "PLUGINS_ENV",
]

# dotted Python identifiers, a colon, one identifier: a name to import, never a path
_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
ENTRY_POINT_GROUP = "shuffledp.models"
PLUGINS_ENV = "SHUFFLEDP_MODEL_PLUGINS"


@dataclass(frozen=True)
class ModelIdentity:
    """What a RoundSpec says of its model: name (a built-in task, or the plug-in's "package.module:factory") and
    the sha256 digest of its definition and layout."""

    name: str
    digest: str


def check_module_name(key: str, value: object) -> str:
    """model.module's syntax (ConfigError naming the key): "package.module:factory", or "" for a built-in task."""
    if not isinstance(value, str):
        raise ConfigError(f"{key} must be a string, got {value!r}")
    if value and not _NAME.match(value):
        raise ConfigError(f'{key} must be "package.module:factory" (an installed module, not a path), got {value!r}')
    return value


def registered_plugins() -> frozenset[str]:
    """The "package.module:factory" plug-ins this party may import: its installed packages' entry points of the group
    "shuffledp.models" (read from their metadata: nothing is imported) and the values in its SHUFFLEDP_MODEL_PLUGINS."""
    installed = {f"{ep.module}:{ep.attr}" for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return frozenset(installed | {v.strip() for v in os.environ.get(PLUGINS_ENV, "").split(",") if v.strip()})


def register_plugin(spec: str) -> None:
    """Register "package.module:factory" in this process's SHUFFLEDP_MODEL_PLUGINS (and so in the processes it starts
    from then on): for a configuration that is this party's own, such as `shuffledp run`'s configuration file."""
    if spec not in registered_plugins():
        os.environ[PLUGINS_ENV] = ",".join(filter(None, [os.environ.get(PLUGINS_ENV, ""), spec]))


def load_factory(spec: str) -> tuple[Any, str]:
    """(the factory named by "package.module:factory", sha256 of its module's source file)."""
    module_name, attr = spec.split(":")
    # importing runs the module's top level: only what this party registered, checked before anything is imported
    registered = registered_plugins()
    if spec not in registered:
        raise ConfigError(
            f"model.module = {spec!r} is not a model plug-in registered here (entry point group "
            f'"{ENTRY_POINT_GROUP}" of an installed package, or {PLUGINS_ENV}); registered: '
            f"{', '.join(sorted(registered)) or 'none'}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"model.module = {spec!r}: cannot import {module_name!r} here: {exc}") from exc
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"model.module = {spec!r}: module {module_name!r} has no {attr!r}")
    marked = getattr(factory, "__shuffledp_model_factory__", False) is True
    if not marked and not (isinstance(factory, type) and issubclass(factory, ModelPlugin)):
        raise ConfigError(
            f"model.module = {spec!r} is neither a ModelPlugin subclass nor a factory marked with "
            "@shuffledp.models.model_factory"
        )
    path = getattr(module, "__file__", None)
    source = hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else ""
    return factory, source


def build_model(cfg: ModelConfig, num_features: int, num_classes: int) -> ModelPlugin:
    """The run's model for data of num_features features and num_classes classes: the built-in task, or the
    plug-in's factory(num_features, num_classes, **model.args). ConfigError (one line) when the plug-in cannot be
    loaded or refuses its arguments."""
    if not cfg.module:
        return make_model(cfg.task, num_features, num_classes, l2=cfg.l2, hidden=cfg.hidden)
    factory, _ = load_factory(cfg.module)
    try:
        model = factory(num_features=int(num_features), num_classes=int(num_classes), **dict(cfg.args))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.module = {cfg.module!r} refused model.args {dict(cfg.args)!r}: {exc}") from exc
    except Exception as exc:  # the plug-in's own failure: one line naming it, not its traceback
        raise ConfigError(f"model.module = {cfg.module!r}: its factory raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, ModelPlugin):
        raise ConfigError(f"model.module = {cfg.module!r} returned {type(model).__name__}, not a ModelPlugin")
    return model


def model_identity(cfg: ModelConfig, model: ModelPlugin) -> ModelIdentity:
    """The name and digest a RoundSpec carries for the model build_model(cfg, ...) made. For a plug-in the digest
    also covers its "package.module:factory", its arguments and its module's source file, so that two parties with
    different code under one name disagree."""
    if not cfg.module:
        return ModelIdentity(model.task, model_digest(model))  # type: ignore[attr-defined]
    _, source = load_factory(cfg.module)
    origin = {"module": cfg.module, "args": dict(cfg.args), "source_sha256": source}
    return ModelIdentity(cfg.module, model_digest(model, origin))
