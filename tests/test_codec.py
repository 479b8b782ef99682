"""The codec on its own: wire layout against literal bytes, statistics of the quantizers,
non-finite handling, and bad input. Runs the eager torch reference (the oracle);
test_kernels.py checks that the Triton and compiled paths produce the same bytes.
"""

import math
import struct

import pytest
import torch

import qcomm
from qcomm import QuantConfig, dequantize, packed_nbytes, quantize
from qcomm.layout import HEADER_NBYTES

EAGER = "eager"


def snr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return 20 * math.log10(x.float().norm().item() / (x.float() - y.float()).norm().item())


def roundtrip(x, cfg, seed=0):
    return dequantize(quantize(x, cfg, seed=seed, impl=EAGER), impl=EAGER)


# ----------------------------------------------------------------------------- layout


def test_header_bytes_literal():
    cfg = QuantConfig(bits=4, bucket_size=8, scheme="nuq", norm="l2", rounding="nearest")
    p = quantize(torch.zeros(10, dtype=torch.bfloat16), cfg, impl=EAGER)
    head = bytes(p.payload[:HEADER_NBYTES].tolist())
    assert head == (
        b"QC" + bytes([1, 4, 2, 0b11, 1, 0]) + (8).to_bytes(4, "little") + bytes(4)
        + (10).to_bytes(8, "little") + bytes(8)
    )
    assert qcomm.describe(p.payload)["numel"] == 10


@pytest.mark.parametrize(
    "bits, codes, expected",
    [
        # 1 bit: bit j of byte 0 is code j.
        (1, [1, 0, 1, 1, 0, 0, 0, 1], [0b10001101]),
        # 2 bits: byte 0 = k3 k2 k1 k0.
        (2, [0, 1, 2, 3, 3, 2, 1, 0], [0b11100100, 0b00011011]),
        # 4 bits: k0 in the low nibble.
        (4, [1, 2, 3, 4, 15, 0, 9, 6], [0x21, 0x43, 0x0F, 0x69]),
        # 8 bits: one byte per code.
        (8, [0, 1, 127, 128, 200, 255, 3, 4], [0, 1, 127, 128, 200, 255, 3, 4]),
        # 3 bits: byte 0 = k2[1:0] k1 k0, byte 1 = k5[0] k4 k3 k2[2], byte 2 = k7 k6 k5[2:1].
        (3, [7, 0, 5, 1, 2, 3, 4, 6], [0b01000111, 0b10100011, 0b11010001]),
    ],
)
def test_codes_layout_literal(bits, codes, expected):
    """minmax, nearest: input min..max in steps of 1 gives the codes themselves."""
    top = (1 << bits) - 1
    # Pin min to 0 and max to top with a 9th..16th element so that step == 1 exactly.
    x = torch.tensor(codes + [0, top] + [0] * 6, dtype=torch.float32)
    cfg = QuantConfig(bits=bits, bucket_size=16, scheme="minmax", rounding="nearest")
    p = quantize(x, cfg, impl=EAGER)
    assert p.nbytes == packed_nbytes(16, cfg) == HEADER_NBYTES + 16 * math.ceil((8 + 2 * bits) / 16)
    meta = struct.unpack("<2f", bytes(p.payload[HEADER_NBYTES:HEADER_NBYTES + 8].tolist()))
    assert meta == (0.0, 1.0)
    assert p.codes()[:bits].tolist() == expected
    assert torch.equal(dequantize(p, impl=EAGER), x)


def test_lane_groups_per_machine():
    """The word decode's groups: one vector of the loop Inductor writes (8 or 16 fp32
    lanes, twice that for 16-bit stores), at least one int32 word; 8 bits only on
    8-lane machines; None for widths or buckets the words cannot serve."""
    from qcomm.reference import lane_group

    f32, bf16 = torch.float32, torch.bfloat16
    assert [lane_group(b, 1024, f32, lanes=16) for b in (1, 2, 4, 8)] == [32, 16, 16, None]
    assert [lane_group(b, 1024, bf16, lanes=16) for b in (1, 2, 4, 8)] == [32, 32, 32, None]
    assert [lane_group(b, 1024, f32, lanes=8) for b in (1, 2, 4, 8)] == [32, 16, 8, 8]
    assert [lane_group(b, 1024, bf16, lanes=8) for b in (1, 2, 4, 8)] == [32, 16, 16, 16]
    assert lane_group(3, 1024, f32, lanes=8) is None and lane_group(4, 8, f32, lanes=16) is None
    assert lane_group(4, 24, bf16, lanes=8) is None  # not a whole number of groups


