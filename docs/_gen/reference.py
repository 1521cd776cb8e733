"""mkdocs hook: the reference pages generated from the code at every build, so that none of them can drift from it.

- reference/configuration.md: the embedded default exactly as `shuffledp run --print-default` prints it
  (shuffledp.config.default_toml), then each protocol plug-in's own table [privacy.<name>] from its `settings`
  dataclass (shuffledp.settings.render_table and the same fields' metadata), with what its plug-in declares
  (schedules, transports, optimizers) and the keys of its example run (`--print-default --protocol NAME`).
- reference/cli.md: the help of every command and subcommand, from the argparse parsers
  (shuffledp.cli.build_parser), as `shuffledp ... --help` prints it.
- reference/api/<floor>.md: one API page per floor of the package's layer order (the numbered list in
  shuffledp/__init__.py's docstring), each a mkdocstrings directive over that floor's packages and modules; the nav's
  "Python API" entry is filled with them (on_config), so a new subpackage named in the layer order gets its page.
- reference/modules.md: every module of shuffledp/, services/ and clients/ with the first sentence of its docstring,
  by floor (read with ast: nothing is imported).
- the architecture page's `<!-- generated: floors -->` marker: the floors with each folder's own rule (the "May
  import" paragraph of its package docstring).

Listed in mkdocs.yml under `hooks:`; docs/_gen/ itself is excluded from the site.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
from dataclasses import MISSING
from pathlib import Path

from mkdocs.structure.files import File, Files

CONFIG_PAGE = "reference/configuration.md"
CLI_PAGE = "reference/cli.md"
MODULES_PAGE = "reference/modules.md"
API_DIR = "reference/api"
FLOORS_MARKER = "<!-- generated: floors -->"
ROOT = Path(__file__).resolve().parent.parent.parent  # the repository
# the parties' folders are installed as subpackages of shuffledp (pyproject's package-dir)
PARTIES = {"services": ROOT / "services", "clients": ROOT / "clients"}


# ---------------------------------------------------------------------------------------- configuration
def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _allowed(meta: dict, kind: type) -> str:
    if meta.get("choices"):
        return ", ".join(f'`"{c}"`' for c in meta["choices"])
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is None and hi is None:
        return ""
    left = ("(" if meta.get("lo_open") else "[") + ("-inf" if lo is None else repr(lo))
    right = ("inf" if hi is None else repr(hi)) + (")" if meta.get("hi_open") else "]")
    return f"`{left}, {right}`"


def _key_table(cls: type) -> list[str]:
    from shuffledp.settings import _declared, toml_value

    rows = ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    for f, kind in _declared(cls):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        shown = "unset" if default is None else f"`{toml_value(default)}`"
        kind_name = getattr(kind, "__name__", str(kind))
        if f.metadata.get("read") is not None:
            kind_name = "see meaning"
        rows.append(
            f"| `{f.name}` | {kind_name} | {shown} | {_allowed(dict(f.metadata), kind)} | {_cell(f.metadata['doc'])} |"
        )
    return rows


def _example_toml(example: dict) -> str:
    from shuffledp.settings import toml_value

    lines = []
    for section, keys in example.items():
        lines.append(f"[{section}]")
        for key, value in keys.items():
            lines.append(f"{key} = {toml_value(value)}" if value is not None else f"# {key}: unset")
    return "\n".join(lines)


def _common_tables() -> list[tuple[str, type]]:
    """The run configuration's sections that are declared as typed tables (shuffledp.settings.setting fields): their
    keys' types, ranges and defaults come from the same declarations as the parser's."""
    import dataclasses
    import typing

    from shuffledp import settings

    hints = typing.get_type_hints(settings.RunConfig)
    found = []
    for f in dataclasses.fields(settings.RunConfig):
        cls = hints.get(f.name)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and settings.table_keys(cls):
            found.append((f.name, cls))
    return found


def configuration_page() -> str:
    from shuffledp.config import default_toml
    from shuffledp.protocols.registry import PROTOCOL_NAMES, PROTOCOL_SUMMARIES, round_protocol
    from shuffledp.settings import render_table, table_keys

    out = [
        "# Configuration reference",
        "",
        '!!! note "Generated"',
        "    This page is generated at every build of the site from the code that `shuffledp run --print-default`",
        "    prints (`shuffledp/config.py`'s embedded default, each protocol plug-in's `settings` table in",
        "    `shuffledp/protocols/`, rendered by `shuffledp.settings.render_table`). It cannot drift from the code.",
        "",
        "A run is configured by one TOML file. `shuffledp run --print-default > my.toml` writes the embedded default",
        "below, which documents every key; `shuffledp run --print-default --protocol NAME` writes a run of protocol",
        "NAME instead (its own table and the keys its plug-in sets for an example run). Keys left out of a file take",
        "built-in defaults, which are the values below except `model.radius` (built-in 4) and",
        "`schedule.learning_rate` (built-in: the theory rule of Thm 4.1). What each section means, and the mistakes",
        "that are refused, is in [Run your own experiment](../how-to/run-an-experiment.md).",
        "",
        "## The embedded default",
        "",
        "`shuffledp run --print-default` (digits, PGD over PVEC in count mode, eps 8):",
        "",
        "```toml",
        default_toml().rstrip("\n"),
        "```",
    ]
    for section, cls in _common_tables():
        out += ["", f"## `[{section}]`", "", " ".join((cls.__doc__ or "").split()), ""]
        out += _key_table(cls)
    out += [
        "",
        "## The protocols",
        "",
        "`privacy.protocol` names one of these plug-ins (`shuffledp/protocols/registry.py`). Each declares the",
        "schedules, transports and optimizers it runs with, and its own table `[privacy.<name>]`; a key of another",
        "protocol's table is refused with one line naming its table.",
        "",
        "| protocol | what it is | `schedule.kind` | `transport.mode` | `schedule.optimizer` | Poisson sampling |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    plugins = {name: round_protocol(name) for name in PROTOCOL_NAMES}
    for name, p in plugins.items():
        out.append(
            f"| [`{name}`](#privacy-{name}) | {_cell(PROTOCOL_SUMMARIES[name])} | "
            f"{', '.join(p.schedules)} | {', '.join(p.transports)} | {', '.join(p.optimizers)} | "
            f"{'yes' if p.poisson_sampling else 'no'} |"
        )
    for name, p in plugins.items():
        out += ["", f"## `[privacy.{name}]` {{#privacy-{name}}}", "", f"{PROTOCOL_SUMMARIES[name]}.", ""]
        if table_keys(p.settings):
            out += _key_table(p.settings)
            out += ["", "As `--print-default --protocol " + name + "` prints it:", "", "```toml"]
            out += [render_table(p.settings, f"privacy.{name}").rstrip("\n"), "```"]
        else:
            out.append("This protocol has no keys of its own.")
        if p.example:
            out += [
                "",
                f"Its example run (`shuffledp run --print-default --protocol {name}`) sets these keys on top of the",
                "embedded default:",
                "",
                "```",
                _example_toml(p.example),
                "```",
            ]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------- command line
def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser once
                found += _commands(sub)
    return found


def cli_page() -> str:
    from shuffledp.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "110"  # argparse wraps to the terminal: a fixed width for a reproducible page
    try:
        parsers = _commands(build_parser())
        helps = [(p.prog, p.format_help()) for p in parsers]
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    out = [
        "# Command-line reference",
        "",
        '!!! note "Generated"',
        "    This page is generated at every build of the site from the `shuffledp` command's own argparse parsers",
        "    (`shuffledp.cli.build_parser`): each section is what `... --help` prints.",
        "",
        "Bad arguments print one line and exit with status 2. The exit statuses of `shuffledp run` are listed in",
        "[Run your own experiment](../how-to/run-an-experiment.md#exit-statuses).",
        "",
    ]
    for prog, text in helps:
        out += [f"## `{prog}`", "", "```text", text.rstrip("\n"), "```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- floors, API, modules
def _docstring(path: Path) -> str:
    try:
        return ast.get_docstring(ast.parse(path.read_text())) or ""
    except (OSError, SyntaxError):
        return ""


def _where(name: str) -> Path | None:
    """The package directory or module file of a name in the layer order (None: not in the tree yet)."""
    if name in PARTIES:
        return PARTIES[name]
    for candidate in (ROOT / "shuffledp" / name, ROOT / "shuffledp" / f"{name}.py"):
        if candidate.exists():
            return candidate
    return None


def floors() -> list[tuple[int, str, list[str]]]:
    """(number, text, names that exist) of each floor in shuffledp/__init__.py's docstring, lowest first."""
    doc = _docstring(ROOT / "shuffledp" / "__init__.py")
    out = []
    for m in re.finditer(r"^(\d+)\. (.+?)(?=^\d+\. |^\n|\Z)", doc, flags=re.M | re.S):
        text = " ".join(m.group(2).split())
        names = [n for n in dict.fromkeys(re.findall(r"`([a-z_0-9]+)`", text)) if _where(n) is not None]
        out.append((int(m.group(1)), text, names))
    return out


