"""Fused state update, the receive side of a weight-difference gather (``qcomm.fsdp``) in
one launch: one program per bucket of the *state* decodes the state's bucket, adds the
decoded differences of the same elements (a payload of another configuration: its own
bucket size, scheme and bits), stores the sum cast to the output's dtype, and quantizes
that fp32 sum back into the state's bucket (round to nearest, non-finite meta stored as
0). A (state bucket, row) grid: every peer's row in the same launch.

Memory traffic per element, 8-bit state, 4-bit differences, fp32 output: read 1 B +
0.5 B, write 4 B + 1 B (+ meta per bucket): 6.5 B, where decoding the state into the
output, an accumulating decode of the differences and a quantize from the output
(three launches) move 1 + 4 + 0.5 + 8 + 4 + 1 = 18.5 B.

The state is read and rewritten in place: each program reads its own bucket's codes and
meta, and every store depends on the bucket's min and max, which depend on every load
of the bucket, so all of a bucket's loads precede its stores.
"""

import math

import torch
import triton
import triton.language as tl

from .common import MINMAX, bucket_tile, pack_store, scheme_args, tile_args
from .dequantize import code_values, decode_tile, store_cast
from .quantize import bucket_meta, bucket_stats, tile_codes


@triton.jit
def decode_at(meta_ptr, codes_ptr, index, valid, BITS: tl.constexpr, B: tl.constexpr,
              SCHEME: tl.constexpr, LEVELS: tl.constexpr):
    """fp32 values of elements ``index`` of one payload (bucket size ``B``), element by
    element: any tile shape, so another configuration's buckets line up with this
    program's. Element i's code is bits ``[i*BITS, (i+1)*BITS)`` of the code stream,
    within two bytes at most; its byte is ``(i // 8) * BITS + (i % 8) * BITS // 8``
    (no ``i * BITS``: that overflows int32 from 2^28 elements)."""
    within = (index % 8) * BITS
    byte = (index // 8) * BITS + within // 8
    shift = within % 8
    lo = tl.load(codes_ptr + byte, mask=valid, other=0).to(tl.int32)
    hi = tl.load(codes_ptr + byte + 1, mask=valid & (shift + BITS > 8), other=0).to(tl.int32)
    k = ((lo | (hi << 8)) >> shift) & ((1 << BITS) - 1)
    bucket = index // B
    if SCHEME == MINMAX:
        m0 = tl.load(meta_ptr + bucket * 2, mask=valid, other=0.0)
        m1 = tl.load(meta_ptr + bucket * 2 + 1, mask=valid, other=0.0)
    else:
        m0 = tl.load(meta_ptr + bucket, mask=valid, other=0.0)
        m1 = m0  # unused
    return code_values(k, m0, m1, BITS, SCHEME, LEVELS)


@triton.jit
def _update_state_kernel(
    s_meta_ptr,  # *fp32: state row 0's metadata (read, then rewritten); row r at + r * s_meta_row
    s_codes_ptr,  # *uint8: state row 0's codes (read, then rewritten)
    d_meta_ptr,  # *fp32: difference row 0's metadata
    d_codes_ptr,  # *uint8: difference row 0's codes
    out_ptr,  # *fp32|bf16|fp16: output row 0; row r at + r * out_row
    n,
    n_rows,
    s_meta_row,
    s_codes_row,
    d_meta_row,
    d_codes_row,
    out_row,
    BITS: tl.constexpr,  # the state's configuration, its tile shape (tile_args)
    B: tl.constexpr,
    R: tl.constexpr,
    SCHEME: tl.constexpr,
    LEVELS: tl.constexpr,
    L2: tl.constexpr,
    WIDE: tl.constexpr,
    DBITS: tl.constexpr,  # the differences' configuration
    DB: tl.constexpr,
    DSCHEME: tl.constexpr,
    DLEVELS: tl.constexpr,
):
    r = tl.program_id(1).to(tl.int64)
    s_meta_ptr += r * s_meta_row
    s_codes_ptr += r * s_codes_row
    d_meta_ptr += r * d_meta_row
    d_codes_ptr += r * d_codes_row
    out_ptr += r * out_row
    bucket, row, rmask, index, valid = bucket_tile(n, n_rows, B, R, WIDE, B // R, 0)
    y = decode_tile(s_meta_ptr, s_codes_ptr, bucket, row, rmask, BITS, R, SCHEME, LEVELS)
    y = y + decode_at(d_meta_ptr, d_codes_ptr, index, valid, DBITS, DB, DSCHEME, DLEVELS)
    y = tl.where(valid, y, 0.0)  # the padding of a partial bucket, as quantize loads it
    store_cast(out_ptr, index, valid, y)
    z, a, b = bucket_stats(y, valid, y, valid, False, SCHEME, L2)
    offset, s, inv, bad = bucket_meta(s_meta_ptr, bucket, z, a, b, SCHEME, LEVELS, L2, True)
    codes = tile_codes(y, offset, s, inv, bad, 0.0, BITS, SCHEME, LEVELS, False)
    pack_store(s_codes_ptr, tl.where(valid, codes, 0), row, rmask, BITS, R)


def update_state(s_meta: torch.Tensor, s_codes: torch.Tensor, d_meta: torch.Tensor,
                 d_codes: torch.Tensor, out: torch.Tensor, state_config,
                 delta_config, scratch: torch.Tensor | None = None, warps: int = 0) -> None:
    """Rows: ``s_meta``/``s_codes`` [R, ...] views of R state payloads (rewritten),
    ``d_meta``/``d_codes`` of R difference payloads, ``out`` [R, n]; checked by
    qcomm.codec. ``scratch`` is not read: the sum stays in registers. ``warps``: warps
    per program (0: by bucket size)."""
    R, n = out.shape
    if n == 0 or R == 0:
        return
    # the state's tile shape for fp32 values (decoded and requantized in fp32)
    args = tile_args(state_config, n, 4, warps=warps)
    args["WIDE"] = args["WIDE"] or n + delta_config.bucket_size >= 2**31
    _update_state_kernel[(math.ceil(n / state_config.bucket_size), R)](
        s_meta, s_codes, d_meta, d_codes, out, n, s_meta_row=s_meta.stride(0),
        s_codes_row=s_codes.stride(0), d_meta_row=d_meta.stride(0),
        d_codes_row=d_codes.stride(0), out_row=out.stride(0),
        **scheme_args(state_config), L2=state_config.norm == "l2",
        DBITS=delta_config.bits, DB=delta_config.bucket_size, **scheme_args(delta_config, "D"),
        **args,
        enable_fp_fusion=False,  # decode, add and quantize round as torch does (no FMA)
    )