@pytest.mark.parametrize("bits, group", [(1, 32), (2, 16), (2, 32), (4, 8), (4, 16),
                                         (4, 32), (8, 8), (8, 16)])
def test_word_unpack_matches_byte_unpack(bits, group):
    """The decode's int32-word unpack reads the same codes as the byte-by-byte one, lane
    for lane, at every group any machine uses, including words with the sign bit set."""
    from qcomm.reference import unpack_codes, unpack_words

    g = torch.Generator().manual_seed(bits * group)
    packed = torch.randint(0, 256, (64 * group * bits // 8,), dtype=torch.uint8, generator=g)
    packed[3] = 0xFF  # a word whose top bit is set: arithmetic shifts must not leak
    words = unpack_words(packed, bits, group)
    assert words.shape == (64, group)
    assert torch.equal(words.reshape(-1), unpack_codes(packed, bits))


@pytest.mark.parametrize("scheme", ["minmax", "nuq"])
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_dequantize_same_at_every_group(scheme, bits):
    """Whatever group a machine picks (or bytes), the decode is the same bits, into fp32,
    bf16 and accumulated."""
    from qcomm.reference import dequantize_reference

    cfg = QuantConfig(bits=bits, bucket_size=64, scheme=scheme)
    x = torch.randn(64 * 5 + 9)
    p = quantize(x, cfg, seed=3, impl=EAGER)
    kw = dict(bits=bits, bucket_size=64, scheme=scheme)
    for dtype in (torch.float32, torch.bfloat16):
        want = dequantize_reference(p.meta(), p.codes(), torch.empty(x.numel(), dtype=dtype),
                                    group=None, **kw)
        for group in (8, 16, 32):
            if group * bits % 32 == 0:
                got = dequantize_reference(p.meta(), p.codes(),
                                           torch.empty(x.numel(), dtype=dtype), group=group,
                                           **kw)
                assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else
                                            torch.int32),
                                   want.view(torch.int16 if dtype != torch.float32 else
                                             torch.int32)), (dtype, group)
        for staged in (1, 2, 4):  # through an fp32 buffer, that many buckets at a time
            got = dequantize_reference(p.meta(), p.codes(), torch.empty(x.numel(), dtype=dtype),
                                       staged=staged, **kw)
            ints = torch.int16 if dtype != torch.float32 else torch.int32
            assert torch.equal(got.view(ints), want.view(ints)), (dtype, staged)
    acc = torch.ones(x.numel())
    dequantize_reference(p.meta(), p.codes(), acc, accumulate=True, group=32, **kw)
    assert torch.equal(acc, 1.0 + dequantize(p, impl=EAGER))


def test_nuq_and_maxnorm_codes_literal():
    # nuq 4 bits: M = 7 magnitudes 2^-6 .. 1 plus 0; code = sign << 3 | j.
    x = torch.tensor([1.0, -1.0, 0.5, -0.25, 0.0, 2.0**-6, -(2.0**-6), 0.0])
    p = quantize(x, QuantConfig(bits=4, bucket_size=8, scheme="nuq", rounding="nearest"),
                 impl=EAGER)
    assert p.meta().tolist() == [1.0]
    # j: 1 -> 7, 0.5 -> 6, 0.25 -> 5, 2^-6 -> 1, 0 -> 0
    assert p.codes().tolist() == [0x7 | 0xF << 4, 0x6 | 0xD << 4, 0x0 | 0x1 << 4, 0x9 | 0 << 4]
    assert torch.equal(dequantize(p, impl=EAGER), x)
    # maxnorm 2 bits: levels {-s, 0, s}, codes 0, 1, 2; step = s.
    x = torch.tensor([-2.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 2.0])
    p = quantize(x, QuantConfig(bits=2, bucket_size=8, scheme="maxnorm", rounding="nearest"),
                 impl=EAGER)
    assert p.meta().tolist() == [2.0]
    assert p.codes().tolist() == [0b01100100, 0b10010101]
    assert torch.equal(dequantize(p, impl=EAGER), x)


