"""A run's checkpoint between rounds: the optimizer's state and, for a protocol whose analyzer adds the noise
(DP-FTRL's tree), its noise state, as one .npz blob in the ledger, so that a restart redraws no released noise."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from shuffledp.optimizers.base import Optimizer
from shuffledp.optimizers.psgd import AveragingState
from shuffledp.protocols.base import RoundProtocol

__all__ = ["RunState", "encode_state", "decode_state", "decode_run_state"]

_NOISE_PREFIX = "noise."


class RunState(NamedTuple):
    """A run between rounds: the optimizer's state, and the noise state of a protocol whose analyzer adds the
    noise (DP-FTRL's tree) or None. Both go into every checkpoint, so a restart redraws no released noise."""

    opt: Any
    noise: Any = None

    def to_arrays(self) -> dict[str, np.ndarray]:
        out = dict(self.opt.to_arrays())
        if self.noise is not None:
            out.update({_NOISE_PREFIX + k: v for k, v in self.noise.to_arrays().items()})
        return out


def encode_state(state: Any) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **state.to_arrays())
    return buf.getvalue()


def decode_state(blob: bytes, from_arrays: Callable[[dict[str, np.ndarray]], Any] = AveragingState.from_arrays) -> Any:
    """The optimizer's state of a checkpoint."""
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        return from_arrays({k: z[k] for k in z.files if not k.startswith(_NOISE_PREFIX)})


def decode_run_state(blob: bytes, opt: Optimizer, protocol: RoundProtocol, plan: dict[str, Any]) -> RunState:
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        noise = {k[len(_NOISE_PREFIX) :]: z[k] for k in z.files if k.startswith(_NOISE_PREFIX)}
    restored = protocol.noise_from_arrays(plan, noise) if noise else protocol.noise_state(plan)
    return RunState(decode_state(blob, opt.state_from_arrays), restored)
