"""How a node's contribution travels: cut into Contributions of at most about SUBMIT_CHUNK_BYTES each (a round's
answer for 10^6 users is far above one gRPC message), by messages or, for columns, by consecutive users and whole
sum groups; the refusals travel with the first part. Split out of the node (issue 47)."""

from __future__ import annotations

from shuffledp.transport import grpc_options
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["split_contribution"]


def split_contribution(c: pb.Contribution, max_bytes: int = grpc_options.SUBMIT_CHUNK_BYTES) -> list[pb.Contribution]:
    """`c` as Contributions of at most about max_bytes each (all messages of a round have one size); the refusals
    travel with the first. One Contribution if it fits."""
    if c.ByteSize() <= max_bytes:
        return [c]
    if c.HasField("columns"):  # the columns of a COUNTS round or a check-in (never with messages)
        return _split_columns(c, max_bytes)
    per_message = c.messages[0].ByteSize() + 8  # + field tag and length prefix
    k = max(1, max_bytes // per_message)
    parts = []
    for start in range(0, len(c.messages), k):
        part = pb.Contribution(run_id=c.run_id, round=c.round, node_id=c.node_id)
        part.messages.extend(c.messages[start : start + k])
        parts.append(part)
    parts[0].refusals.extend(c.refusals)
    return parts


def _split_columns(c: pb.Contribution, max_bytes: int) -> list[pb.Contribution]:
    """By consecutive users; with sums (UserColumns.sums) or Prio3 reports (UserColumns.reports), at group boundaries,
    each part with its groups' sums or reports."""
    cols = c.columns
    n = len(cols.user_ids)
    row = len(cols.counts) // n  # bytes of one user's counts (0 in a check-in or with sums)
    per_user = cols.nonce_bytes + row + max(len(u) for u in cols.user_ids) + 3  # + tag and length of its id
    k = max(1, max_bytes // per_user)
    group = cols.sum_users if cols.sums or cols.reports else 0
    if group:
        groups = -(-n // group)
        sum_bytes = len(cols.sums) // groups
        report_bytes = max((r.ByteSize() + 8 for r in cols.reports), default=0)  # + tag and length prefix
        k = group * max(1, max_bytes // (group * per_user + sum_bytes + report_bytes))  # whole groups only
    parts = []
    for a in range(0, n, k):
        b = min(n, a + k)
        part = pb.Contribution(run_id=c.run_id, round=c.round, node_id=c.node_id)
        part.columns.user_ids.extend(cols.user_ids[a:b])
        part.columns.nonce_bytes = cols.nonce_bytes
        part.columns.nonces = cols.nonces[a * cols.nonce_bytes : b * cols.nonce_bytes]
        part.columns.counts = cols.counts[a * row : b * row]
        if group:
            part.columns.sums = cols.sums[a // group * sum_bytes : -(-b // group) * sum_bytes]
            part.columns.reports.extend(cols.reports[a // group : -(-b // group)])
            part.columns.sum_users = group
        parts.append(part)
    parts[0].refusals.extend(c.refusals)
    return parts
