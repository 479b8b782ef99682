"""The codec written to be read: plain torch, one bucket at a time, no speed tricks.

Tests check the tuned torch path and the Triton kernels against it byte for byte. The
wire layout (header, meta, bit packing) is :mod:`qcomm.layout`'s; the numbers are
:mod:`qcomm.constants`'. All float arithmetic is fp32 (the input is converted first,
exactly), one rounding per operation in the order written, no fused multiply-add.

Per bucket of values ``v`` (``B = bucket_size`` elements; the last may be shorter),
``L = scheme.levels(bits)`` (its row of ``layout.SCHEMES``):

- minmax: ``lo = min(v)``, ``step = (max(v) - lo) / (L - 1)``; meta ``[lo, step]``;
  position ``t = (v - lo) / step``, code ``k`` in ``0 .. L - 1``; decodes to
  ``lo + k * step``. A zero min or max is +0.0 whatever zeros the bucket holds
  (:func:`plus_zero`; a reduction meets -0.0 and +0.0 in any order).
- maxnorm: ``scale = max |v|`` (norm "max") or ``||v||_2`` (norm "l2": squares summed
  in fp64, square root in fp64, then rounded to fp32); ``c = (L - 1) / 2``,
  ``step = scale / c``; meta ``[step]``; ``t = v / step + c``; decodes to
  ``(k - c) * step``.
- nuq: ``scale`` as maxnorm; meta ``[scale]``; ``r = min(|v| / scale, 1)`` is rounded
  to a level ``j`` in ``0 .. M`` (``M = L - 1``; level 0 is 0, level j is ``2^-(M-j)``)
  by where ``r`` lies between its two neighbouring levels; code
  ``k = sign << (bits - 1) | j`` with ``sign = v < 0``; decodes to ``+-scale * lvl(j)``.
  nuq at 1 bit is maxnorm at 1 bit (``layout.scheme_for``).

``v / step`` is computed as ``(v * s) * inv`` with ``s = BOOST if step < TINY else 1``
and ``inv = 1 / (step * s)`` (0 when ``step`` is 0): one division per bucket, and no
infinite reciprocal for denormal steps (both factors are powers of two). minmax
subtracts first: ``((v - lo) * s) * inv``; maxnorm adds ``c`` last: ``(v * s) * inv + c``.

Rounding of a position ``t`` (negative positions count as 0; codes clamp at ``L - 1``):
stochastic is ``floor(t + u)`` with ``t + u`` one fp32 add; nearest is ``floor(t)`` plus
one where ``t - floor(t) > 0.5`` (ties go down). nuq goes up a level where
``frac > 1 - u`` (stochastic) or ``frac > 0.5`` (nearest), ``frac`` the fraction of the
way from level ``j`` to ``j + 1``: read from the fp32 bits of ``r`` (its mantissa) where
``r >= 2^-(M-1)``, else ``r * 2^(M-1)``.

The uniforms ``u``: element ``p`` of bucket ``b`` (``H = B / 2``) and element ``p + H``
share one 32-bit hash of counter ``c = b * H + p mod H``,
``fmix32((lo32(c) * GOLDEN + key) ^ (hi32(c) * GOLDEN_HI))`` (uint32 arithmetic,
``key = constants.seed_key(seed)``); the first half takes its low 16 bits, the second
half its high 16, as ``bits16 / 65536``.

A bucket holding inf or NaN has NaN meta and codes 0, except that nuq still sets the
sign bit of each element below 0 (-inf among them): the payload is what every path
writes, and decodes to NaN either way.

Decoding computes fp32 values as above (nuq negates ``scale * lvl(j)`` where the sign
bit is set); another output dtype is that, then one torch cast. Every NaN in what is
returned (decoded, summed or cast) is then the canonical one, ``layout.NAN_BITS``
(:func:`canonical`): the bits a NaN gets from arithmetic or a cast differ between
machines (x86's inf * 0 is 0xFFC00000, a GPU's 0x7FFFFFFF; torch's CPU cast of a NaN
to bf16 is 0xFFFF), and every path must write the same bytes.
"""

