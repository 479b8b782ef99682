"""Every data path produces the same bytes: the readable oracle (qcomm/oracle.py), the
Triton kernels (under TRITON_INTERPRET=1 on CPU, natively on a GPU), the tuned torch
path run eagerly (impl="eager") and compiled (impl="torch").

The three-way grid (oracle == eager == Triton, payload bytes and decoded bits): every
scheme x bits 1, 2, 3, 4, 8 x fp32/bf16/fp16 x sizes 0, 1, B - 1, B + 1, several
buckets, and bits 5, 6, 7 at two sizes; 40-element buckets; L2 norm and nearest
rounding; buckets holding inf, -inf and NaN; tiny (denormal-step) and huge buckets;
the default bucket. The oracle against the eager path alone, on a larger grid:
tests/test_oracle.py."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of qcomm.kernels (triton.jit reads it at decoration).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import qcomm  # noqa: E402
from qcomm import Packed, QuantConfig, dequantize, oracle, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the GPU tier (pytest -m gpu): on CUDA where there is one, else through the interpreter
pytestmark = pytest.mark.gpu
B = 64  # small buckets keep the interpreter fast; sizes below straddle them
SIZES = [0, 1, B - 1, B + 1, 203, 5 * B + 3]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCHEMES = ["minmax", "maxnorm", "nuq"]
# (bits, n): the bits with packing paths of their own (1, 2, 4, 8 whole words or bytes, 3
# byte by byte) at every size; 5, 6 and 7 (byte by byte, like 3) at a partial and a
# multi-bucket size, so bits 1-8 are all covered without 3x the interpreter's cases.
BITS_SIZES = ([(bits, n) for bits in (1, 2, 3, 4, 8) for n in SIZES]
              + [(bits, n) for bits in (5, 6, 7) for n in (B + 1, 5 * B + 3)])


def describe_mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two tensors differ: count and first positions (NaN-aware)."""
    diff = ~((a == b) | (torch.isnan(a.float()) & torch.isnan(b.float())))
    where = diff.nonzero().flatten()[:8].tolist()
    return f"{int(diff.sum())} of {a.numel()} differ, first at {where}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: torch.equal calls -0.0 equal to +0.0 (triton 3.6's
    ``-x`` is ``0 - x``, which turned nuq's negative zeros positive on the GPU)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.reshape(-1).view(ints), b.reshape(-1).view(ints))


