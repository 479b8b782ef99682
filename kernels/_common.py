"""Shared ``@triton.jit`` helpers: the RNG and the bit packing of the wire format.

Each one mirrors a function of ``qcomm/reference.py`` operation for operation, so the
Triton and torch paths produce the same bytes (tests check it bit for bit).
"""

import os

import triton
import triton.language as tl

# One program per bucket. Warps per program: one per 1024 elements, 1 to 8 (a 1024
# bucket: one warp, 32 values per thread). Fewer threads per bucket means fewer
# cross-warp reductions (shared memory and barriers) per element: compiled for sm_90,
# the 8-bit min-max quantize kernel is 42 SASS instructions per element at 1 warp, 65
# at 4 and 100 at 8 (static counts, cuobjdump of the cubin), and at ~33 T instructions/s
# an H200 must stay under ~60 per element to quantize fp32 at its 4.3 TB/s copy rate.
# QCOMM_TRITON_WARPS overrides it (bench/device_check.sh compares settings); read once.
_WARPS_OVERRIDE = int(os.environ.get("QCOMM_TRITON_WARPS", "0") or 0)


def num_warps(bucket_size: int) -> int:
    if _WARPS_OVERRIDE:
        return _WARPS_OVERRIDE
    return max(1, min(8, bucket_size // 1024))

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
def uniform(index, key, WIDE: tl.constexpr):
    """Uniform in [0, 1) on a 2^-24 grid from (key, element index); no state.

    ``WIDE``: ``index`` is int64 and may reach 2^32. Otherwise it is int32 and the high
    word, always 0, is skipped (h ^ 0 * GOLDEN_HI == h): a 64-bit shift and a multiply
    less per element, the same bits.
    """
    if WIDE:
        lo = (index & 0xFFFFFFFF).to(tl.uint32)
        hi = (index >> 32).to(tl.uint32)
        h = lo * GOLDEN + key.to(tl.uint32)
        h = h ^ (hi * GOLDEN_HI)
    else:
        h = index.to(tl.uint32) * GOLDEN + key.to(tl.uint32)
    h = fmix32(h)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


# reference.TINY and reference.BOOST (see reference._scaled)
TINY = tl.constexpr(2.0**-100)
BOOST = tl.constexpr(2.0**64)


@triton.jit
def scaled(v, step):
    """``reference._scaled``: ``v / step`` through one division per bucket, not per element."""
    s = tl.where(step < TINY, BOOST, 1.0)
    inv = tl.where(step > 0, tl.math.div_rn(1.0, step * s), 0.0)
    return (v * s) * inv


@triton.jit
def round_codes(t, thr, TOP: tl.constexpr):
    """Round level position ``t >= 0`` up when its fraction exceeds ``thr``; clamp."""
    lo = tl.floor(t)
    frac = t - lo
    up = (frac > thr).to(tl.int32)
    return tl.minimum(tl.maximum(lo.to(tl.int32) + up, 0), TOP)


@triton.jit
def pack_store(codes_ptr, codes, grp, gmask, BITS: tl.constexpr, ALIGNED: tl.constexpr):
    """Store codes int32 [G, 8] (row = a group of 8 consecutive elements) at groups
    ``grp`` [G] where ``gmask``: each group is one little-endian BITS-byte word.

    8 bits need no packing (byte k = code k); 1, 2 and 4 bits store the group's word as
    one uint8/uint16/uint32 when ``ALIGNED`` (the codes start 4-byte aligned: the
    launcher checks); other widths, or unaligned codes, store BITS bytes. Packing is a
    sum along the in-row axis, so no code crosses a thread boundary more than once.
    """
    k = tl.arange(0, 8)
    if BITS == 8:
        tl.store(codes_ptr + grp[:, None] * 8 + k[None, :], codes.to(tl.uint8),
                 mask=gmask[:, None])
    elif ALIGNED and BITS == 4:
        word = tl.sum(codes.to(tl.uint32) << (k * 4).to(tl.uint32)[None, :], axis=1)
        tl.store(codes_ptr.to(tl.pointer_type(tl.uint32)) + grp, word, mask=gmask)
    elif ALIGNED and BITS == 2:
        word = tl.sum(codes.to(tl.uint32) << (k * 2).to(tl.uint32)[None, :], axis=1)
        tl.store(codes_ptr.to(tl.pointer_type(tl.uint16)) + grp, word.to(tl.uint16),
                 mask=gmask)
    elif BITS == 1:
        word = tl.sum(codes.to(tl.uint32) << k.to(tl.uint32)[None, :], axis=1)
        tl.store(codes_ptr + grp, word.to(tl.uint8), mask=gmask)
    else:
        word = tl.sum(codes.to(tl.uint64) << (k * BITS).to(tl.uint64)[None, :], axis=1)
        bytes_ = (word[:, None] >> (k * 8).to(tl.uint64)[None, :]) & 0xFF
        tl.store(codes_ptr + grp[:, None] * BITS + k[None, :], bytes_.to(tl.uint8),
                 mask=gmask[:, None] & (k[None, :] < BITS))


@triton.jit
def load_unpack(codes_ptr, grp, gmask, BITS: tl.constexpr, ALIGNED: tl.constexpr):
    """Inverse of :func:`pack_store`: int32 codes [G, 8] of groups ``grp`` (0 where not
    ``gmask``)."""
    k = tl.arange(0, 8)
    if BITS == 8:
        return tl.load(codes_ptr + grp[:, None] * 8 + k[None, :], mask=gmask[:, None],
                       other=0).to(tl.int32)
    if ALIGNED and BITS == 4:
        word = tl.load(codes_ptr.to(tl.pointer_type(tl.uint32)) + grp, mask=gmask, other=0)
    elif ALIGNED and BITS == 2:
        word = tl.load(codes_ptr.to(tl.pointer_type(tl.uint16)) + grp, mask=gmask,
                       other=0).to(tl.uint32)
    elif BITS == 1:
        word = tl.load(codes_ptr + grp, mask=gmask, other=0).to(tl.uint32)
    else:
        bytes_ = tl.load(codes_ptr + grp[:, None] * BITS + k[None, :],
                         mask=gmask[:, None] & (k[None, :] < BITS), other=0)
        word = tl.sum(bytes_.to(tl.uint64) << (k * 8).to(tl.uint64)[None, :], axis=1)
        codes = (word[:, None] >> (k * BITS).to(tl.uint64)[None, :]) & ((1 << BITS) - 1)
        return codes.to(tl.int32)
    codes = (word[:, None] >> (k * BITS).to(tl.uint32)[None, :]) & ((1 << BITS) - 1)
    return codes.to(tl.int32)
