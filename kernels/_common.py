"""Shared ``@triton.jit`` helpers: the RNG and the bit packing of the wire format.

Each one mirrors a function of ``qcomm/reference.py`` operation for operation, so the
Triton and torch paths produce the same bytes (tests check it bit for bit).
"""

import triton
import triton.language as tl

# The same constants as qcomm/reference.py (murmur3 fmix32, golden-ratio Weyl steps).
# Globals must be constexpr *instances*: triton 3.6 refuses the annotated form
# (``X: tl.constexpr = ...``) that later versions and the interpreter accept.
FMIX_C1 = tl.constexpr(0x85EBCA6B)
FMIX_C2 = tl.constexpr(0xC2B2AE35)
GOLDEN = tl.constexpr(0x9E3779B1)
GOLDEN_HI = tl.constexpr(0x7F4A7C15)


@triton.jit
def fmix32(h):
    h = h ^ (h >> 16)
    h = h * FMIX_C1
    h = h ^ (h >> 13)
    h = h * FMIX_C2
    return h ^ (h >> 16)


@triton.jit
def uniform(index, key):
    """Uniform in [0, 1) on a 2^-24 grid from (key, int64 element index); no state."""
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    h = lo * GOLDEN + key.to(tl.uint32)
    h = h ^ (hi * GOLDEN_HI)
    h = fmix32(h)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def round_codes(t, thr, TOP: tl.constexpr):
    """Round level position ``t >= 0`` up when its fraction exceeds ``thr``; clamp."""
    lo = tl.floor(t)
    frac = t - lo
    up = (frac > thr).to(tl.int32)
    return tl.minimum(tl.maximum(lo.to(tl.int32) + up, 0), TOP)


@triton.jit
def pack_store(codes_ptr, codes, bucket, n_groups, BITS: tl.constexpr,
               BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    """Store one bucket's codes: each group of 8 is one little-endian BITS-byte word.

    ``codes`` is int32 [BLOCK]; groups at or past ``GROUPS`` (bucket end) or
    ``n_groups`` (tensor end) are not written.
    """
    grouped = tl.reshape(codes.to(tl.uint64), (BLOCK // 8, 8))
    k = tl.arange(0, 8)
    word = tl.sum(grouped << (k * BITS).to(tl.uint64)[None, :], axis=1)
    bytes_ = (word[:, None] >> (k * 8).to(tl.uint64)[None, :]) & 0xFF
    g = tl.arange(0, BLOCK // 8)
    gg = bucket * GROUPS + g  # int64: global group index
    mask = (g[:, None] < GROUPS) & (gg[:, None] < n_groups) & (k[None, :] < BITS)
    tl.store(codes_ptr + gg[:, None] * BITS + k[None, :], bytes_.to(tl.uint8), mask=mask)


@triton.jit
def load_unpack(codes_ptr, bucket, n_groups, BITS: tl.constexpr,
                BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    """Inverse of :func:`pack_store`: int32 codes [BLOCK] of one bucket (0 past its end)."""
    k = tl.arange(0, 8)
    g = tl.arange(0, BLOCK // 8)
    gg = bucket * GROUPS + g
    mask = (g[:, None] < GROUPS) & (gg[:, None] < n_groups) & (k[None, :] < BITS)
    bytes_ = tl.load(codes_ptr + gg[:, None] * BITS + k[None, :], mask=mask, other=0)
    word = tl.sum(bytes_.to(tl.uint64) << (k * 8).to(tl.uint64)[None, :], axis=1)
    codes = (word[:, None] >> (k * BITS).to(tl.uint64)[None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes.to(tl.int32), (BLOCK,))