def gradient_like(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
    if n > 10:
        x[3] = 0.0
        x[7] = -x[7].abs() - 1.0  # an outlier
    return x.to(dtype).to(DEVICE)


def assert_same_bytes(x, cfg, seed=123):
    """oracle == eager == Triton payloads, byte for byte; returns (eager, Triton) Packed."""
    want = oracle.quantize(x.cpu(), cfg, seed)
    ref = quantize(x.cpu(), cfg, seed=seed, impl="eager")
    tri = quantize(x, cfg, seed=seed, impl="triton")
    got = tri.payload.cpu()
    assert torch.equal(ref.payload, want), "eager vs oracle: " + describe_mismatch(
        ref.payload, want)
    assert torch.equal(got, want), "triton vs oracle: " + describe_mismatch(got, want)
    return ref, tri


def assert_same_values(ref, tri):
    """oracle == eager == Triton decoded values (1-D sources: dequantize's default output,
    the source dtype and shape), bit for bit, NaNs included (qcomm/layout.py's canonical
    bits); returns them."""
    want = oracle.dequantize(ref.payload, ref.config, ref.numel, ref.dtype)
    eager = dequantize(ref, impl="eager")
    got = dequantize(tri, impl="triton").cpu()
    assert got.dtype == ref.dtype
    assert same_bits(eager, want), "eager vs oracle: " + describe_mismatch(eager, want)
    assert same_bits(got, want), "triton vs oracle: " + describe_mismatch(got, want)
    return want


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bits, n", BITS_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_oracle(scheme, bits, dtype, n):
    x = gradient_like(n, dtype, seed=n + bits)
    cfg = QuantConfig(bits=bits, bucket_size=B, scheme=scheme)
    assert_same_values(*assert_same_bytes(x, cfg))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_oracle_unpaired_buckets(scheme, bits, dtype):
    """Buckets whose half is not whole tile rows (40 elements: 5 rows of 8, so bf16 and
    8-bit) take the kernel's one-tile path, where each element selects its pair's hash;
    fp32 at 2 and 4 bits (rows of 4) still pairs. Both must give the oracle's bytes."""
    x = gradient_like(3 * 40 + 13, dtype, seed=bits)
    assert_same_values(*assert_same_bytes(x, QuantConfig(bits=bits, bucket_size=40,
                                                         scheme=scheme)))


@pytest.mark.parametrize("scheme, bits", [("minmax", 5), ("maxnorm", 6), ("nuq", 7),
                                          ("nuq", 4), ("maxnorm", 2)])
@pytest.mark.parametrize("norm, rounding", [("l2", "stochastic"), ("max", "nearest"),
                                            ("l2", "nearest")])
def test_triton_matches_oracle_norms_and_rounding(scheme, bits, norm, rounding):
    x = gradient_like(3 * B + 5, torch.float32, seed=bits)
    assert_same_values(*assert_same_bytes(x, QuantConfig(
        bits=bits, bucket_size=B, scheme=scheme, norm=norm, rounding=rounding)))


def test_triton_default_bucket_and_nonfinite():
    x = gradient_like(2 * 1024 + 17, torch.float32)
    x[1500] = float("nan")
    x[10] = float("-inf")
    ref, tri = assert_same_bytes(x, QuantConfig())
    got = assert_same_values(ref, tri)
    assert torch.isnan(got[:2048]).all() and torch.isfinite(got[2048:]).all()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bits, dtype", [(4, torch.float32), (1, torch.bfloat16),
                                         (7, torch.float16)], ids=str)
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_triton_nonfinite_buckets(scheme, bits, dtype, rounding):
    """A bucket holding inf, -inf or NaN: NaN meta, zero codes (nuq keeps the sign bits of
    negative elements), decoded to NaN; the buckets around it are untouched."""
    x = gradient_like(5 * B + 3, dtype, seed=bits)
    x[B + 5], x[2 * B + 60], x[3 * B] = float("inf"), float("-inf"), float("nan")
    x[5 * B + 1] = float("inf")  # in the partial last bucket
    cfg = QuantConfig(bits=bits, bucket_size=B, scheme=scheme, rounding=rounding)
    ref, tri = assert_same_bytes(x, cfg)
    got = assert_same_values(ref, tri)
    bad = torch.zeros(5 * B + 3, dtype=torch.bool)
    bad[B:4 * B] = bad[5 * B:] = True
    assert torch.equal(torch.isnan(got), bad)
    assert torch.isnan(ref.meta()).sum() == (3 + 1) * (2 if scheme == "minmax" else 1)


# Canonical zeros and NaNs (qcomm/layout.py): every path writes the same bytes where the
# hardware would pick its own sign of zero or NaN bits. Literal bytes, every path.
PATHS = ["oracle", "eager", "triton"]  # the compiled path: test_compiled_torch_path_...
NAN_BITS = [(torch.float32, 0x7FC00000), (torch.bfloat16, 0x7FC0), (torch.float16, 0x7E00)]


