"""Shared helper of the analyzer tests: wait for a run to end through the real operator API."""

from __future__ import annotations

import time

from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg


def wait_for_run(stub: pbg.AnalyzerStub, run_id: str, timeout: float = 30) -> pb.RunStatus:
    """Poll GetRunStatus until the run leaves CREATED/RUNNING; AssertionError after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = stub.GetRunStatus(pb.RunRef(run_id=run_id))
        if st.state not in (pb.CREATED, pb.RUNNING):
            return st
        time.sleep(0.1)
    raise AssertionError(f"run {run_id} did not finish in {timeout} s")
