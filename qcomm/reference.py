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
- the hash runs on int32 with wrapping multiplies, the same bits as the kernels' uint32,
  once per pair of elements (:func:`uniform`: element p and p + B/2 of a bucket share it).

The structure around that math (how buckets are split, what is concatenated, fp32 codes)
is chosen for the C++ Inductor writes from it on AVX2 and AVX-512; the comments give the
measurements. Every such choice computes the same bits.
"""

from __future__ import annotations

import functools
import itertools

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


def pair_hash(counter: torch.Tensor, key: int | torch.Tensor) -> torch.Tensor:
    """``fmix32((lo32(c) * GOLDEN + key) ^ (hi32(c) * GOLDEN_HI))`` of int64 or int32
    counters ``c``, as int32 bits (wrapping multiplies: the kernels' uint32 bits). An
    int32 counter (all below 2^31: the kernels' ``WIDE=False``) has a high word of 0,
    and ``h ^ 0 * GOLDEN_HI == h``: the 64-bit shift, conversion and multiply are
    skipped, the same bits. 32-bit lanes: twice the vector width of int64 on the CPU.
    """
    h = counter.to(torch.int32) * _i32(GOLDEN) + key  # lo32(c): truncates mod 2^32
    if counter.dtype != torch.int32:
        h = h ^ ((counter >> 32).to(torch.int32) * _i32(GOLDEN_HI))
    return _fmix32(h)


def half_uniform(h: torch.Tensor, high: bool | torch.Tensor) -> torch.Tensor:
    """The low (``high`` False) or high 16 bits of hash ``h`` as a uniform in [0, 1) on a
    2^-16 grid (exact in fp32)."""
    if isinstance(high, bool):
        bits16 = _srl(h, 16) if high else h & 0xFFFF
    else:
        bits16 = torch.where(high, _srl(h, 16), h & 0xFFFF)
    return bits16.to(torch.float32) * (1.0 / 65536.0)


def uniform(index: torch.Tensor, key: int | torch.Tensor, bucket_size: int) -> torch.Tensor:
    """The stochastic-rounding uniform of every element ``index`` (int32 or int64):
    counter-based, a function of (key, index, bucket size) only.

    Element ``p`` of bucket ``b`` (``p < B``, ``H = B / 2``) and element ``p + H`` are a
    pair: both hash counter ``c = b * H + p mod H`` once; the first half takes the low 16
    bits of the hash, the second half the high 16 (:func:`half_uniform`). One hash per
    two elements: the hash is the largest part of the quantize loop (fmix32: two 32-bit
    multiplies and three shift-xors), and halving it took the CPU 8-bit code loop from
    0.72 to 0.94 G elements/s (Zen 3, 1 thread). Halves, not neighbours: both are
    contiguous runs, so each vector of one half meets its partner vector of the other
    (CPU) and each thread its partner row (kernels). Rounding to ``floor(t + u)``
    is unbiased to within 2^-16 of a step.
    """
    B = bucket_size
    H = B // 2
    pos = index % B
    high = pos >= H
    counter = index // B * H + torch.where(high, pos - H, pos)
    return half_uniform(pair_hash(counter, key), high)


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


def _round_codes(t: torch.Tensor, u: torch.Tensor | None, top: int) -> torch.Tensor:
    """Round level position ``t >= 0`` (NaN-free): stochastically to ``floor(t + u)``
    with uniforms ``u`` (:func:`uniform`), to nearest (ties down) where ``u`` is None;
    clamp to ``top``.

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

    The work is two kinds of call, each through ``wrap(fn, **static)`` (the codec passes
    its ``torch.compile`` cache): :func:`encode_buckets` on the full buckets as
    ``[nb, B]`` views, :func:`encode_bucket` on one bucket at a time (the partial last
    one; a lone full one) copied into a B-element buffer. Split here, outside the
    compiled graphs, the graphs see 2-D tensors whose only dynamic size is the bucket
    count, so Inductor indexes them without a division or modulo by a symbolic size
    per vector (the flat graph's loops had several), or tensors of fixed size.
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
    whole, singles = _pieces(x if x.dim() == 1 else x.reshape(-1), meta_out, codes_out,
                             bucket_size=B, bits=bits, W=W)
    if whole:
        xw, mw, cw = whole
        nb, H = xw.shape[0], B // 2
        encode = wrap(encode_buckets, **static)
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
        via32 = x.dtype != torch.float32 and sid == 2
        fp32 = x.dtype == torch.float32 or via32
        direct = fp32 and bits == 8
        # fp32 graphs take the counters' offsets as data (positions); a bf16/fp16 graph
        # is tiled 16 wide, where converting them to int32 went through a buffer (a
        # store-forwarding stall: bf16 8-bit, 2^24, 0.57-0.60 -> 0.34-0.46 G elements/s),
        # so it keeps the in-graph arange.
        pos = positions(H, x.device) if fp32 else None
        chunks = _row_chunks(nb, CONVERT_CHUNK // B if via32 else nb if direct
                             else ENCODE_CHUNK // B)
        most = max(stop - start for start, stop in chunks) * B  # buffer elements
        scratch = buf32 = None
        for r, stop in chunks:
            def part(t, r=r, stop=stop):  # the chunk's rows (all of t: no view op)
                return t if len(chunks) == 1 else t[r:stop]

            first = index_tensor(r, x.device)
            src, m, c = part(xw), part(mw), part(cw)
            if via32:
                if buf32 is None:
                    buf32 = torch.empty(most, dtype=torch.float32, device=x.device)
                src = buf32[: src.numel()].view(-1, B).copy_(src)
            if direct:
                encode(src, m, c[:, :H], c[:, H:], pos, first=first, key=key, divisor=divisor)
                continue
            if fp32:
                if scratch is None:
                    scratch = torch.empty(most, dtype=torch.uint8, device=x.device)
                dest = scratch[: src.numel()].view(-1, B)
                encode(src, m, dest[:, :H], dest[:, H:], pos, first=first, key=key,
                       divisor=divisor)
                halves = (dest, None)
            else:
                halves = encode(src, m, None, None, pos, first=first, key=key, divisor=divisor)
                if bits == 8:
                    c[:, :H].copy_(halves[0])
                    c[:, H:].copy_(halves[1])
                    continue
            wrap(pack_buckets, bits=bits)(*halves, c)
    for piece in singles:
        _encode_single(wrap(encode_bucket, **static), *piece, key=key, divisor=divisor,
                       bucket_size=B, bits=bits)
    return meta_out, codes_out


def index_tensor(i: int, device: torch.device) -> torch.Tensor:
    """``i`` as a 0-d int64 tensor on ``device``: an index (or the RNG key) passed into a
    compiled graph as data (a Python int would be a constant, and a new graph for each
    value). 0 is cached:
    the graphs only read it. ``torch.scalar_tensor`` takes 3 us here, ``torch.tensor`` 9."""
    return _zero_index(device) if i == 0 else torch.scalar_tensor(i, dtype=torch.int64,
                                                                  device=device)


@functools.cache
def _zero_index(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


def _pieces(flat, meta, codes, *, bucket_size, bits, W):
    """Split the elements ``flat`` (1-D), their ``meta`` and ``codes`` into ``whole``, the
    full buckets as ``([nb, B], [nb, W], [nb, B * bits / 8])`` views (None unless there
    are two or more), and ``singles``, the buckets to go one at a time, as 1-D views
    ``(elements, meta, codes, first element index)``: the partial last bucket and a
    lone full one. (Dynamo specializes sizes 0 and 1, so a [1, B] call of the full
    buckets' graph would compile a second graph: seconds, on two cores.)"""
    B = bucket_size
    full = flat.numel() // B
    nbytes = full * B * bits // 8  # bucket sizes are multiples of 8: whole bytes
    whole, singles = None, []
    if full >= 2:
        whole = (_rows(flat, full, B), _rows(meta, full, W), _rows(codes, full, B * bits // 8))
    elif full == 1:
        singles.append((flat[:B], meta[:W], codes[:nbytes], 0))
    if full * B < flat.numel():
        singles.append((flat[full * B:], meta[full * W:], codes[nbytes:], full * B))
    return whole, singles


def _rows(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """The first ``rows * width`` elements of 1-D ``t`` as [rows, width]: one view op
    where that is all of ``t`` (each op costs ~3 us of a per-call cost of ~100-200)."""
    return t.view(rows, width) if t.numel() == rows * width else t[: rows * width].view(rows,
                                                                                      width)


def _row_chunks(nb: int, step: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of at most ``step`` + 1 of ``nb >= 2`` bucket rows, none of
    one row: a lone last row joins the chunk before it (as in :func:`_pieces`, a [1, B]
    call would compile a second graph)."""
    bounds = [*range(0, nb, max(2, step)), nb]
    if bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(itertools.pairwise(bounds))


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
    n = x.numel()
    padded = torch.zeros(B, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x)
    whole = codes_out.numel() == B * bits // 8
    codes = codes_out if whole else torch.empty(B * bits // 8, dtype=torch.uint8,
                                                device=x.device)
    encode(padded, meta_out, codes, length=index_tensor(n, x.device),
           start=index_tensor(start, x.device), key=key,
           divisor=divisor)
    if not whole:
        codes_out.copy_(codes[: codes_out.numel()])


# Elements quantize_reference encodes per call where the codes pass through byte buffers
# (below 8 bits, or from bf16/fp16): at most 16 MiB of them, under glibc's 32 MiB
# ceiling for serving an allocation from mmap, so after the first call they come from
# the heap instead of fresh, page-faulting pages every call. 2^26 elements, 1 thread,
# Zen 3, G elements/s, one run, whole tensor -> 2^24 chunks (2^21-2^22 chunks lost
# 5-20% to per-call costs): fp32 2-bit 0.29 -> 0.41, 4-bit 0.33 -> 0.42; bf16 2-bit
# 0.28 -> 0.46, 4-bit 0.32 -> 0.45, 8-bit 0.46 -> 0.56.
ENCODE_CHUNK = 1 << 24
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
    (nuq), with :func:`_round_codes`' selects."""
    return torch.arange(n, dtype=torch.float32, device=device).view(1, n)


def encode_buckets(x, meta_out, lo_out, hi_out, pos, *, first, key, divisor, bits,
                   bucket_size, sid, l2, stochastic, wide):
    """Quantize full buckets ``x`` [nb, B] (the first one bucket number ``first``, a 0-d
    tensor: element indices from ``first * B``) into ``meta_out`` [nb, W] and the codes,
    one byte each, of each bucket's two halves: into ``lo_out`` and ``hi_out``
    [nb, B / 2] (views) if given, else returned as two new tensors. ``pos`` is
    :func:`positions` of B / 2, or None (an arange in the graph). ``bucket_size`` (B)
    is not read: it keys the codec's compile cache, as every static argument of these
    pieces does."""
    nb, B = x.shape
    H = B // 2
    xf = x.to(torch.float32)
    meta, per = _bucket_stats(xf, None, sid=sid, bits=bits, l2=l2, divisor=divisor)
    meta_out.copy_(meta)
    if stochastic:
        itype = torch.int64 if wide else torch.int32
        bucket = first.to(itype) + torch.arange(nb, device=x.device, dtype=itype)
        within = (torch.arange(H, device=x.device, dtype=itype) if pos is None
                  else pos.to(itype))
        counter = bucket[:, None] * H + within
        h = pair_hash(counter, key)
        u_lo, u_hi = half_uniform(h, False), half_uniform(h, True)
    else:
        u_lo = u_hi = None
    lo, hi = [_codes(half, per, u, sid=sid, bits=bits).to(torch.uint8)
              for half, u in ((xf[:, :H], u_lo), (xf[:, H:], u_hi))]
    if lo_out is None:
        return lo, hi
    lo_out.copy_(lo)
    hi_out.copy_(hi)


def pack_buckets(codes, codes_hi, codes_out, *, bits):
    """Pack code bytes into ``codes_out`` [nb, B * bits / 8]: ``codes`` is the buckets'
    [nb, B] bytes, or with ``codes_hi`` the two halves [nb, B / 2] as
    :func:`encode_buckets` returns them. (Named arguments, no ``*codes``: the codec
    calls a compiled graph directly only where its inputs are named arguments.)"""
    both = codes if codes_hi is None else torch.cat((codes, codes_hi), dim=1)
    codes_out.copy_(pack_codes(both, bits))


def encode_bucket(x, meta_out, codes_out, *, length, start, key, divisor, bucket_size, bits,
                  sid, l2, stochastic, wide):
    """Quantize one bucket: the first ``length`` (0-d tensor) elements of ``x`` (fp32
    [B], zeros after them; first index ``start``, 0-d) into ``meta_out`` [W] and
    ``codes_out`` [B * bits / 8], codes past ``length`` 0. Masked, on its own (masks over
    the whole tensor cost 6x: 13.7 GB/s without against 2.3 GB/s with, minmax 8 bits,
    2^24 elements, 2 cores, Inductor)."""
    B = bucket_size
    pos = torch.arange(B, device=x.device)
    valid = (pos < length).view(1, B)
    padded = x.view(1, B)
    meta, per = _bucket_stats(padded, valid, sid=sid, bits=bits, l2=l2, divisor=divisor)
    if stochastic:
        index = start.to(torch.int64 if wide else torch.int32) + pos.to(torch.int32)
        u = uniform(index, key, B).view(1, B)
    else:
        u = None
    codes = torch.where(valid, _codes(padded, per, u, sid=sid, bits=bits), 0.0)
    meta_out.copy_(meta.reshape(-1))
    codes_out.copy_(pack_codes(codes.reshape(-1).to(torch.uint8), bits))


# Fixed shapes: the codec compiles these without dynamic sizes (one graph per configuration)
encode_bucket.static_shapes = True


def _bucket_stats(xp, valid, *, sid, bits, l2, divisor):
    """Per-bucket statistics of buckets ``xp`` [nb, B] (fp32; ``valid`` masks the padding
    of a partial bucket, None: all valid): (meta [nb, W] as the payload stores it,
    ``per``, what :func:`_codes` needs, four [nb, 1] tensors: offset, boost s,
    1 / (step * s) and the level offset c, the last two 0 in a bucket holding inf or NaN).

    For maxnorm and nuq they are columns of one concatenated [nb, 4] tensor so that
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
    bad = torch.isnan(_bucket_reduce(xp * 0.0, torch.sum))
    offset = level = torch.zeros_like(bad, dtype=torch.float32)
    if sid == 0:  # minmax
        lo_in = xp if valid is None else torch.where(valid, xp, float("inf"))
        hi_in = xp if valid is None else torch.where(valid, xp, float("-inf"))
        offset = _bucket_reduce(lo_in, torch.amin)
        step = (_bucket_reduce(hi_in, torch.amax) - offset) / divisor
        meta = torch.cat([torch.where(bad, nan, offset), torch.where(bad, nan, step)], dim=1)
    else:  # padding is 0: it changes neither max |x| nor the L2 norm
        if l2:
            scale = _bucket_reduce(xp.to(torch.float64).square(), torch.sum).sqrt()
            scale = scale.to(torch.float32)
        else:
            scale = _bucket_reduce(xp.abs(), torch.amax)
        step = scale / divisor if sid == 1 else scale  # nuq divides |x| by the scale
        meta = torch.where(bad, nan, step)
        if sid == 1:
            level = torch.where(bad, 0.0, divisor)  # maxnorm's c
    # v / step as (v * s) * (1 / (step * s)): one division per bucket, not per element
    # (a division costs the GPU kernel ~10 instructions an element); s is BOOST for
    # steps under TINY, so no reciprocal overflows; 0 where step is not > 0 (constant
    # buckets) and in bad ones.
    s = torch.where(step < TINY, BOOST, 1.0)
    inv = torch.where((step > 0) & ~bad, 1.0 / (step * s), 0.0)
    if sid != 0:
        cat = torch.cat([offset, s, inv, level], dim=1)
        offset, s, inv, level = (cat[:, i:i + 1] for i in range(4))
    return meta, (offset, s, inv, level)


def _codes(x, per, u, *, sid, bits):
    """Codes (fp32, exact integers) of elements ``x`` [nb, m] under their buckets'
    ``per`` (:func:`_bucket_stats`), rounded with uniforms ``u`` (None: to nearest).

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
    if sid == 0:  # minmax: x = min + k * step
        t = ((x - offset) * s) * inv
        return _round_codes(torch.where(t == t, t, 0.0), u, L - 1)
    if sid == 1:  # maxnorm: x = (k - c) * step, c = (L - 1) / 2
        t = (x * s) * inv + level
        return _round_codes(torch.where(t > 0.0, t, 0.0), u, L - 1)
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


# Steps below TINY are scaled by BOOST before their reciprocal is taken: 1 / 2^-100 is
# 2^100, far from fp32's overflow at 2^128, and both factors are exact powers of two.
TINY = 2.0**-100
BOOST = 2.0**64


def _bytes(v: torch.Tensor) -> torch.Tensor:
    """Integer values in [0, 255] as uint8; int32 through fp32 (exact), which AVX2 converts
    in one instruction and int32 -> uint8 not at all (see _round_codes)."""
    return v if v.dtype == torch.uint8 else v.to(torch.float32).to(torch.uint8)


def _byte_pieces(bits: int, m: int):
    """(k, shift) of the codes overlapping byte m of a group's word: shift = k*bits - 8m."""
    return [(k, k * bits - 8 * m) for k in range(8)
            if k * bits < 8 * m + 8 and (k + 1) * bits > 8 * m]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (int32 or uint8) [..., m] (m a multiple of 8) -> uint8
    [..., m * bits / 8], 8 codes per ``bits`` bytes along the last dimension.

    Group g's word ``w = sum_k codes[8g + k] << (k * bits)`` is stored little-endian in
    bytes ``[g * bits, (g + 1) * bits)``. Each byte is built from the codes that overlap
    it, so every code is computed once (bits dividing 8) or at most twice (3, 5, 6, 7
    bits): a reduction over the 8 codes of a group would run scalar under Inductor.
    """
    lead = codes.shape[:-1]
    if bits == 8:
        return _bytes(codes)
    if 8 % bits == 0:
        per = 8 // bits
        g = codes.view(*lead, -1, per)
        byte = g[..., 0]
        for k in range(1, per):
            byte = byte | (g[..., k] << (k * bits))
        return _bytes(byte)
    g = codes.view(*lead, -1, 8)
    out = []
    for m in range(bits):
        byte = None
        for k, shift in _byte_pieces(bits, m):
            piece = (g[..., k] << shift) if shift >= 0 else (g[..., k] >> -shift)
            byte = piece if byte is None else byte | piece
        out.append(byte & 0xFF)
    return _bytes(torch.stack(out, dim=-1)).reshape(*lead, -1)


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
    GB/s from bytes, memcpy speed, bench/results/cpu-amd-epyc-2c/codec.txt).
    """
    lanes = vector_lanes() if lanes is None else lanes
    if bits not in (1, 2, 4) and not (bits == 8 and lanes < 16):
        return None
    tile = lanes * (4 // out_dtype.itemsize)
    group = max(tile, 32 // bits)
    return group if bucket_size % group == 0 else None


def unpack_words(packed: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """:func:`unpack_codes` for 1, 2, 4 and 8 bits, as ``[n / group, group]``, read as
    int32 words: lane s of a group takes word ``j = s * bits // 32`` shifted right by
    ``s * bits - 32 * j`` (one broadcast word per group, or a blend of several). Word
    and shift are both chosen by the same comparisons of ``s``, so every index Inductor
    sees is affine in the lane: a ``% 32`` made it build a per-lane shift table (scalar
    code), and a shift table as a tensor is an int32 vector load, which AVX2's
    ``Vectorized<int32_t>`` does through a buffer (8 bits into fp32: 2.58 -> 1.83 G
    elements/s with a table). The byte planes of :func:`unpack_codes` store with a
    stride and stay scalar: decode of 2^22 fp32 elements at 2 and 4 bits, 1 thread,
    AVX-512 (bench/results/cpu-amd-epyc-2c/codec.txt and its git history): 4.3-6.4 GB/s
    from byte planes, 13-26 GB/s from words. ``packed`` holds whole groups and starts
    4-byte aligned (the payload layout guarantees both for full buckets).
    """
    words_per_group = group * bits // 32
    w = packed.view(torch.int32).view(-1, words_per_group)
    pos = torch.arange(group, dtype=torch.int32, device=packed.device) * bits  # bit offset
    last = words_per_group - 1
    word, shift = w[:, last:], pos - 32 * last
    for j in range(last - 1, -1, -1):
        in_word = pos < 32 * (j + 1)  # lanes s of word j and below
        word = torch.where(in_word, w[:, j:j + 1], word)
        shift = torch.where(in_word, pos - 32 * j, shift)
    # Arithmetic shifts are fine: the mask drops the sign copies above bit 31 - shift.
    return (word >> shift) & ((1 << bits) - 1)


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
    group: int | None | str = "auto",
) -> torch.Tensor:
    """Decode into ``out`` (contiguous, ``numel`` elements; cast to its dtype), or with
    ``accumulate`` add the fp32 decode into it; returns ``out``.

    As :func:`quantize_reference`, two kinds of call through ``wrap``:
    :func:`decode_buckets` on the full buckets as ``[nb, B]`` views, :func:`decode_bucket`
    on one bucket at a time (the partial last one; a lone full one) into a B-element
    fp32 buffer, stored from there.
    ``staged``: decode that many buckets at a time into an fp32 buffer and convert from
    there into ``out`` (the codec's CPU path for 16-bit outputs on AVX-512; not with
    accumulate). ``group``: codes per lane group of the full buckets' word decode, None
    for byte by byte; ``"auto"``: :func:`lane_group` for this machine and the dtype
    the decode stores. Every choice gives the same values.
    """
    if staged is not None and accumulate:
        raise ValueError("dequantize_reference: staged decoding stores; it cannot accumulate")
    B = bucket_size
    sid = effective_scheme_id(scheme, bits)
    if group == "auto":  # (on a GPU, Inductor writes Triton: the 16-lane shapes stay)
        group = lane_group(bits, B, torch.float32 if staged else out.dtype,
                           lanes=None if out.device.type == "cpu" else 16)
    whole, singles = _pieces(out.view(-1), meta, codes, bucket_size=B, bits=bits,
                             W=meta_words(sid))
    run_whole = wrap(decode_buckets, group=group, bits=bits, bucket_size=B, sid=sid,
                     accumulate=accumulate)
    # dtype- and accumulate-free: one graph per configuration (_decode_single stores)
    run_single = wrap(decode_bucket, bits=bits, bucket_size=B, sid=sid)
    if whole and staged is None:
        run_whole(whole[1], whole[2], whole[0])
    elif whole:
        o, m, c = whole
        chunks = _row_chunks(o.shape[0], staged)
        buf = torch.empty(max(stop - r for r, stop in chunks) * B, dtype=torch.float32,
                          device=out.device)
        for r, stop in chunks:
            tmp = buf[: (stop - r) * B].view(-1, B)
            run_whole(m[r:stop], c[r:stop], tmp)
            o[r:stop].copy_(tmp)
    for o, m, c, _ in singles:
        _decode_single(run_single, m, c, o, bucket_size=B, bits=bits, accumulate=accumulate)
    return out


def decode_buckets(meta, codes, out, *, bits, bucket_size, sid, accumulate, group):
    """Decode full buckets: ``codes`` [nb, B * bits / 8] under ``meta`` [nb, W] into
    ``out`` [nb, B]: from int32 words (:func:`unpack_words`) as [nb, B / G, G] where
    ``group`` G is given (:func:`lane_group`), else byte by byte."""
    nb, B = out.shape[0], bucket_size
    if group is None:
        k = unpack_codes(codes, bits)
        y = _decode_buckets(meta, k, bits=bits, sid=sid)
    else:
        k = unpack_words(codes, bits, group).view(nb, B // group, group)
        y = _decode_buckets(meta.unsqueeze(1), k, bits=bits, sid=sid)
        out = out.view(nb, B // group, group)
    store(out, y, accumulate)


def _decode_single(decode, meta, codes, out, *, bucket_size, bits, accumulate):
    """One bucket of ``out.numel() <= B`` elements (1-D) through the compiled ``decode``
    (:func:`decode_bucket`) into a B-element fp32 buffer, then stored (cast or added)
    into ``out``: fixed shapes, one graph for every length, dtype and ``accumulate``
    (as :func:`_encode_single`). The same values: the graph computes each in fp32,
    and one cast or one fp32 add follows, here as there."""
    B = bucket_size
    nbytes = B * bits // 8
    if codes.numel() < nbytes:
        full = torch.zeros(nbytes, dtype=torch.uint8, device=codes.device)
        full[: codes.numel()].copy_(codes)
        codes = full
    if out.numel() == B and out.dtype == torch.float32 and not accumulate:
        decode(meta, codes, out)  # a lone full bucket into fp32: no buffer
        return
    y = torch.empty(B, dtype=torch.float32, device=out.device)
    decode(meta, codes, y)
    store(out, y[: out.numel()], accumulate)


def decode_bucket(meta, codes, out, *, bits, bucket_size, sid):
    """Decode one bucket: ``codes`` [B * bits / 8] under ``meta`` [W] into fp32 ``out``
    [B] (the codes past a partial bucket's end are zeros: values to be dropped)."""
    k = unpack_codes(codes, bits)
    out.copy_(_decode_buckets(meta.view(1, -1), k.view(1, bucket_size), bits=bits,
                              sid=sid).view(-1))


decode_bucket.static_shapes = True


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