@pytest.mark.parametrize("scheme", ["minmax", "maxnorm", "nuq"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 1023, 1025, 4099])
def test_packed_nbytes_exact(scheme, bits, n):
    cfg = QuantConfig(bits=bits, scheme=scheme)
    p = quantize(torch.randn(n), cfg, impl=EAGER)
    assert p.nbytes == packed_nbytes(n, cfg)
    words = 2 if scheme == "minmax" else 1  # [min, step] vs [step] or [scale]
    raw = HEADER_NBYTES + 4 * words * math.ceil(n / 1024) + math.ceil(n / 8) * bits
    assert packed_nbytes(n, cfg) == 16 * math.ceil(raw / 16)  # padded to 16 bytes
    # the padding is zero, whatever the buffer held before
    out = torch.full((p.nbytes,), 0xAB, dtype=torch.uint8)
    q = quantize(torch.randn(n), cfg, impl=EAGER, out=out)
    assert (q.payload[raw:] == 0).all() and q.codes().numel() == math.ceil(n / 8) * bits


def test_compression_ratio_fp32():
    n = 1 << 20
    assert 4 * n / packed_nbytes(n, QuantConfig(bits=8)) > 3.95
    assert 4 * n / packed_nbytes(n, QuantConfig(bits=4)) > 7.8
    assert 4 * n / packed_nbytes(n, QuantConfig(bits=2, scheme="nuq")) > 15.5


# ------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("scheme", ["minmax", "maxnorm", "nuq"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_unbiased(scheme, bits):
    """Mean of R independent roundings of the same bucket converges to x.

    The R copies sit in R buckets of one tensor, so each draws its own random numbers
    (the RNG is indexed by element); the tolerance is 5 standard errors of the mean,
    from the measured per-element variance.
    """
    d, R = 64, 4000
    base = torch.randn(d, generator=torch.Generator().manual_seed(1))
    x = base.repeat(R)
    y = roundtrip(x, QuantConfig(bits=bits, bucket_size=d, scheme=scheme), seed=7).view(R, d)
    mean, var = y.mean(0), y.var(0)
    tol = 5 * (var / R).sqrt() + 1e-6
    assert ((mean - base).abs() <= tol).all(), (mean - base).abs().max()
    # And the error is real, not zero (the test could not fail otherwise).
    assert var.max() > 0


def test_stochastic_rounding_bias_under_a_grid_step():
    """``floor(t + u)`` over all 65536 values of u (the 2^-16 grid): the mean code is t
    to within 2^-15 everywhere up to the top level, the fp32 add's rounding included
    (positions near 255, where its ulp is 2^-16, and fractions just under 1), and every
    code is floor(t) or floor(t) + 1."""
    from qcomm.reference import _round_codes

    u = torch.arange(65536, dtype=torch.float32) / 65536
    t = torch.tensor([0.0, 2.0**-20, 0.3, 1 - 2.0**-24, 3.5, 100.123456, 127.99999,
                      200.7, 254.5, 254.99998, 255.0], dtype=torch.float32)
    codes = _round_codes(t[:, None], u[None, :], 255)
    assert ((codes == t.floor()[:, None]) | (codes == t.floor()[:, None] + 1)).all()
    bias = (codes.double().mean(1) - t.double()).abs()
    assert (bias <= 2.0**-15).all(), bias.max()
    near = _round_codes(t[:, None], None, 255).view(-1)  # nearest, ties down
    assert near.tolist() == [0, 0, 0, 1, 3, 100, 128, 201, 254, 255, 255]