def quantize_on(path: str, x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """The payload (on the CPU) of ``x`` quantized by ``path`` (seed 0)."""
    if path == "oracle":
        return oracle.quantize(x.cpu(), cfg, 0)
    device = DEVICE if path == "triton" else "cpu"
    return quantize(x.to(device), cfg, seed=0, impl=path).payload.cpu()


def bits_of(t: torch.Tensor) -> list[int]:
    """Each element's bits as an unsigned integer."""
    ints = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return (t.cpu().view(ints).to(torch.int64) & ((1 << 8 * t.element_size()) - 1)).tolist()


@pytest.fixture(params=[None, 8], ids=["lanes-here", "lanes-8"])
def lanes(request, monkeypatch):
    """The eager path's 16-bit decodes as this machine runs them, and as an 8-lane (AVX2)
    one does (stored straight from the graph where an AVX-512 one stages through fp32)."""
    from qcomm.cpu import dequantize as cpu_dequantize

    if request.param is not None:
        monkeypatch.setattr(cpu_dequantize, "vector_lanes", lambda: request.param)
    cpu_dequantize.lane_group.cache_clear()
    yield request.param
    cpu_dequantize.lane_group.cache_clear()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("first", [0.0, -0.0], ids=["plus-first", "minus-first"])
def test_zero_meta_words_are_plus_zero(path, first):
    """Buckets holding 0.0 and -0.0 in either order (paired halves: the kernels combine
    the halves before reducing): a zero min is +0.0, and a bucket of zeros has min and
    step +0.0 (a max of -0.0 minus a min of +0.0 would be -0.0), bytes 00 00 00 00."""
    other = -first
    half = B // 2
    min_zero = torch.tensor([first] + [1.0] * (half - 1) + [other] + [2.0] * (half - 1))
    zeros = torch.tensor([first, other] * half)
    x = torch.cat([min_zero, zeros, -min_zero])  # the last: max zero, min -2.0
    cfg = QuantConfig(bits=4, bucket_size=B)
    meta = quantize_on(path, x, cfg)[32:32 + 3 * 8].view(torch.float32)
    assert bits_of(meta[:4]) == [0, bits_of(meta[1:2])[0], 0, 0], bits_of(meta)
    assert meta[1].item() == pytest.approx(2 / 15) and meta[4].item() == -2.0
    assert torch.equal(quantize_on(path, x, cfg), oracle.quantize(x, cfg, 0))


def nan_source(case: str) -> tuple[torch.Tensor, QuantConfig, torch.Tensor]:
    """(x, config, where the decode is NaN): a bucket holding a NaN (NaN meta: the NaN
    comes from arithmetic on it), or an L2 norm past fp32's range (meta inf; nuq's level
    0 times inf is NaN, then its sign bit set: x86 makes 0xFFC00000, then -NaN)."""
    if case == "nan-bucket":
        x = gradient_like(2 * B, torch.float32).cpu()
        x[3] = float("nan")
        return x, QuantConfig(bits=4, bucket_size=B), torch.arange(2 * B) < B
    x = torch.tensor([3e38, -3e38] * B)
    return x, QuantConfig(bits=4, bucket_size=B, scheme="nuq", norm="l2"), x == x


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype, nan", NAN_BITS, ids=lambda v: hex(v) if isinstance(v, int)
                         else str(v))
@pytest.mark.parametrize("case", ["nan-bucket", "nuq-l2-overflow"])
def test_decoded_nans_are_canonical(path, dtype, nan, case, lanes):
    x, cfg, where = nan_source(case)
    payload = oracle.quantize(x, cfg, 0)
    if path == "oracle":
        got = oracle.dequantize(payload, cfg, x.numel(), dtype)
    else:
        device = DEVICE if path == "triton" else "cpu"
        out = torch.empty(x.numel(), dtype=dtype, device=device)
        got = dequantize(Packed(payload.to(device), x.numel(), torch.float32, cfg), out=out,
                         impl=path).cpu()
    assert torch.equal(torch.isnan(got), where)
    assert set(bits_of(got[where])) == {nan}, sorted({hex(b) for b in bits_of(got[where])})


