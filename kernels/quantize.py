"""Fused quantize: one program per bucket loads it once, reduces its scale, draws the
random offsets, rounds, packs and stores codes and metadata. No full-size temporaries.

Memory traffic per element: read 4 B (fp32) or 2 B (bf16/fp16); write b/8 B of codes,
plus 4-8 B of metadata per bucket: at 8 bits, bucket 1024, fp32 that is 5.0 B moved per
element, the least any quantizer can move.

Where a half bucket is whole tile rows (``PAIRED``: buckets of a multiple of 16
elements, the default 1024 among them) the bucket is two tiles, one per half, and one
hash draws the random offsets of both (``qcomm.oracle``'s uniforms: element p and p + B/2
share it); other buckets are one tile whose elements each select their pair's hash.
"""

import torch
import triton
import triton.language as tl

from .common import (
    MAXNORM,
    MINMAX,
    bucket_tile,
    half_uniform,
    nan_where,
    pack_store,
    pair_hash,
    plus_zero,
    reciprocal_step,
    round_position,
    scheme_args,
    tile_args,
)


@triton.jit
def bucket_stats(x, valid, x1, valid1, PAIRED: tl.constexpr, SCHEME: tl.constexpr,
                  L2: tl.constexpr):
    """Statistics of the bucket in tile ``x`` (and ``x1``, its second half, when
    ``PAIRED``): (sum of x * 0, then min and max (minmax), max |x| (maxnorm, nuq) or the
    fp64 sum of squares (L2); the last two returned twice). inf * 0 and NaN * 0 are NaN,
    finite * 0 is +-0: the first is NaN iff the bucket holds a non-finite value, whatever
    the summation order. The halves are combined element by element before one
    reduction: a reduction across warps goes through shared memory and a barrier."""
    z = x * 0.0
    if SCHEME == MINMAX:
        a = tl.where(valid, x, float("inf"))
        b = tl.where(valid, x, float("-inf"))
    elif L2:
        a = x.to(tl.float64) * x.to(tl.float64)
    else:
        a = tl.abs(x)
    if PAIRED:
        z = z + x1 * 0.0
        if SCHEME == MINMAX:
            a = tl.minimum(a, tl.where(valid1, x1, float("inf")))
            b = tl.maximum(b, tl.where(valid1, x1, float("-inf")))
        elif L2:
            a = a + x1.to(tl.float64) * x1.to(tl.float64)
        else:
            a = tl.maximum(a, tl.abs(x1))
    z = tl.sum(tl.sum(z, axis=1), axis=0)
    if SCHEME == MINMAX:
        a = tl.min(tl.min(a, axis=1), axis=0)
        b = tl.max(tl.max(b, axis=1), axis=0)
    elif L2:
        a = tl.sum(tl.sum(a, axis=1), axis=0)
        b = a
    else:
        a = tl.max(tl.max(a, axis=1), axis=0)
        b = a
    return z, a, b


@triton.jit
def bucket_meta(meta_ptr, bucket, z, a, b, SCHEME: tl.constexpr, LEVELS: tl.constexpr,
                 L2: tl.constexpr, FINITE: tl.constexpr):
    """Store the bucket's metadata from its statistics; return what the codes need
    (offset, s, inv, bad): the bucket statistics of ``qcomm.oracle.encode_bucket``.
    ``FINITE``: store 0
    for each meta word that is not finite (``torch.nan_to_num(meta, 0, 0, 0)``)."""
    bad = z != z
    if SCHEME == MINMAX:
        # zeros +0.0 (qcomm.layout): the reductions meet -0.0 and +0.0 in any order
        a = plus_zero(a)
        offset = a
        step = tl.math.div_rn(plus_zero(b) - a, LEVELS - 1.0)
        tl.store(meta_ptr + bucket * 2, _finite(nan_where(bad, a), FINITE))
        tl.store(meta_ptr + bucket * 2 + 1, _finite(nan_where(bad, step), FINITE))
    else:
        offset = 0.0
        if L2:
            scale = tl.sqrt(a).to(tl.float32)
        else:
            scale = a
        if SCHEME == MAXNORM:
            step = tl.math.div_rn(scale, (LEVELS - 1) / 2.0)
        else:
            step = scale
        tl.store(meta_ptr + bucket, _finite(nan_where(bad, step), FINITE))
    s, inv = reciprocal_step(step)
    return offset, s, inv, bad


