"""Draws docs/img/round.svg, the architecture page's diagram of one round from a user to the released model.

Run by hand after a change (`python3 docs/_gen/round_svg.py`). A plain SVG with no script and no web font, so that
the site needs no network (a mermaid diagram would load mermaid's JavaScript from a CDN).
"""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

W, H = 1020, 880
COLS = {"user": 145, "shuffler": 440, "analyzer": 715, "out": 935}
HEADS = {
    "user": ("User on a client node", "clients/: policy, spend record, CSPRNG"),
    "shuffler": ("Shuffler", "services/shuffler*.py"),
    "analyzer": ("Analyzer", "services/: analyzer, run manager, ledger"),
    "out": ("Released", "results/"),
}
FILL = {"user": "#e3f2fd", "shuffler": "#fff3e0", "analyzer": "#e8f5e9", "out": "#f3e5f5"}
FONT = "DejaVu Sans, Liberation Sans, Arial, sans-serif"


class Drawing:
    def __init__(self) -> None:
        self.y = 80
        self.out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
            f'font-family="{FONT}" font-size="13">',
            "<title>One round, from a user to the released model</title>",
            '<defs><marker id="a" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8" markerHeight="8" '
            'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#333"/></marker></defs>',
            f'<rect x="0" y="0" width="{W}" height="{H}" fill="#ffffff"/>',
        ]
        for key, x in COLS.items():
            w = 260 if key != "out" else 150
            title, sub = HEADS[key]
            self.out += [
                f'<rect x="{x - w / 2}" y="10" width="{w}" height="48" rx="6" fill="{FILL[key]}" stroke="#555"/>',
                f'<text x="{x}" y="30" text-anchor="middle" font-weight="bold">{escape(title)}</text>',
                f'<text x="{x}" y="48" text-anchor="middle" font-size="11" fill="#444">{escape(sub)}</text>',
                f'<line x1="{x}" y1="60" x2="{x}" y2="{H - 20}" stroke="#999" stroke-dasharray="4 4"/>',
            ]

    def note(self, col: str, lines: list[str]) -> None:
        x, w, h = COLS[col], (270 if col != "out" else 160), 16 * len(lines) + 10
        self.out.append(
            f'<rect x="{x - w / 2}" y="{self.y}" width="{w}" height="{h}" rx="4" fill="{FILL[col]}" stroke="#888"/>'
        )
        for i, text in enumerate(lines):
            self.out.append(f'<text x="{x}" y="{self.y + 18 + 16 * i}" text-anchor="middle">{escape(text)}</text>')
        self.y += h + 10

    def arrow(self, a: str, b: str, lines: list[str]) -> None:
        x1, x2 = COLS[a], COLS[b]
        for i, text in enumerate(lines):
            self.out.append(
                f'<text x="{(x1 + x2) / 2}" y="{self.y + 12 + 15 * i}" text-anchor="middle" font-size="12">'
                f"{escape(text)}</text>"
            )
        self.y += 15 * len(lines) + 6
        self.out.append(
            f'<line x1="{x1}" y1="{self.y}" x2="{x2}" y2="{self.y}" stroke="#333" stroke-width="1.5" '
            'marker-end="url(#a)"/>'
        )
        self.y += 14

    def caption(self, col: str, text: str) -> None:
        self.out.append(
            f'<text x="{COLS[col]}" y="{self.y + 6}" text-anchor="middle" font-style="italic" fill="#555">'
            f"{escape(text)}</text>"
        )
        self.y += 24


def draw() -> str:
    d = Drawing()
    plan = ["1. plan the round (noise, cohort)", "2. RESERVE its cost in the ledger", "(fsync), sign the spec"]
    d.note("analyzer", plan)
    d.arrow("analyzer", "shuffler", ["ExecuteRound(signed spec)"])
    d.note("shuffler", ["3. draw the cohort in secret (CSPRNG)", "record participation (fsync)"])
    d.arrow("shuffler", "user", ["Invitation: the signed spec, as it came", "(over the node's Connect stream)"])
    d.note("user", ["4. verify the analyzer's signature", "recompute the round's eps;", "refuse what [policy] forbids"])
    d.arrow("user", "shuffler", ["check-in (no payload)"])
    d.arrow("shuffler", "user", ["second invitation: c users checked in"])
    d.note(
        "user",
        ["5. clip, round and add noise", "(PVEC counts; or seal to the analyzer)", "6. RECORD the spend (fsync),"]
        + ["then let the message leave"],
    )
    d.arrow("user", "shuffler", ["contribution (summed counts or ciphertexts)"])
    d.note("shuffler", ["7. validate every message;", "release only if >= c_min arrived;", "add counts / permute"])
    d.arrow("shuffler", "analyzer", ["batch: totals or shuffled messages", "(no ids, no addresses, no order)"])
    d.note("analyzer", ["8. decode, COMMIT the round in", "the ledger, optimizer step,", "evaluate on held-out data"])
    d.caption("analyzer", "repeat 1-8 for each round")
    d.arrow("analyzer", "out", ["9. release"])
    d.note("out", ["model.npz (mean of", "the iterates), ledger,", "summary, plot"])
    assert d.y < H, d.y
    return "\n".join([*d.out, "</svg>"]) + "\n"


if __name__ == "__main__":
    (Path(__file__).resolve().parent.parent / "img" / "round.svg").write_text(draw())