@pytest.mark.parametrize("path", ["eager", "triton"])
def test_sums_write_canonical_nans(path, lanes):
    """NaNs the output already holds (accumulate), the own chunk brings (a reduce-scatter's
    sum) or a decode makes (a state update), whatever their bits: the canonical NaN, the
    oracle's values bit for bit."""
    device = DEVICE if path == "triton" else "cpu"
    x, cfg, where = nan_source("nan-bucket")
    n = x.numel()
    p = oracle.quantize(x, cfg, 0)
    finite = oracle.quantize(gradient_like(n, torch.float32, seed=2).cpu(), cfg, 0)
    acc = torch.ones(n)
    other_nans = torch.tensor([-0x400000, 0x7FC00001], dtype=torch.int32)  # 0xFFC00000, ...
    acc.view(torch.int32)[[0, B + 1]] = other_nans
    want = oracle.canonical(acc + oracle.dequantize(finite, cfg, n))
    got = acc.to(device)
    dequantize(Packed(finite.to(device), n, torch.float32, cfg), out=got, accumulate=True,
               impl=path)
    assert bits_of(got) == bits_of(want)
    assert bits_of(want[[0, B + 1]]) == [0x7FC00000] * 2
    own = acc.to(torch.bfloat16)  # its NaNs as torch's cast makes them (0xFFFF here)
    rows = torch.stack([finite, finite, p])
    want = oracle.dequantize_sum([finite, None, p], cfg, n, own, dtype=torch.bfloat16)
    got = qcomm.dequantize_sum(rows.to(device), n, torch.float32, cfg, own=own.to(device),
                               out=torch.empty(n, dtype=torch.bfloat16, device=device),
                               skip=1, impl=path)
    assert bits_of(got) == bits_of(want) and set(bits_of(want[where])) == {0x7FC0}
    state_cfg = QuantConfig(bits=8, bucket_size=B, rounding="nearest")
    state = oracle.quantize(gradient_like(n, torch.float32, seed=3).cpu(), state_cfg, 0)
    want, new = oracle.update_state(state, p, n, state_cfg, cfg, dtype=torch.float16)
    rows = state.view(1, -1).to(device)
    got = qcomm.update_state_rows(rows, p.view(1, -1).to(device), n, state_cfg, cfg,
                                  out=torch.empty(1, n, dtype=torch.float16, device=device),
                                  impl=path)
    assert bits_of(got[0]) == bits_of(want) and set(bits_of(want[where])) == {0x7E00}
    assert torch.equal(rows[0].cpu(), new)


@pytest.mark.parametrize("scheme", ["minmax", "nuq"])
def test_triton_accumulate_and_cast(scheme):
    x = gradient_like(4 * B + 9, torch.float32)
    cfg = QuantConfig(bits=4, bucket_size=B, scheme=scheme)
    p = quantize(x, cfg, impl="triton")
    acc = torch.linspace(-1, 1, x.numel(), device=DEVICE)
    on_cpu = Packed(p.payload.cpu(), p.numel, p.dtype, p.config)  # eager runs on CPU
    decoded = oracle.dequantize(on_cpu.payload, cfg, p.numel)
    assert same_bits(dequantize(on_cpu, impl="eager"), decoded)
    want = acc.cpu() + decoded
    eager_acc = acc.cpu().clone()  # (.cpu() of a CPU tensor is that tensor)
    dequantize(on_cpu, out=eager_acc, accumulate=True, impl="eager")
    assert same_bits(eager_acc, want)
    dequantize(p, out=acc, accumulate=True, impl="triton")
    assert same_bits(acc.cpu(), want)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(x.numel(), dtype=dtype, device=DEVICE)
        dequantize(p, out=out, impl="triton")
        cast = oracle.dequantize(on_cpu.payload, cfg, p.numel, dtype)
        assert same_bits(cast, decoded.to(dtype))  # fp32 decode, then one cast
        assert same_bits(out.cpu(), cast)
        assert same_bits(dequantize(on_cpu, impl="eager").to(dtype), cast)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bits, norm, rounding", [(4, "max", "stochastic"),
                                                  (3, "l2", "nearest")])
def test_triton_tiny_and_huge_buckets(scheme, bits, norm, rounding):
    """Steps below 2^-100 (denormal buckets) take the 2^64 boost; huge ones do not.
    fp32 only: the Triton interpreter's bf16 -> fp32 conversion mangles bf16 denormals
    (a GPU converts them exactly; test_oracle.py has them against the eager path)."""
    x = gradient_like(4 * B, torch.float32, seed=11).cpu()
    x[:B] *= 1e-39
    x[B:2 * B] *= 1e-43
    x[2 * B:3 * B] *= 1e30
    cfg = QuantConfig(bits=bits, bucket_size=B, scheme=scheme, norm=norm, rounding=rounding)
    assert_same_values(*assert_same_bytes(x.to(DEVICE), cfg))


