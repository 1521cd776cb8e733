"""Input generators of tests/test_fuzz_rpcs.py: raw garbage, mutated valid messages, bit-flipped serializations.

Everything is drawn from one `random.Random(seed)`: the inputs are test data, not privacy noise, so a fixed seed is
what we want (a failure names its seed and is reproduced by rerunning the same generator).
"""

from __future__ import annotations

import math
import os
import random
import re

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

# Integer edges per protobuf scalar type: the wire extremes are where length and overflow bugs live.
_U32, _U64 = 2**32 - 1, 2**64 - 1
_I32 = (-(2**31), 2**31 - 1)
_I64 = (-(2**63), 2**63 - 1)
_INT_RANGES: dict[int, tuple[int, int]] = {
    FieldDescriptor.TYPE_UINT32: (0, _U32),
    FieldDescriptor.TYPE_FIXED32: (0, _U32),
    FieldDescriptor.TYPE_UINT64: (0, _U64),
    FieldDescriptor.TYPE_FIXED64: (0, _U64),
    FieldDescriptor.TYPE_INT32: _I32,
    FieldDescriptor.TYPE_SINT32: _I32,
    FieldDescriptor.TYPE_SFIXED32: _I32,
    FieldDescriptor.TYPE_INT64: _I64,
    FieldDescriptor.TYPE_SINT64: _I64,
    FieldDescriptor.TYPE_SFIXED64: _I64,
}
_DOUBLES = (
    math.nan,
    math.inf,
    -math.inf,
    0.0,
    -0.0,
    5e-324,
    1e-300,
    1.7976931348623157e308,
    -1.7976931348623157e308,
    2.0**64,
    -1.0,
    1.0,
)
# Words the services branch on: without them a random string almost never gets past the first check.
_DOMAIN_WORDS = (
    "pvec",
    "rr",
    "gaussian",
    "logreg",
    "leastsq",
    "counts",
    "bits",
    "shuffledp.v1.Shuffler",
    "shuffledp.v1.Analyzer",
    "shuffledp.v1.ClientNode",
)
_ODD_STRINGS = ("", " ", "\x00", "\x00" * 7, "\n\t\r", "é" * 3, "\u202e", "\U0001f600", "%s%n", "../" * 20, "a" * 129)


