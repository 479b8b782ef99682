"""What the tuned torch path's two ops share: the hash as int32 lane arithmetic, bucket
reductions, rounding, bit packing, and how a flat tensor splits into full buckets and
single ones. Every function computes the bits :mod:`qcomm.oracle` defines; its shape
is chosen for the C++ Inductor writes from it (the comments give the measurements).
"""

from __future__ import annotations

import collections
import functools
import itertools

import torch

from ..constants import FMIX_C1, FMIX_C2, GOLDEN, GOLDEN_HI
from ..layout import INT_OF, NAN_BITS, SCHEME_BY_ID


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


def divisor_for(scheme_id: int, bits: int) -> float:
    """What the scale is divided by to get the step (``qcomm.layout.Scheme.divisor``):
    ``L - 1`` (minmax), ``c`` (maxnorm)."""
    scheme = SCHEME_BY_ID[scheme_id]
    return scheme.divisor(scheme.levels(bits))


# Calls of the torch path's pieces (each one loop nest or compiled graph: the CPU's
# launches), by how they ran: "eager" here, "direct" and "dynamo" in qcomm.cpu.compiled.
calls = collections.Counter()


def eager(fn, **static):
    """The default ``wrap`` of the codec entry points: run ``fn`` as it is."""
    run = functools.partial(fn, **static)

    def counted(*args, **kwargs):
        calls["eager"] += 1
        return run(*args, **kwargs)

    return counted


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


