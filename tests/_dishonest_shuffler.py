"""A dishonest shuffler, as a test fixture (issue 43): the project's own shuffler (`shuffledp serve shuffler ...`)
with two hooks. It rewrites every invitation it relays as the file MODE_FILE says at that moment, and it tries to
open every sealed message it receives with an X25519 key of its own, counting in REPORT_FILE (JSON) how many it
opened. Usage: python _dishonest_shuffler.py MODE_FILE REPORT_FILE <serve shuffler arguments>.

Modes: "honest"; "swap_key_signed" (its own key in the signed bytes), "swap_key_unsigned" (the signature dropped, its
key in a plain spec), "swap_key_beside" (the signed spec kept, a plain spec with its key beside it); and rewrites of
one field inside the signed bytes: "noise_multiplier", "m", "p", "max_participations", "clip_norm", "model_digest".
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from shuffledp.services import shuffler as honest

from shuffledp import cli
from shuffledp.security import sealing
from shuffledp.transport.spec_signing import second_spec
from shuffledp.v1 import shuffledp_pb2 as pb

MODE_FILE, REPORT_FILE = Path(sys.argv[1]), Path(sys.argv[2])
_private, _public = sealing.generate_keypair()
_lock = threading.Lock()
_seen = {"sealed": 0, "opened": 0, "invitations": 0, "rewritten": 0}


def _rewrite(spec: pb.RoundSpec, mode: str) -> None:
    r = spec.randomizer
    if mode.startswith("swap_key"):
        spec.analyzer_public_key = _public
    elif mode == "noise_multiplier":
        r.extra["noise_multiplier"] = 10 * r.extra["noise_multiplier"]
    elif mode == "m":
        r.m = max(1, r.m // 4)
    elif mode == "p":
        r.p = r.p / 4
    elif mode == "max_participations":
        spec.participation.max_per_tree += 1
    elif mode == "clip_norm":
        r.clip_norm = 10 * r.clip_norm
    elif mode == "model_digest":
        spec.model_digest = "0" * 64
    else:
        raise ValueError(f"unknown mode {mode!r}")


def _invitation(invite) -> pb.Invitation:
    inv = _honest_invitation(invite)
    mode = MODE_FILE.read_text().strip()
    with _lock:
        _seen["invitations"] += 1
        _seen["rewritten"] += mode != "honest"
        REPORT_FILE.write_text(json.dumps(_seen))
    if mode == "honest":
        return inv
    spec = pb.RoundSpec.FromString(inv.signed_spec.spec)
    if mode in ("swap_key_unsigned", "swap_key_beside"):
        if inv.checked_in:
            spec = second_spec(spec, inv.checked_in)
        _rewrite(spec, mode)
        if mode == "swap_key_unsigned":
            inv.ClearField("signed_spec")
            inv.checked_in = 0
        inv.spec.CopyFrom(spec)
        return inv
    _rewrite(spec, mode)
    inv.signed_spec.spec = spec.SerializeToString()
    return inv


def _submission(c: pb.Contribution, node_id: str):
    info = sealing.round_info(c.run_id, c.round)
    for m in c.messages:
        if m.WhichOneof("payload") == "sealed":
            for ct in m.sealed.ciphertexts:
                try:
                    sealing.open_sealed(_private, ct, info)
                    opened = 1
                except sealing.SealingError:
                    opened = 0
                with _lock:
                    _seen["sealed"] += 1
                    _seen["opened"] += opened
    with _lock:
        REPORT_FILE.write_text(json.dumps(_seen))
    return _honest_submission(c, node_id)


_honest_invitation, _honest_submission = honest._invitation, honest._submission
honest._invitation, honest._submission = _invitation, _submission

if __name__ == "__main__":
    sys.exit(cli.main(["serve", "shuffler", *sys.argv[3:]]))