from __future__ import annotations

import torch

from .constants import BOOST, FMIX_C1, FMIX_C2, GOLDEN, GOLDEN_HI, MASK32, TINY, seed_key
from .layout import (
    HEADER_NBYTES,
    INT_OF,
    MAXNORM,
    MINMAX,
    NAN_BITS,
    NUQ,
    encode_header,
    packed_nbytes,
    scheme_for,
)

F32 = torch.float32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer on uint32 values held in int64 (a product may wrap mod 2^64;
    its low 32 bits, all the mask keeps, are still right)."""
    h = h ^ (h >> 16)
    h = (h * FMIX_C1) & MASK32
    h = h ^ (h >> 13)
    h = (h * FMIX_C2) & MASK32
    return h ^ (h >> 16)


def uniforms(start: int, n: int, bucket_size: int, seed: int) -> torch.Tensor:
    """fp32 uniforms in [0, 1) of the elements ``start .. start + n - 1`` of a tensor."""
    key = seed_key(seed) & MASK32
    H = bucket_size // 2
    index = torch.arange(start, start + n, dtype=torch.int64)
    bucket, p = index // bucket_size, index % bucket_size
    high = p >= H
    counter = bucket * H + p % H
    lo32, hi32 = counter & MASK32, counter >> 32
    mixed = ((lo32 * GOLDEN + key) & MASK32) ^ ((hi32 * GOLDEN_HI) & MASK32)
    h = fmix32(mixed)
    bits16 = torch.where(high, h >> 16, h & 0xFFFF)
    return bits16.to(F32) / 65536.0


def f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=F32)


def plus_zero(t: torch.Tensor) -> torch.Tensor:
    """``t`` with -0.0 made +0.0 (the meta's zeros, ``qcomm.layout``)."""
    return torch.where(t == 0, 0.0, t)


def canonical(t: torch.Tensor) -> torch.Tensor:
    """``t`` (fp32, bf16 or fp16) with every NaN the canonical one, ``layout.NAN_BITS``
    (set through the integer view: bit for bit)."""
    bits = t.view(INT_OF[t.dtype])
    return torch.where(torch.isnan(t), NAN_BITS[t.dtype], bits).view(t.dtype)


def reciprocal(step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, inv): ``v / step`` is taken as ``(v * s) * inv``."""
    s = f32(BOOST if step < TINY else 1.0)
    inv = f32(1.0) / (step * s) if step > 0 else f32(0.0)
    return s, inv


def round_position(t: torch.Tensor, u: torch.Tensor | None, top: int) -> torch.Tensor:
    """Level positions ``t`` (fp32) to int64 codes in ``0 .. top``; ``u`` None: nearest."""
    t = torch.where(t > 0, t, 0.0)  # negative (by rounding) and NaN positions: 0
    if u is None:
        lo = torch.floor(t)
        k = lo + (t - lo > 0.5).to(F32)
    else:
        k = torch.floor(t + u)
    return k.clamp(max=top).to(torch.int64)


def nuq_levels(r: torch.Tensor, u: torch.Tensor | None, M: int) -> torch.Tensor:
    """nuq levels ``j`` in ``0 .. M`` of ratios ``r`` in [0, 1]."""
    rbits = r.view(torch.int32).to(torch.int64)
    exponent = (rbits >> 23) - 127  # r = 2^exponent * (1 + mantissa / 2^23) where normal
    mantissa = (rbits & 0x7FFFFF).to(F32)
    geometric = exponent >= -(M - 1)  # r at or above the smallest nonzero level
    j_below = torch.where(geometric, exponent + M, 0)  # the level just below r
    frac = torch.where(geometric, mantissa / 8388608.0, r * 2.0 ** (M - 1))
    up = frac > (0.5 if u is None else 1.0 - u)
    return torch.clamp(j_below + up.to(torch.int64), max=M)


def encode_bucket(v: torch.Tensor, u: torch.Tensor | None, config) -> tuple[list, torch.Tensor]:
    """(meta words, int64 codes) of one bucket ``v`` (fp32) with uniforms ``u``."""
    bits = config.bits
    scheme = scheme_for(config.scheme, bits)
    L = scheme.levels(bits)
    if not torch.isfinite(v).all():
        codes = torch.zeros(v.numel(), dtype=torch.int64)
        if scheme is NUQ:
            codes = torch.where(v < 0, 1 << (bits - 1), codes)
        return [float("nan")] * scheme.meta_words, codes
    if scheme is MINMAX:
        lo, hi = plus_zero(v.min()), plus_zero(v.max())
        step = (hi - lo) / f32(L - 1)
        s, inv = reciprocal(step)
        return [lo, step], round_position(((v - lo) * s) * inv, u, L - 1)
    if config.norm == "l2":
        scale = v.double().square().sum().sqrt().to(F32)
    else:
        scale = v.abs().max()
    if scheme is MAXNORM:
        c = f32((L - 1) / 2.0)
        step = scale / c
        s, inv = reciprocal(step)
        return [step], round_position((v * s) * inv + c, u, L - 1)
    s, inv = reciprocal(scale)
    r = torch.clamp((v.abs() * s) * inv, max=1.0)
    j = nuq_levels(r, u, L - 1)
    return [scale], torch.where(v < 0, j | (1 << (bits - 1)), j)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (< 2^bits) to the little-endian bit stream, zero-padded to a group of 8:
    bit ``j`` of code ``i`` is bit ``i * bits + j`` of the stream."""
    padded = torch.zeros(-(-codes.numel() // 8) * 8, dtype=torch.int64)
    padded[: codes.numel()] = codes
    stream = (padded[:, None] >> torch.arange(bits)) & 1
    return (stream.reshape(-1, 8) << torch.arange(8)).sum(dim=1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes, int64."""
    stream = (packed.to(torch.int64)[:, None] >> torch.arange(8)) & 1
    codes = (stream.reshape(-1, bits) << torch.arange(bits)).sum(dim=1)
    return codes[:numel]


def quantize(x: torch.Tensor, config, seed: int) -> torch.Tensor:
    """The full wire payload (uint8) of ``x`` (fp32, bf16 or fp16, read flat)."""
    flat = x.detach().cpu().reshape(-1).to(F32)
    n, B = flat.numel(), config.bucket_size
    meta, codes = [], [torch.zeros(0, dtype=torch.int64)]
    for start in range(0, n, B):
        v = flat[start:start + B]
        u = None if config.rounding == "nearest" else uniforms(start, v.numel(), B, seed)
        words, k = encode_bucket(v, u, config)
        meta += [float(w) for w in words]  # fp32 -> float -> fp32 is exact
        codes.append(k)
    body = torch.cat([
        torch.tensor(list(encode_header(n, x.dtype, config)), dtype=torch.uint8),
        canonical(torch.tensor(meta, dtype=F32)).view(torch.uint8),
        pack_codes(torch.cat(codes), config.bits),
    ])
    payload = torch.zeros(packed_nbytes(n, config), dtype=torch.uint8)
    payload[: body.numel()] = body
    return payload


def decode_bucket(meta: torch.Tensor, k: torch.Tensor, scheme, bits: int) -> torch.Tensor:
    """fp32 values of one bucket's codes ``k`` under its meta words (``scheme``: a
    ``layout.Scheme``, the one :func:`layout.scheme_for` gives)."""
    L = scheme.levels(bits)
    if scheme is MINMAX:
        return meta[0] + k.to(F32) * meta[1]
    if scheme is MAXNORM:
        return (k.to(F32) - (L - 1) / 2.0) * meta[0]
    M = L - 1
    level = torch.tensor([0.0] + [2.0 ** (j - M) for j in range(1, M + 1)], dtype=F32)
    magnitude = meta[0] * level[k & ((1 << (bits - 1)) - 1)]
    return torch.where(k >> (bits - 1) == 1, -magnitude, magnitude)


def dequantize(payload: torch.Tensor, config, numel: int,
               dtype: torch.dtype = F32) -> torch.Tensor:
    """Decode a payload of ``numel`` elements: fp32 values, then one cast to ``dtype``."""
    payload = payload.cpu()
    assert payload.numel() == packed_nbytes(numel, config), "payload size"
    bits, B = config.bits, config.bucket_size
    scheme = scheme_for(config.scheme, bits)
    W = scheme.meta_words
    nb = -(-numel // B)
    meta_end = HEADER_NBYTES + 4 * W * nb
    meta = payload[HEADER_NBYTES:meta_end].clone().view(F32).reshape(nb, W)
    codes = unpack_codes(payload[meta_end:meta_end + -(-numel // 8) * bits], bits, numel)
    out = [decode_bucket(meta[i], codes[i * B:(i + 1) * B], scheme, bits) for i in range(nb)]
    return canonical((torch.cat(out) if out else torch.zeros(0, dtype=F32)).to(dtype))


def minmax_steps(x: torch.Tensor, config) -> torch.Tensor:
    """The step ``(max - min) / (2^b - 1)`` of each element's min-max bucket (fp32, like
    ``x`` flattened): how far a stochastically rounded element can land from its value
    (half of it to nearest). Non-finite values are left out of their bucket's range."""
    flat = x.float().reshape(-1)
    n, b = flat.numel(), config.bucket_size
    pad = torch.nn.functional.pad(flat, (0, (-n) % b), value=float("nan")).view(-1, b)
    lo = torch.nan_to_num(pad, nan=float("inf")).amin(1)
    hi = torch.nan_to_num(pad, nan=float("-inf")).amax(1)
    return ((hi - lo) / (2**config.bits - 1)).repeat_interleave(b)[:n]


def dequantize_sum(payloads: list[torch.Tensor | None], config, numel: int, own: torch.Tensor,
                   op: str = "sum", factor: float = 1.0,
                   dtype: torch.dtype = F32) -> torch.Tensor:
    """The reduce-scatter's receive side: this rank's own chunk (exact) plus the fp32
    decode of every payload that is not None, added in order, one fp32 add each; then
    the reduce op ("sum"; "avg": divided by ``factor``, the world size; "premul":
    multiplied by it) and one cast to ``dtype``; NaNs canonical."""
    acc = own.detach().cpu().reshape(-1).to(F32)
    for p in payloads:
        if p is not None:
            acc = acc + dequantize(p, config, numel)
    if op == "avg":
        acc = acc / f32(factor)
    elif op == "premul":
        acc = acc * f32(factor)
    return canonical(acc.to(dtype))


def update_state(state: torch.Tensor, delta: torch.Tensor, numel: int, state_config,
                 delta_config, dtype: torch.dtype = F32) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of a weight-difference gather's receive side (``qcomm.fsdp``): the sum
    ``state + delta`` of two decoded payloads, one fp32 add an element, returned cast to
    ``dtype`` (NaNs canonical), and that fp32 sum quantized back into a new state
    payload (``state_config`` rounds to nearest: no seed), whose non-finite metadata
    words are then set to 0 (a bucket holding inf or NaN decodes to zeros next time;
    codes as :func:`quantize` writes them). Returns (values, new state payload); the
    state payloads are of fp32 sources."""
    assert state_config.rounding == "nearest", "a state rounds to nearest"
    acc = dequantize(state, state_config, numel) + dequantize(delta, delta_config, numel)
    new = quantize(acc, state_config, seed=0)
    words = scheme_for(state_config.scheme, state_config.bits).meta_words
    end = HEADER_NBYTES + 4 * words * -(-numel // state_config.bucket_size)
    meta = new[HEADER_NBYTES:end].view(F32)
    meta.copy_(torch.nan_to_num(meta, nan=0.0, posinf=0.0, neginf=0.0))
    return canonical(acc.to(dtype)), new
