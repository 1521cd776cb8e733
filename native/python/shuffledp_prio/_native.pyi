"""Type stub of the Rust extension (native/src/lib.rs)."""

from collections.abc import Sequence
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt

PRIO_CRATE_VERSION: str
VDAF_DRAFT: str

class VdafError(ValueError):
    """A Prio3 operation failed: a bad parameter or measurement, or a message that did not decode or verify."""

class DecodeError(VdafError):
    """A message did not decode as this instance's encoding (wrong length, malformed)."""

class VerificationError(VdafError):
    """The joint verification rejected the report: FLP decision or joint randomness check failed."""

_Measurement = Sequence[int] | npt.NDArray[np.unsignedinteger]

class _Prio3SumVecBase:
    verify_key_size: ClassVar[int]  # 32
    nonce_size: ClassVar[int]  # 16
    @property
    def length(self) -> int: ...
    @property
    def max_measurement(self) -> int: ...
    @property
    def bits(self) -> int: ...
    @property
    def chunk_length(self) -> int: ...
    @property
    def num_proofs(self) -> int: ...
    @property
    def num_aggregators(self) -> int: ...
    @property
    def field(self) -> Literal["Field128", "Field64"]: ...
    @property
    def algorithm_id(self) -> int: ...
    @property
    def ctx(self) -> bytes: ...
    def shard(self, measurement: _Measurement, nonce: bytes) -> tuple[bytes, ...]:
        """(public_share, leader_input_share, helper_input_share): fresh randomness from the OS CSPRNG.
        Raises VdafError for a measurement of the wrong length or with an entry above max_measurement."""
    def _shard_with_rand(self, measurement: _Measurement, nonce: bytes, rand: bytes) -> tuple[bytes, ...]:
        """shard with fixed randomness: for the published test vectors only."""
    def _shard_out_of_range(self, measurement: _Measurement, nonce: bytes, index: int, value: int) -> tuple[bytes, ...]:
        """A dishonest Client's report claiming `value` for entry `index`: for the rejection tests only."""
    def prepare_init(
        self, verify_key: bytes, agg_id: int, nonce: bytes, public_share: bytes, input_share: bytes
    ) -> tuple[bytes, bytes]:
        """(prep_state, prep_share) of Aggregator agg_id. prep_state stays with the Aggregator. Raises DecodeError
        for a share that does not decode."""
    def prep_shares_to_prep(self, prep_shares: Sequence[bytes]) -> bytes:
        """The verifier message from every Aggregator's prep share. Raises VerificationError when the proof check
        fails, DecodeError for a share that does not decode."""
    def prepare_next(self, prep_state: bytes, prep_message: bytes) -> bytes:
        """This Aggregator's output share. Raises VerificationError when the joint randomness does not match."""
    def aggregate(self, output_shares: Sequence[bytes], aggregate_share: bytes | None = None) -> bytes:
        """The sum of the output shares (added to aggregate_share when given)."""
    def unshard(self, aggregate_shares: Sequence[bytes], num_measurements: int) -> list[int]:
        """The aggregate result: the per-entry sums."""

class Prio3SumVec(_Prio3SumVecBase):
    """Prio3SumVec, draft-18 section 7.4.3: Field128, one proof, algorithm ID 0x00000003."""
    def __init__(
        self,
        length: int,
        max_measurement: int,
        chunk_length: int | None = None,
        *,
        num_proofs: int = 1,
        ctx: bytes = b"shuffledp/prio3sumvec",
        num_aggregators: int = 2,
    ) -> None: ...

class Prio3SumVecField64Multiproof(_Prio3SumVecBase):
    """Prio3SumVecWithMultiproof of the draft-18 reference code: Field64, >= 3 proofs, algorithm ID 0xFFFFFFFF."""
    def __init__(
        self,
        length: int,
        max_measurement: int,
        chunk_length: int | None = None,
        *,
        num_proofs: int = 3,
        ctx: bytes = b"shuffledp/prio3sumvec",
        num_aggregators: int = 2,
    ) -> None: ...