def _dotted(name: str) -> str:
    return f"shuffledp.{name}"


def _label(text: str) -> str:
    """A floor's short name: the text before its colon ("foundation", "`cli`, `api`", "the parties")."""
    return text.split(":")[0].replace("`", "").strip()


def _page_name(number: int, names: list[str]) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", _label(dict((n, t) for n, t, _ in floors())[number]).lower()).strip("-")
    return f"{API_DIR}/{slug or f'floor-{number}'}.md"


def _rule(name: str) -> str:
    """What a package may import, from its own docstring (its "May import" paragraph, or one that names imports)."""
    where = _where(name)
    if where is None or not where.is_dir():
        return ""
    paragraphs = [" ".join(p.split()) for p in _docstring(where / "__init__.py").split("\n\n")][1:]
    for p in paragraphs:
        if "may import" in p.lower():
            return p
    for p in paragraphs:
        if " import" in p and not p.startswith("- "):
            return p
    return ""


def floors_table() -> str:
    rows = ["| floor | what | folders | rule |", "| --- | --- | --- | --- |"]
    for number, text, names in floors():
        folders = []
        for n in names:
            where = _where(n)
            rel = where.relative_to(ROOT).as_posix() + ("/" if where.is_dir() else "")
            folders.append(f"`{rel}`")
        rules = " ".join(r for r in (_rule(n) for n in names) if r) or "its own floor and the ones below"
        what = text.replace("|", "\\|")
        api = f" ([API]({_page_name(number, names)}))" if names else ""
        rows.append(f"| {number} | {what}{api} | {', '.join(folders)} | {rules.replace('|', '/')} |")
    return "\n".join(rows)


