"""A keyed pseudo-random permutation of [0, n) whose entry i costs O(1).

The sample order of an epoch is such a permutation, keyed by (seed, epoch): a
step's B entries cost O(B) time and memory, whatever n is, so no array of all
windows exists anywhere and every rank computes the same order on its own.

How: a balanced Feistel network over b-bit integers (b even, 2**b the next
power of four >= n) is a bijection of [0, 2**b) for any round function.
Values that land at or past n are encrypted again ("cycle-walking") until
they fall inside [0, n): following a permutation's cycle from a point of
[0, n) must come back into [0, n), so the result is a bijection of [0, n).
2**b < 4n, so the expected number of walks is below 4. The round function is
a splitmix64-style mixer of the half block and a round key; six rounds.
Everything is numpy uint64 arithmetic, which wraps (the mixer relies on it).
"""

import numpy as np

ROUNDS = 6
_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """Vigna's splitmix64 finaliser on a Python int: a well-mixed 64-bit key."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Permutation:
    """perm(positions) -> the entries at those positions of a permutation of [0, n)."""

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"a permutation of [0, {n}) is empty")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        base = splitmix64(splitmix64(seed) ^ epoch)
        self.keys = [np.uint64(splitmix64(base + r)) for r in range(ROUNDS)]

    def _round(self, right, key):
        x = (right ^ key) * np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(32)
        return x & self.mask

    def _encrypt(self, x):
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << half) | right

    def __call__(self, positions) -> np.ndarray:
        """Entries at `positions` (ints in [0, n)), as int64, in O(len(positions))."""
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        out = self._encrypt(x.astype(np.uint64))
        outside = np.flatnonzero(out >= np.uint64(self.n))
        while outside.size:  # cycle-walking: encrypt again until inside [0, n)
            out[outside] = self._encrypt(out[outside])
            outside = outside[out[outside] >= np.uint64(self.n)]
        return out.astype(np.int64)