def _mse_per_norm2(x, cfg, seeds=8):
    """E||Q(v) - v||^2 / ||v||^2 averaged over buckets and seeds."""
    d = cfg.bucket_size
    v = x.view(-1, d)
    errs = []
    for s in range(seeds):
        y = roundtrip(x, cfg, seed=s).view(-1, d)
        errs.append(((y - v) ** 2).sum(1) / (v**2).sum(1))
    return torch.stack(errs).mean().item()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_variance_bound(bits):
    """maxnorm with the L2 norm is QSGD with s = 2^(b-1) - 1 magnitude levels."""
    d = 512
    x = torch.randn(64 * d, generator=torch.Generator().manual_seed(2))
    s = (1 << (bits - 1)) - 1
    bound = min(d / s**2, math.sqrt(d) / s)
    mse = _mse_per_norm2(x, QuantConfig(bits=bits, bucket_size=d, scheme="maxnorm", norm="l2"))
    assert mse <= bound, (mse, bound)
    assert mse > 0


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_nuqsgd_variance_bound(bits):
    """NUQSGD: E||Q(v)-v||^2 <= [1/8 + min(d 2^-2s / 4, 2^-s sqrt(d))] ||v||^2, 2^-s the
    smallest nonzero level (s = M - 1)."""
    d = 512
    x = torch.randn(64 * d, generator=torch.Generator().manual_seed(3))
    s = (1 << (bits - 1)) - 2
    bound = 1 / 8 + min(d * 2.0 ** (-2 * s) / 4, 2.0**-s * math.sqrt(d))
    mse = _mse_per_norm2(x, QuantConfig(bits=bits, bucket_size=d, scheme="nuq", norm="l2"))
    assert mse <= bound, (mse, bound)


def test_nuq_beats_uniform_on_heavy_tails():
    """Gradient-like data (Student t, 2 dof: most entries small, a few large) at 4 bits."""
    g = torch.Generator().manual_seed(4)
    normal = torch.randn(1 << 16, generator=g)
    chi2 = torch.randn(1 << 16, generator=g) ** 2 + torch.randn(1 << 16, generator=g) ** 2
    x = normal / (chi2 / 2).sqrt()
    nuq = _mse_per_norm2(x, QuantConfig(bits=4, scheme="nuq"), seeds=3)
    uni = _mse_per_norm2(x, QuantConfig(bits=4, scheme="maxnorm"), seeds=3)
    assert nuq < 0.8 * uni, (nuq, uni)


# SNR in dB measured on N(0,1) data, bucket 1024, nearest rounding (fp32 and bf16 alike);
# the floors sit 1 dB below. ~6 dB per bit for the uniform schemes; nuq's exponential
# levels saturate (NUQSGD's 1/8 variance term) and stop gaining past 4 bits.
SNR_MEASURED = {
    "minmax": {1: -8.0, 2: 4.0, 3: 11.5, 4: 18.1, 8: 42.5},
    "maxnorm": {1: -8.5, 2: 1.3, 3: 9.8, 4: 17.1, 8: 42.0},
    "nuq": {1: -8.5, 2: 1.3, 3: 11.6, 4: 14.2, 8: 14.2},
}


@pytest.mark.parametrize("scheme", sorted(SNR_MEASURED))
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_snr_floor_nearest(scheme, bits, dtype):
    x = torch.randn(1 << 15, generator=torch.Generator().manual_seed(5)).to(dtype)
    y = roundtrip(x, QuantConfig(bits=bits, scheme=scheme, rounding="nearest"))
    assert y.dtype == dtype
    assert snr_db(x, y) >= SNR_MEASURED[scheme][bits] - 1.0


def test_seed_determinism():
    x = torch.randn(5000)
    cfg = QuantConfig(bits=4)
    a = quantize(x, cfg, seed=11, impl=EAGER).payload
    b = quantize(x, cfg, seed=11, impl=EAGER).payload
    c = quantize(x, cfg, seed=12, impl=EAGER).payload
    d = quantize(x, cfg.replace(seed=11), impl=EAGER).payload
    assert torch.equal(a, b) and torch.equal(a, d)
    assert not torch.equal(a, c)
    # Seeds that differ only above bit 32 differ too.
    e = quantize(x, cfg, seed=11 + (1 << 40), impl=EAGER).payload
    assert not torch.equal(a, e)


