"""Fused dequantize: one program per bucket unpacks the codes, scales them and stores
(or adds into fp32, the reduce-scatter primitive, or subtracts from it, error feedback's
residual) the decoded values.

Memory traffic per element: read b/8 B of codes (+ meta per bucket); write 4 B (fp32) or
2 B; adding or subtracting, read and write 4 B of fp32.
"""

import torch
import triton
import triton.language as tl

from .common import (
    MAXNORM,
    MINMAX,
    NAN16,
    NAN_BF16,
    bucket_tile,
    load_unpack,
    nan_where,
    scheme_args,
    tile_args,
)


@triton.jit
def _to_bf16_rne(y):
    """fp32 -> bf16 rounding to nearest even, NaN -> the canonical 0x7FC0
    (``qcomm.layout.NAN_BITS``): torch's cast but for the NaN bits, bit for bit.

    Written out in integer ops because the Triton interpreter (how CI runs this kernel)
    truncates fp32 -> bf16; GPUs round to nearest even either way.
    """
    b = y.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(y != y, NAN_BF16, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_fp16(y):
    """fp32 -> fp16 (the hardware's rounding to nearest even), NaN -> the canonical
    0x7E00 (``qcomm.layout.NAN_BITS``; an NVIDIA GPU's conversion writes 0x7FFF)."""
    h = y.to(tl.float16).to(tl.uint16, bitcast=True)
    h = tl.where(y != y, NAN16, h)
    return h.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _dequantize_kernel(
    meta_ptr,  # *fp32 [buckets * meta words]
    codes_ptr,  # *uint8 [ceil(n/8) * BITS]
    out_ptr,  # *fp32|bf16|fp16 [n]: written, or (ACCUMULATE 1 / -1, fp32) added / subtracted
    n,
    n_rows,
    BITS: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    SCHEME: tl.constexpr,
    LEVELS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    WIDE: tl.constexpr,  # n >= 2^31: int64 element indices
    meta_row,  # row strides: grid axis 1 decodes payload row r into output row r
    codes_row,
    out_row,
):
    r = tl.program_id(1).to(tl.int64)  # 0 for one payload (strides 0)
    meta_ptr += r * meta_row
    codes_ptr += r * codes_row
    out_ptr += r * out_row
    bucket, row, rmask, index, valid = bucket_tile(n, n_rows, B, R, WIDE, B // R, 0)
    y = decode_tile(meta_ptr, codes_ptr, bucket, row, rmask, BITS, R, SCHEME, LEVELS)
    if ACCUMULATE == 1:
        y = y + tl.load(out_ptr + index, mask=valid, other=0.0)
    elif ACCUMULATE == -1:  # out - decode: what the payload leaves out of out
        y = tl.load(out_ptr + index, mask=valid, other=0.0) - y
    store_cast(out_ptr, index, valid, y)


@triton.jit
def store_cast(out_ptr, index, valid, y):
    """Store fp32 ``y`` into ``out_ptr``'s dtype (bf16 rounded as torch rounds), every
    NaN the canonical one (``qcomm.layout.NAN_BITS``): the bits a NaN gets from the
    arithmetic before (a GPU's 0x7FFFFFFF, x86's 0xFFC00000) are the hardware's."""
    if out_ptr.dtype.element_ty == tl.bfloat16:
        v = _to_bf16_rne(y)
    elif out_ptr.dtype.element_ty == tl.float16:
        v = _to_fp16(y)
    else:
        v = nan_where(y != y, y)
    tl.store(out_ptr + index, v, mask=valid)


@triton.jit
def decode_tile(meta_ptr, codes_ptr, bucket, row, rmask, BITS: tl.constexpr, R: tl.constexpr,
                SCHEME: tl.constexpr, LEVELS: tl.constexpr):
    """The fp32 values of this program's bucket tile of one payload."""
    k = load_unpack(codes_ptr, row, rmask, BITS, R)
    if SCHEME == MINMAX:
        m0 = tl.load(meta_ptr + bucket * 2)
        m1 = tl.load(meta_ptr + bucket * 2 + 1)
    else:
        m0 = tl.load(meta_ptr + bucket)
        m1 = m0  # unused
    return code_values(k, m0, m1, BITS, SCHEME, LEVELS)


@triton.jit
def code_values(k, m0, m1, BITS: tl.constexpr, SCHEME: tl.constexpr, LEVELS: tl.constexpr):
    """fp32 values of int32 codes ``k`` under their buckets' meta words ``m0`` (and
    ``m1``, minmax's step): scalars for one bucket, or one per element."""
    if SCHEME == MINMAX:
        y = m0 + k.to(tl.float32) * m1
    elif SCHEME == MAXNORM:
        y = (k.to(tl.float32) - (LEVELS - 1) / 2.0) * m0
    else:
        M: tl.constexpr = LEVELS - 1
        j = k & ((1 << (BITS - 1)) - 1)
        level = ((127 - M + j) << 23).to(tl.float32, bitcast=True)
        level = tl.where(j == 0, 0.0, level)
        mag = m0 * level
        # The sign as a bit, not ``-mag``: triton 3.6 lowers ``-x`` to ``0 - x``, which
        # makes a negative zero level +0.0 where torch gives -0.0 (seen on an H200).
        sign = (k >> (BITS - 1)).to(tl.uint32) << 31
        y = (mag.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return y


def dequantize(meta: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, config,
               accumulate: int, warps: int = 0) -> None:
    """Decode into 1-D contiguous ``out`` (``accumulate`` 0; 1: added into fp32 ``out``;
    -1: subtracted from it); or rows (``meta``,
    ``codes`` [R, ...] views of R payloads, ``out`` [R, n]) in one launch over a
    (bucket, row) grid; ``warps`` per program (0: by bucket size). Checked by
    qcomm.codec."""
    many = out.dim() == 2
    n = out.shape[-1]
    if n == 0 or out.numel() == 0:
        return
    strides = dict(meta_row=meta.stride(0), codes_row=codes.stride(0),
                   out_row=out.stride(0)) if many else dict(meta_row=0, codes_row=0, out_row=0)
    _dequantize_kernel[(-(-n // config.bucket_size), out.shape[0] if many else 1)](
        meta, codes, out, n, **scheme_args(config), **strides,
        ACCUMULATE=int(accumulate), **tile_args(config, n, out.element_size(), warps=warps),
        enable_fp_fusion=False,  # mn + k * step must round as torch does (no FMA)
    )