def pieces(flat, meta, codes, *, bucket_size, bits, words):
    """Split the elements ``flat`` (1-D, or [R, n]: R rows of n, each a payload's),
    their ``meta`` and ``codes`` (1-D, or [R, ...] rows) into ``whole``, the full buckets
    as ``([..., buckets, B], [..., buckets, words], [..., buckets, B * bits / 8])``
    views (None unless there are two or more), and ``singles``, the buckets to go one at
    a time, as views ``(elements, meta, codes, first element index)`` along the last
    dimension: the partial last bucket and a lone full one. (Dynamo specializes sizes 0
    and 1, so a [1, B] call of the full buckets' graph would compile a second graph:
    seconds, on two cores.)"""
    B = bucket_size
    full = flat.shape[-1] // B
    nbytes = full * B * bits // 8  # bucket sizes are multiples of 8: whole bytes
    whole, singles = None, []
    if full >= 2:
        whole = (_rows(flat, full, B), _rows(meta, full, words), _rows(codes, full, B * bits // 8))
    elif full == 1:
        singles.append((flat[..., :B], meta[..., :words], codes[..., :nbytes], 0))
    if full * B < flat.shape[-1]:
        singles.append((flat[..., full * B:], meta[..., full * words:], codes[..., nbytes:],
                        full * B))
    return whole, singles


def _rows(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """The first ``rows * width`` elements of 1-D ``t`` as [rows, width] (of each row of
    2-D ``t``: [R, rows, width]): one view op where that is all of ``t`` (each op costs
    ~3 us of a per-call cost of ~100-200)."""
    if t.dim() == 2:
        return t[:, : rows * width].unflatten(1, (rows, width))
    return t.view(rows, width) if t.numel() == rows * width else t[: rows * width].view(rows,
                                                                                      width)


def row_chunks(n_buckets: int, step: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of at most ``step`` + 1 of ``n_buckets >= 2`` bucket rows, none of
    one row: a lone last row joins the chunk before it (as in :func:`pieces`, a [1, B]
    call would compile a second graph)."""
    bounds = [*range(0, n_buckets, max(2, step)), n_buckets]
    if bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(itertools.pairwise(bounds))


def _bytes(v: torch.Tensor) -> torch.Tensor:
    """Integer values in [0, 255] as uint8; int32 through fp32 (exact), which AVX2 converts
    in one instruction and int32 -> uint8 not at all (see
    :func:`qcomm.cpu.quantize.round_position`)."""
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


def plus_zero(t: torch.Tensor) -> torch.Tensor:
    """``t`` with -0.0 made +0.0: a meta word's zero (``qcomm.layout``'s canonical bits).
    A select, not ``t + 0.0``: Inductor drops an add of zero."""
    return torch.where(t == 0, 0.0, t)


def canonical_(t: torch.Tensor) -> torch.Tensor:
    """Make every NaN of ``t`` (fp32, bf16 or fp16) the canonical one in place
    (``qcomm.layout.NAN_BITS``), selected and stored as integer bits: a float select or
    store would go through a conversion, and torch's CPU conversion of a NaN to bf16
    gives 0xFFFF vectorized, 0x7FC0 scalar."""
    ints = INT_OF[t.dtype]
    t.view(ints).copy_(torch.where(t == t, t.view(ints), NAN_BITS[t.dtype]))
    return t


def has_nan(t: torch.Tensor) -> bool:
    """Whether fp32 ``t`` holds a NaN: its sum is NaN whenever an element is (and now and
    then when none is: infinities of both signs, then only a select too many). 15 us
    over 2^18 elements where ``isnan(t).any()`` takes 580 (1 thread, Xeon AVX-512)."""
    return bool(torch.sum(t).isnan())


def write(dst: torch.Tensor, y: torch.Tensor) -> None:
    """``dst[...] = y`` (fp32 ``y``, one cast into ``dst``'s dtype) with every NaN the
    canonical one. Traced into a graph, the select (:func:`canonical_`'s) fuses into the
    graph's loop; run eagerly, the cast goes at copy speed and the select, three passes
    more (2^18 fp32 elements into bf16, 1 thread, Xeon AVX-512: ``copy_`` 52 us, with the
    select 530), runs only where ``y`` holds a NaN (:func:`has_nan`)."""
    if not torch.compiler.is_compiling():
        dst.copy_(y)
        if has_nan(y):
            canonical_(dst)
        return
    ints = INT_OF[dst.dtype]
    low = y if dst.dtype == y.dtype else y.to(dst.dtype)
    dst.view(ints).copy_(torch.where(y == y, low.view(ints), NAN_BITS[dst.dtype]))


def canonical_nans(out: torch.Tensor, meta: torch.Tensor) -> None:
    """Make every NaN of ``out``, just decoded from payloads of metadata ``meta``, the
    canonical one. A decode is NaN only in a bucket whose meta is inf or NaN (finite
    meta words give finite or infinite values: ``min + k * step``, ``(k - c) * step``
    and ``scale * level`` of finite factors never make a NaN), so the decode graphs
    store their values as they come and this looks at the meta, 1/256 of the bytes or
    less, through its sum (finite unless a word is inf or NaN, or now and then the sum
    overflows: then only a select too many; 1 us for 8192 words where ``isfinite(meta)
    .all()`` took 43): the select over ``out`` runs only for a payload holding a
    non-finite bucket. (In the graphs, the select cost bf16 decodes 10-30%: 2^22
    elements, 8 bits, 1 thread, Xeon AVX-512, minmax 2.42 -> 2.65-2.8 ms, nuq 2.5 ->
    3.25.)"""
    if not bool(torch.sum(meta).isfinite()):
        canonical_(out)


def store(dst: torch.Tensor, y: torch.Tensor, accumulate: int) -> None:
    """``dst[...] = y`` (``accumulate`` 0 or False: as it comes, :func:`canonical_nans`
    follows), ``dst += y`` (1 or True) or ``dst -= y`` (-1: what a payload leaves out of
    ``dst``, error feedback's residual), NaNs canonical: ``dst`` may hold NaNs of any
    bits (in a graph through :func:`write`; eagerly in place, then :func:`canonical_`
    where a NaN came out)."""
    if not accumulate:
        dst.copy_(y)
    elif torch.compiler.is_compiling():
        write(dst, dst - y if accumulate < 0 else dst + y)
    else:
        if accumulate < 0:
            dst.sub_(y)
        else:
            dst.add_(y)
        if has_nan(dst):
            canonical_(dst)
