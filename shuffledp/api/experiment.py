"""Run an experiment from Python, exactly as `shuffledp run` does (the same code: shuffledp.cli.run's RunSession).

    import shuffledp.api as sdp

    result = sdp.run({"privacy": {"eps": 4.0}, "schedule": {"rounds": 8}})   # the embedded local deployment
    result.metrics            # per-round DataFrame
    result.model.predict(X)   # the released model
    result.spend.eps          # what the ledger charged

    with sdp.start("my.toml", out="results/a") as exp:   # stream the rounds as they come
        for r in exp:
            print(r.round, r.accuracy, r.eps_spent)
    result = exp.result()

A local run starts the shuffler, the analyzer and the client nodes as separate processes (their own process group,
stopped when the run ends, and by their lifeline when this process or its notebook kernel dies); `analyzer=` drives
a running deployment instead (with `pki=`, `server_name=` as `shuffledp run --analyzer`). The progress lines and the
final summary are the command's, printed to this process's stdout (a notebook cell shows them as they come).

Ctrl-C (a notebook's interrupt) behaves as in the command: the run is cancelled, what the analyzer had is written
to the results directory and the spend printed; then RunInterrupted (a KeyboardInterrupt) is raised carrying that
partial Result. Configuration mistakes raise RunRefused with the command's one line, before anything starts.
"""

from __future__ import annotations

import contextlib
import os
import tomllib
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from shuffledp.api.result import Result, RoundResult, load_result
from shuffledp.api.settings import ConfigSource, apply_settings, config_document, dumps
from shuffledp.cli.run import (
    CALL_TIMEOUT_S,
    GIVE_UP_S,
    Cluster,
    Interrupted,
    RunRefused,
    RunSession,
    RunStep,
    prepare_run,
    print_summary,
    run_args,
)
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["Experiment", "RunInterrupted", "RunRefused", "config_text", "run", "start"]

OnRound = Callable[[RoundResult], object]


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or Experiment.cancel) ended the run: it was cancelled and what the analyzer had was written to `out`.
    `result` is that partial Result (None when the analyzer gave nothing)."""

    def __init__(self, message: str, result: Result | None, out: Path):
        super().__init__(message)
        self.result, self.out = result, out


def config_text(config: ConfigSource = None, settings: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """(TOML text, label) of a configuration with dotted-key settings on top (shuffledp.api.settings): a file's text
    is kept verbatim when nothing is set on it."""
    doc, text, label = config_document(config)
    if settings:
        return dumps(apply_settings(doc, settings)), label
    return (text if text is not None else dumps(doc)), label


class Experiment:
    """A started run. Iterate over it for its rounds (RoundResult) as the analyzer reports them; `result()` waits for
    the end and returns the Result. The run proceeds in the services whether or not it is iterated; its progress
    lines are printed as it is followed. Use it as a context manager: leaving the block by an exception (Ctrl-C
    included) before the run ended cancels it and writes what it has; leaving it normally waits for the end."""

    def __init__(self, session: RunSession, steps: Generator[RunStep, None, pb.RunResult], on_round: OnRound | None):
        self._session, self._steps, self._on_round = session, steps, on_round
        self._pending: deque[RoundResult] = deque()
        self._result: Result | None = None
        self.run_id = ""
        self.rounds_planned = 0

    # ------------------------------------------------------------------------------------------------ facts
    @property
    def out(self) -> Path:
        """The run's results directory."""
        return self._session.out

    @property
    def config_toml(self) -> str:
        """The configuration the run was created with (config.toml)."""
        return self._session.config_toml

    @property
    def done(self) -> bool:
        """Whether the run has ended and its results are written."""
        return self._result is not None

    # ------------------------------------------------------------------------------------------ the stream
    def __iter__(self) -> Iterator[RoundResult]:
        return self

    def __next__(self) -> RoundResult:
        while not self._pending:
            if self._result is not None:
                raise StopIteration
            self._advance()
        return self._pending.popleft()

    def _advance(self) -> None:
        """One status from the analyzer: its new rounds queued (and shown to on_round), or the run's end."""
        try:
            try:
                status, new, have = next(self._steps)
            except StopIteration as done:
                self._complete(done.value)
                return
            self.rounds_planned = status.rounds_planned
            rounds = [RoundResult.from_metrics(m, status.rounds_planned) for m in new]
            try:
                watch = self._session.on_status
                if watch is not None:
                    watch(status, new, have)
                for r in rounds:
                    if self._on_round is not None:
                        self._on_round(r)
            except KeyboardInterrupt:  # in a callback: cancelled as anywhere else
                self._steps.throw(KeyboardInterrupt())
            self._pending.extend(rounds)
        except Interrupted as exc:
            self._interrupted(exc)
        except BaseException:
            self._session.close()
            raise

    def _complete(self, result: pb.RunResult) -> None:
        session = self._session
        try:
            session.finish(result)
        finally:
            session.close()
        status = print_summary(result, session.out, session.started)
        self._result = load_result(session.out, exit_status=status)

    def _interrupted(self, exc: Interrupted) -> None:
        session = self._session
        try:
            session.interrupted(exc)
        finally:
            session.close()
        partial = load_result(session.out, exit_status=130) if (session.out / "summary.json").exists() else None
        if partial is not None:
            self._result = partial
        what = f"run {exc.run_id} cancelled" if exc.run_id else "no run was started"
        raise RunInterrupted(f"{what}; results so far in {session.out}", partial, session.out) from None

    def result(self) -> Result:
        """Follow the run to its end (its rounds go to on_round and the progress lines); its Result, written to
        `out`. RunInterrupted on Ctrl-C; ServiceFailed, AnalyzerLost or grpc.RpcError when the run could not be
        followed (a local run's services stopped)."""
        while self._result is None:
            self._advance()
        return self._result

    wait = result

    def cancel(self) -> Result | None:
        """Cancel the run (as Ctrl-C does): what the analyzer had is written and the spend printed; that partial
        Result (None if there was none). A run that ended already: its Result."""
        if self._result is not None:
            return self._result
        try:
            self._steps.throw(KeyboardInterrupt())
        except Interrupted as exc:
            try:
                self._interrupted(exc)
            except RunInterrupted as stopped:
                return stopped.result
        except StopIteration as done:  # ended meanwhile
            self._complete(done.value)
        return self._result

    def close(self) -> None:
        """Cancel the run if it has not ended (see cancel), and stop a local run's services."""
        with contextlib.suppress(KeyboardInterrupt):
            if self._result is None:
                self.cancel()
        self._steps.close()
        self._session.close()

    def __enter__(self) -> Experiment:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        if exc is None:
            self.result()
        elif not isinstance(exc, RunInterrupted):
            self.close()
        return None

    def __repr__(self) -> str:
        state = "done" if self._result is not None else "running"
        return f"Experiment(run_id={self.run_id!r}, {state}, out={str(self.out)!r})"


