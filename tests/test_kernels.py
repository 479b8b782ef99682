"""Every data path produces the same bytes: Triton kernels (under TRITON_INTERPRET=1 on
CPU, natively on a GPU), the compiled torch path, and the eager reference."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of qcomm.kernels (triton.jit reads it at decoration).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from qcomm import Packed, QuantConfig, dequantize, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B = 64  # small buckets keep the interpreter fast; sizes below straddle them
SIZES = [0, 1, B - 1, B + 1, 203, 5 * B + 3]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


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
    ref = quantize(x.cpu(), cfg, seed=seed, impl="eager")
    tri = quantize(x, cfg, seed=seed, impl="triton")
    got = tri.payload.cpu()
    assert torch.equal(got, ref.payload), describe_mismatch(got, ref.payload)
    return ref, tri


@pytest.mark.parametrize("scheme", ["minmax", "maxnorm", "nuq"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_triton_matches_reference(scheme, bits, dtype, n):
    x = gradient_like(n, dtype, seed=n + bits)
    cfg = QuantConfig(bits=bits, bucket_size=B, scheme=scheme)
    ref, tri = assert_same_bytes(x, cfg)
    want = dequantize(ref, impl="eager")
    got = dequantize(tri, impl="triton").cpu()
    assert got.dtype == dtype
    assert same_bits(got, want), describe_mismatch(got, want)


@pytest.mark.parametrize("scheme", ["minmax", "maxnorm", "nuq"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_reference_unpaired_buckets(scheme, bits, dtype):
    """Buckets whose half is not whole tile rows (40 elements: 5 rows of 8, so bf16 and
    8-bit) take the kernel's one-tile path, where each element selects its pair's hash;
    fp32 at 2 and 4 bits (rows of 4) still pairs. Both must give the reference's bytes."""
    x = gradient_like(3 * 40 + 13, dtype, seed=bits)
    assert_same_bytes(x, QuantConfig(bits=bits, bucket_size=40, scheme=scheme))


@pytest.mark.parametrize("scheme, bits", [("minmax", 5), ("maxnorm", 6), ("nuq", 7),
                                          ("nuq", 4), ("maxnorm", 2)])
@pytest.mark.parametrize("norm, rounding", [("l2", "stochastic"), ("max", "nearest"),
                                            ("l2", "nearest")])
def test_triton_matches_reference_norms_and_rounding(scheme, bits, norm, rounding):
    x = gradient_like(3 * B + 5, torch.float32, seed=bits)
    assert_same_bytes(x, QuantConfig(bits=bits, bucket_size=B, scheme=scheme, norm=norm,
                                     rounding=rounding))


def test_triton_default_bucket_and_nonfinite():
    x = gradient_like(2 * 1024 + 17, torch.float32)
    x[1500] = float("nan")
    x[10] = float("-inf")
    ref, tri = assert_same_bytes(x, QuantConfig())
    got = dequantize(tri, impl="triton").cpu()
    want = dequantize(ref, impl="eager")
    assert torch.isnan(got[:2048]).all() and torch.isfinite(got[2048:]).all()
    assert same_bits(got[2048:], want[2048:])


@pytest.mark.parametrize("scheme", ["minmax", "nuq"])
def test_triton_accumulate_and_cast(scheme):
    x = gradient_like(4 * B + 9, torch.float32)
    cfg = QuantConfig(bits=4, bucket_size=B, scheme=scheme)
    p = quantize(x, cfg, impl="triton")
    acc = torch.linspace(-1, 1, x.numel(), device=DEVICE)
    on_cpu = Packed(p.payload.cpu(), p.numel, p.dtype, p.config)  # the oracle runs on CPU
    want = acc.cpu() + dequantize(on_cpu, impl="eager")
    dequantize(p, out=acc, accumulate=True, impl="triton")
    assert same_bits(acc.cpu(), want)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(x.numel(), dtype=dtype, device=DEVICE)
        dequantize(p, out=out, impl="triton")
        assert same_bits(out.cpu(), dequantize(on_cpu, impl="eager").to(dtype))


@pytest.mark.parametrize("scheme", ["minmax", "maxnorm", "nuq"])
def test_triton_tiny_and_huge_buckets(scheme):
    """Steps below 2^-100 (denormal buckets) take the 2^64 boost; huge ones do not."""
    x = gradient_like(4 * B, torch.float32, seed=11).cpu()
    x[:B] *= 1e-39
    x[B:2 * B] *= 1e-43
    x[2 * B:3 * B] *= 1e30
    assert_same_bytes(x.to(DEVICE), QuantConfig(bits=4, bucket_size=B, scheme=scheme))


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


# The compiled CPU path: one compile per configuration (~10-25 s each on 2 cores), so a
# few representative ones; the eager reference stands for the rest.
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
def test_compiled_torch_path_matches_eager(cfg, dtype, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("QCOMM_COMPILE", "1")
    # Dynamic lengths, with and without a partial last bucket: whole-bucket sizes after a
    # first compile once hit an Inductor lowering error (a reshape of a symbolic arange).
    # The first six lengths reach every graph (one bucket, full or partial; several);
    # the last two are new lengths of each kind and must compile nothing (the partial
    # bucket's graph once recompiled for each new tail length, a lone bucket's for nb=1).
    for i, n in enumerate((512, 256, 515, 2048, 1024, 2051, 8192, 5000)):
        if i == 6:
            graphs = counters["stats"]["unique_graphs"]
        x = gradient_like(n, dtype, seed=n).cpu()
        a = quantize(x, cfg, seed=9, impl="torch")
        b = quantize(x, cfg, seed=9, impl="eager")
        assert torch.equal(a.payload, b.payload), describe_mismatch(a.payload, b.payload)
        ya = dequantize(a, impl="torch")
        yb = dequantize(b, impl="eager")
        assert same_bits(ya, yb), describe_mismatch(ya, yb)
        acc, acc_eager = torch.ones(n), torch.ones(n)
        dequantize(a, out=acc, accumulate=True, impl="torch")
        dequantize(b, out=acc_eager, accumulate=True, impl="eager")
        assert same_bits(acc, acc_eager)
    assert counters["stats"]["unique_graphs"] == graphs, "a new length compiled a new graph"


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
    assert "12 kernels compiled for sm_90" in run.stdout