def api_page(number: int, text: str, names: list[str]) -> str:
    out = [f"# {number}. {_label(text)}", "", text, ""]
    for n in names:
        if n == "v1":  # generated protobuf code: the contract is proto/shuffledp/v1/shuffledp.proto
            out += ["`shuffledp.v1` is the generated wire code of `proto/shuffledp/v1/shuffledp.proto`.", ""]
            continue
        where = _where(n)
        if n in PARTIES:  # found on the repository's path (mkdocs.yml: paths [.]) and shown under their import name
            out += [f"::: {n}", "    options:", f"      heading: shuffledp.{n}", "      show_submodules: true", ""]
        else:
            out += [f"::: {_dotted(n)}"]
            if where.is_dir():
                out += ["    options:", "      show_submodules: true"]
            out.append("")
    return "\n".join(out)


def _modules(where: Path, dotted: str) -> list[tuple[str, Path]]:
    if where.is_file():
        return [(dotted, where)]
    found = []
    for path in sorted(where.rglob("*.py")):
        if "_pb2" in path.name or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(where).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        found.append((".".join([dotted, *parts]), path))
    return found


def modules_page() -> str:
    out = [
        "# Module map",
        "",
        '!!! note "Generated"',
        "    Every module of `shuffledp/`, `services/` and `clients/`, by floor of the layer order, with the first",
        "    sentence of its docstring, read at build time. The rules of the floors are on the",
        "    [Architecture](../architecture.md#the-floors) page.",
        "",
    ]
    for number, text, names in floors():
        if not names:
            continue
        out += [f"## {number}. {_label(text)}", "", "| module | what it is |", "| --- | --- |"]
        for n in names:
            where = _where(n)
            for dotted, path in _modules(where, _dotted(n)):
                first = " ".join(_docstring(path).split("\n\n")[0].split())
                first = re.split(r"(?<=[.:;])\s", first, maxsplit=1)[0] if first else ""
                rel = path.relative_to(ROOT).as_posix()
                out.append(f"| `{dotted}` (`{rel}`) | {_cell(first)} |")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- the hook
def on_config(config):
    """Fill the nav's "Python API" entry with one page per floor."""
    pages = [{f"{n}. {_label(t)}": _page_name(n, names)} for n, t, names in floors() if names]
    pages = [{"Overview": f"{API_DIR}/index.md"}, *pages, {"Module map": MODULES_PAGE}]

    def fill(items):
        for i, item in enumerate(items):
            if isinstance(item, dict):
                for key, value in item.items():
                    if key == "Python API":
                        items[i] = {key: pages}
                    elif isinstance(value, list):
                        fill(value)

    fill(config["nav"])
    return config


def on_files(files: Files, config) -> Files:
    generated = {CONFIG_PAGE: configuration_page(), CLI_PAGE: cli_page(), MODULES_PAGE: modules_page()}
    for number, text, names in floors():
        if names:
            generated[_page_name(number, names)] = api_page(number, text, names)
    for uri, content in generated.items():
        files.append(File.generated(config, uri, content=content))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if FLOORS_MARKER in markdown:
        markdown = markdown.replace(FLOORS_MARKER, floors_table())
    return markdown
