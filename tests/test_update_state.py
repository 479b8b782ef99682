"""qcomm.codec.update_state_rows (the weight-difference gather's receive side in one
call) gives the values and bytes of qcomm.oracle.update_state, and of the three calls it
fuses (decode the state, accumulate the differences' decode, quantize back, zero the
non-finite meta), on every path: the Triton kernel (interpreted on CPU), the torch path
eager and compiled. Bucket sizes of the state and the differences differ (one divides
the other, or neither), sizes straddle the spans the compiled graph takes whole."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before qcomm.kernels imports triton

import pytest  # noqa: E402

from qcomm import (  # noqa: E402
    QuantConfig,
    dequantize_rows,
    oracle,
    packed_nbytes,
    quantize_rows,
    update_state_rows,
)
from qcomm.layout import HEADER_NBYTES, meta_nbytes  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the GPU tier (pytest -m gpu): on CUDA where there is one, else through the interpreter
pytestmark = pytest.mark.gpu
R = 3

# (state config, difference config, n): state 8-bit minmax like qcomm.fsdp.DEFAULT_STATE
S64 = QuantConfig(bits=8, bucket_size=64, scheme="minmax", rounding="nearest")
CASES = [
    (S64, QuantConfig(bits=4, bucket_size=64), 64 * 5 + 7),  # equal buckets
    (S64, QuantConfig(bits=4, bucket_size=128), 128 * 3 + 64 + 5),  # state divides
    (QuantConfig(bits=8, bucket_size=128, scheme="minmax", rounding="nearest"),
     QuantConfig(bits=2, bucket_size=64, scheme="maxnorm"), 128 * 2 + 70),  # deltas divide
    (S64, QuantConfig(bits=3, bucket_size=48, scheme="nuq"), 192 * 2 + 50),  # lcm 192
    (QuantConfig(bits=4, bucket_size=32, scheme="maxnorm", rounding="nearest"),
     QuantConfig(bits=8, bucket_size=64, scheme="minmax"), 64 * 4),  # a 4-bit state
    (QuantConfig(bits=6, bucket_size=64, scheme="nuq", rounding="nearest", norm="l2"),
     QuantConfig(bits=5, bucket_size=64), 64 * 3 + 1),
]
IMPLS = ["eager", "torch", "triton"]
# compiled: one pair like qcomm.fsdp's (8-bit state, 4-bit differences): the compiled
# path runs the codec's own pieces, compiled and checked per configuration in
# test_kernels/test_rows, and each configuration compiles for 10-40 s on 2 cores
COMPILED = CASES[1:2]


def payload_rows(n, cfg, seed, scale=1.0, bad=()):
    """R payloads (row stride padded by 8 bytes: rows of one buffer, not contiguous) of
    random fp32 rows; ``bad``: (row, element, value) set before quantizing."""
    g = torch.Generator().manual_seed(seed + n)
    x = torch.randn(R, n, generator=g) * scale
    for r, i, v in bad:
        x[r, i] = v
    nbytes = packed_nbytes(n, cfg)
    buf = torch.zeros(R, nbytes + 8, dtype=torch.uint8)
    rows = buf[:, :nbytes]
    for r in range(R):
        rows[r].copy_(oracle.quantize(x[r], cfg, seed=seed * 7 + r))
    return rows.to(DEVICE)


def bits_of(t):
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(ints).cpu()


def expected(state, deltas, n, scfg, dcfg, dtype):
    vals, states = zip(*(oracle.update_state(state[r].cpu(), deltas[r].cpu(), n, scfg, dcfg,
                                             dtype) for r in range(R)), strict=True)
    return torch.stack(vals), torch.stack(states)


@pytest.mark.parametrize("impl, scfg, dcfg, n",
                         [(i, *c) for i in IMPLS for c in (COMPILED if i == "torch" else CASES)])
def test_update_state_rows_is_the_oracle(impl, scfg, dcfg, n):
    state = payload_rows(n, scfg, seed=1)
    deltas = payload_rows(n, dcfg, seed=2, scale=0.01)
    for dtype in (torch.float32, torch.bfloat16):
        want_vals, want_state = expected(state, deltas, n, scfg, dcfg, dtype)
        # a 16-bit out sums in the caller's scratch buffer when given (qcomm.fsdp's)
        for scratch in (None, torch.full((R * n + 3,), 5.0, device=DEVICE)):
            s = state.clone()
            out = torch.full((R, n + 5), 7.0, dtype=dtype, device=DEVICE)[:, :n]
            update_state_rows(s, deltas, n, scfg, dcfg, out=out, scratch=scratch, impl=impl)
            assert torch.equal(bits_of(out), bits_of(want_vals))
            assert torch.equal(s.cpu(), want_state)


@pytest.mark.parametrize("impl", IMPLS)
def test_update_state_rows_is_the_three_calls_it_fuses(impl):
    """What qcomm.fsdp did per piece before: decode the state into the output, add the
    differences' decode, quantize back, zero the NaN meta; here with a NaN and an inf in
    the differences and a bucket whose range overflows the step (inf step, finite min)."""
    scfg, dcfg = S64, QuantConfig(bits=4, bucket_size=128)
    n = 128 * 4 + 30
    big = 3e38
    state = payload_rows(n, scfg, seed=3, bad=[(0, 5, big), (0, 6, -big)])
    deltas = payload_rows(n, dcfg, seed=4, scale=0.01,
                          bad=[(1, 200, float("nan")), (2, n - 3, float("inf"))])
    ref_state, ref_out = state.clone(), torch.empty(R, n, device=DEVICE)
    dequantize_rows(ref_state, n, torch.float32, scfg, out=ref_out, impl="eager")
    dequantize_rows(deltas, n, torch.float32, dcfg, out=ref_out, accumulate=True,
                    impl="eager")
    quantize_rows(ref_out, scfg, [0] * R, out=ref_state, impl="eager")
    meta = ref_state[:, HEADER_NBYTES:HEADER_NBYTES + meta_nbytes(n, scfg)].view(torch.float32)
    meta.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    s, out = state.clone(), torch.empty(R, n, device=DEVICE)
    update_state_rows(s, deltas, n, scfg, dcfg, out=out, impl=impl)
    assert torch.equal(bits_of(out), bits_of(ref_out))
    assert torch.equal(s, ref_state)
    # the non-finite buckets: NaN / inf out, zero meta in the state (decode to 0)
    assert out[1, 200].isnan() and out[2, n - 3].isnan()  # a bad bucket decodes NaN
    again = torch.empty(R, n, device=DEVICE)
    dequantize_rows(s, n, torch.float32, scfg, out=again, impl="eager")
    assert again.isfinite().all()
    assert (again[1, 192:256] == 0).all() and (again[2, 512:] == 0).all()
    assert (again[0, :64] == again[0, 0]).all()  # inf step stored as 0: the bucket's min


def test_update_state_rows_refuses_bad_input():
    scfg, dcfg, n = S64, QuantConfig(bits=4, bucket_size=64), 100
    state, deltas = payload_rows(n, scfg, 1), payload_rows(n, dcfg, 2)
    out = torch.empty(R, n, device=DEVICE)
    with pytest.raises(ValueError, match="round to nearest"):
        update_state_rows(state, deltas, n, QuantConfig(bits=8, bucket_size=64), dcfg, out=out)
    with pytest.raises(ValueError, match="deltas has 2 rows"):
        update_state_rows(state, deltas[:2], n, scfg, dcfg, out=out)
    with pytest.raises(ValueError, match="deltas must be a 2-D uint8"):
        update_state_rows(state, deltas, n, scfg, QuantConfig(bits=2, bucket_size=64), out=out)
    with pytest.raises(ValueError, match="scratch must be a contiguous float32 tensor of "
                       "at least 300"):
        update_state_rows(state, deltas, n, scfg, dcfg, out=out, scratch=torch.empty(299))
    with pytest.raises(ValueError, match=r"out must be a \[3, 100\]"):
        update_state_rows(state, deltas, n, scfg, dcfg, out=out[:, :99])
    wrong = state.clone()
    wrong[1, :HEADER_NBYTES].copy_(oracle.quantize(torch.zeros(n), QuantConfig(
        bits=8, bucket_size=64, scheme="maxnorm", rounding="nearest"), 0)[:HEADER_NBYTES])
    before = wrong.clone()
    with pytest.raises(ValueError, match="state row 1"):
        update_state_rows(wrong, deltas, n, scfg, dcfg, out=out)
    assert torch.equal(wrong, before)  # nothing written
