"""Live terminal view of `shuffledp run` (issue 29 item 4): when stdout is a terminal, a status line at the bottom,
redrawn in place, shows the rounds done with a progress bar and ETA, and the eps spent against the run's limit; the
per-round lines print above it as before. Not a terminal (a file, a pipe, CI): not used, the lines alone."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["LiveView", "status_line"]

_CLEAR = "\r\x1b[2K"  # back to the line's start and erase it (ANSI; every terminal emulator in use has it)


def _bar(fraction: float, width: int) -> str:
    full = round(max(0.0, min(1.0, fraction)) * width)
    return "#" * full + "." * (width - full)


def _clock_text(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def status_line(done: int, planned: int, eps: float, eps_limit: float, eta: float | None, width: int = 100) -> str:
    """`rounds [####......] 3/10  ETA 0:42  eps 2.876/8 [###.....]`, cut to `width` characters."""
    rounds = f"rounds [{_bar(done / planned if planned else 0.0, 20)}] {done}/{planned or '?'}"
    eta_text = "ETA --:--" if eta is None else f"ETA {_clock_text(eta)}"
    budget = f"eps {eps:.3f}/{eps_limit:g} [{_bar(eps / eps_limit if eps_limit > 0 else 0.0, 10)}]"
    return f"{rounds}  {eta_text}  {budget}"[:width]


class LiveView:
    """drive_run's echo (lines above the status line) and on_status (the status line); close() erases it."""

    def __init__(self, stream: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = stream
        self._clock = clock
        self._line = ""
        self._started: float | None = None  # when the first round began (the plan was known)
        self._done_at_start = 0

    def _draw(self) -> None:
        self._out.write(_CLEAR + self._line)
        self._out.flush()

    def echo(self, text: str = "") -> None:
        self._out.write(_CLEAR + text + "\n")
        self._draw()

    def update(self, status: pb.RunStatus, new: Sequence[pb.RoundMetrics], seen: int) -> None:
        del new  # the view shows totals only: the rounds seen in all
        planned, done = int(status.rounds_planned), min(seen, int(status.rounds_planned))
        if planned and self._started is None:
            self._started, self._done_at_start = self._clock(), done
        eta = None
        if self._started is not None and done > self._done_at_start:
            # rounds of one run take about the same time: the mean so far times the rounds left
            per_round = (self._clock() - self._started) / (done - self._done_at_start)
            eta = per_round * (planned - done)
        b = status.budget
        width = max(40, shutil.get_terminal_size((100, 24)).columns - 1)
        self._line = status_line(done, planned, b.eps_spent, b.eps_limit, eta, width)
        self._draw()

    def close(self) -> None:
        """Erase the status line (the summary prints where it was)."""
        if self._line:
            self._out.write(_CLEAR)
            self._out.flush()
            self._line = ""
