"""The README's `shuffledp account` examples are what the CLI prints (docs match behaviour).

Each `$ shuffledp ...` line of the README's account section is run as a real process. A JSON example's
`"key": value` pairs ("..." elides the rest) must equal the printed object's; a table example's lines must each
be a line of the printed table (spacing normalized).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _examples() -> list[tuple[str, list[str]]]:
    text = README.read_text()
    section = text[text.index("## `shuffledp account`") :]
    section = section[: section.index("\n## ", 4)] if "\n## " in section[4:] else section
    examples, current = [], None
    for line in section.splitlines():
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
