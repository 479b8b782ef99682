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

from ._common import num_warps, pack_store, round_codes, row_layout, scaled, uniform


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
    bucket = tl.program_id(0)
    if WIDE:  # 64-bit indices only where needed: FSDP flat buffers can pass 2^31 elements
        bucket = bucket.to(tl.int64)
    # The bucket as a [rows, R] tile: a row packs into whole bytes (row_layout), so
    # packing reduces along rows, inside a thread, instead of across the block.
    r = tl.arange(0, RBLOCK)
    row = bucket * (B // R) + r  # global row index
    rmask = (r < B // R) & (row < n_rows)
    index = row[:, None] * R + tl.arange(0, R)[None, :]
    valid = rmask[:, None] & (index < n)
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
    B = config.bucket_size
    sid = effective_scheme_id(config.scheme, config.bits)
    nb = -(-n // B)
    R, WORD = row_layout(config.bits, x.element_size())
    _quantize_kernel[(nb,)](
        x, meta, codes, n, -(-n // 8) * (8 // R), key,
        BITS=config.bits, B=B, R=R, WORD=WORD, RBLOCK=triton.next_power_of_2(B // R),
        SCHEME=sid,
        LEVELS=levels(sid, config.bits), L2=config.norm == "l2",
        STOCHASTIC=config.rounding == "stochastic", WIDE=n + B >= 2**31,
        num_warps=num_warps(B),
        # A fused multiply-add rounds once where torch rounds twice and would flip a
        # code now and then: the wire bytes must match the torch path exactly.
        enable_fp_fusion=False,
    )
