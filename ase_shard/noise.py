"""Random numbers keyed by atom: the same for an atom whichever rank holds it (numba).

A thermostat on :class:`~ase_shard.distributed.DistributedAtoms` draws noise for
the atoms each rank holds. Drawn from a stream, the numbers would depend on
which rank holds which atom, in which order: a run would differ with the number
of ranks, and a run resumed from a checkpoint (whose partition is cut afresh)
would leave the uninterrupted one. :class:`AtomNoise` is counter-based instead
(Philox-4x32-10, Salmon et al., SC'11, the generator of numpy's ``Philox`` and of
cuRAND): an atom's deviates at a step are a function of the seed, the step, the
draw and the atom's global id alone. Each takes two 64-bit uniforms made of
four 32-bit words and one Box-Muller transform per pair of coordinates.
"""

from __future__ import annotations

import numba
import numpy as np

# Philox-4x32's multipliers and key increments (the golden ratio, sqrt(3) - 1)
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)
_ROUNDS = 10


class AtomNoise:
    """Standard normal deviates keyed by ``(seed, step, draw, atom id)``.

    Attributes
    ----------
    seed : int
        The key, below 2**64 (a checkpoint records it with the integrator).
    """

    def __init__(self, seed: int):
        self.seed = int(seed)

    def normals(self, ids: np.ndarray, step: int, draw: int) -> np.ndarray:
        """``(len(ids), 3)`` deviates of the atoms ``ids`` (global ids, below 2**63) at
        ``step`` (below 2**56); ``draw`` (0-255) tells apart several at one step."""
        out = np.empty((len(ids), 3))
        _normals(np.asarray(ids, dtype=np.int64), int(step), int(draw), self.seed, out)
        return out


@numba.njit(cache=True, inline="always")
def _philox(c0, c1, c2, c3, k0, k1):  # pragma: no cover - compiled
    """The four 32-bit words of one Philox-4x32-10 block (in 64-bit integers)."""
    for _ in range(_ROUNDS):
        product0 = _M0 * c0
        product1 = _M1 * c2
        c0, c1, c2, c3 = (
            ((product1 >> _32) ^ c1 ^ k0) & _MASK,
            product1 & _MASK,
            ((product0 >> _32) ^ c3 ^ k1) & _MASK,
            product0 & _MASK,
        )
        k0 = (k0 + _W0) & _MASK
        k1 = (k1 + _W1) & _MASK
    return c0, c1, c2, c3


@numba.njit(cache=True)
def _normals(ids, step, draw, seed, out):  # pragma: no cover - compiled
    k0 = np.uint64(seed) & _MASK
    k1 = np.uint64(seed) >> _32
    c2 = np.uint64(step) & _MASK
    high = ((np.uint64(step) >> _32) << np.uint64(16)) | np.uint64(draw << 8)
    scale = 2.0**-53
    for i in range(ids.shape[0]):
        atom = np.uint64(ids[i])
        c0 = atom & _MASK
        c1 = atom >> _32
        for block in range(2):  # four uniforms, three of them used
            w0, w1, w2, w3 = _philox(c0, c1, c2, high | np.uint64(block), k0, k1)
            # 53 bits each, in (0, 1]: the logarithm below stays finite
            u0 = ((w0 << np.uint64(21)) | (w1 >> np.uint64(11))) + np.uint64(1)
            u1 = ((w2 << np.uint64(21)) | (w3 >> np.uint64(11))) + np.uint64(1)
            radius = np.sqrt(-2.0 * np.log(u0 * scale))
            angle = 2.0 * np.pi * (u1 * scale)
            if block == 0:
                out[i, 0] = radius * np.cos(angle)
                out[i, 1] = radius * np.sin(angle)
            else:
                out[i, 2] = radius * np.cos(angle)
