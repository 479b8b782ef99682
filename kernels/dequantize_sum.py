"""Fused decode-and-sum, the reduce-scatter's receive side in one launch: one program
per bucket loads this rank's own chunk (exact, any float dtype) into fp32, adds the
decoded bucket of every received payload row in row order, applies the reduce op and
stores the result cast to the output dtype. No fp32 sum buffer, no launch per peer.

Memory traffic per element at R payload rows: read 4 B (own, fp32) + (R - 1) * b/8 B of
codes (+ meta per bucket), write 4 B (fp32) or 2 B: at 8 bits and R = 8, 15 B, where a
copy of the own chunk into an fp32 sum (8 B), R - 1 accumulating decodes (9 B each) and
a copy out (8 B) move 79 B.
"""

import torch
import triton
import triton.language as tl

from .common import bucket_tile, scheme_args, tile_args
from .dequantize import decode_tile, store_cast

OPS = {"sum": 0, "avg": 1, "premul": 2}


@triton.jit
def _dequantize_sum_kernel(
    meta_ptr,  # *fp32: payload row 0's metadata; row r at + r * meta_row
    codes_ptr,  # *uint8: payload row 0's codes; row r at + r * codes_row
    own_ptr,  # *fp32|bf16|fp16 [n]: this rank's chunk, added exact
    out_ptr,  # *fp32|bf16|fp16 [n]: the result (may be own_ptr's memory: read first)
    n,
    n_rows,
    rows,  # payload rows
    skip,  # the row not read (this rank's own slot), or rows
    meta_row,
    codes_row,
    factor,  # fp32: AVG's divisor or PREMUL_SUM's factor
    BITS: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    SCHEME: tl.constexpr,
    LEVELS: tl.constexpr,
    OP: tl.constexpr,  # OPS: 0 sum, 1 divide by factor (div_rn), 2 multiply by factor
    WIDE: tl.constexpr,
):
    bucket, row, rmask, index, valid = bucket_tile(n, n_rows, B, R, WIDE, B // R, 0)
    acc = tl.load(own_ptr + index, mask=valid, other=0.0).to(tl.float32)
    for r in range(0, rows):
        if r != skip:
            r64 = tl.cast(r, tl.int64)
            acc = acc + decode_tile(meta_ptr + r64 * meta_row, codes_ptr + r64 * codes_row,
                                    bucket, row, rmask, BITS, R, SCHEME, LEVELS)
    if OP == 1:
        acc = tl.math.div_rn(acc, factor)  # an IEEE division, as torch's
    elif OP == 2:
        acc = acc * factor
    store_cast(out_ptr, index, valid, acc)


def dequantize_sum(meta: torch.Tensor, codes: torch.Tensor, own: torch.Tensor,
                   out: torch.Tensor, config, skip: int | None, op: str,
                   factor: float, warps: int = 0) -> None:
    """``out = op(own + sum of the decodes of rows r != skip)``, rows of ``meta`` and
    ``codes`` ([R, ...] views of R payloads), in fp32 in row order; ``warps`` per
    program (0: by bucket size); checked by qcomm.codec."""
    n = out.numel()
    if n == 0:
        return
    rows = meta.shape[0]
    _dequantize_sum_kernel[(-(-n // config.bucket_size),)](
        meta, codes, own, out, n, rows=rows, skip=rows if skip is None else skip,
        meta_row=meta.stride(0), codes_row=codes.stride(0), factor=float(factor),
        **scheme_args(config), OP=OPS[op],
        **tile_args(config, n, out.element_size(), warps=warps),
        enable_fp_fusion=False,  # decode and add round as torch does (no FMA)
    )