def start(
    config: ConfigSource = None,
    settings: Mapping[str, Any] | None = None,
    *,
    config_toml: str | None = None,
    label: str | None = None,
    out: str | os.PathLike[str] | None = None,
    reuse_out: bool = False,
    quiet: bool = False,
    analyzer: str | None = None,
    pki: str | os.PathLike[str] | None = None,
    server_name: str = "analyzer",
    tensorboard: str | os.PathLike[str] | None = None,
    metrics_port: int = 0,
    on_round: OnRound | None = None,
    services: tuple[Cluster, str] | None = None,
    checked: bool = False,
    give_up_s: float = GIVE_UP_S,
    call_timeout_s: float = CALL_TIMEOUT_S,
    **options: Any,
) -> Experiment:
    """Check, start and create a run; return it once the analyzer has started it.

    config: a TOML file (str or path), a dict of its document ({"privacy": {"eps": 4}} or {"privacy.eps": 4}), or
    None for the embedded default; or config_toml, the TOML text itself. settings: dotted keys set on top
    ({"privacy.eps": 4}; privacy.protocol follows shuffledp.api.settings' rules). label names the run (default: the
    file's stem, "default" or "config"). The other arguments are `shuffledp run`'s options of the same name (out:
    default results/<label>-<time>; analyzer: a running deployment instead of local processes); `options` any
    other option of the command by its name (e.g. seed=, once the command has it). on_round sees every round as it
    arrives. services: (a Cluster and its analyzer's address) already started for this configuration's [data],
    [deployment] and [policy] (sweeps); checked: the caller ran check_before_start on this configuration already.
    RunRefused (the command's one line) when the run cannot start."""
    if config_toml is not None:
        if config is not None:
            raise TypeError("give config or config_toml, not both")
        doc_label = "config"
        text = config_text(tomllib.loads(config_toml), settings)[0] if settings else config_toml
    else:
        text, doc_label = config_text(config, settings)
    label = label or doc_label
    path_options = {"out": out, "pki": pki, "tensorboard": tensorboard}
    args = run_args(
        reuse_out=reuse_out,
        quiet=quiet,
        analyzer=analyzer,
        server_name=server_name,
        metrics_port=metrics_port,
        **{k: Path(v) if v is not None else None for k, v in path_options.items()},
        **options,
    )
    source = label
    if isinstance(config, str | os.PathLike):
        source = str(config)
    elif config is None and config_toml is None:
        source = "default config"
    session = prepare_run(
        args,
        config_toml=text,
        label=label,
        source=source,
        give_up_s=give_up_s,
        call_timeout_s=call_timeout_s,
        services=services,
        checked=checked,
    )
    session.open()
    experiment: Experiment | None = None
    try:
        session.start()
        steps = session.steps(on_created=lambda run_id: setattr(experiment, "run_id", run_id))
        experiment = Experiment(session, steps, on_round)
        try:
            status, _, _ = next(steps)  # created and started
        except Interrupted as exc:
            experiment._interrupted(exc)
        experiment.rounds_planned = status.rounds_planned
        return experiment
    except BaseException:
        session.close()
        raise


def run(
    config: ConfigSource = None,
    settings: Mapping[str, Any] | None = None,
    *,
    on_round: OnRound | None = None,
    **options: Any,
) -> Result:
    """Run an experiment to its end and return its Result (start's arguments). In a notebook the progress lines
    appear as the rounds come; Ctrl-C cancels the run, writes what it has, prints the spend and raises
    RunInterrupted with the partial Result."""
    experiment = start(config, settings, on_round=on_round, **options)
    try:
        return experiment.result()
    except RunInterrupted:
        raise
    except BaseException:
        experiment.close()
        raise