# ------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("scheme", ["minmax", "maxnorm", "nuq"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_poisons_only_its_bucket(scheme, bad):
    x = torch.randn(4 * 256)
    x_bad = x.clone()
    x_bad[300] = bad
    cfg = QuantConfig(bits=8, bucket_size=256, scheme=scheme)
    y = roundtrip(x_bad, cfg, seed=3)
    clean = roundtrip(x, cfg, seed=3)
    assert not torch.isfinite(y[256:512]).any()  # every value of bucket 1 is non-finite
    keep = torch.ones(1024, dtype=torch.bool)
    keep[256:512] = False
    assert torch.equal(y[keep], clean[keep])


@pytest.mark.parametrize("scheme", ["minmax", "maxnorm", "nuq"])
@pytest.mark.parametrize("bits", [1, 2, 8])
@pytest.mark.parametrize("value", [0.0, 3.25, -7.5])
def test_constant_bucket_exact(scheme, bits, value):
    x = torch.full((300,), value)
    y = roundtrip(x, QuantConfig(bits=bits, bucket_size=64, scheme=scheme), seed=1)
    assert torch.equal(y, x), (y - x).abs().max()


@pytest.mark.parametrize("scheme", ["minmax", "maxnorm", "nuq"])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-39, 1e-43])
def test_tiny_buckets_keep_relative_precision(scheme, magnitude):
    """Buckets whose step is far below 2^-100 (down to denormals): the reciprocal of the
    step would overflow to inf and turn codes into NaN garbage without the 2^64 boost."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(256, generator=g) * 2 - 1
    x = (x * magnitude).float()  # denormal for the smaller magnitudes (fp32 min normal 1e-38)
    cfg = QuantConfig(bits=8, bucket_size=64, scheme=scheme, rounding="nearest")
    y = roundtrip(x, cfg, seed=2)
    assert torch.isfinite(y).all()
    scale = x.view(4, 64).abs().amax(1).repeat_interleave(64)
    # 8 bits: a nearest code is within half a step of the bucket's range; nuq's coarsest
    # gap (1/2 to 1) is half the scale. Denormal inputs are themselves quantized to 1.4e-45.
    bound = (0.5 if scheme == "nuq" else 2 / 255) * scale + 2e-45
    assert ((y - x).abs() <= bound).all(), ((y - x).abs() / scale).max()


# -------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool,
                                   torch.complex64, torch.float64])
def test_rejects_non_float_dtypes(dtype):
    x = torch.zeros(16, dtype=dtype)
    with pytest.raises(TypeError, match=str(dtype).split(".")[-1]):
        quantize(x, QuantConfig(), impl=EAGER)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=0), "bits"), (dict(bits=9), "bits"), (dict(bits=4.0), "bits"),
        (dict(bucket_size=12), "bucket_size"), (dict(bucket_size=0), "bucket_size"),
        (dict(bucket_size=1 << 20), "bucket_size"), (dict(scheme="qsgd"), "scheme"),
        (dict(norm="l1"), "norm"), (dict(rounding="up"), "rounding"), (dict(seed="x"), "seed"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        QuantConfig(**kwargs)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        QuantConfig().bits = 4


def test_bad_out_and_payload():
    x = torch.randn(100)
    cfg = QuantConfig(bits=4)
    p = quantize(x, cfg, impl=EAGER)
    with pytest.raises(ValueError, match="100 elements"):
        dequantize(p, out=torch.empty(99), impl=EAGER)
    with pytest.raises(TypeError, match="float32 out"):
        dequantize(p, out=torch.empty(100, dtype=torch.bfloat16), accumulate=True, impl=EAGER)
    with pytest.raises(ValueError, match="needs out"):
        dequantize(p, accumulate=True, impl=EAGER)
    with pytest.raises(TypeError, match="floating-point"):
        dequantize(p, out=torch.empty(100, dtype=torch.int32), impl=EAGER)
    with pytest.raises(ValueError, match="bytes"):
        quantize(x, cfg, out=torch.empty(3, dtype=torch.uint8), impl=EAGER)
    with pytest.raises(TypeError, match="QuantConfig"):
        quantize(x, {"bits": 4})
    with pytest.raises(ValueError, match="impl"):
        quantize(x, cfg, impl="cuda")
    # A payload read with the wrong expectations names the mismatch.
    other = qcomm.Packed(p.payload, 100, torch.float32, cfg.replace(bits=8))
    with pytest.raises(ValueError, match="bytes"):
        dequantize(other, impl=EAGER)
    same_size = qcomm.Packed(p.payload, 100, torch.float32, cfg.replace(scheme="maxnorm"))
    with pytest.raises(ValueError, match="bytes|scheme"):
        dequantize(same_size, impl=EAGER)
    nearest = qcomm.Packed(p.payload, 100, torch.float32, cfg.replace(rounding="nearest"))
    with pytest.raises(ValueError, match="rounding"):
        dequantize(nearest, impl=EAGER)
    garbage = qcomm.Packed(torch.zeros_like(p.payload), 100, torch.float32, cfg)
    with pytest.raises(ValueError, match="not a qcomm payload"):
        dequantize(garbage, impl=EAGER)


def test_inputs_never_written_and_noncontiguous_ok():
    base = torch.randn(64, 48)
    x = base.t()  # non-contiguous
    before = base.clone()
    cfg = QuantConfig(bits=4, bucket_size=64)
    p = quantize(x, cfg, seed=5, impl=EAGER)
    assert torch.equal(base, before)
    assert torch.equal(p.payload, quantize(x.contiguous(), cfg, seed=5, impl=EAGER).payload)
    y = dequantize(p, impl=EAGER)
    assert y.shape == x.shape
    payload_before = p.payload.clone()
    out = torch.zeros(64, 48).t()  # non-contiguous out, same shape as x
    dequantize(p, out=out, impl=EAGER)
    assert torch.equal(out, y)
    assert torch.equal(p.payload, payload_before)


def test_accumulate_adds_in_fp32():
    x = torch.randn(3000)
    p = quantize(x, QuantConfig(bits=8), impl=EAGER)
    acc = torch.full((3000,), 2.0)
    dequantize(p, out=acc, accumulate=True, impl=EAGER)
    assert torch.equal(acc, dequantize(p, impl=EAGER) + 2.0)


@pytest.mark.parametrize("scheme, bits", [("minmax", 8), ("minmax", 4), ("nuq", 2),
                                          ("maxnorm", 3), ("minmax", 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_out_decodes_in_chunks(scheme, bits, dtype, monkeypatch):
    """The torch path decodes into 16-bit outputs through a small fp32 buffer, a run of
    buckets at a time: chunk edges, the partial last bucket and a 2-D shape must come out
    as the fp32 decode rounded once."""
    monkeypatch.setattr(qcomm.codec, "_CHUNK", 64)  # 16-element buckets: 4 per chunk
    cfg = QuantConfig(bits=bits, bucket_size=16, scheme=scheme)
    x = torch.randn(16 * 4 * 3 + 7, dtype=torch.float32) * 5
    p = quantize(x.to(dtype), cfg, seed=2, impl=EAGER)
    want = dequantize(p, out=torch.empty(x.numel()), impl=EAGER).to(dtype)
    got = dequantize(p, impl=EAGER)
    assert got.dtype == dtype and torch.equal(got, want)
    p2 = quantize(x.to(dtype).view(-1, 1), cfg, seed=2, impl=EAGER)
    assert torch.equal(dequantize(p2, impl=EAGER).view(-1), want)


def test_uniform_pairs_halves_against_formula():
    """The stochastic-rounding uniform, against its formula in Python ints: element p of
    bucket b and element p + B/2 hash the counter b * B/2 + p mod B/2 once, and take its
    low and high 16 bits. int64 indices past 2^32 mix in the counter's high word; int32
    indices (tensors under 2^31 elements, the kernels' WIDE=False) skip it, same bits."""
    from qcomm import reference as R

    key, B = R.seed_key(7), 64
    idx = [0, 1, 31, 32, 33, 63, 64, 96, 5, 2**31 - 1, 123456789, 2**33 + 3,
           2**41 + 2**31 + 40]

    def want(i):
        b, p = divmod(i, B)
        c = b * (B // 2) + p % (B // 2)
        lo, hi = c & 0xFFFFFFFF, c >> 32
        h = R.fmix32_int(((lo * R.GOLDEN + key) & 0xFFFFFFFF) ^ ((hi * R.GOLDEN_HI) & 0xFFFFFFFF))
        return ((h >> 16) if p >= B // 2 else (h & 0xFFFF)) / 2**16

    got = R.uniform(torch.tensor(idx, dtype=torch.int64), key, B)
    assert got.tolist() == [want(i) for i in idx]
    assert got[0] != got[3] and got[1] != got[4]  # elements 0, 32 and 1, 33: one hash each
    narrow = torch.tensor(idx[:11], dtype=torch.int32)
    assert torch.equal(R.uniform(narrow, key, B), got[:11])


def test_quantize_paths_agree_on_the_pairing():
    """The full-bucket graph (halves as views, one hash per pair), the one-bucket
    graph (the per-element formula) and int32 / int64 counters give the same codes:
    the last bucket of a tensor, quantized with the others and alone, the same bytes."""
    from qcomm import reference as R

    x = torch.randn(4 * 64)
    kw = dict(bits=4, bucket_size=64, sid=0, l2=False, stochastic=True, key=R.seed_key(5),
              divisor=torch.tensor(15.0))
    meta = torch.empty(4, 2)
    full = torch.empty(4, 64, dtype=torch.uint8)
    for wide in (False, True):
        pos = R.positions(32, x.device)
        R.encode_buckets(x.view(4, 64), meta, full[:, :32], full[:, 32:], pos, wide=wide,
                         first=torch.tensor(0), **kw)
        # a chunk of the buckets: the same bytes as in the whole
        part = torch.empty(2, 64, dtype=torch.uint8)
        R.encode_buckets(x.view(4, 64)[1:3], torch.empty(2, 2), part[:, :32], part[:, 32:],
                         pos, wide=wide, first=torch.tensor(1), **kw)
        assert torch.equal(part, full[1:3])
        codes = torch.empty(32, dtype=torch.uint8)
        tmeta = torch.empty(2)
        R.encode_bucket(x[192:], tmeta, codes, length=torch.tensor(64),
                        start=torch.tensor(192), wide=wide, **kw)
        assert torch.equal(tmeta, meta[3])
        assert torch.equal(codes, R.pack_codes(full[3], 4))


def test_row_chunks_never_leave_one_row():
    from qcomm.reference import _row_chunks

    assert _row_chunks(7, 3) == [(0, 3), (3, 7)]  # the lone 7th row joins the chunk before
    assert _row_chunks(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert _row_chunks(2, 16) == [(0, 2)]
    assert _row_chunks(5, 1) == [(0, 2), (2, 5)]  # steps of one row would all be lone


@pytest.mark.parametrize("scheme", ["minmax", "nuq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4, 3])
def test_chunked_encode_gives_the_same_bytes(bits, dtype, scheme, monkeypatch):
    """Byte buffers go ENCODE_CHUNK elements at a time, nuq from bf16 through fp32
    CONVERT_CHUNK at a time; chunks of 3 buckets over 7 full ones and a tail (a lone
    last bucket goes alone) give the bytes of one pass."""
    from qcomm import reference as R

    B = 64
    cfg = QuantConfig(bits=bits, bucket_size=B, scheme=scheme)
    x = (torch.randn(7 * B + 5) * 3).to(dtype)
    whole = quantize(x, cfg, seed=3, impl="eager").payload
    monkeypatch.setattr(R, "ENCODE_CHUNK", 3 * B)
    monkeypatch.setattr(R, "CONVERT_CHUNK", 3 * B)
    chunked = quantize(x, cfg, seed=3, impl="eager").payload
    assert torch.equal(chunked, whole)
