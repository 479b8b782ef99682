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


def row_length(bits: int, codes_ptr: int) -> int:
    """Elements per tile row: 4 for 2 and 4 bits (a row packs into 1 or 2 whole bytes;
    2-byte stores need an even codes address), else 8 (a row is one BITS-byte word)."""
    return 4 if bits == 2 or (bits == 4 and codes_ptr % 2 == 0) else 8


@triton.jit
def pack_store(codes_ptr, codes, row, rmask, BITS: tl.constexpr, R: tl.constexpr):
    """Store codes int32 [rows, R] (a row = R consecutive elements) at tile rows ``row``
    where ``rmask``. The code stream's bytes: element i's code at bits [i*b, (i+1)*b).

    8 bits need no packing (byte k = code k). With rows of 4 (:func:`row_length`), a
    row of 4-bit codes is one uint16 and of 2-bit codes one byte; 1-bit rows of 8 are
    one byte; other widths store their BITS-byte word byte by byte. Rows are as long as
    the loads' vectors (4 fp32), so packing a row stays inside one thread.
    """
    k = tl.arange(0, R)
    if BITS == 8:
        tl.store(codes_ptr + row[:, None] * R + k[None, :], codes.to(tl.uint8),
                 mask=rmask[:, None])
    elif R == 4:
        word = tl.sum(codes.to(tl.uint32) << (k * BITS).to(tl.uint32)[None, :], axis=1)
        if BITS == 4:
            tl.store(codes_ptr.to(tl.pointer_type(tl.uint16)) + row, word.to(tl.uint16),
                     mask=rmask)
        else:
            tl.store(codes_ptr + row, word.to(tl.uint8), mask=rmask)
    elif BITS == 1:
        word = tl.sum(codes.to(tl.uint32) << k.to(tl.uint32)[None, :], axis=1)
        tl.store(codes_ptr + row, word.to(tl.uint8), mask=rmask)
    else:
        word = tl.sum(codes.to(tl.uint64) << (k * BITS).to(tl.uint64)[None, :], axis=1)
        bytes_ = (word[:, None] >> (k * 8).to(tl.uint64)[None, :]) & 0xFF
        tl.store(codes_ptr + row[:, None] * BITS + k[None, :], bytes_.to(tl.uint8),
                 mask=rmask[:, None] & (k[None, :] < BITS))


@triton.jit
def load_unpack(codes_ptr, row, rmask, BITS: tl.constexpr, R: tl.constexpr):
    """Inverse of :func:`pack_store`: int32 codes [rows, R] (0 where not ``rmask``)."""
    k = tl.arange(0, R)
    if BITS == 8:
        return tl.load(codes_ptr + row[:, None] * R + k[None, :], mask=rmask[:, None],
                       other=0).to(tl.int32)
    if R == 4:
        if BITS == 4:
            word = tl.load(codes_ptr.to(tl.pointer_type(tl.uint16)) + row, mask=rmask,
                           other=0).to(tl.uint32)
        else:
            word = tl.load(codes_ptr + row, mask=rmask, other=0).to(tl.uint32)
    elif BITS == 1:
        word = tl.load(codes_ptr + row, mask=rmask, other=0).to(tl.uint32)
    else:
        bytes_ = tl.load(codes_ptr + row[:, None] * BITS + k[None, :],
                         mask=rmask[:, None] & (k[None, :] < BITS), other=0)
        word = tl.sum(bytes_.to(tl.uint64) << (k * 8).to(tl.uint64)[None, :], axis=1)
        codes = (word[:, None] >> (k * BITS).to(tl.uint64)[None, :]) & ((1 << BITS) - 1)
        return codes.to(tl.int32)
    codes = (word[:, None] >> (k * BITS).to(tl.uint32)[None, :]) & ((1 << BITS) - 1)
    return codes.to(tl.int32)
