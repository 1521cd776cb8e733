"""Configurations as the API takes them: a TOML file, a dict (the document tomllib would read from that file), or
the embedded default, with dotted-key settings on top ({"privacy.eps": 4, "schedule.learning_rate": 2.0}).

Setting `privacy.protocol` follows two rules, so that one base configuration serves every protocol of a sweep:
- the tables [privacy.NAME] of the other protocols are dropped (a base may carry the tables of all it compares);
- a protocol that does not run over the base's schedule.kind or transport.mode (pvec is fully interactive or
  sequential over counts, gaussian subsampled and sealed) takes the [schedule] and [transport] of its example run,
  the ones `shuffledp run --print-default --protocol NAME` prints (and its [privacy.NAME] table when the base has
  none); the settings given win over them. Every run's config.toml records what it ran.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["ConfigSource", "config_document", "apply_settings", "dumps", "parse_value"]

# a configuration: a TOML file's path, a dict of its document, or None (the embedded default)
ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | None


def config_document(config: ConfigSource) -> tuple[dict[str, Any], str | None, str]:
    """(document, its TOML text when read verbatim from a file or the default, a label) of a configuration. A str or
    a path is a file (ConfigError, one line, when it cannot be read); a dict is the document itself: sections as
    tables ({"privacy": {"eps": 4}}), or dotted keys ({"privacy.eps": 4}), or both."""
    from shuffledp.config import ConfigError, default_toml, read_config_text

    if config is None:
        text = default_toml()
        return tomllib.loads(text), text, "default"
    if isinstance(config, Mapping):
        return apply_settings({}, config, protocol_rules=False), None, "config"
    path = Path(config)
    text = read_config_text(path)
    try:
        return tomllib.loads(text), text, path.stem
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: configuration is not valid TOML: {exc}") from None


def _split(key: str) -> list[str]:
    parts = key.split(".")
    if not all(parts):
        raise ValueError(f"setting {key!r}: a dotted key (section.key, e.g. privacy.eps)")
    return parts


def _put(doc: dict[str, Any], key: str, value: Any) -> None:
    parts = _split(key)
    table = doc
    for name in parts[:-1]:
        nxt = table.setdefault(name, {})
        if not isinstance(nxt, dict):
            raise ValueError(f"setting {key!r}: {name} is a value, not a table")
        table = nxt
    if isinstance(value, Mapping):  # a table: merged key by key
        for k, v in value.items():
            _put(doc, f"{key}.{k}", v)
        return
    table[parts[-1]] = copy.deepcopy(value)


def _get(doc: Mapping[str, Any], key: str, default: Any = None) -> Any:
    table: Any = doc
    for name in _split(key):
        if not isinstance(table, Mapping) or name not in table:
            return default
        table = table[name]
    return table


def apply_settings(
    doc: Mapping[str, Any], settings: Mapping[str, Any], *, protocol_rules: bool = True
) -> dict[str, Any]:
    """A copy of the document with the settings (dotted keys, or tables) set; with privacy.protocol among them, the
    module docstring's two rules."""
    out = copy.deepcopy(dict(doc))
    for key, value in settings.items():
        _put(out, key, value)
    protocol = settings.get("privacy.protocol", (settings.get("privacy") or {}).get("protocol"))
    if not protocol_rules or not isinstance(protocol, str):
        return out
    from shuffledp.config import default_toml
    from shuffledp.protocols.registry import PROTOCOL_NAMES, round_protocol

    if protocol not in PROTOCOL_NAMES:
        return out  # the configuration's own check names it
    privacy = out.setdefault("privacy", {})
    for name in PROTOCOL_NAMES:
        if name != protocol:
            privacy.pop(name, None)
    plugin = round_protocol(protocol)
    kind = _get(out, "schedule.kind", "fully_interactive")
    mode = _get(out, "transport.mode", "counts")
    if kind in plugin.schedules and mode in plugin.transports:
        return out
    example = tomllib.loads(default_toml(protocol))
    out["schedule"] = example.get("schedule", {})
    out["transport"] = example.get("transport", {})
    if protocol not in privacy and protocol in example.get("privacy", {}):
        privacy[protocol] = example["privacy"][protocol]
    for key, value in settings.items():  # the settings given win
        if key.startswith(("schedule.", "transport.", f"privacy.{protocol}.")) or key in ("schedule", "transport"):
            _put(out, key, value)
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if hasattr(v, "item"):  # a numpy scalar
        return _toml_value(v.item())
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as a TOML value")


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)


def dumps(doc: Mapping[str, Any]) -> str:
    """TOML text of a configuration document (tables as [section] and [section.sub])."""
    lines: list[str] = []

    def table(path: list[str], t: Mapping[str, Any]) -> None:
        plain = {k: v for k, v in t.items() if not isinstance(v, Mapping)}
        subs = {k: v for k, v in t.items() if isinstance(v, Mapping)}
        if path and (plain or not subs):
            lines.append(f"[{'.'.join(_key(p) for p in path)}]")
        lines.extend(f"{_key(k)} = {_toml_value(v)}" for k, v in plain.items())
        if path and (plain or not subs):
            lines.append("")
        for k, v in subs.items():
            table([*path, k], v)

    top = {k: v for k, v in doc.items() if not isinstance(v, Mapping)}
    if top:
        raise ValueError(f"a configuration's top level holds tables only, got {sorted(top)}")
    table([], doc)
    return "\n".join(lines).rstrip() + "\n"


def parse_value(text: str) -> Any:
    """A command-line value as TOML reads it (1 -> int, 0.5 -> float, true -> bool, [1, 2] -> list), else the
    string itself (pvec)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
