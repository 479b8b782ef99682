"""The torch reference of every codec op: the oracle the Triton kernels must match bit
for bit, and (compiled by :mod:`qcomm.codec` with ``torch.compile``) the CPU data path.

Everything here is plain tensor code over int32/fp32 so that eager torch, Inductor's
C++ and the Triton kernels compute the same bits:

- no fp32 ``a*b + c`` whose rounding decides a code (Triton would fuse it into an FMA;
  the kernels are launched with fusion off as well);
- divisions are IEEE-rounded (``tl.math.div_rn`` on the Triton side), and there is
  one per bucket, not per element: values are scaled by the bucket's reciprocal step
  (a division costs the GPU kernel ~10 instructions an element, a third of its work);
  steps under 2^-100, whose reciprocal would overflow, are first scaled up by 2^64
  (exact: a power of two), so no bucket meets an infinite reciprocal;
- the bucket statistics that decide codes are exact (min, max, max |x|) or summed in
  fp64 before one rounding to fp32 (the L2 norm), so reduction order does not matter
  (an fp64 sum of <= 2^15 squares of fp32 values rounds to the same fp32 except with
  probability ~2^-29 per bucket);
- the hash runs on int32 with wrapping multiplies, the same bits as the kernels' uint32.
"""

from __future__ import annotations

import functools

import torch

from .layout import MASK32, effective_scheme_id, levels, meta_words

# Multiply-xorshift constants of murmur3's fmix32 finalizer and the golden-ratio Weyl
# step: a bijection on uint32 with full avalanche, so consecutive element indices
# give independent-looking random numbers.
FMIX_C1 = 0x85EBCA6B
FMIX_C2 = 0xC2B2AE35
GOLDEN = 0x9E3779B1
GOLDEN_HI = 0x7F4A7C15


def _i32(c: int) -> int:
    """A uint32 constant as the int32 with the same bits."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _srl(h: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int32 ``h`` (torch's ``>>`` is arithmetic)."""
    return (h >> s) & ((1 << (32 - s)) - 1)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # int32 multiplies wrap mod 2^32 like the kernels' uint32 ones; xor and the
    # logical shifts see the same 32 bits, so the result is the uint32 hash's bits.
    h = h ^ _srl(h, 16)
    h = h * _i32(FMIX_C1)
    h = h ^ _srl(h, 13)
    h = h * _i32(FMIX_C2)
    return h ^ _srl(h, 16)


