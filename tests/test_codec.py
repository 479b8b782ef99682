"""The codec on its own: wire layout against literal bytes, statistics of the quantizers,
non-finite handling, and bad input. Runs the torch path eagerly;
test_kernels.py checks that it, the Triton kernels and the oracle produce the same bytes.
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


def test_call_descriptor_bytes_literal():
    """The 48-byte call descriptor (layout.py): the payload header, kind, op, path, 5
    reserved zero bytes, the call index as uint64 LE; and back. An exact call under
    bits=auto says path 1 and may carry any dtype (int64: 16 + 1)."""
    from qcomm import layout

    cfg = QuantConfig(bits=4, bucket_size=8, scheme="nuq", norm="l2", rounding="nearest")
    desc = layout.encode_descriptor("reduce_scatter", 10, torch.bfloat16, cfg, 4, 258)
    assert desc == (
        b"QC" + bytes([1, 4, 2, 0b11, 1, 0]) + (8).to_bytes(4, "little") + bytes(4)
        + (10).to_bytes(8, "little") + bytes(8)
        + bytes([2, 4]) + bytes(6) + bytes([2, 1, 0, 0, 0, 0, 0, 0])
    )
    assert len(desc) == layout.DESC_NBYTES
    got = layout.decode_descriptor(desc)
    assert (got["kind"], got["op_id"], got["call"], got["numel"], got["bits"]) == (
        "reduce_scatter", 4, 258, 10, 4)
    ag = layout.encode_descriptor("all_gather", 1, torch.float32, QuantConfig(), layout.NO_OP, 0)
    assert ag[32:34] == bytes([1, 255])
    exact = layout.encode_descriptor("all_reduce", 3, torch.int64, QuantConfig(), 0, 7, path=1)
    assert exact[6] == 17 and exact[32:40] == bytes([3, 0, 1, 0, 0, 0, 0, 0])
    got = layout.decode_descriptor(exact)
    assert (got["dtype"], got["path"], got["kind"], got["numel"]) == (
        torch.int64, "exact", "all_reduce", 3)
    with pytest.raises(ValueError, match="not a qcomm call descriptor"):
        layout.decode_descriptor(bytes(48))


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


@pytest.mark.parametrize("impl", ["eager", "torch"])
def test_parameters_quantize_on_every_path(impl):
    """An nn.Parameter (a leaf that requires grad) is read like any tensor, not refused
    ("a leaf Variable that requires grad is being used in an in-place operation"): the
    same bytes as its data, and no graph built."""
    cfg = QuantConfig(bits=4, bucket_size=64)
    w = torch.nn.Parameter(torch.randn(3 * 64 + 5))
    p = quantize(w, cfg, seed=1, impl=impl)
    assert torch.equal(p.payload, quantize(w.detach(), cfg, seed=1, impl=impl).payload)
    y = dequantize(p, impl=impl)
    assert not y.requires_grad and y.grad_fn is None


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