class Fuzzer:
    """Deterministic generator of request bytes for one seed. `huge` is the length of a "huge" string/bytes;
    `max_bytes` bounds a generated message's serialization (message() redraws larger ones)."""

    def __init__(self, seed: int, huge: int = 256 * 1024, max_bytes: int = 3 * 2**20) -> None:
        self.rng = random.Random(seed)
        self.huge = huge
        self.max_bytes = max_bytes

    # ----- (a) raw garbage ----------------------------------------------------------------------------------------
    def garbage(self) -> bytes:
        """Random bytes, mostly short; sometimes protobuf-shaped (a tag, a length) so parsing goes deeper."""
        r = self.rng
        kind = r.random()
        if kind < 0.5:
            return r.randbytes(r.randint(1, 64))
        if kind < 0.75:
            return r.randbytes(r.randint(65, 4096))
        if kind < 0.95:
            # length-delimited field 1..15 announcing more (or fewer) bytes than follow
            tag = (r.randint(1, 15) << 3) | 2
            return bytes([tag, r.randint(0, 255)]) + r.randbytes(r.randint(0, 32))
        # an over-long varint / a group start tag: classic parser edge cases
        return r.choice([b"\xff" * r.randint(10, 20), b"\x0b" + r.randbytes(8), b"\x08" + b"\x80" * 11])

    # ----- (b) valid messages with mutated fields ----------------------------------------------------------------
    def _int(self, ftype: int) -> int:
        lo, hi = _INT_RANGES[ftype]
        r = self.rng
        return r.choice([lo, hi, 0, 1, max(lo, -1), hi // 2 + 1, r.randint(lo, hi), r.randint(0, min(hi, 1000))])

    def string(self) -> str:
        r = self.rng
        x = r.random()
        if x < 0.2:
            return r.choice(_ODD_STRINGS)
        if x < 0.35:
            return r.choice(_DOMAIN_WORDS)
        if x < 0.5:
            return "x" * r.randint(self.huge // 4, self.huge)  # huge
        n = r.randint(1, 40)
        # any code point but lone surrogates (which a proto3 string cannot hold: the library refuses them)
        return "".join(
            chr(r.choice([r.randint(0x20, 0x7E), r.randint(0, 0xD7FF), r.randint(0xE000, 0x10FFFF)])) for _ in range(n)
        )

    def bytes_(self) -> bytes:
        r = self.rng
        x = r.random()
        if x < 0.2:
            return b""
        if x < 0.25:
            return r.randbytes(r.randint(self.huge // 4, self.huge))
        return r.randbytes(r.choice([1, 16, 32, 33, r.randint(0, 200)]))

    def _scalar(self, f: FieldDescriptor) -> object:
        t = f.type
        if t in _INT_RANGES:
            return self._int(t)
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            v = self.rng.choice([*_DOUBLES, self.rng.uniform(-1e6, 1e6), self.rng.random()])
            if t == FieldDescriptor.TYPE_FLOAT and math.isfinite(v) and abs(v) > 3.4e38:
                v = math.inf  # a float field cannot hold it; inf is the same edge
            return v
        if t == FieldDescriptor.TYPE_BOOL:
            return self.rng.random() < 0.5
        if t == FieldDescriptor.TYPE_STRING:
            return self.string()
        if t == FieldDescriptor.TYPE_BYTES:
            return self.bytes_()
        if t == FieldDescriptor.TYPE_ENUM:
            known = [v.number for v in f.enum_type.values]
            # proto3 enums are open: unknown numbers are valid on the wire and must be handled
            return self.rng.choice([*known, *known, -1, len(known), _I32[1]])
        raise AssertionError(f"unhandled field type {t} of {f.full_name}")

    def _count(self, depth: int) -> int:
        r = self.rng
        if depth >= 3:
            return 0
        if depth == 0 and r.random() < 0.05:
            return r.randint(100, 1000)  # many elements, only at the top level (bounded request size)
        return r.choice([0, 1, 1, 2, 3, r.randint(4, 20)])

    def fill(self, msg: Message, depth: int = 0, p_set: float = 0.7) -> Message:
        """Set a random subset of `msg`'s fields to random (edge) values, recursively (bounded depth)."""
        for f in msg.DESCRIPTOR.fields:
            if self.rng.random() <= p_set:
                self._fill_field(msg, f, depth)
        return msg

    def _fill_field(self, msg: Message, f: FieldDescriptor, depth: int) -> None:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key_f, val_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            m = getattr(msg, f.name)
            for _ in range(self._count(depth)):
                k = self._scalar(key_f)
                if val_f.message_type is not None:
                    self.fill(m[k], depth + 1)
                else:
                    m[k] = self._scalar(val_f)
        elif f.is_repeated:
            rep = getattr(msg, f.name)
            for _ in range(self._count(depth)):
                if f.message_type is not None:
                    self.fill(rep.add(), depth + 1)
                else:
                    rep.append(self._scalar(f))
        elif f.message_type is not None:
            if depth < 3:
                self.fill(getattr(msg, f.name), depth + 1)
                getattr(msg, f.name).SetInParent()  # present even if nothing inside was set
        else:
            setattr(msg, f.name, self._scalar(f))

    def mutate(self, msg: Message, n: int) -> Message:
        """Change `n` randomly chosen fields of `msg` in place (a sub-message: one of its fields, or all anew)."""
        fields = msg.DESCRIPTOR.fields
        for _ in range(n if fields else 0):
            f = self.rng.choice(fields)
            if f.message_type is not None and not f.is_repeated and self.rng.random() < 0.7:
                self.mutate(getattr(msg, f.name), 1)
            else:
                msg.ClearField(f.name)
                self._fill_field(msg, f, 0)
        return msg

    def message(self, cls: type[Message], template: Message | None = None) -> Message:
        """A `cls` with mutated fields whose serialization is at most `max_bytes` (redrawn otherwise): half of
        the time a valid `template` with 0-3 fields changed (gets past the first checks; 0 because a one-field
        message changed is just random), else random fields."""
        for _ in range(20):
            if template is not None and self.rng.random() < 0.5:
                msg = cls()
                msg.CopyFrom(template)
                self.mutate(msg, self.rng.randint(0, 3))
            else:
                msg = self.fill(cls())
            if msg.ByteSize() <= self.max_bytes:
                return msg
        return cls()

    # ----- (c) bit flips ------------------------------------------------------------------------------------------
    def bitflip(self, data: bytes) -> bytes:
        """`data` with 1..8 random bits flipped (or, for an empty message, a few random bytes)."""
        if not data:
            return self.rng.randbytes(self.rng.randint(1, 4))
        b = bytearray(data)
        for _ in range(self.rng.randint(1, 8)):
            i = self.rng.randrange(len(b) * 8)
            b[i // 8] ^= 1 << (i % 8)
        return bytes(b)

    # ----- configuration text (CreateRun) -------------------------------------------------------------------------
    def toml(self, base: str) -> str:
        """`base` (a valid run configuration) with random values replaced, lines dropped or duplicated."""
        r = self.rng
        literals = [
            "18446744073709551615",
            "-9223372036854775808",
            "99999999999999999999999",
            "nan",
            "inf",
            "-inf",
            "1e308",
            "-1",
            "0",
            '""',
            '"' + "z" * 5000 + '"',
            "true",
            "[]",
            "[1, 2, 3]",
            "{}",
            '"\\u0000"',
        ]
        out = []
        for line in base.splitlines():
            x = r.random()
            if x < 0.05:
                continue  # drop
            if x < 0.08:
                out.append(line)  # duplicate (a duplicate key is invalid TOML)
            if x < 0.3 and re.match(r"^\s*\w+\s*=", line):
                key = line.split("=", 1)[0]
                line = f"{key}= {r.choice(literals)}"
            out.append(line)
        if r.random() < 0.1:
            out.append(f"[{r.choice(['data', 'nosuchsection', 'privacy'])}]\n{r.choice(['x', 'eps'])} = 1")
        return "\n".join(out)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (/proc/PID/stat), in seconds."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (VmRSS of /proc/PID/status), in bytes."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0  # a zombie has no VmRSS line
