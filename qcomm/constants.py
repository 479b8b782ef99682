"""The numbers every codec path shares, defined once: the oracle (:mod:`qcomm.oracle`),
the tuned torch path (:mod:`qcomm.cpu`) and the Triton kernels (``qcomm.kernels``)
import them from here, so the three cannot drift apart.

The random source of stochastic rounding is a counter-based hash (no RNG state): for
element pair counter ``c`` and 32-bit key ``k`` (from the seed, :func:`seed_key`),
``h = fmix32((lo32(c) * GOLDEN + k) ^ (hi32(c) * GOLDEN_HI))`` in uint32 arithmetic.
fmix32 is murmur3's finalizer, a bijection on uint32 with full avalanche, so
consecutive counters give independent-looking numbers; GOLDEN and GOLDEN_HI are
golden-ratio Weyl steps.
"""

from __future__ import annotations

MASK32 = 0xFFFFFFFF

# murmur3 fmix32: h ^= h >> 16; h *= C1; h ^= h >> 13; h *= C2; h ^= h >> 16
FMIX_C1 = 0x85EBCA6B
FMIX_C2 = 0xC2B2AE35
# Weyl steps: 2^32 / golden ratio (odd), and another odd constant for the high word
GOLDEN = 0x9E3779B1
GOLDEN_HI = 0x7F4A7C15

# A bucket's step below TINY is scaled by BOOST before its reciprocal is taken:
# 1 / 2^-100 is 2^100, far from fp32's overflow at 2^128, and both factors are exact
# powers of two, so ``(v * BOOST) * (1 / (step * BOOST))`` loses nothing.
TINY = 2.0**-100
BOOST = 2.0**64


def fmix32_int(h: int) -> int:
    """murmur3's fmix32 on a Python int (uint32 in, uint32 out)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * FMIX_C1) & MASK32
    h ^= h >> 13
    h = (h * FMIX_C2) & MASK32
    return h ^ (h >> 16)


def seed_key(seed: int) -> int:
    """Fold a seed (any int; its low 64 bits count) into the 32-bit key of the element
    hash, returned as the int32 with those bits (what the torch path's int32 lanes and
    a Triton int32 argument hold; ``key & MASK32`` is the uint32). Every path derives
    its key here, on the host."""
    seed &= (1 << 64) - 1
    key = fmix32_int((seed & MASK32) ^ fmix32_int((seed >> 32) ^ GOLDEN_HI))
    return key - (1 << 32) if key >= 1 << 31 else key
