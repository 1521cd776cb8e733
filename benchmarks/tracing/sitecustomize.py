"""Round tracing for benchmarks/trace_round.py: Python runs this file at start-up in every process whose PYTHONPATH
holds benchmarks/tracing. With SHUFFLEDP_TRACE_DIR set, it wraps the functions on a round's path so that each call
appends its entry and exit time (CLOCK_MONOTONIC: one clock for every process of the machine) to <dir>/<pid>.log.
Nothing in shuffledp changes; without the variable this file does nothing."""

from __future__ import annotations

import os

# module -> the functions (Class.method) traced in it: every process imports all three parties' modules here, and
# only the functions its own party calls leave lines in its log
TRACED = {
    "shuffledp.services.ledger": ["Ledger.reserve", "Ledger.save_checkpoint", "Ledger.totals", "Ledger.commit"],
    "shuffledp.services.run_manager": [
        "RunManager._round",
        "RunManager._metrics",
        "RunManager._evaluate",
        "RunManager._await_shuffler",
    ],
    "shuffledp.services.shuffler": ["ShufflerServicer._result"],
    "shuffledp.services.shuffler_state": [
        "ShufflerState.execute_round",
        "ShufflerState.submit",
        "ShufflerState._invite",
        "SqliteParticipationStore.record_round",
    ],
    "shuffledp.clients.node": [
        "ClientNodeHandle._answer",
        "NodeCore.handle",
        "NodeCore.prepare",
        "_Stream.send",
        "_Stream.resolve",
    ],
    "shuffledp.clients.policy": ["PolicyTable.decide"],
    "shuffledp.protocols.pvec_round": ["PvecRound.decode", "PvecRound.released"],
    "shuffledp.services.analyzer": ["AnalyzerServicer.GetRunStatus"],
    "shuffledp.clients.spend_store": ["SqliteSpendStore.record"],
}


def _install(directory: str) -> None:
    import functools
    import importlib
    import time

    log = open(os.path.join(directory, f"{os.getpid()}.log"), "a", buffering=1)  # noqa: SIM115 (process-long)

    def traced(name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            log.write(f"{time.monotonic_ns()} {name}\n")
            try:
                return fn(*args, **kwargs)
            finally:
                log.write(f"{time.monotonic_ns()} {name}/end\n")

        return wrapper

    for module_name, names in TRACED.items():
        module = importlib.import_module(module_name)
        for name in names:
            cls_name, method = name.split(".")
            cls = getattr(module, cls_name)
            setattr(cls, method, traced(name, getattr(cls, method)))


if os.environ.get("SHUFFLEDP_TRACE_DIR"):
    _install(os.environ["SHUFFLEDP_TRACE_DIR"])
