"""A seeded permutation of [0, n) that is computed where it is read, never stored.

A training split of 15T tokens in rows of 4,096 holds 3.7 billion rows: its shuffled index
(`numpy.random.permutation`) would take 29 GB on every rank, and be drawn again every epoch
and on every resume. `Permutation` maps any position to its row with a Feistel network of
six rounds over the smallest power of four that holds n (a bijection on that domain), and
walks a value that lands at or beyond n through the network again until it falls inside
(cycle walking keeps it a bijection on [0, n); the domain is under 4n, so fewer than four
passes are needed on average). A rank computes the rows of its own slice of a batch and
nothing else: its memory and work do not grow with the split, the run or the world size.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finalizer


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each element (uint64 arithmetic wraps, as the hash wants)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """`Permutation(n, seed, epoch)[positions]`: the rows at those positions of the epoch's
    order. The same (n, seed, epoch) always gives the same order, on every rank."""

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = int(n)
        self.half = max(1, (max(self.n - 1, 1).bit_length() + 1) // 2)  # 4**half >= n
        self.mask = np.uint64((1 << self.half) - 1)
        rng = np.random.default_rng((seed, epoch))
        self.keys = rng.integers(0, 2**64, size=ROUNDS, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x >> shift, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << shift) | right

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n}).")
        out = self._encrypt(positions.astype(np.uint64))
        outside = out >= self.n
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)