@triton.jit
def _finite(v, FINITE: tl.constexpr):
    """``v``, or with ``FINITE`` +0.0 where ``v`` is inf or NaN (``v - v`` is NaN there
    and +0.0 elsewhere), as ``nan_to_num``."""
    if FINITE:
        v = tl.where(v - v == 0.0, v, 0.0)
    return v


@triton.jit
def tile_codes(x, offset, s, inv, bad, u, BITS: tl.constexpr, SCHEME: tl.constexpr,
                LEVELS: tl.constexpr, STOCHASTIC: tl.constexpr):
    """int32 codes of a tile: ``qcomm.oracle.encode_bucket``'s codes; ``u`` the uniforms
    (stochastic)."""
    if SCHEME == MINMAX:
        t = tl.where(bad, 0.0, ((x - offset) * s) * inv)
        codes = round_position(t, u, LEVELS - 1, STOCHASTIC)
    elif SCHEME == MAXNORM:
        t = tl.where(bad, 0.0, (x * s) * inv + (LEVELS - 1) / 2.0)
        codes = round_position(t, u, LEVELS - 1, STOCHASTIC)
    else:
        M: tl.constexpr = LEVELS - 1
        r = tl.minimum(tl.where(bad, 0.0, (tl.abs(x) * s) * inv), 1.0)
        rbits = r.to(tl.int32, bitcast=True)
        ebits = (rbits >> 23) & 0xFF
        mant = (rbits & 0x7FFFFF).to(tl.float32)
        geometric = ebits >= 127 - (M - 1)
        j_lo = tl.where(geometric, ebits - 127 + M, 0)
        frac = tl.where(geometric, mant * (1.0 / 8388608.0), r * (2.0 ** (M - 1)))
        if STOCHASTIC:
            up = (frac > 1.0 - u).to(tl.int32)
        else:
            up = (frac > 0.5).to(tl.int32)
        j = tl.minimum(j_lo + up, M)
        sign = (x < 0).to(tl.int32)
        codes = (sign << (BITS - 1)) | j
    return codes