def fmix32_int(h: int) -> int:
    """fmix32 on a Python int (host side: turns a seed into the RNG key)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * FMIX_C1) & MASK32
    h ^= h >> 13
    h = (h * FMIX_C2) & MASK32
    return h ^ (h >> 16)


def seed_key(seed: int) -> int:
    """Fold a (up to 64-bit) seed into the 32-bit key of the element hash (as int32)."""
    seed &= (1 << 64) - 1
    return _i32(fmix32_int((seed & MASK32) ^ fmix32_int((seed >> 32) ^ GOLDEN_HI)))


def uniform(index: torch.Tensor, key: int | torch.Tensor) -> torch.Tensor:
    """Counter-based uniform in [0, 1) on a 2^-24 grid from (key, int64 element index).

    ``h = fmix32((lo32(i) * GOLDEN + key) ^ (hi32(i) * GOLDEN_HI))``, ``u = (h >> 8) / 2^24``
    over uint32 (here int32 with wrapping multiplies): exact in fp32, and the same
    function as ``kernels/_common.py::uniform``. 32-bit lanes: twice the vector width
    of int64 on the CPU path. An int32 ``index`` (every index < 2^31, the kernels'
    ``WIDE=False``) has a high word of 0, and ``h ^ 0 * GOLDEN_HI == h``: the 64-bit
    shift, conversion and multiply are skipped, the same bits.
    """
    h = index.to(torch.int32) * _i32(GOLDEN) + key  # lo32(i): truncates mod 2^32
    if index.dtype != torch.int32:
        h = h ^ ((index >> 32).to(torch.int32) * _i32(GOLDEN_HI))
    h = _fmix32(h)
    return _srl(h, 8).to(torch.float32) * (1.0 / 16777216.0)


def _bucket_reduce(t: torch.Tensor, op) -> torch.Tensor:
    """Reduce each bucket (row of ``t``) to ``[nb, 1]`` in two stages: across rows of 16
    (or 8) lanes first, then the lanes. Inductor vectorizes the first stage vertically:
    measured 25 GB/s for a max over [2^14, 1024] fp32 against 5 GB/s reducing each row
    at once (dynamic shapes, 2 cores). Exact for min and max; the NaN test of a sum is
    order-free; the fp64 L2 sum rounds to the same fp32 as any other order w.h.p.
    """
    nb, B = t.shape
    lanes = 16 if B % 16 == 0 else 8
    return op(op(t.view(nb, B // lanes, lanes), dim=1), dim=1, keepdim=True)


def divisor_for(scheme_id: int, bits: int) -> float:
    """What the scale is divided by to get the step: ``L - 1`` (minmax), ``c`` (maxnorm)."""
    L = levels(scheme_id, bits)
    return float(L - 1) if scheme_id == 0 else (L - 1) / 2.0


def _round_codes(t: torch.Tensor, thr: torch.Tensor | float, top: int) -> torch.Tensor:
    """Round level position ``t >= 0`` up when its fraction exceeds ``thr``; clamp."""
    lo = torch.floor(t)
    frac = t - lo
    up = (frac > thr).to(torch.int32)
    return torch.clamp(lo.to(torch.int32) + up, 0, top)


def eager(fn, **static):
    """The default ``wrap`` of the codec entry points: run ``fn`` as it is."""
    return functools.partial(fn, **static)


def quantize_reference(
    x: torch.Tensor,
    *,
    bits: int,
    bucket_size: int,
    scheme: str,
    l2: bool,
    stochastic: bool,
    key: int | torch.Tensor,
    divisor: torch.Tensor | None = None,
    meta_out: torch.Tensor | None = None,
    codes_out: torch.Tensor | None = None,
    wrap=eager,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float tensor (read flat); returns (meta fp32 [nb * words], codes uint8),
    written into ``meta_out`` / ``codes_out`` when given (the payload's views: no
    temporaries, no copy).

    ``meta`` per bucket: minmax ``[min, step]``; maxnorm ``[step]``; nuq ``[scale]``.
    ``codes``: ``ceil(n / 8) * bits`` bytes, each group of 8 consecutive codes one
    little-endian ``bits``-byte word with code k at bits ``[k*bits, (k+1)*bits)``.
    A bucket holding inf or NaN gets NaN metadata and all-zero codes.

    ``key`` (the RNG key) and ``divisor`` (the level count the scale is divided by,
    :func:`divisor_for`) may be 0-d tensors: under ``torch.compile`` a Python number
    would be a constant, and Inductor turns ``x / constant`` into ``x * (1 / constant)``,
    which rounds differently from the Triton kernel's IEEE division.

    The work is two calls, each through ``wrap(fn, **static)`` (the codec passes its
    ``torch.compile`` cache): :func:`encode_buckets` on the full buckets as ``[nb, B]``
    views, :func:`encode_tail` on the partial last bucket. Split here, outside the
    compiled graphs, the graphs see 2-D tensors whose only dynamic size is the bucket
    count, so Inductor indexes them without a division or modulo by a symbolic size
    per vector (the flat graph's loops had several).
    """
    n = x.numel()
    B = bucket_size
    sid = effective_scheme_id(scheme, bits)
    W = meta_words(sid)
    if divisor is None:
        divisor = torch.tensor(divisor_for(sid, bits), dtype=torch.float32, device=x.device)
    if meta_out is None:
        meta_out = torch.empty(-(-n // B) * W, dtype=torch.float32, device=x.device)
        codes_out = torch.empty(-(-n // 8) * bits, dtype=torch.uint8, device=x.device)
    # wide: indices may reach 2^31 (the kernels' WIDE, n + B >= 2^31); part of the
    # compile key, so a 2^31-element tensor gets its own graph.
    static = dict(bits=bits, bucket_size=B, sid=sid, l2=l2, stochastic=stochastic,
                  wide=n + B >= 2**31)
    whole, tail = _pieces(x.reshape(-1), meta_out, codes_out, bucket_size=B, bits=bits, W=W)
    if whole:
        wrap(encode_buckets, **static)(*whole, key=key, divisor=divisor)
    if tail:
        # The tail's first element index as a tensor: an int would be a constant of the
        # compiled graph, one compile per tensor size.
        start = torch.tensor(n - tail[0].numel(), dtype=torch.int64, device=x.device)
        wrap(encode_tail, **static)(*tail, start=start, key=key, divisor=divisor)
    return meta_out, codes_out


def _pieces(flat, meta, codes, *, bucket_size, bits, W):
    """Split the elements ``flat`` (1-D), their ``meta`` and ``codes`` into the full
    buckets, as ``([nb, B], [nb, W], [nb, B * bits / 8])`` views, and the partial last
    bucket, as 1-D views; either is None where there is none."""
    B = bucket_size
    full = flat.numel() // B
    nbytes = full * B * bits // 8  # bucket sizes are multiples of 8: whole bytes
    whole = tail = None
    if full:
        whole = (flat[: full * B].view(full, B), meta[: full * W].view(full, W),
                 codes[:nbytes].view(full, B * bits // 8))
    if full * B < flat.numel():
        tail = (flat[full * B:], meta[full * W:], codes[nbytes:])
    return whole, tail


def encode_buckets(x, meta_out, codes_out, *, key, divisor, bits, bucket_size, sid, l2,
                   stochastic, wide):
    """Quantize full buckets ``x`` [nb, B] into ``meta_out`` [nb, W] and ``codes_out``
    [nb, B * bits / 8] (element indices from 0). ``bucket_size`` (B) is not read: it keys
    the codec's compile cache, as every static argument of these pieces does."""
    meta, codes = _quantize_buckets(x.to(torch.float32), 0, None, bits=bits, sid=sid, l2=l2,
                                    stochastic=stochastic, key=key, divisor=divisor,
                                    wide=wide)
    meta_out.copy_(meta)
    codes = codes.to(torch.uint8)
    if bits < 8:
        # Below 8 bits, materialize the codes as bytes before packing (a graph break
        # under torch.compile; a no-op in eager). Fused, Inductor recomputed each packed
        # byte's codes from strided, gathered reads of x. 2^24 fp32, 1 thread: min-max
        # 4-bit 1.5 GB/s fused against 3.2 through bytes, nuq 4-bit 0.28 against 2.9;
        # maxnorm the same either way. At 8 bits there is nothing to pack and every
        # scheme runs fused (maxnorm 8-bit 4.3 GB/s). (Packing by summing shifted codes
        # into int32 words, fused, ran at 0.3-1 GB/s.)
        if torch.compiler.is_compiling():  # eager: never touch dynamo (it crashed gloo
            torch._dynamo.graph_break()     # ranks at exit: "terminate called ...")
    codes_out.copy_(pack_codes(codes, bits))


def encode_tail(x, meta_out, codes_out, *, start, key, divisor, bucket_size, bits, sid, l2,
                stochastic, wide):
    """Quantize the partial last bucket ``x`` (1-D, < B elements, first index ``start``)
    into ``meta_out`` [W] and ``codes_out`` [ceil(len / 8) * bits]: padded to a bucket
    and masked, on its own (masks over the whole tensor cost 6x: 13.7 GB/s without
    against 2.3 GB/s with, minmax 8 bits, 2^24 elements, 2 cores, Inductor)."""
    B = bucket_size
    rest = x.numel()
    valid = (torch.arange(B, device=x.device) < rest).view(1, B)
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, B - rest)).view(1, B)
    meta, codes = _quantize_buckets(padded, start.to(torch.int64 if wide else torch.int32),
                                    valid, bits=bits, sid=sid, l2=l2, stochastic=stochastic,
                                    key=key, divisor=divisor, wide=wide)
    meta_out.copy_(meta.reshape(-1))
    codes_out.copy_(pack_codes(codes.reshape(-1)[: -(-rest // 8) * 8], bits))


def _quantize_buckets(xp, start, valid, *, bits, sid, l2, stochastic, key, divisor,
                      wide=True):
    """Quantize buckets ``xp`` [nb, B] (fp32) whose first element has index ``start``;
    ``valid`` masks the padding of a partial bucket (None: all valid); ``wide``: element
    indices may reach 2^31 (int64 indices; else int32, as the kernels' ``WIDE``).
    Returns (meta [nb, W] fp32, codes [nb, B] int32; padding codes 0)."""
    nb, B = xp.shape
    L = levels(sid, bits)
    # Broadcast, not arange(nb * B).view(nb, B): Inductor (torch 2.13) fails to lower that
    # reshape when nb is symbolic ("pop from empty list").
    # int32 indices where all are < 2^31 (see uniform); int64 otherwise.
    itype = torch.int64 if wide else torch.int32
    rows = torch.arange(nb, device=xp.device, dtype=itype)[:, None] * B
    index = start + rows + torch.arange(B, device=xp.device, dtype=itype)
    # inf * 0 and NaN * 0 are NaN; finite * 0 is +-0: the sum is NaN iff the bucket
    # holds a non-finite value, whatever the summation order.
    bad = torch.isnan(_bucket_reduce(xp * 0.0, torch.sum))
    if stochastic:
        thr = 1.0 - uniform(index, key)  # P(frac > 1 - u) = frac for u on [0, 1)
    else:
        thr = 0.5
    nan = torch.tensor(float("nan"), dtype=torch.float32, device=xp.device)
    if sid == 0:  # minmax
        lo_in = xp if valid is None else torch.where(valid, xp, float("inf"))
        hi_in = xp if valid is None else torch.where(valid, xp, float("-inf"))
        mn = _bucket_reduce(lo_in, torch.amin)
        mx = _bucket_reduce(hi_in, torch.amax)
        step = (mx - mn) / divisor
        t = _scaled(xp - mn, step)
        t = torch.where(bad, 0.0, t)
        codes = _round_codes(t, thr, L - 1)
        meta = torch.cat([torch.where(bad, nan, mn), torch.where(bad, nan, step)], dim=1)
    else:  # padding is 0: it changes neither max |x| nor the L2 norm
        if l2:
            scale = _bucket_reduce(xp.to(torch.float64).square(), torch.sum).sqrt()
            scale = scale.to(torch.float32)
        else:
            scale = _bucket_reduce(xp.abs(), torch.amax)
        if sid == 1:  # maxnorm: x = (k - c) * step, c = (L - 1) / 2
            step = scale / divisor
            t = _scaled(xp, step) + divisor
            t = torch.where(bad, 0.0, t)
            codes = _round_codes(t, thr, L - 1)
            meta = torch.where(bad, nan, step)
        else:  # nuq: sign bit, level j in 0..M: 0 or 2^-(M - j)
            M = L - 1
            r = _scaled(xp.abs(), scale)
            r = torch.clamp(torch.where(bad, 0.0, r), max=1.0)
            ebits = (r.view(torch.int32) >> 23) & 0xFF  # r >= 0: the sign bit is 0
            mant = (r.view(torch.int32) & 0x7FFFFF).to(torch.float32)
            geometric = ebits >= 127 - (M - 1)  # r >= 2^-(M-1), the smallest level
            j_lo = torch.where(geometric, ebits - 127 + M, 0)
            frac = torch.where(geometric, mant * (1.0 / 8388608.0), r * float(2.0 ** (M - 1)))
            up = (frac > thr).to(torch.int32)
            j = torch.clamp(j_lo.to(torch.int32) + up, max=M)
            sign = (xp < 0).to(torch.int32)
            codes = (sign << (bits - 1)) | j
            meta = torch.where(bad, nan, scale)
    if valid is not None:
        codes = torch.where(valid, codes, 0)
    return meta, codes


# Steps below TINY are scaled by BOOST before their reciprocal is taken: 1 / 2^-100 is
# 2^100, far from fp32's overflow at 2^128, and both factors are exact powers of two.
TINY = 2.0**-100
BOOST = 2.0**64


def _scaled(v: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``v / step`` per bucket as ``(v * s) * (1 / (step * s))``; 0 where ``step`` is not
    > 0 (constant or non-finite buckets). ``s`` is BOOST for steps under TINY, else 1."""
    s = torch.where(step < TINY, BOOST, 1.0)
    inv = torch.where(step > 0, 1.0 / (step * s), 0.0)
    return (v * s) * inv


def _byte_pieces(bits: int, m: int):
    """(k, shift) of the codes overlapping byte m of a group's word: shift = k*bits - 8m."""
    return [(k, k * bits - 8 * m) for k in range(8)
            if k * bits < 8 * m + 8 and (k + 1) * bits > 8 * m]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 codes [..., m] (m a multiple of 8) -> uint8 [..., m * bits / 8], 8 codes per
    ``bits`` bytes along the last dimension.

    Group g's word ``w = sum_k codes[8g + k] << (k * bits)`` is stored little-endian in
    bytes ``[g * bits, (g + 1) * bits)``. Each byte is built from the codes that overlap
    it, so every code is computed once (bits dividing 8) or at most twice (3, 5, 6, 7
    bits): a reduction over the 8 codes of a group would run scalar under Inductor.
    """
    lead = codes.shape[:-1]
    if bits == 8:
        return codes.to(torch.uint8)
    if 8 % bits == 0:
        per = 8 // bits
        g = codes.view(*lead, -1, per)
        byte = g[..., 0]
        for k in range(1, per):
            byte = byte | (g[..., k] << (k * bits))
        return byte.to(torch.uint8)
    g = codes.view(*lead, -1, 8)
    out = []
    for m in range(bits):
        byte = None
        for k, shift in _byte_pieces(bits, m):
            piece = (g[..., k] << shift) if shift >= 0 else (g[..., k] >> -shift)
            byte = piece if byte is None else byte | piece
        out.append(byte & 0xFF)
    return torch.stack(out, dim=-1).to(torch.uint8).reshape(*lead, -1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 [..., m] -> int32 codes [..., m * 8 / bits]."""
    lead = packed.shape[:-1]
    mask = (1 << bits) - 1
    if bits == 8:
        return packed.to(torch.int32)
    if 8 % bits == 0:
        # One plane per position in the byte (contiguous loads, strided stores): a single
        # broadcast shift over [bytes, 8 / bits] made Inductor gather (~1 GB/s).
        wide = packed.to(torch.int32)
        planes = [(wide >> (s * bits)) & mask for s in range(8 // bits)]
        return torch.stack(planes, dim=-1).reshape(*lead, -1)
    g = packed.view(*lead, -1, bits).to(torch.int32)
    out = []
    for k in range(8):
        code = None
        for m in range(bits):
            shift = k * bits - 8 * m
            if not -bits < shift < 8:  # byte m holds none of code k
                continue
            piece = (g[..., m] >> shift) if shift >= 0 else (g[..., m] << -shift)
            code = piece if code is None else code | piece
        out.append(code & mask)
    return torch.stack(out, dim=-1).reshape(*lead, -1)


def lane_group(bits: int, bucket_size: int) -> int | None:
    """Codes per lane group of the word paths (:func:`unpack_words`): 16 (one AVX-512
    vector of fp32; 2 and 4 bits) or 32 (1 bit: one int32 word); None where the word
    paths do not apply (3, 5, 6, 7 and 8 bits, or buckets not a multiple of the group)."""
    if bits not in (1, 2, 4):
        return None
    group = max(16, 32 // bits)
    return group if bucket_size % group == 0 else None


def unpack_words(packed: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """:func:`unpack_codes` for 1, 2 and 4 bits, as ``[n / group, group]``, read as int32
    words: lane s of a group takes word ``s * bits // 32`` (a broadcast: one per group, or
    a blend of two at 4 bits) shifted by ``s * bits % 32``. Every loop Inductor makes of
    it runs along the lanes, 16 wide; the byte planes of :func:`unpack_codes` store with
    a stride and stay scalar. Decode of 2^22 fp32 elements at 2 and 4 bits, 1 thread
    (bench/results/cpu-amd-epyc-2c/codec.txt and its git history): 4.3-6.4 GB/s from
    byte planes, 13-26 GB/s from words. ``packed`` holds whole groups and starts 4-byte
    aligned (the payload layout guarantees both for full buckets).
    """
    words_per_group = group * bits // 32
    w = packed.view(torch.int32).view(-1, words_per_group)
    s = torch.arange(group, dtype=torch.int32, device=packed.device)
    word = w[:, words_per_group - 1:]
    for j in range(words_per_group - 2, -1, -1):  # lanes of word j: s * bits < 32 (j + 1)
        word = torch.where(s * bits < 32 * (j + 1), w[:, j:j + 1], word)
    # Arithmetic shifts are fine: the mask drops the sign copies above bit 31 - shift.
    return (word >> ((s * bits) % 32)) & ((1 << bits) - 1)


def dequantize_reference(
    meta: torch.Tensor,
    codes: torch.Tensor,
    out: torch.Tensor,
    *,
    bits: int,
    bucket_size: int,
    scheme: str,
    accumulate: bool = False,
    wrap=eager,
    staged: int | None = None,
) -> torch.Tensor:
    """Decode into ``out`` (contiguous, ``numel`` elements; cast to its dtype), or with
    ``accumulate`` add the fp32 decode into it; returns ``out``.

    As :func:`quantize_reference`, two calls through ``wrap``: :func:`decode_buckets` on
    the full buckets as ``[nb, B]`` views, :func:`decode_tail` on the partial last one.
    ``staged``: decode that many buckets at a time into an fp32 buffer and convert from
    there into ``out`` (the codec's CPU path for 16-bit outputs; not with accumulate).
    """
    if staged is not None and accumulate:
        raise ValueError("dequantize_reference: staged decoding stores; it cannot accumulate")
    B = bucket_size
    sid = effective_scheme_id(scheme, bits)
    static = dict(bits=bits, bucket_size=B, sid=sid, accumulate=accumulate)
    whole, tail = _pieces(out.view(-1), meta, codes, bucket_size=B, bits=bits,
                          W=meta_words(sid))
    run_whole, run_tail = wrap(decode_buckets, **static), wrap(decode_tail, **static)
    if staged is None:
        if whole:
            run_whole(whole[1], whole[2], whole[0])
        if tail:
            run_tail(tail[1], tail[2], tail[0])
        return out
    buf = torch.empty(min(out.numel(), staged * B), dtype=torch.float32, device=out.device)
    if whole:
        o, m, c = whole
        for r in range(0, o.shape[0], staged):
            tmp = buf[: o[r:r + staged].numel()].view(-1, B)
            run_whole(m[r:r + staged], c[r:r + staged], tmp)
            o[r:r + staged].copy_(tmp)
    if tail:
        o, m, c = tail
        tmp = buf[: o.numel()]
        run_tail(m, c, tmp)
        o.copy_(tmp)
    return out


def decode_buckets(meta, codes, out, *, bits, bucket_size, sid, accumulate):
    """Decode full buckets: ``codes`` [nb, B * bits / 8] under ``meta`` [nb, W] into
    ``out`` [nb, B]. 1, 2 and 4 bits unpack from int32 words (:func:`unpack_words`) as
    [nb, B / G, G], G codes a lane group; other widths byte by byte."""
    nb, B = out.shape[0], bucket_size
    group = lane_group(bits, B)
    if group is None:
        k = unpack_codes(codes, bits)
        y = _decode_buckets(meta, k, bits=bits, sid=sid)
    else:
        k = unpack_words(codes, bits, group).view(nb, B // group, group)
        y = _decode_buckets(meta.unsqueeze(1), k, bits=bits, sid=sid)
        out = out.view(nb, B // group, group)
    store(out, y, accumulate)


def decode_tail(meta, codes, out, *, bits, bucket_size, sid, accumulate):
    """Decode the partial last bucket: ``out`` (1-D, < B elements) from its ``meta`` [W]
    and ``codes`` [ceil(len / 8) * bits]."""
    rest = out.numel()
    k = unpack_codes(codes, bits)[:rest]
    store(out, _decode_buckets(meta.view(1, -1), k.view(1, rest), bits=bits, sid=sid).view(-1),
           accumulate)


def store(dst: torch.Tensor, y: torch.Tensor, accumulate: bool) -> None:
    """``dst += y`` (accumulate) or ``dst[...] = y``."""
    if accumulate:
        dst.add_(y)
    else:
        dst.copy_(y)


def _decode_buckets(m: torch.Tensor, k: torch.Tensor, *, bits: int, sid: int) -> torch.Tensor:
    """fp32 values of codes ``k`` [nb, ..., b] under per-bucket meta ``m`` [nb, ..., W]
    (the middle dimensions broadcast)."""
    L = levels(sid, bits)
    if sid == 0:
        return m[..., :1] + k.to(torch.float32) * m[..., 1:2]
    if sid == 1:
        return (k.to(torch.float32) - (L - 1) / 2.0) * m
    M = L - 1
    j = k & ((1 << (bits - 1)) - 1)
    level = ((127 - M + j) << 23).view(torch.float32)
    level = torch.where(j == 0, 0.0, level)
    mag = m * level
    return torch.where((k >> (bits - 1)) == 1, -mag, mag)
