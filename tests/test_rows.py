"""The row calls of the codec (qcomm.codec.quantize_rows / dequantize_rows /
dequantize_sum: R payloads in one call, what a collective sends to or gets from R peers)
give the bytes and values of the one-payload calls, on every path: the oracle, the
Triton kernels (interpreted on CPU), the torch path eager and compiled.

Rows are strided views (chunks of a flat buffer with gaps between them, as a piece of
every chunk of a reduce-scatter's input is), sizes straddle 64-element buckets."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before qcomm.kernels imports triton

import pytest  # noqa: E402

from qcomm import (  # noqa: E402
    QuantConfig,
    dequantize_rows,
    dequantize_sum,
    oracle,
    packed_nbytes,
    quantize,
    quantize_rows,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the GPU tier (pytest -m gpu): on CUDA where there is one, else through the interpreter
pytestmark = pytest.mark.gpu
B = 64
R = 3


def rows_of(n: int, dtype, gap: int = 40, seed: int = 0, rows: int = R) -> torch.Tensor:
    """[rows, n] rows of one buffer, ``gap`` elements apart."""
    g = torch.Generator().manual_seed(seed + n)
    base = (torch.randn(rows * (n + gap), generator=g) * 3).to(dtype).to(DEVICE)
    return base.as_strided((rows, n), (n + gap, 1))


def bits_of(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(ints).cpu()


CASES = [("minmax", 8, torch.float32, 64 * 5 + 7), ("minmax", 4, torch.bfloat16, 64 * 3),
         ("nuq", 3, torch.float32, 63), ("maxnorm", 2, torch.float16, 64 * 2 + 1),
         ("minmax", 1, torch.float32, 64)]
IMPLS = ["eager", "triton"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scheme, bits, dtype, n", CASES)
def test_quantize_rows_is_quantize_of_each_row(impl, scheme, bits, dtype, n):
    cfg = QuantConfig(bits=bits, scheme=scheme, bucket_size=B)
    x = rows_of(n, dtype)
    seeds = [5, 1 << 40, 77]
    want = [oracle.quantize(x[r].cpu(), cfg, seeds[r]) for r in range(R)]
    for skip in (None, 0, 1, 2):
        out = torch.full((R, packed_nbytes(n, cfg)), 0xAB, dtype=torch.uint8, device=DEVICE)
        quantize_rows(x, cfg, seeds, out=out, skip=skip, impl=impl)
        for r in range(R):
            if r == skip:  # untouched
                assert bool((out[r] == 0xAB).all())
            else:
                assert torch.equal(out[r].cpu(), want[r]), (skip, r)
    single = quantize(x[1].contiguous(), cfg, seed=seeds[1], impl=impl).payload
    assert torch.equal(single.cpu(), want[1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scheme, bits, dtype, n", CASES)
def test_dequantize_rows_and_sum_match_the_oracle(impl, scheme, bits, dtype, n):
    cfg = QuantConfig(bits=bits, scheme=scheme, bucket_size=B)
    x = rows_of(n, dtype, seed=1)
    seeds = [3, 4, 5]
    payloads = torch.stack([oracle.quantize(x[r].cpu(), cfg, seeds[r]) for r in range(R)])
    payloads = payloads.to(DEVICE)
    # into strided rows, and accumulated into fp32
    out = torch.zeros(R * (n + 9), dtype=dtype, device=DEVICE).as_strided((R, n), (n + 9, 1))
    dequantize_rows(payloads, n, dtype, cfg, out=out, impl=impl)
    acc = torch.ones(R, n, device=DEVICE)
    dequantize_rows(payloads, n, dtype, cfg, out=acc, accumulate=True, impl=impl)
    # subtracted from strided fp32 rows (error feedback's residual, in place)
    owed = rows_of(n, torch.float32, seed=4)
    before = owed.cpu().clone()
    dequantize_rows(payloads, n, dtype, cfg, out=owed, subtract=True, impl=impl)
    for r in range(R):
        want = oracle.dequantize(payloads[r], cfg, n)
        assert torch.equal(bits_of(out[r]), bits_of(want.to(dtype))), r
        assert torch.equal(bits_of(acc[r]), bits_of(want + 1.0)), r
        assert torch.equal(bits_of(owed[r]), bits_of(before[r] - want)), r
    own = rows_of(n, dtype, seed=2)[0].contiguous()
    for op, factor in (("sum", 1.0), ("avg", 3.0), ("premul", 0.3)):
        for out_dtype in {torch.float32, dtype}:
            got = torch.empty(n, dtype=out_dtype, device=DEVICE)
            dequantize_sum(payloads, n, dtype, cfg, own=own, out=got, skip=1, op=op,
                           factor=factor, impl=impl)
            want = oracle.dequantize_sum([payloads[0], None, payloads[2]], cfg, n, own, op,
                                         factor, out_dtype)
            assert torch.equal(bits_of(got), bits_of(want)), (op, out_dtype)
    # out may be own (a reduce-scatter into its own chunk)
    mine = own.clone()
    dequantize_sum(payloads, n, dtype, cfg, own=mine, out=mine, skip=None, impl=impl)
    want = oracle.dequantize_sum(list(payloads), cfg, n, own, dtype=dtype)
    assert torch.equal(bits_of(mine), bits_of(want))


@pytest.mark.skipif(DEVICE == "cuda", reason="the torch path is the CPU's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_strided_rows_decode_one_row_a_call(dtype, monkeypatch):
    """Strided output rows past qcomm.cpu.dequantize.STRIDED_ROWS_SPLIT (a collective's
    piece of its W output slots) are decoded one row per call, to the oracle's values,
    stored and accumulated; contiguous rows stay one call."""
    from qcomm.cpu import common
    from qcomm.cpu import dequantize as cpu_dequantize

    monkeypatch.setattr(cpu_dequantize, "STRIDED_ROWS_SPLIT", 2 * B)
    cfg = QuantConfig(bits=4, bucket_size=B)
    n = 5 * B + 7  # full buckets and a partial one per row
    payloads = torch.stack([oracle.quantize(x, cfg, 9 + r) for r, x in
                            enumerate(rows_of(n, torch.float32, seed=4))])
    want = [oracle.dequantize(payloads[r], cfg, n) for r in range(R)]
    slots = torch.zeros(R, 3 * n, dtype=dtype)  # the piece [n, 2n) of each row's slot
    acc = torch.ones(R, 3 * n)
    owed = torch.full((R, 3 * n), 0.5)
    for out, how in ((slots[:, n:2 * n], {}), (acc[:, n:2 * n], {"accumulate": True}),
                     (owed[:, n:2 * n], {"subtract": True})):
        before = common.calls["eager"]
        dequantize_rows(payloads, n, torch.float32, cfg, out=out, impl="eager", **how)
        assert common.calls["eager"] - before == 2 * R  # per row: full buckets, the tail
    for r in range(R):
        assert torch.equal(bits_of(slots[r, n:2 * n]), bits_of(want[r].to(dtype))), r
        assert torch.equal(bits_of(acc[r, n:2 * n]), bits_of(want[r] + 1.0)), r
        assert torch.equal(bits_of(owed[r, n:2 * n]), bits_of(0.5 - want[r])), r
    assert not slots[:, :n].any() and not slots[:, 2 * n:].any()  # nothing outside
    assert torch.equal(acc[:, :n], torch.ones(R, n))
    assert torch.equal(owed[:, 2 * n:], torch.full((R, n), 0.5))
    whole = torch.empty(R, n, dtype=dtype)
    before = common.calls["eager"]
    dequantize_rows(payloads, n, torch.float32, cfg, out=whole, impl="eager")
    assert common.calls["eager"] - before == 2  # contiguous rows: one call of each kind
    assert all(torch.equal(bits_of(whole[r]), bits_of(want[r].to(dtype))) for r in range(R))


@pytest.mark.skipif(DEVICE == "cuda", reason="the torch path is the CPU's")
@pytest.mark.parametrize("bits", [4, 8])  # codes through a byte buffer; straight in
def test_compiled_rows_match_eager(bits):
    """The compiled graphs of rows (a [rows, buckets, B] graph beside the [buckets, B]
    one, the unrolled sum) give the eager bytes and values, and new lengths and row
    strides reuse them (a second size is where AOT autograd would fix the size of the
    payload buffer two mutated views come from, at 8 bits)."""
    from torch._dynamo.utils import counters

    cfg = QuantConfig(bits=bits, bucket_size=B)
    # (rows, n): new lengths, strides and row counts after the first two
    for i, (rows, n) in enumerate(((3, 64 * 5 + 7), (3, 64 * 4), (3, 64 * 9 + 1),
                                   (5, 64 * 7))):
        if i == 2:
            graphs = counters["stats"]["unique_graphs"]
        if i == 3:  # a new row count compiles only the sum (its rows are unrolled)
            assert counters["stats"]["unique_graphs"] == graphs, "a new length compiled"
        x = rows_of(n, torch.float32, gap=8 * i, rows=rows)
        seeds = list(range(1, rows + 1))
        a = torch.empty(rows, packed_nbytes(n, cfg), dtype=torch.uint8)
        b = torch.empty_like(a)
        quantize_rows(x, cfg, seeds, out=a, skip=1, impl="torch")
        quantize_rows(x, cfg, seeds, out=b, skip=1, impl="eager")
        keep = [r for r in range(rows) if r != 1]
        assert torch.equal(a[keep], b[keep])
        a[1] = b[1] = a[0]
        ya, yb = torch.empty(rows, n), torch.empty(rows, n)
        dequantize_rows(a, n, torch.float32, cfg, out=ya, impl="torch")
        dequantize_rows(b, n, torch.float32, cfg, out=yb, impl="eager")
        assert torch.equal(bits_of(ya), bits_of(yb))
        za, zb = x.clone(), x.clone()
        dequantize_rows(a, n, torch.float32, cfg, out=za, subtract=True, impl="torch")
        dequantize_rows(b, n, torch.float32, cfg, out=zb, subtract=True, impl="eager")
        assert torch.equal(bits_of(za), bits_of(zb))
        sa, sb = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        own = x[1].contiguous()
        dequantize_sum(a, n, torch.float32, cfg, own=own, out=sa, skip=1, op="avg", factor=3.0,
                       impl="torch")
        dequantize_sum(b, n, torch.float32, cfg, own=own, out=sb, skip=1, op="avg", factor=3.0,
                       impl="eager")
        assert torch.equal(bits_of(sa), bits_of(sb))


def test_row_calls_refuse_bad_input():
    cfg = QuantConfig(bits=8, bucket_size=B)
    x = torch.randn(R, 100)
    nb = packed_nbytes(100, cfg)
    out = torch.empty(R, nb, dtype=torch.uint8)
    with pytest.raises(TypeError, match="3 ints"):
        quantize_rows(x, cfg, [1, 2], out=out)
    with pytest.raises(ValueError, match="rows of"):
        quantize_rows(x, cfg, [1, 2, 3], out=torch.empty(R, nb + 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="skip"):
        quantize_rows(x, cfg, [1, 2, 3], out=out, skip=3)
    with pytest.raises(TypeError, match="2-D"):
        quantize_rows(x.int(), cfg, [1, 2, 3], out=out)
    quantize_rows(x, cfg, [1, 2, 3], out=out)
    with pytest.raises(ValueError, match=r"\[3, 100\]"):
        dequantize_rows(out, 100, torch.float32, cfg, out=torch.empty(R, 99))
    with pytest.raises(ValueError, match="op must be"):
        dequantize_sum(out, 100, torch.float32, cfg, own=x[0].clone(), out=torch.empty(100),
                       op="max")
    # a header that is not the expected one names the row and the field
    with pytest.raises(ValueError, match="payload row 0: .*dtype"):
        dequantize_rows(out, 100, torch.bfloat16, cfg, out=torch.empty(R, 100))
    bad = out.clone()
    bad[2, 3] = 4  # bits
    with pytest.raises(ValueError, match="payload row 2: .*bits"):
        dequantize_sum(bad, 100, torch.float32, cfg, own=x[0].clone(), out=torch.empty(100),
                       skip=0)
    dequantize_sum(bad, 100, torch.float32, cfg, own=x[0].clone(), out=torch.empty(100),
                   skip=2)  # the skipped row is not read
    first = out.clone()
    first[0, 3] = 4  # a bad row before the skipped one (the other block of rows)
    with pytest.raises(ValueError, match="payload row 0: .*bits"):
        dequantize_sum(first, 100, torch.float32, cfg, own=x[1].clone(), out=torch.empty(100),
                       skip=1)


def test_subtract_needs_fp32_rows_and_not_accumulate():
    cfg = QuantConfig(bits=4, bucket_size=B)
    payloads = torch.stack([oracle.quantize(torch.randn(B), cfg, r) for r in range(2)])
    owed = torch.zeros(2, B)
    with pytest.raises(ValueError, match="accumulate and subtract are exclusive"):
        dequantize_rows(payloads, B, torch.float32, cfg, out=owed, accumulate=True,
                        subtract=True)
    with pytest.raises(TypeError, match="subtract=True needs a float32 out"):
        dequantize_rows(payloads, B, torch.float32, cfg, out=owed.bfloat16(), subtract=True)
    assert not owed.any()  # nothing written by a refused call