@triton.jit
def _quantize_kernel(
    x_ptr,  # *fp32|bf16|fp16 [n]: input, read once
    meta_ptr,  # *fp32 [buckets * meta words]: per-bucket metadata (layout.py)
    codes_ptr,  # *uint8 [ceil(n/8) * BITS]: packed codes
    n,  # number of elements
    n_rows,  # ceil(n / 8) * (8 // R): rows up to the end of the last group of 8
    key,  # 32-bit RNG key of this call (qcomm.constants.seed_key)
    BITS: tl.constexpr,  # 1..8
    B: tl.constexpr,  # bucket size, a multiple of 8
    R: tl.constexpr,  # elements per tile row (common.row_width)
    SCHEME: tl.constexpr,  # the scheme's id, MINMAX, MAXNORM or NUQ (common.scheme_args)
    LEVELS: tl.constexpr,  # its level count at BITS (common.scheme_args)
    L2: tl.constexpr,  # scale = L2 norm instead of max |x| (maxnorm, nuq)
    STOCHASTIC: tl.constexpr,  # stochastic rounding, else nearest
    WIDE: tl.constexpr,  # n >= 2^31: int64 element indices
    PAIRED: tl.constexpr,  # B // 2 is whole rows: one tile per half bucket
    keys_ptr,  # *int32 [R]: each payload row's key (MANY)
    skip,  # MANY: the row left out (R if none); program p writes row p + (p >= skip)
    x_row,  # MANY: row strides of x (elements), meta (fp32 words), codes (bytes)
    meta_row,
    codes_row,
    MANY: tl.constexpr,  # rows: grid axis 1 is the payload row, each with its own key
):
    if MANY:
        r = tl.program_id(1)
        r = r + (r >= skip).to(tl.int32)
        key = tl.load(keys_ptr + r)
        r = r.to(tl.int64)  # payload rows of a 2^31-byte buffer: int64 offsets
        x_ptr += r * x_row
        meta_ptr += r * meta_row
        codes_ptr += r * codes_row
    H: tl.constexpr = B // 2
    if PAIRED:
        HR: tl.constexpr = H // R  # rows per half
        bucket, row, rmask, index, valid = bucket_tile(n, n_rows, B, R, WIDE, HR, 0)
        _, row1, rmask1, index1, valid1 = bucket_tile(n, n_rows, B, R, WIDE, HR, HR)
        x = tl.load(x_ptr + index, mask=valid, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + index1, mask=valid1, other=0.0).to(tl.float32)
        z, a, b = bucket_stats(x, valid, x1, valid1, True, SCHEME, L2)
        offset, s, inv, bad = bucket_meta(meta_ptr, bucket, z, a, b, SCHEME, LEVELS, L2, False)
        if STOCHASTIC:
            h = pair_hash(index - bucket * H, key, WIDE)  # counter = bucket * H + q
            u = half_uniform(h, False)
            u1 = half_uniform(h, True)
        else:
            u = 0.0  # unused: nearest rounding
            u1 = u
        codes1 = tile_codes(x1, offset, s, inv, bad, u1, BITS, SCHEME, LEVELS, STOCHASTIC)
        pack_store(codes_ptr, tl.where(valid1, codes1, 0), row1, rmask1, BITS, R)
    else:
        bucket, row, rmask, index, valid = bucket_tile(n, n_rows, B, R, WIDE,
                                                       B // R, 0)
        x = tl.load(x_ptr + index, mask=valid, other=0.0).to(tl.float32)
        z, a, b = bucket_stats(x, valid, x, valid, False, SCHEME, L2)
        offset, s, inv, bad = bucket_meta(meta_ptr, bucket, z, a, b, SCHEME, LEVELS, L2, False)
        if STOCHASTIC:
            high = index - bucket * B >= H  # the second half takes the high 16 bits
            h = pair_hash(index - bucket * H - tl.where(high, H, 0), key, WIDE)
            u = tl.where(high, half_uniform(h, True), half_uniform(h, False))
        else:
            u = 0.0  # unused: nearest rounding
    codes = tile_codes(x, offset, s, inv, bad, u, BITS, SCHEME, LEVELS, STOCHASTIC)
    pack_store(codes_ptr, tl.where(valid, codes, 0), row, rmask, BITS, R)


def quantize(x: torch.Tensor, meta: torch.Tensor, codes: torch.Tensor, config,
             key: int | list[int], skip: int | None = None, warps: int = 0) -> None:
    """Launch the fused quantize of 1-D contiguous ``x`` into ``meta`` and ``codes``; or,
    rows (``x`` [R, n], ``meta`` and ``codes`` [R, ...] views of R payloads, ``key`` R
    keys), every row but ``skip`` in one launch over a (bucket, row) grid. ``warps``:
    warps per program (0: by bucket size).

    Shapes and dtypes are checked by ``qcomm.codec`` (the one caller); this writes
    ``meta`` (fp32) and ``codes`` (uint8) in place and never writes ``x``.
    """
    many = x.dim() == 2
    n = x.shape[-1]
    rows = (x.shape[0] - (skip is not None)) if many else 1
    if n == 0 or rows == 0:
        return
    if many:
        keys = torch.tensor(key, dtype=torch.int32).to(x.device, non_blocking=True)
        strides = dict(keys_ptr=keys, skip=x.shape[0] if skip is None else skip,
                       x_row=x.stride(0), meta_row=meta.stride(0), codes_row=codes.stride(0))
        key = 0
    else:  # keys_ptr unread
        strides = dict(keys_ptr=meta, skip=0, x_row=0, meta_row=0, codes_row=0)
    _quantize_kernel[(-(-n // config.bucket_size), rows)](
        x, meta, codes, n, key=key, **scheme_args(config), MANY=many,
        **strides,
        L2=config.norm == "l2", STOCHASTIC=config.rounding == "stochastic",
        **tile_args(config, n, x.element_size(), halves=True, warps=warps),
        # A fused multiply-add rounds once where torch rounds twice and would flip a
        # code now and then: the wire bytes must match the torch path exactly.
        enable_fp_fusion=False,
    )
