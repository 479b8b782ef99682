"""Dequantize on the tuned torch path: :func:`dequantize` decodes a payload's
metadata and codes into an output (stored or accumulated), the values of
:func:`qcomm.oracle.dequantize`, from pieces that :mod:`qcomm.cpu.compiled` compiles.
"""

from __future__ import annotations

import functools

import torch

from ..layout import MAXNORM, MINMAX, levels, scheme_for
from .common import canonical_nans, eager, pieces, row_chunks, store, unpack_codes, write


def dequantize(meta: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, config,
               accumulate: int, *, wrap=eager) -> None:
    """Decode a payload's ``meta`` and ``codes`` views into contiguous ``out`` (any float
    dtype; with ``accumulate`` 1, fp32, added into; -1, subtracted from): the same signature as
    ``qcomm.kernels.dequantize.dequantize``, plus ``wrap`` (compiled or eager). Checked
    by :mod:`qcomm.codec`, the one caller.

    A 16-bit ``out`` is stored directly where the word decode's lane groups match
    Inductor's 16-wide tiling of a 16-bit store (AVX2, :func:`lane_group`), and on CUDA
    (chunks would be kernel launches); elsewhere it is decoded ``_STAGED`` elements at a
    time into fp32 and converted. Into bf16, 1 thread, 2^24 elements, Zen 3, G
    elements/s, staged -> direct: 4 bits 1.08-1.14 -> 3.0-4.1, 8 bits 1.06-1.09 ->
    2.8-3.4; 3 bits (bytes) 0.38-0.41 staged, 0.22 direct. On AVX-512 a direct 16-bit
    store was measured (with the older 16-lane groups) 2-9x slower than staged: into
    bf16, 2^22 elements, minmax 8-bit 0.81 -> 2.0 G elements/s staged, minmax 4-bit
    0.53 -> 1.8, nuq 4-bit 0.16 -> 1.6.

    Rows ``out`` [R, n] that are not one contiguous block (a collective's piece: columns
    ``[a, b)`` of its W output slots) and longer than :data:`STRIDED_ROWS_SPLIT` go one
    row per call."""
    if (out.dim() == 2 and out.shape[0] > 1 and out.shape[-1] > STRIDED_ROWS_SPLIT
            and not out.is_contiguous()):
        for r in range(out.shape[0]):
            dequantize(meta[r], codes[r], out[r], config, accumulate, wrap=wrap)
        return
    kw = dict(bits=config.bits, bucket_size=config.bucket_size, scheme=config.scheme,
              wrap=wrap)
    direct = (accumulate or out.dtype == torch.float32 or out.device.type == "cuda"
              or (vector_lanes() < 16 and lane_group(config.bits, config.bucket_size,
                                                     out.dtype)))
    if direct:
        dequantize_flat(meta, codes, out, accumulate=accumulate, **kw)
    else:
        dequantize_flat(meta, codes, out, staged=max(1, _STAGED // config.bucket_size), **kw)


# Rows longer than this, stored into a strided [R, n] output, are decoded one row per
# graph call. The [rows, buckets, B] graph over a strided output (symbolic row stride)
# ran slower per element than one call per contiguous row from 2^18-2^19 elements a row
# up, and fell off a cliff at 2^20 (R x 2^21 fp32 outputs decoded in pieces of the
# size, ms, rows graph / a call per row, 1 thread, AMD EPYC AVX-512;
# `bench/experiments/strided_decode.py BITS R --no-split` at f72c4cf): 2 bits R = 2
# 2^17 3.60 / 4.45, 2^18 2.44 / 2.11, 2^19 2.27 / 1.64, 2^20 2.40 / 1.22; R = 8 2^17
# 7.30 / 11.80, 2^18 7.80 / 7.95, 2^19 8.06 / 6.51, 2^20 38.0 / 5.74; 8 bits R = 8 2^18
# 9.80 / 8.44, 2^19 11.47 / 7.48, 2^20 38.9 / 6.07. Into contiguous rows the rows graph
# stays ahead (1.2-2.0x at 2^20: `bench/rows.py`, in git history at 661a74f). Below the
# split the fixed ~90 us of each extra call costs more than the graph loses.
STRIDED_ROWS_SPLIT = 1 << 18

# Elements decoded at once into a 16-bit output where it is staged: 2^18, 1 MiB of fp32
# that stays in cache. A full-size fp32 buffer cost a fresh, page-faulting allocation
# per call: minmax 8-bit into bf16 at 2^26 elements ran at 1.4 GB/s that way, 2.6 fused.
_STAGED = 1 << 18


@functools.cache
def vector_lanes() -> int:
    """fp32 lanes of the SIMD vectors Inductor compiles the CPU path for: 16 (AVX-512),
    8 (AVX2), ...; 16 where it cannot tell (the shapes stay valid, only slower).
    Called outside the compiled graphs (it probes the compiler once)."""
    try:
        from torch._inductor import cpu_vec_isa

        isa = cpu_vec_isa.pick_vec_isa()
        return int(isa.nelements(torch.float32)) if isa else 16
    except Exception:  # an internal module: its changes must not break the codec
        return 16


@functools.cache
def lane_group(bits: int, bucket_size: int, out_dtype: torch.dtype = torch.float32,
               lanes: int | None = None) -> int | None:
    """Codes per lane group of the word decode (:func:`unpack_words`) into ``out_dtype``
    on a machine of ``lanes`` fp32 lanes (default :func:`vector_lanes`); None where the
    bytes are read one by one (:func:`unpack_codes`): 3, 5, 6 and 7 bits, 8 bits on
    16 lanes, or buckets that are not whole groups.

    A group is one vector of the loop Inductor writes, which it tiles by the narrowest
    float it stores: ``lanes`` for fp32 outputs, twice that for bf16/fp16 (at least the
    32 codes of one int32 word at 1 bit). A group of another width breaks the loop into
    scalar code or per-lane index tables. Decode of [2^14, 1024], 8 bits, Zen 3 (AVX2,
    8 lanes), 1 thread, G elements/s: fp32 out 2.58 (group 8) / 1.83 (16); bf16 out
    0.30 (8) / 3.44 (16) / 0.23 (32); 4 bits into bf16 0.56 (8) / 3.61 (16).

    8 bits go through words only on 8-lane machines: AVX2's ``Vectorized<uint8_t>`` has
    no 8-byte load (Inductor copies each 8 bytes through a buffer first): 0.69 G
    elements/s from bytes against 2.58 from words; AVX-512 loads 16 bytes directly (23
    GB/s from bytes, memcpy speed, ``python -m bench codec``).
    """
    lanes = vector_lanes() if lanes is None else lanes
    if bits not in (1, 2, 4) and not (bits == 8 and lanes < 16):
        return None
    tile = lanes * (4 // out_dtype.itemsize)
    group = max(tile, 32 // bits)
    return group if bucket_size % group == 0 else None


def unpack_words(packed: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """:func:`unpack_codes` for 1, 2, 4 and 8 bits, as ``[..., n / group, group]``, read as
    int32 words: lane s of a group takes word ``j = s * bits // 32`` shifted right by
    ``s * bits - 32 * j`` (one broadcast word per group, or a blend of several). Word
    and shift are both chosen by the same comparisons of ``s``, so every index Inductor
    sees is affine in the lane: a ``% 32`` made it build a per-lane shift table (scalar
    code), and a shift table as a tensor is an int32 vector load, which AVX2's
    ``Vectorized<int32_t>`` does through a buffer (8 bits into fp32: 2.58 -> 1.83 G
    elements/s with a table). The byte planes of :func:`unpack_codes` store with a
    stride and stay scalar: decode of 2^22 fp32 elements at 2 and 4 bits, 1 thread,
    AVX-512 (``python -m bench codec``, before and after): 4.3-6.4 GB/s
    from byte planes, 13-26 GB/s from words. ``packed`` holds whole groups and starts
    4-byte aligned (the payload layout guarantees both for full buckets).
    """
    words_per_group = group * bits // 32
    w = packed.view(torch.int32).unflatten(-1, (-1, words_per_group))
    pos = torch.arange(group, dtype=torch.int32, device=packed.device) * bits  # bit offset
    last = words_per_group - 1
    word, shift = w[..., last:], pos - 32 * last
    for j in range(last - 1, -1, -1):
        in_word = pos < 32 * (j + 1)  # lanes s of word j and below
        word = torch.where(in_word, w[..., j:j + 1], word)
        shift = torch.where(in_word, pos - 32 * j, shift)
    # Arithmetic shifts are fine: the mask drops the sign copies above bit 31 - shift.
    return (word >> shift) & ((1 << bits) - 1)


def dequantize_flat(
    meta: torch.Tensor,
    codes: torch.Tensor,
    out: torch.Tensor,
    *,
    bits: int,
    bucket_size: int,
    scheme: str,
    accumulate: int = 0,
    wrap=eager,
    staged: int | None = None,
    group: int | None | str = "auto",
) -> torch.Tensor:
    """Decode into ``out`` (contiguous, ``numel`` elements; cast to its dtype), or with
    ``accumulate`` 1 add the fp32 decode into it (-1: subtract it); returns ``out``.

    As :func:`qcomm.cpu.quantize.quantize_flat`, two kinds of call through ``wrap``:
    :func:`decode_buckets` on the full buckets as ``[buckets, B]`` views, :func:`decode_bucket`
    on one bucket at a time (the partial last one; a lone full one) into a B-element
    fp32 buffer, stored from there.
    ``staged``: decode that many buckets at a time into an fp32 buffer and convert from
    there into ``out`` (the codec's CPU path for 16-bit outputs on AVX-512; not with
    accumulate). ``group``: codes per lane group of the full buckets' word decode, None
    for byte by byte; ``"auto"``: :func:`lane_group` for this machine and the dtype
    the decode stores. Every choice gives the same values.
    """
    if staged is not None and accumulate:
        raise ValueError("dequantize_flat: staged decoding stores; it cannot accumulate")
    B = bucket_size
    effective = scheme_for(scheme, bits)
    sid = effective.id
    if group == "auto":  # (on a GPU, Inductor writes Triton: the 16-lane shapes stay)
        group = lane_group(bits, B, torch.float32 if staged else out.dtype,
                           lanes=None if out.device.type == "cpu" else 16)
    rows = out.dim() == 2 and meta.dim() == 2  # [R, n]: row r decodes payload r
    whole, singles = pieces(out if rows else out.view(-1), meta, codes, bucket_size=B,
                             bits=bits, words=effective.meta_words)
    run_whole = wrap(decode_buckets, group=group, bits=bits, bucket_size=B, sid=sid,
                     accumulate=accumulate)
    # dtype- and accumulate-free: one graph per configuration (_decode_single stores)
    run_single = wrap(decode_bucket, bits=bits, bucket_size=B, sid=sid)
    if whole and staged is None:
        run_whole(whole[1], whole[2], whole[0])
    elif whole:
        o, m, c = whole
        per_row = out.shape[0] if rows else 1
        chunks = row_chunks(o.shape[-2], max(1, staged // per_row))
        buf = torch.empty(max(stop - r for r, stop in chunks) * B * per_row,
                          dtype=torch.float32, device=out.device)
        for r, stop in chunks:
            tmp = buf[: (stop - r) * B * per_row].view(*o.shape[:-2], stop - r, B)
            run_whole(m.narrow(-2, r, stop - r), c.narrow(-2, r, stop - r), tmp)
            o.narrow(-2, r, stop - r).copy_(tmp)
    for o, m, c, _ in singles:
        _decode_single(run_single, m, c, o, bucket_size=B, bits=bits, accumulate=accumulate)
    if not accumulate:  # (accumulating stores select in the graph: out's NaNs too)
        canonical_nans(out, meta)
    return out


def decode_buckets(meta, codes, out, *, bits, bucket_size, sid, accumulate, group):
    """Decode full buckets: ``codes`` [buckets, B * bits / 8] under ``meta`` [buckets, words] into
    ``out`` [buckets, B]: from int32 words (:func:`unpack_words`) as [buckets, B / G, G] where
    ``group`` G is given (:func:`lane_group`), else byte by byte."""
    y = _decode_whole(meta, codes, bits=bits, bucket_size=bucket_size, sid=sid, group=group)
    store(out if group is None else out.unflatten(-1, (-1, group)), y, accumulate)


def _decode_whole(meta, codes, *, bits, bucket_size, sid, group):
    """fp32 values of full buckets (:func:`decode_buckets`): [..., buckets, B], or
    [..., buckets, B / G, G] from words."""
    if group is None:
        return _decode_buckets(meta, unpack_codes(codes, bits), bits=bits, sid=sid)
    k = unpack_words(codes, bits, group)
    return _decode_buckets(meta.unsqueeze(-2), k, bits=bits, sid=sid)


def decode_sum_buckets(meta, codes, own, out, factor, *, rows, op, bits, bucket_size, sid,
                       group):
    """The reduce-scatter's sum of full buckets in one pass: ``own`` [buckets, B] (this
    rank's chunk, exact; any float dtype) plus the decode of payload rows ``rows`` (a
    tuple, in order) of ``meta`` [R, buckets, words] and ``codes`` [R, buckets, B *
    bits / 8], in fp32, one add after another; then ``op``: "sum", "avg" (divided by
    0-d ``factor``: an IEEE division, as the kernels' ``div_rn``) or "premul"
    (multiplied by it); stored into ``out`` [buckets, B] (cast to its dtype)."""
    y = own.to(torch.float32)
    if group is not None:
        y = y.unflatten(-1, (-1, group))
        out = out.unflatten(-1, (-1, group))
    for r in rows:
        y = y + _decode_whole(meta[r], codes[r], bits=bits, bucket_size=bucket_size, sid=sid,
                              group=group)
    write(out, _apply_op(y, factor, op))


def _apply_op(y, factor, op):
    return y / factor if op == "avg" else y * factor if op == "premul" else y


def decode_sum_bucket(meta, codes, own, out, factor, *, rows, op, bits, bucket_size, sid):
    """:func:`decode_sum_buckets` of one bucket: ``meta`` [R, words], ``codes`` [R, B *
    bits / 8] (zero codes past a partial bucket), ``own`` fp32 [B]; into fp32 ``out`` [B]."""
    y = own
    for r in rows:
        k = unpack_codes(codes[r], bits)
        y = y + _decode_buckets(meta[r].view(1, -1), k.view(1, bucket_size), bits=bits,
                                sid=sid).view(-1)
    write(out, _apply_op(y, factor, op))


decode_sum_bucket.static_shapes = True


def _decode_single(decode, meta, codes, out, *, bucket_size, bits, accumulate):
    """One bucket of ``out.numel() <= B`` elements (1-D) through the compiled ``decode``
    (:func:`decode_bucket`) into a B-element fp32 buffer, then stored (cast or added)
    into ``out``: fixed shapes, one graph for every length, dtype and ``accumulate``
    (as :func:`_encode_single`). The same values: the graph computes each in fp32,
    and one cast or one fp32 add follows, here as there."""
    B = bucket_size
    # contiguous: a fixed-shape graph also fixes its strides, and a row's stride in a
    # buffer of payloads changes with the size (copies of one bucket a row)
    meta, codes = meta.contiguous(), _full_codes(codes, B * bits // 8).contiguous()
    if (out.shape[-1] == B and out.dtype == torch.float32 and not accumulate
            and out.is_contiguous()):
        decode(meta, codes, out)  # a lone full bucket into fp32: no buffer
        return
    y = torch.empty(*out.shape[:-1], B, dtype=torch.float32, device=out.device)
    decode(meta, codes, y)
    store(out, y[..., : out.shape[-1]], accumulate)


def _full_codes(codes, nbytes):
    """A partial bucket's codes (last dimension) padded with zero bytes to ``nbytes``."""
    if codes.shape[-1] == nbytes:
        return codes
    full = torch.zeros(*codes.shape[:-1], nbytes, dtype=torch.uint8, device=codes.device)
    full[..., : codes.shape[-1]].copy_(codes)
    return full


def decode_bucket(meta, codes, out, *, bits, bucket_size, sid):
    """Decode one bucket: ``codes`` [B * bits / 8] under ``meta`` [words] into fp32 ``out``
    [B] (the codes past a partial bucket's end are zeros: values to be dropped); or one
    bucket of each of R rows ([R, ...] each)."""
    k = unpack_codes(codes, bits)
    rows = codes.shape[:-1]
    out.copy_(_decode_buckets(meta.view(-1, meta.shape[-1]), k.view(-1, bucket_size),
                              bits=bits, sid=sid).view(*rows, bucket_size))


decode_bucket.static_shapes = True


def _decode_buckets(m: torch.Tensor, k: torch.Tensor, *, bits: int, sid: int) -> torch.Tensor:
    """fp32 values of codes ``k`` [buckets, ..., b] under per-bucket meta ``m``
    [buckets, ..., words] (the middle dimensions broadcast)."""
    L = levels(sid, bits)
    if sid == MINMAX.id:
        return m[..., :1] + k.to(torch.float32) * m[..., 1:2]
    if sid == MAXNORM.id:
        return (k.to(torch.float32) - (L - 1) / 2.0) * m
    M = L - 1
    j = k & ((1 << (bits - 1)) - 1)
    level = ((127 - M + j) << 23).view(torch.float32)
    level = torch.where(j == 0, 0.0, level)
    mag = m * level
    return torch.where((k >> (bits - 1)) == 1, -mag, mag)


def dequantize_sum(meta: torch.Tensor, codes: torch.Tensor, own: torch.Tensor,
                   out: torch.Tensor, config, skip: int | None, op: str, factor: float, *,
                   wrap=eager) -> None:
    """``out = op(own + the fp32 decodes of rows r != skip, added in row order)``:
    ``meta`` and ``codes`` [R, ...] views of R payloads, ``own`` and ``out`` 1-D
    contiguous (any float dtypes): the signature of
    ``qcomm.kernels.dequantize_sum.dequantize_sum``, plus ``wrap``. One graph call for
    the full buckets whatever R (the rows are unrolled in it: one graph per row set) and
    one for a partial last bucket; a 16-bit ``out`` on the CPU is summed ``_STAGED``
    elements at a time into fp32 and converted (as :func:`dequantize`)."""
    B, bits = config.bucket_size, config.bits
    effective = scheme_for(config.scheme, bits)
    sid = effective.id
    rows = tuple(r for r in range(meta.shape[0]) if r != skip)
    fac = _factor_tensor(float(factor), str(out.device))
    staged = out.dtype != torch.float32 and out.device.type == "cpu"
    group = lane_group(bits, B, torch.float32, lanes=None if out.device.type == "cpu" else 16)
    static = dict(rows=rows, op=op, bits=bits, bucket_size=B, sid=sid)
    whole, singles = pieces(out, meta, codes, bucket_size=B, bits=bits,
                             words=effective.meta_words)
    if whole:
        o, m, c = whole
        own_w = own[: o.numel()].view(o.shape)
        run_whole = wrap(decode_sum_buckets, group=group, **static)
        if not staged:
            run_whole(m, c, own_w, o, fac)
        else:
            chunks = row_chunks(o.shape[0], max(1, _STAGED // B))
            buf = torch.empty(max(stop - r for r, stop in chunks) * B, dtype=torch.float32,
                              device=out.device)
            for r, stop in chunks:
                tmp = buf[: (stop - r) * B].view(-1, B)
                run_whole(m.narrow(1, r, stop - r), c.narrow(1, r, stop - r), own_w[r:stop],
                          tmp, fac)
                write(o[r:stop], tmp)
    run_single = wrap(decode_sum_bucket, **static)
    for o, m, c, start in singles:
        mine = torch.zeros(B, dtype=torch.float32, device=out.device)
        mine[: o.numel()].copy_(own[start:start + o.numel()])
        y = torch.empty(B, dtype=torch.float32, device=out.device)
        run_single(m.contiguous(), _full_codes(c, B * bits // 8).contiguous(), mine, y, fac)
        write(o, y[: o.numel()])


@functools.lru_cache(maxsize=64)
def _factor_tensor(factor: float, device: str) -> torch.Tensor:
    # A 0-d tensor: Inductor would turn y / constant into a multiply (see quantize)
    return torch.tensor(factor, dtype=torch.float32, device=device)