@pytest.mark.parametrize("bits", [2, 4, 8, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_payload_offsets(bits, dtype):
    """A payload 4 bytes into a buffer (codes as whole words still aligned) gives the
    same bytes and writes nothing outside it; 1 or 2 bytes in is a clear error."""
    from qcomm.layout import packed_nbytes

    x = gradient_like(3 * B + 21, dtype, seed=bits)
    cfg = QuantConfig(bits=bits, bucket_size=B)
    nbytes = packed_nbytes(x.numel(), cfg)
    buf = torch.zeros(nbytes + 8, dtype=torch.uint8, device=DEVICE)
    out = buf[4:4 + nbytes]
    tri = quantize(x, cfg, seed=4, impl="triton", out=out)
    ref = quantize(x.cpu(), cfg, seed=4, impl="eager")
    assert torch.equal(tri.payload.cpu(), ref.payload)
    assert torch.equal(ref.payload, oracle.quantize(x, cfg, 4))
    assert not buf[:4].any() and not buf[4 + nbytes:].any(), "wrote outside out"
    assert same_bits(dequantize(tri, impl="triton").cpu(), dequantize(ref, impl="eager"))
    for offset in (1, 2):
        with pytest.raises(ValueError, match="divisible by 4"):
            quantize(x, cfg, impl="triton", out=buf[offset:offset + nbytes])
        moved = buf[offset:offset + nbytes]
        moved.copy_(ref.payload.to(DEVICE))
        with pytest.raises(ValueError, match="divisible by 4"):
            dequantize(Packed(moved, x.numel(), dtype, cfg), impl="triton")


def test_triton_input_untouched():
    x = gradient_like(300, torch.bfloat16)
    before = x.clone()
    p = quantize(x, QuantConfig(bits=3, bucket_size=B), impl="triton")
    assert torch.equal(x, before)
    payload = p.payload.clone()
    dequantize(p, impl="triton")
    assert torch.equal(p.payload, payload)


@pytest.mark.parametrize("warps", [1, 4])
def test_warps_reach_the_launch_with_the_same_bytes(warps, monkeypatch):
    """The codec's ``warps=`` (a group's CommConfig.triton_warps) is what every launcher
    asks num_warps for, 0 by bucket size; the bytes and values stay the same (on a GPU
    the programs really run that many warps; the interpreter ignores it)."""
    from qcomm.kernels import common

    from qcomm import dequantize_rows, quantize_rows

    asked = []
    real = common.num_warps
    monkeypatch.setattr(common, "num_warps", lambda b, w=0: asked.append(w) or real(b, w))
    cfg = QuantConfig(bits=4, bucket_size=B)
    x = gradient_like(5 * B + 3, torch.float32)
    want = quantize(x, cfg, seed=5, impl="triton")
    got = quantize(x, cfg, seed=5, impl="triton", warps=warps)
    assert torch.equal(got.payload, want.payload)
    assert same_bits(dequantize(got, impl="triton", warps=warps), dequantize(want, impl="triton"))
    rows = torch.empty(2, got.nbytes, dtype=torch.uint8, device=DEVICE)
    quantize_rows(torch.stack([x, x]), cfg, [5, 5], out=rows, impl="triton", warps=warps)
    assert torch.equal(rows[1], want.payload)
    out = torch.empty(2, x.numel(), device=DEVICE)
    dequantize_rows(rows, x.numel(), torch.float32, cfg, out=out, impl="triton", warps=warps)
    assert same_bits(out[0], dequantize(want, impl="triton"))
    assert asked == [0, warps, warps, 0, warps, warps, 0]
    assert real(B) == 1 and real(8192) == 8 and real(8192, warps) == warps


def with_specials(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """``x`` with its first bucket zeros of both signs (-0.0 first: canonical +0.0 meta)
    and a NaN in its last element (NaN meta, canonical NaNs decoded)."""
    x = x.clone()
    first = x[:bucket_size]
    first.copy_(torch.where(torch.arange(first.numel()) % 3 == 0, -0.0, 0.0))
    x[-1] = float("nan")
    return x


# The compiled CPU path: one compile per configuration (~10-25 s each on 2 cores), so a
# few representative ones; the eager reference stands for the rest. CPU tensors only:
# redundant on a GPU, where the GPU tier skips them (the CPU suite runs them).
@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU path's compiles: the CPU suite's")
@pytest.mark.parametrize(
    "cfg, dtype",
    [
        (QuantConfig(bits=8), torch.float32),
        (QuantConfig(bits=4), torch.float32),
        (QuantConfig(bits=4, scheme="nuq"), torch.bfloat16),
        (QuantConfig(bits=3, scheme="maxnorm", norm="l2", bucket_size=256), torch.float16),
        # 16-bit 8-bit codes come back from the graph and are copied into the payload's
        # halves; half of a 40-element bucket is not a whole vector
        (QuantConfig(bits=8, bucket_size=40), torch.bfloat16),
    ],
    ids=["minmax8-fp32", "minmax4-fp32", "nuq4-bf16", "maxnorm3-l2-fp16", "minmax8-b40-bf16"],
)
def test_compiled_torch_path_matches_eager(cfg, dtype):
    from torch._dynamo.utils import counters

    # impl="torch" compiles whatever QCOMM_COMPILE says (a path named is the path run)
    # Dynamic lengths, with and without a partial last bucket: whole-bucket sizes after a
    # first compile once hit an Inductor lowering error (a reshape of a symbolic arange).
    # The first six lengths reach every graph (one bucket, full or partial; several);
    # the last two are new lengths of each kind and must compile nothing (the partial
    # bucket's graph once recompiled for each new tail length, a lone bucket's for nb=1).
    for i, n in enumerate((512, 256, 515, 2048, 1024, 2051, 8192, 5000)):
        if i == 6:
            graphs = counters["stats"]["unique_graphs"]
        x = with_specials(gradient_like(n, dtype, seed=n).cpu(), cfg.bucket_size)
        a = quantize(x, cfg, seed=9, impl="torch")
        b = quantize(x, cfg, seed=9, impl="eager")
        assert torch.equal(a.payload, b.payload), describe_mismatch(a.payload, b.payload)
        want = oracle.quantize(x, cfg, 9)
        assert torch.equal(a.payload, want), describe_mismatch(a.payload, want)
        ya = dequantize(a, impl="torch")
        yb = dequantize(b, impl="eager")
        assert same_bits(ya, yb), describe_mismatch(ya, yb)
        assert same_bits(ya, oracle.dequantize(want, cfg, n, dtype))
        acc, acc_eager = torch.ones(n), torch.ones(n)
        dequantize(a, out=acc, accumulate=True, impl="torch")
        dequantize(b, out=acc_eager, accumulate=True, impl="eager")
        assert same_bits(acc, acc_eager)
        assert same_bits(acc, oracle.canonical(1.0 + oracle.dequantize(want, cfg, n)))
    assert counters["stats"]["unique_graphs"] == graphs, "a new length compiled a new graph"


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every kernel test compiles its "
                    "kernels for real")
def test_kernels_compile_for_hopper():
    """The full Triton pipeline down to an sm_90 cubin, which the interpreter never runs:
    a kernel that interprets fine can still fail to compile (it did, on triton 3.6)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_gpu.py")
    run = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "24 kernels compiled for sm_90" in run.stdout
    # --digest: one PTX digest a kernel, the same for the same code
    digests = [subprocess.run([sys.executable, str(script), "90", "--digest"], env=env,
                              capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert digests[0].returncode == 0, digests[0].stderr[-4000:]
    assert digests[0].stdout == digests[1].stdout
    assert digests[0].stdout.count("PTX digests") == 6
