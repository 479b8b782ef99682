"""Quantize on the tuned torch path: :func:`quantize` writes a payload's metadata and
codes, the bytes of :func:`qcomm.oracle.quantize`, from pieces that
:mod:`qcomm.cpu.compiled` compiles (or that run eagerly).
"""

from __future__ import annotations

import functools

import torch

from ..constants import BOOST, TINY
from ..layout import MAXNORM, MINMAX, NUQ, effective_scheme_id, levels, scheme_for
from .common import (
    divisor_for,
    eager,
    half_uniform,
    index_tensor,
    pack_codes,
    pair_hash,
    pieces,
    plus_zero,
    row_chunks,
    uniform,
)


def quantize(x: torch.Tensor, meta: torch.Tensor, codes: torch.Tensor, config,
             key: int | list[int], *, wrap=eager) -> None:
    """Quantize 1-D contiguous ``x`` into a payload's ``meta`` (fp32) and ``codes`` (uint8)
    views: the same signature as ``qcomm.kernels.quantize.quantize``, plus ``wrap``, how
    the pieces run (:func:`qcomm.cpu.compiled.compiled` or eagerly). ``key`` is
    :func:`qcomm.constants.seed_key` of the call's seed. Rows: ``x`` [R, n] (R >= 2,
    rows of any stride), ``meta`` and ``codes`` [R, ...] (row r: payload r's views) and
    ``key`` a list of R keys: every row is its own payload, in the same graph calls as
    one (rows of over :data:`ROWS_SPLIT` elements: a call per row). Shapes and dtypes
    are checked by :mod:`qcomm.codec`, the one caller."""
    sid = effective_scheme_id(config.scheme, config.bits)
    rows_meta = None
    if not isinstance(key, int) and x.shape[-1] > ROWS_SPLIT:
        for r, k in enumerate(key):
            quantize(x[r], meta[r], codes[r], config, k, wrap=wrap)
        return
    if isinstance(key, int):
        key = index_tensor(key, x.device)
    else:  # [R, 1]: broadcast over each row's elements (int32: the lanes' type)
        key = torch.tensor(key, dtype=torch.int32, device=x.device).view(-1, 1)
        # The rows' metadata goes through a contiguous buffer: as views of one buffer
        # whose rows interleave with the codes', the fp32 metadata and uint8 codes
        # overlap in AOT autograd's eyes, and it refuses to mutate overlapping views of
        # two dtypes in one graph. (1/256 of the bytes at 8 bits, buckets of 1024.)
        rows_meta, meta = meta, torch.empty(meta.shape, dtype=torch.float32, device=x.device)
    quantize_flat(
        x, bits=config.bits, bucket_size=config.bucket_size, scheme=config.scheme,
        l2=config.norm == "l2", stochastic=config.rounding == "stochastic",
        key=key, divisor=_divisor_tensor(sid, config.bits, str(x.device)),
        meta_out=meta, codes_out=codes, wrap=wrap)
    if rows_meta is not None:
        rows_meta.copy_(meta)


@functools.lru_cache(maxsize=64)
def _divisor_tensor(sid: int, bits: int, device: str) -> torch.Tensor:
    # A 0-d tensor, not a Python float: Inductor would turn x / constant into a multiply.
    return torch.tensor(divisor_for(sid, bits), device=device)


