"""The oracle (qcomm/oracle.py) by itself: literal payloads worked out by hand, its hash
against constants.fmix32_int, and the tuned torch path (impl="eager") against it on a
grid too large for the Triton interpreter (tests/test_kernels.py has the three-way one)."""

import itertools

import pytest
import torch

from qcomm import QuantConfig, dequantize, oracle, quantize
from qcomm.constants import GOLDEN, MASK32, fmix32_int, seed_key
from qcomm.layout import encode_header, packed_nbytes


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (-0.0 is not +0.0; NaNs compare by their bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.reshape(-1).view(ints), b.reshape(-1).view(ints))


def f32_bytes(*values: float) -> list[int]:
    return torch.tensor(values, dtype=torch.float32).view(torch.uint8).tolist()


def test_literal_minmax_nearest():
    """2 bits, one bucket of 8: min 0, max 3, step (3 - 0) / 3 = 1, so the codes are the
    values rounded to nearest, ties (1.5, 2.5) down: 3 2 1 0 0 1 2 1. Packed 4 to a byte,
    code 0 in the low bits: 3 | 2 << 2 | 1 << 4 | 0 << 6 = 27, 0 | 1 << 2 | 2 << 4 |
    1 << 6 = 100."""
    cfg = QuantConfig(bits=2, bucket_size=8, rounding="nearest")
    x = torch.tensor([3.0, 2.0, 1.0, 0.0, 0.4, 0.6, 2.5, 1.5])
    payload = oracle.quantize(x, cfg, seed=0)
    body = list(encode_header(8, torch.float32, cfg)) + f32_bytes(0.0, 1.0) + [27, 100]
    assert len(body) == 42 and packed_nbytes(8, cfg) == 48
    assert payload.tolist() == body + [0] * 6
    decoded = oracle.dequantize(payload, cfg, 8)
    assert decoded.tolist() == [3.0, 2.0, 1.0, 0.0, 0.0, 1.0, 2.0, 1.0]


def test_literal_nuq_nearest():
    """3 bits: a sign bit and levels j = 0..3 of 0, 1/4, 1/2, 1 times scale = max |x| = 1.
    0.75 is halfway from 1/2 to 1 (a tie: down, j = 2); 0.3 is 1/5 of the way from 1/4 to
    1/2 (j = 1); 0.1 is 2/5 of the way from 0 to 1/4 (j = 0); -0.2 is 4/5 (j = 1, sign).
    Codes 7 2 1 2 1 0 5 0; packed 3 bits each into one 24-bit word:
    7 | 2 << 3 | 1 << 6 | 2 << 9 | 1 << 12 | 5 << 18 = 0x141457, bytes 57 14 14."""
    cfg = QuantConfig(bits=3, bucket_size=8, scheme="nuq", rounding="nearest")
    x = torch.tensor([-1.0, 0.5, 0.25, 0.75, 0.3, 0.1, -0.2, 0.0])
    payload = oracle.quantize(x, cfg, seed=0)
    assert payload[32:36].tolist() == f32_bytes(1.0)
    assert payload[36:39].tolist() == [0x57, 0x14, 0x14]
    assert not payload[39:].any()
    decoded = oracle.dequantize(payload, cfg, 8)
    assert decoded.tolist() == [-1.0, 0.5, 0.25, 0.5, 0.25, 0.0, -0.25, 0.0]


def test_uniforms_one_hash_per_pair():
    """Element p < B/2 of a bucket takes the low 16 bits and p + B/2 the high 16 of the
    hash of counter bucket * B/2 + p, computed here with the scalar fmix32 of constants
    (the counters stay below 2^32, so the high word is 0)."""
    B, seed = 16, 2**63 + 5
    u = oracle.uniforms(0, 3 * B, B, seed)
    key = seed_key(seed) & MASK32
    for bucket, p in itertools.product(range(3), range(B // 2)):
        h = fmix32_int((bucket * (B // 2) + p) * GOLDEN + key)
        assert u[bucket * B + p] * 65536 == h & 0xFFFF
        assert u[bucket * B + B // 2 + p] * 65536 == h >> 16
    assert torch.equal(oracle.uniforms(B + 3, 20, B, seed), u[B + 3:B + 23])


def gradient_like(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
    if n > 10:
        x[3] = 0.0
        x[7] = -x[7].abs() - 1.0  # an outlier
    return x.to(dtype)


def awkward(B: int) -> torch.Tensor:
    """Buckets that take the rare branches: denormal steps (the boost), huge values,
    an L2 norm past fp32's range, all zeros of both signs, constant, non-finite."""
    x = gradient_like(9 * B + 5, torch.float32, seed=B)
    x[:B] *= 1e-39
    x[B:2 * B] *= 1e-43
    x[2 * B:3 * B] *= 1e30
    x[3 * B:4 * B] = torch.where(torch.arange(B) % 3 == 1, -0.0, 0.0)
    x[4 * B:5 * B] = 1.5
    x[5 * B:6 * B] *= 3e38
    x[6 * B + 1], x[7 * B + 2], x[8 * B] = float("inf"), float("-inf"), float("nan")
    x[-1] = float("inf")  # the partial last bucket
    return x


def check(x: torch.Tensor, cfg: QuantConfig, seed: int) -> None:
    want = oracle.quantize(x, cfg, seed)
    got = quantize(x, cfg, seed=seed, impl="eager")
    what = f"{cfg}, {x.dtype}, n={x.numel()}, seed={seed}"
    assert torch.equal(got.payload, want), f"payload: {what}"
    for dtype in {x.dtype, torch.float32}:
        y = dequantize(got, out=torch.empty(x.numel(), dtype=dtype), impl="eager")
        assert same_bits(y, oracle.dequantize(want, cfg, x.numel(), dtype)), f"{dtype}: {what}"


@pytest.mark.parametrize("scheme", ["minmax", "maxnorm", "nuq"])
@pytest.mark.parametrize("bits", range(1, 9))
def test_oracle_matches_eager(scheme, bits):
    """Every bits, dtype, norm, rounding and size around a bucket of 64."""
    B = 64
    for dtype, norm, rounding, n in itertools.product(
            [torch.float32, torch.bfloat16, torch.float16], ["max", "l2"],
            ["stochastic", "nearest"], [0, 1, B - 1, B, B + 1, 5 * B + 3]):
        if scheme == "minmax" and norm == "l2":
            continue  # minmax has no norm
        cfg = QuantConfig(bits=bits, bucket_size=B, scheme=scheme, norm=norm,
                          rounding=rounding)
        check(gradient_like(n, dtype, seed=n + bits), cfg, seed=123 + bits)


@pytest.mark.parametrize("scheme", ["minmax", "maxnorm", "nuq"])
@pytest.mark.parametrize("B", [8, 40, 1024])
def test_oracle_matches_eager_awkward_buckets(scheme, B):
    """:func:`awkward` buckets (bf16 denormals too, which the Triton interpreter cannot
    load), 40-element buckets (halves of 20), the default 1024, a 64-bit seed."""
    x = awkward(B)
    for bits, dtype, norm, rounding in itertools.product(
            [1, 2, 3, 5, 8], [torch.float32, torch.bfloat16], ["max", "l2"],
            ["stochastic", "nearest"]):
        if scheme == "minmax" and norm == "l2":
            continue
        cfg = QuantConfig(bits=bits, bucket_size=B, scheme=scheme, norm=norm,
                          rounding=rounding)
        check(x.to(dtype), cfg, seed=2**63 + bits)
