"""A curious shuffler, as a test fixture (issue 45): the project's own shuffler (`shuffledp serve shuffler ...`) that
keeps a copy of everything it sees: every contribution the nodes send it, every invitation it relays, every batch it
hands the analyzer, and both sides of every FinishAggregation. It follows the protocol (honest but curious); the
test then attacks what it kept. Usage: python _curious_shuffler.py DUMP_DIR <serve shuffler arguments>.

Files in DUMP_DIR, numbered in the order they were made: contribution-N.pb (Contribution), invitation-N.pb
(Invitation), execute-N.pb (the analyzer's ExecuteRound request), batch-N.pb (ShuffledBatch),
aggregation-request-N.pb / aggregation-answer-N.pb (AggregationRequest, LeaderAggregate).
"""

from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path

from shuffledp.services import shuffler as honest

from shuffledp import cli
from shuffledp.v1 import shuffledp_pb2 as pb

DUMP = Path(sys.argv[1])
DUMP.mkdir(parents=True, exist_ok=True)
_lock = threading.Lock()
_seq = itertools.count()


def _keep(kind: str, message: bytes) -> None:
    with _lock:
        n = next(_seq)
    (DUMP / f"{kind}-{n}.pb").write_bytes(message)


def _submission(c: pb.Contribution, node_id: str):
    _keep("contribution", c.SerializeToString())
    return _honest_submission(c, node_id)


def _invitation(invite) -> pb.Invitation:
    inv = _honest_invitation(invite)
    _keep("invitation", inv.SerializeToString())
    return inv


def _request(wire: pb.RoundSpec):
    _keep("execute", wire.SerializeToString())
    return _honest_request(wire)


def _batch(b) -> pb.ShuffledBatch:
    out = _honest_batch(b)
    _keep("batch", out.SerializeToString())
    return out


def _finish_aggregation(self, request: pb.AggregationRequest) -> bytes:
    _keep("aggregation-request", request.SerializeToString())
    answer = _honest_finish(self, request)
    _keep("aggregation-answer", answer)
    return answer


_honest_submission, _honest_invitation, _honest_batch = honest._submission, honest._invitation, honest._batch
_honest_finish, _honest_request = honest.ShufflerServicer._finish_aggregation, honest._request
honest._request = _request
honest._submission, honest._invitation, honest._batch = _submission, _invitation, _batch
honest.ShufflerServicer._finish_aggregation = _finish_aggregation

if __name__ == "__main__":
    sys.exit(cli.main(["serve", "shuffler", *sys.argv[2:]]))