def quantize_flat(
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
    """Quantize a float tensor (read flat); returns (meta fp32 [buckets * words], codes uint8),
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

    The work is two kinds of call, each through ``wrap(fn, **static)`` (the codec passes
    its ``torch.compile`` cache): :func:`encode_buckets` on the full buckets as
    ``[buckets, B]`` views, :func:`encode_bucket` on one bucket at a time (the partial last
    one; a lone full one) copied into a B-element buffer. Split here, outside the
    compiled graphs, the graphs see 2-D tensors whose only dynamic size is the bucket
    count, so Inductor indexes them without a division or modulo by a symbolic size
    per vector (the flat graph's loops had several), or tensors of fixed size.
    """
    rows = x.dim() == 2 and meta_out is not None and meta_out.dim() == 2
    n = x.shape[-1] if rows else x.numel()
    B = bucket_size
    effective = scheme_for(scheme, bits)
    sid, words = effective.id, effective.meta_words
    if divisor is None:
        divisor = torch.tensor(divisor_for(sid, bits), dtype=torch.float32, device=x.device)
    if meta_out is None:
        meta_out = torch.empty(-(-n // B) * words, dtype=torch.float32, device=x.device)
        codes_out = torch.empty(-(-n // 8) * bits, dtype=torch.uint8, device=x.device)
    # wide: indices may reach 2^31 (the kernels' WIDE, n + B >= 2^31); part of the
    # compile key, so a 2^31-element tensor gets its own graph.
    static = dict(bits=bits, bucket_size=B, sid=sid, l2=l2, stochastic=stochastic,
                  wide=n + B >= 2**31)
    whole, singles = pieces(x if x.dim() == 1 or rows else x.reshape(-1), meta_out,
                             codes_out, bucket_size=B, bits=bits, words=words)
    per_row = x.shape[0] if rows else 1
    if whole:
        xw, mw, cw = whole
        n_buckets, H = xw.shape[-2], B // 2
        # rows: [R, 1, 1], one key per row's buckets
        whole_key = key.view(-1, 1, 1) if rows else key
        # Rows: the codes go into one [rows, buckets, B] view, split inside the graph.
        # Two mutated views of one buffer whose rows interleave (each row's halves) made
        # AOT autograd pass the buffer itself as a "synthetic base" of fixed size, which
        # failed on the next call of another size.
        encode = wrap(encode_buckets, **static, joined=rows)
        # One loop computes the codes of both halves of every bucket from one hash each
        # (uniform). From fp32 the codes go straight into two views: the payload's halves
        # (8 bits) or those of one byte buffer to pack. From bf16/fp16 they come back
        # as two tensors (more to allocate and a cat to pack): Inductor copies a value
        # into a strided view through a loop of its own, and a loop without bf16/fp16 in
        # the kernel made it tile the 16-bit loads 8 wide, which AVX2 does through a
        # buffer (bf16 8-bit codes loop 0.57 -> 0.93 G elements/s as two outputs, Zen 3,
        # 1 thread). Below 8 bits a second call packs them (pack_buckets): packed in the
        # same graph, Inductor recomputed each packed byte's codes from strided, gathered
        # reads of x (AVX-512, 2^24 fp32, 1 thread: min-max 4-bit 1.5 GB/s against 3.2
        # apart). Those byte buffers go ENCODE_CHUNK elements at a time (below).
        # nuq from bf16/fp16 is converted to fp32 first, CONVERT_CHUNK elements at a time
        # (exact): its per-element bitcasts run one lane at a time in Inductor's 16-wide
        # bf16 loop and vectorize in the 8-wide fp32 one (below).
        via32 = x.dtype != torch.float32 and sid == NUQ.id
        fp32 = x.dtype == torch.float32 or via32
        direct = fp32 and bits == 8
        # fp32 graphs take the counters' offsets as data (positions); a bf16/fp16 graph
        # is tiled 16 wide, where converting them to int32 went through a buffer (a
        # store-forwarding stall: bf16 8-bit, 2^24, 0.57-0.60 -> 0.34-0.46 G elements/s),
        # so it keeps the in-graph arange.
        pos = positions(H, x.device) if fp32 else None
        chunks = row_chunks(n_buckets, CONVERT_CHUNK // (B * per_row) if via32
                             else n_buckets if direct else ENCODE_CHUNK // (B * per_row))
        most = max(stop - start for start, stop in chunks) * B * per_row  # buffer elements
        scratch = buf32 = None
        for r, stop in chunks:
            def part(t, r=r, stop=stop):  # the chunk's buckets (all of t: no view op)
                return t if len(chunks) == 1 else t.narrow(-2, r, stop - r)

            first = index_tensor(r, x.device)
            src, m, c = part(xw), part(mw), part(cw)
            if via32:
                if buf32 is None:
                    buf32 = torch.empty(most, dtype=torch.float32, device=x.device)
                src = buf32[: src.numel()].view(src.shape).copy_(src)
            if direct:
                lo, hi = (c, None) if rows else (c[..., :H], c[..., H:])
                encode(src, m, lo, hi, pos, first=first, key=whole_key, divisor=divisor)
                continue
            if fp32:
                if scratch is None:
                    scratch = torch.empty(most, dtype=torch.uint8, device=x.device)
                dest = scratch[: src.numel()].view(src.shape)
                lo, hi = (dest, None) if rows else (dest[..., :H], dest[..., H:])
                encode(src, m, lo, hi, pos, first=first, key=whole_key, divisor=divisor)
                halves = (dest, None)
            else:
                halves = encode(src, m, None, None, pos, first=first, key=whole_key,
                                divisor=divisor)
                if bits == 8:
                    c[..., :H].copy_(halves[0])
                    c[..., H:].copy_(halves[1])
                    continue
            wrap(pack_buckets, bits=bits, bucket_size=B)(*halves, c)
    for piece in singles:
        _encode_single(wrap(encode_bucket, **static), *piece, key=key, divisor=divisor,
                       bucket_size=B, bits=bits)
    return meta_out, codes_out


def _encode_single(encode, x, meta_out, codes_out, start, *, key, divisor, bucket_size,
                   bits):
    """One bucket of ``n <= B`` elements (1-D, first index ``start``) through the compiled
    ``encode`` (:func:`encode_bucket`): copied into a zeroed B-element fp32 buffer
    (exact from bf16/fp16), so that graph has fixed shapes and one compile serves every
    length and dtype (a partial bucket's length is new with almost every tensor size:
    each a recompile of ~5-20 s at first, then a second, dynamic graph). The length and
    start go in as 0-d tensors, data to the graph; codes beyond the bucket's are
    dropped."""
    B = bucket_size
    n = x.shape[-1]
    padded = torch.zeros(*x.shape[:-1], B, dtype=torch.float32, device=x.device)
    padded[..., :n].copy_(x)
    # direct where whole and contiguous (rows: a row's stride changes with the size, and
    # a fixed-shape graph fixes its strides too)
    whole = codes_out.shape[-1] == B * bits // 8 and codes_out.is_contiguous()
    codes = codes_out if whole else torch.empty(*x.shape[:-1], B * bits // 8,
                                                dtype=torch.uint8, device=x.device)
    meta = meta_out if meta_out.is_contiguous() else torch.empty(
        meta_out.shape, dtype=meta_out.dtype, device=meta_out.device)
    encode(padded, meta, codes, length=index_tensor(n, x.device),
           start=index_tensor(start, x.device), key=key,
           divisor=divisor)
    if not whole:
        codes_out.copy_(codes[..., : codes_out.shape[-1]])
    if meta is not meta_out:
        meta_out.copy_(meta)


# Elements quantize_flat encodes per call where the codes pass through byte buffers
# (below 8 bits, or from bf16/fp16): at most 16 MiB of them, under glibc's 32 MiB
# ceiling for serving an allocation from mmap, so after the first call they come from
# the heap instead of fresh, page-faulting pages every call. 2^26 elements, 1 thread,
# Zen 3, G elements/s, one run, whole tensor -> 2^24 chunks (2^21-2^22 chunks lost
# 5-20% to per-call costs): fp32 2-bit 0.29 -> 0.41, 4-bit 0.33 -> 0.42; bf16 2-bit
# 0.28 -> 0.46, 4-bit 0.32 -> 0.45, 8-bit 0.46 -> 0.56.
ENCODE_CHUNK = 1 << 24
# Rows longer than this are quantized one row per graph call: past it a row's call costs
# far more than its fixed ~50-100 us, and the [rows, buckets, B] graph ran 0.59-0.85x
# as fast as one call per row at 2^20 elements a row, W = 4-16, while 1.02-1.24x at
# 2^18 (8 bits, fp32, AMD EPYC 2 cores AVX-512; `bench/rows.py`, in git history at
# 661a74f).
ROWS_SPLIT = 1 << 18
# Elements of a bf16/fp16 tensor converted to fp32 at a time before a nuq quantize (a
# 16 MiB buffer, under the same ceiling). nuq from bf16, 1 thread, Zen 3, G elements/s,
# best of three alternating runs, direct -> through fp32: 2^24 8-bit 0.36 -> 0.44,
# 4-bit 0.32 -> 0.35, 2-bit 0.29 -> 0.35; 2^26 0.35 -> 0.41, 0.32 -> 0.36, 0.31 -> 0.36.
CONVERT_CHUNK = 1 << 22


@functools.cache
def positions(n: int, device: torch.device) -> torch.Tensor:
    """``0, 1, ..., n - 1`` as fp32 [1, n] on ``device`` (cached): the hash counters'
    offsets within a bucket half, passed into the compiled quantize as data. From
    ``torch.arange`` in the graph, Inductor's AVX2 C++ built each vector of 8 from
    scalars (17 instructions); an fp32 load and a conversion are 2, and an int32 load
    goes through a buffer (see :func:`unpack_words`). 8-bit fp32 code loop per 16
    elements, Zen 3: 107 -> 80 instructions (minmax), 105 -> 80 (maxnorm), 140 -> 111
    (nuq), with :func:`round_position`'s selects."""
    return torch.arange(n, dtype=torch.float32, device=device).view(1, n)


def encode_buckets(x, meta_out, lo_out, hi_out, pos, *, first, key, divisor, bits,
                   bucket_size, sid, l2, stochastic, wide, joined=False):
    """Quantize full buckets ``x`` [buckets, B] (the first one bucket number ``first``, a 0-d
    tensor: element indices from ``first * B``) into ``meta_out`` [buckets, words] and the codes,
    one byte each, of each bucket's two halves: into ``lo_out`` and ``hi_out``
    [buckets, B / 2] (views) if given, else returned as two new tensors. ``pos`` is
    :func:`positions` of B / 2, or None (an arange in the graph). ``bucket_size`` (B)
    is not read: it keys the codec's compile cache, as every static argument of these
    pieces does. Rows (``x`` [rows, buckets, B], ``key`` [rows, 1, 1]): ``joined``, and
    ``lo_out`` [rows, buckets, B] takes both halves (``hi_out`` None)."""
    n_buckets, B = x.shape[-2:]
    H = B // 2
    xf = x.to(torch.float32)
    meta, per = bucket_stats(xf, None, sid=sid, bits=bits, l2=l2, divisor=divisor)
    meta_out.copy_(meta)
    if stochastic:
        itype = torch.int64 if wide else torch.int32
        bucket = first.to(itype) + torch.arange(n_buckets, device=x.device, dtype=itype)
        within = (torch.arange(H, device=x.device, dtype=itype) if pos is None
                  else pos.to(itype))
        counter = bucket[:, None] * H + within
        h = pair_hash(counter, key)
        u_lo, u_hi = half_uniform(h, False), half_uniform(h, True)
    else:
        u_lo = u_hi = None
    lo, hi = [_codes(half, per, u, sid=sid, bits=bits).to(torch.uint8)
              for half, u in ((xf[..., :H], u_lo), (xf[..., H:], u_hi))]
    if joined and lo_out is not None:  # lo_out: all of each bucket's codes
        lo_out.copy_(torch.cat((lo, hi), dim=-1))
        return
    if lo_out is None:
        return lo, hi
    lo_out.copy_(lo)
    hi_out.copy_(hi)


def pack_buckets(codes, codes_hi, codes_out, *, bits, bucket_size):
    """Pack code bytes into ``codes_out`` [buckets, B * bits / 8]: ``codes`` is the buckets'
    [buckets, B] bytes, or with ``codes_hi`` the two halves [buckets, B / 2] as
    :func:`encode_buckets` returns them. (Named arguments, no ``*codes``: the codec
    calls a compiled graph directly only where its inputs are named arguments.)
    ``bucket_size`` is not read: it keys the compile cache, so each bucket size has its
    own graph (a second size recompiled the shared one, which turned its direct calls
    off: Dynamo marks only the bucket count dynamic)."""
    both = codes if codes_hi is None else torch.cat((codes, codes_hi), dim=-1)
    codes_out.copy_(pack_codes(both, bits))


def encode_bucket(x, meta_out, codes_out, *, length, start, key, divisor, bucket_size, bits,
                  sid, l2, stochastic, wide):
    """Quantize one bucket: the first ``length`` (0-d tensor) elements of ``x`` (fp32
    [B], zeros after them; first index ``start``, 0-d) into ``meta_out`` [words] and
    ``codes_out`` [B * bits / 8], codes past ``length`` 0. Masked, on its own (masks over
    the whole tensor cost 6x: 13.7 GB/s without against 2.3 GB/s with, minmax 8 bits,
    2^24 elements, 2 cores, Inductor)."""
    B = bucket_size
    pos = torch.arange(B, device=x.device)
    valid = (pos < length).view(1, B)
    padded = x.view(-1, B)  # [1, B], or [R, B] (rows, each with its own key)
    meta, per = bucket_stats(padded, valid, sid=sid, bits=bits, l2=l2, divisor=divisor)
    if stochastic:
        index = start.to(torch.int64 if wide else torch.int32) + pos.to(torch.int32)
        u = uniform(index, key, B).view(-1, B)
    else:
        u = None
    codes = torch.where(valid, _codes(padded, per, u, sid=sid, bits=bits), 0.0)
    meta_out.copy_(meta.view(meta_out.shape))
    codes_out.copy_(pack_codes(codes.view(*codes_out.shape[:-1], B).to(torch.uint8), bits))


# Fixed shapes: the codec compiles these without dynamic sizes (one graph per configuration)
encode_bucket.static_shapes = True


def bucket_reduce(t: torch.Tensor, op) -> torch.Tensor:
    """Reduce each bucket (last dimension of ``t``) to ``[..., buckets, 1]`` in two
    stages: across rows of 16 (or 8) lanes first, then the lanes. Inductor vectorizes
    the first stage vertically: measured 25 GB/s for a max over [2^14, 1024] fp32
    against 5 GB/s reducing each row at once (dynamic shapes, 2 cores). Exact for min
    and max; the NaN test of a sum is order-free; the fp64 L2 sum rounds to the same
    fp32 as any other order w.h.p.
    """
    B = t.shape[-1]
    lanes = 16 if B % 16 == 0 else 8
    return op(op(t.unflatten(-1, (B // lanes, lanes)), dim=-2), dim=-1, keepdim=True)


def bucket_stats(xp, valid, *, sid, bits, l2, divisor):
    """Per-bucket statistics of buckets ``xp`` [buckets, B] (fp32; ``valid`` masks the padding
    of a partial bucket, None: all valid): (meta [buckets, words] as the payload stores it,
    ``per``, what :func:`_codes` needs, four [buckets, 1] tensors: offset, boost s,
    1 / (step * s) and the level offset c, the last two 0 in a bucket holding inf or NaN).

    For maxnorm and nuq they are columns of one concatenated [buckets, 4] tensor so that
    Inductor stores them once per bucket and the per-element loop loads four numbers.
    Left as expressions, they were inlined into that loop and recomputed every vector,
    two divisions per 8 elements (the compiler cannot hoist them: the uint8 code stores
    may alias the loads): 8-bit min-max quantize 0.51 -> 0.68 G elements/s (Zen 3, 1
    thread). For minmax they stay expressions: recomputed so (96-102 instead of 80
    instructions per 16 elements), but with no concatenated buffer between them Inductor
    fuses the statistics and the code loop into one loop over buckets, and the code loop
    reads each bucket from L1 instead of a second pass through memory: min-max quantize
    1.07-1.23x at all 12 points of fp32/bf16, 2/4/8 bits, 2^24 and 2^26 (nuq 0.76-1.14x
    and maxnorm no better that way: their recomputation costs more)."""
    nan = torch.tensor(float("nan"), dtype=torch.float32, device=xp.device)
    # inf * 0 and NaN * 0 are NaN; finite * 0 is +-0: the sum is NaN iff the bucket
    # holds a non-finite value, whatever the summation order.
    bad = torch.isnan(bucket_reduce(xp * 0.0, torch.sum))
    offset = level = torch.zeros_like(bad, dtype=torch.float32)
    if sid == MINMAX.id:
        lo_in = xp if valid is None else torch.where(valid, xp, float("inf"))
        hi_in = xp if valid is None else torch.where(valid, xp, float("-inf"))
        # zeros +0.0 (qcomm.layout): the reductions meet -0.0 and +0.0 in any order
        offset = plus_zero(bucket_reduce(lo_in, torch.amin))
        step = (plus_zero(bucket_reduce(hi_in, torch.amax)) - offset) / divisor
        meta = torch.cat([torch.where(bad, nan, offset), torch.where(bad, nan, step)], dim=-1)
    else:  # padding is 0: it changes neither max |x| nor the L2 norm
        if l2:
            scale = bucket_reduce(xp.to(torch.float64).square(), torch.sum).sqrt()
            scale = scale.to(torch.float32)
        else:
            scale = bucket_reduce(xp.abs(), torch.amax)
        step = scale / divisor if sid == MAXNORM.id else scale  # nuq divides |x| by the scale
        meta = torch.where(bad, nan, step)
        if sid == MAXNORM.id:
            level = torch.where(bad, 0.0, divisor)  # maxnorm's c
    # v / step as (v * s) * (1 / (step * s)): one division per bucket, not per element
    # (a division costs the GPU kernel ~10 instructions an element); s is BOOST for
    # steps under TINY, so no reciprocal overflows; 0 where step is not > 0 (constant
    # buckets) and in bad ones.
    s = torch.where(step < TINY, BOOST, 1.0)
    inv = torch.where((step > 0) & ~bad, 1.0 / (step * s), 0.0)
    if sid != MINMAX.id:
        cat = torch.cat([offset, s, inv, level], dim=-1)
        offset, s, inv, level = (cat[..., i:i + 1] for i in range(4))
    return meta, (offset, s, inv, level)


def round_position(t: torch.Tensor, u: torch.Tensor | None, top: int) -> torch.Tensor:
    """``qcomm.oracle.round_position``: level position ``t >= 0`` (NaN-free), rounded
    stochastically to ``floor(t + u)`` with uniforms ``u`` (:func:`uniform`), to nearest
    (ties down) where ``u`` is None; clamped to ``top``.

    ``t + u`` is one fp32 add: where it is inexact it rounds to nearest, which moves a
    sum within half an ulp below an integer up to it. Below 256 that half ulp is at most
    2^-17, under the 2^-16 spacing of ``u``, so it changes the rounding of at most one
    value of ``u`` in 65536: a bias under 2^-16 of a step, the order of the grid's own
    (sums from 256 up clamp to ``top`` <= 255 either way). The kernels do the same add
    and floor (no FMA: they run with fusion off), the same bits. Against
    ``floor(t) + (t - floor(t) > 1 - u)``, AVX2 instructions of the 8-bit code loop
    (Zen 3) per 16 fp32 elements: maxnorm 80 -> 70, min-max (fused) 101 -> 93; per 32
    bf16: min-max 212 -> 188, maxnorm 189 -> 173.

    fp32 throughout: the codes are small integers, exact in fp32, and the same values as
    the kernels' int32 arithmetic, but converting to uint8 straight from fp32 is one
    instruction on AVX2 where int32 -> uint8 has no vector conversion in Inductor's C++
    (a loop through a buffer): 8-bit code stores 0.92 G elements/s from int32, 2.39 from
    fp32 (Zen 3, 1 thread). Selects, not ``lo + (frac > 0.5)`` and ``clamp``: a compare
    and a blend each, where the bool-to-float add took four AVX2 instructions and
    ``clamp`` six (its NaN propagation: ``t`` has none)."""
    if u is None:
        lo = torch.floor(t)
        v = torch.where(t - lo > 0.5, lo + 1.0, lo)
    else:
        v = torch.floor(t + u)
    return torch.where(v > top, float(top), v)


def _codes(x, per, u, *, sid, bits):
    """Codes (fp32, exact integers) of elements ``x`` [buckets, m] under their buckets'
    ``per`` (:func:`bucket_stats`), rounded with uniforms ``u`` (None: to nearest).

    A bad bucket (inf or NaN) has ``inv = 0`` and ``c = 0``: its level positions are 0
    for finite x and NaN (then 0) for the rest, the kernels' ``where(bad, 0, t)``
    without reading a fifth number per element: Inductor stores a full-size temporary
    of any value read twice that reads more than 4 (``realize_reads_threshold``), and
    the rounding reads the level position twice. (bf16 8-bit: 0.48 G elements/s with
    the temporary.) Min-max positions are >= 0 (``x - min >= 0``, ``s, inv >= 0``) or
    NaN; maxnorm's may dip below 0 by rounding, and ``where(t > 0, t, 0)`` maps those
    and NaN to 0 in one select, the code a clamp at 0 gave them (any ``t < 0`` rounds
    to -1 or 0 and was clamped to 0)."""
    L = levels(sid, bits)
    offset, s, inv, level = per
    if sid == MINMAX.id:  # x = min + k * step
        t = ((x - offset) * s) * inv
        return round_position(torch.where(t == t, t, 0.0), u, L - 1)
    if sid == MAXNORM.id:  # x = (k - c) * step, c = (L - 1) / 2
        t = (x * s) * inv + level
        return round_position(torch.where(t > 0.0, t, 0.0), u, L - 1)
    # nuq: sign bit, level j in 0..M: 0 or 2^-(M - j)
    M = L - 1
    r = (x.abs() * s) * inv
    r = torch.where(r > 1.0, 1.0, torch.where(r > 0.0, r, 0.0))
    ebits = (r.view(torch.int32) >> 23) & 0xFF  # r >= 0: the sign bit is 0
    mant = (r.view(torch.int32) & 0x7FFFFF).to(torch.float32)
    geometric = ebits >= 127 - (M - 1)  # r >= 2^-(M-1), the smallest level
    j_lo = torch.where(geometric, ebits - 127 + M, 0).to(torch.float32)
    frac = torch.where(geometric, mant * (1.0 / 8388608.0), r * float(2.0 ** (M - 1)))
    # up when frac > 1 - u (0.5: nearest): exact, where frac + u would round
    thr = 0.5 if u is None else 1.0 - u
    j = torch.where(frac > thr, j_lo + 1.0, j_lo)  # <= M: r <= 1, and r = 1 has frac 0
    return torch.where(x < 0, j + float(1 << (bits - 1)), j)
