"""Fused quantize: one program per bucket loads it once, reduces its scale, draws the
random offsets, rounds, packs and stores codes and metadata. No full-size temporaries.

Memory traffic per element: read 4 B (fp32) or 2 B (bf16/fp16); write b/8 B of codes,
plus 4-8 B of metadata per bucket: at 8 bits, bucket 1024, fp32 that is 5.0 B moved per
element, the least any quantizer can move.
"""

import torch
import triton
import triton.language as tl

from qcomm.layout import effective_scheme_id, levels

from ._common import bucket_tile, pack_store, round_codes, scaled, tile_args, uniform


@triton.jit
def _quantize_kernel(
    x_ptr,  # *fp32|bf16|fp16 [n]: input, read once
    meta_ptr,  # *fp32 [nb * W]: per-bucket metadata (layout.py)
    codes_ptr,  # *uint8 [ceil(n/8) * BITS]: packed codes
    n,  # number of elements
    n_rows,  # ceil(n / 8) * (8 // R): rows up to the end of the last group of 8
    key,  # 32-bit RNG key of this call (reference.seed_key)
    BITS: tl.constexpr,  # 1..8
    B: tl.constexpr,  # bucket size, a multiple of 8
    R: tl.constexpr,  # elements per tile row (_common.row_layout)
    WORD: tl.constexpr,  # how a row's codes are stored (_common.row_layout)
    RBLOCK: tl.constexpr,  # next power of 2 >= B // R (rows per bucket)
    SCHEME: tl.constexpr,  # 0 minmax, 1 maxnorm, 2 nuq (effective id)
    LEVELS: tl.constexpr,  # layout.levels(SCHEME, BITS)
    L2: tl.constexpr,  # scale = L2 norm instead of max |x| (maxnorm, nuq)
    STOCHASTIC: tl.constexpr,  # stochastic rounding, else nearest
    WIDE: tl.constexpr,  # n >= 2^31: int64 element indices
):
    bucket, row, rmask, index, valid = bucket_tile(n, n_rows, B, R, RBLOCK, WIDE)
    x = tl.load(x_ptr + index, mask=valid, other=0.0).to(tl.float32)
    # NaN iff the bucket holds inf or NaN, whatever the summation order.
    z = tl.sum(tl.sum(x * 0.0, axis=1), axis=0)
    bad = z != z
    if STOCHASTIC:
        thr = 1.0 - uniform(index, key, WIDE)
    else:
        thr = tl.full([RBLOCK, R], 0.5, tl.float32)
    if SCHEME == 0:
        mn = tl.min(tl.min(tl.where(valid, x, float("inf")), axis=1), axis=0)
        mx = tl.max(tl.max(tl.where(valid, x, float("-inf")), axis=1), axis=0)
        step = tl.math.div_rn(mx - mn, LEVELS - 1.0)
        t = scaled(x - mn, step)
        t = tl.where(bad, 0.0, t)
        codes = round_codes(t, thr, LEVELS - 1)
        tl.store(meta_ptr + bucket * 2, tl.where(bad, float("nan"), mn))
        tl.store(meta_ptr + bucket * 2 + 1, tl.where(bad, float("nan"), step))
    else:
        if L2:
            x64 = x.to(tl.float64)
            scale = tl.sqrt(tl.sum(tl.sum(x64 * x64, axis=1), axis=0)).to(tl.float32)
        else:
            scale = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        if SCHEME == 1:
            c = (LEVELS - 1) / 2.0
            step = tl.math.div_rn(scale, c)
            t = scaled(x, step) + c
            t = tl.where(bad, 0.0, t)
            codes = round_codes(t, thr, LEVELS - 1)
            tl.store(meta_ptr + bucket, tl.where(bad, float("nan"), step))
        else:
            M: tl.constexpr = LEVELS - 1
            r = scaled(tl.abs(x), scale)
            r = tl.minimum(tl.where(bad, 0.0, r), 1.0)
            rbits = r.to(tl.int32, bitcast=True)
            ebits = (rbits >> 23) & 0xFF
            mant = (rbits & 0x7FFFFF).to(tl.float32)
            geometric = ebits >= 127 - (M - 1)
            j_lo = tl.where(geometric, ebits - 127 + M, 0)
            frac = tl.where(geometric, mant * (1.0 / 8388608.0), r * (2.0 ** (M - 1)))
            up = (frac > thr).to(tl.int32)
            j = tl.minimum(j_lo + up, M)
            sign = (x < 0).to(tl.int32)
            codes = (sign << (BITS - 1)) | j
            tl.store(meta_ptr + bucket, tl.where(bad, float("nan"), scale))
    codes = tl.where(valid, codes, 0)
    pack_store(codes_ptr, codes, row, rmask, BITS, R, WORD)


def quantize(x: torch.Tensor, meta: torch.Tensor, codes: torch.Tensor, config, key: int) -> None:
    """Launch the fused quantize of 1-D contiguous ``x`` into ``meta`` and ``codes``.

    Shapes and dtypes are checked by ``qcomm.codec`` (the one caller); this writes
    ``meta`` (fp32) and ``codes`` (uint8) in place and never writes ``x``.
    """
    n = x.numel()
    if n == 0:
        return
    sid = effective_scheme_id(config.scheme, config.bits)
    _quantize_kernel[(-(-n // config.bucket_size),)](
        x, meta, codes, n, key=key, SCHEME=sid, LEVELS=levels(sid, config.bits),
        L2=config.norm == "l2", STOCHASTIC=config.rounding == "stochastic",
        **tile_args(config, n, x.element_size()),
        # A fused multiply-add rounds once where torch rounds twice and would flip a
        # code now and then: the wire bytes must match the torch path exactly.
        enable_fp_fusion=False,
    )
