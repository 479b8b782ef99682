"""CPU quantize throughput for side-by-side runs of two trees (run once per tree,
alternating, from /tmp with PYTHONPATH set to the tree; docs/cpu-path.md has each
command).
G elements/s, best of a few calls after one warm-up, 1 thread, the compiled path.

    side_by_side.py chunks          every dtype, size, scheme and bits of the chunking
                                    comparison, as one JSON line
    side_by_side.py fp32-8bit LABEL minmax, maxnorm, nuq 8-bit from fp32 at 2^24
    side_by_side.py nuq-bf16 LABEL  nuq 8/4/2-bit from bf16 at 2^24 and 2^26
    side_by_side.py bf16 LABEL SCHEME BITS
                                    SCHEME at BITS (a comma list) from bf16, 2^24 and
                                    2^26, best of 5 calls
    side_by_side.py grid DTYPE LOG2 BITS SCHEMES
                                    every SCHEME (a comma list) at every BITS from
                                    DTYPE at 2^LOG2, best of 8 calls, one JSON line
                                    (what alternate.py runs)
    side_by_side.py latency DTYPE LOG2S BITS SCHEMES
                                    median us per call of quantize (into a payload
                                    buffer) and dequantize (into a tensor), 200 calls
                                    after 3, every SCHEME x BITS x 2^LOG2 (comma
                                    lists), one JSON line (alternate.py runs it too)
    side_by_side.py dynamo          where the time of one small quantize call goes
                                    (fp32, 2^11 elements, 8-bit min-max): the whole
                                    call, its compiled graph called through Dynamo,
                                    the same graph called directly, median us
    side_by_side.py overhead        median us per call of a toy compiled graph shaped
                                    like the codec's (4 tensors written in place, a
                                    0-d tensor, dynamic first dimension): torch's own
                                    per-call cost, no qcomm code in it
"""

import functools
import json
import sys
import time

import torch

from qcomm import QuantConfig, dequantize, packed_nbytes, quantize


def rate(x: torch.Tensor, cfg: QuantConfig, calls: int) -> float:
    """G elements/s of the best of ``calls`` quantize calls into one payload buffer."""
    out = torch.empty(packed_nbytes(x.numel(), cfg), dtype=torch.uint8)
    quantize(x, cfg, out=out)
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        quantize(x, cfg, out=out)
        best = min(best, time.perf_counter() - t)
    return x.numel() / best / 1e9


def grid(dtype: str, lg: str, bits: str, schemes: str) -> None:
    """Every scheme x bits from ``dtype`` at 2^``lg``, best of 8 calls, one JSON line."""
    torch.set_num_threads(1)
    x = torch.randn(1 << int(lg)).to(getattr(torch, dtype))
    print(json.dumps({f"{dtype} 2^{lg} {s}{b}": rate(x, QuantConfig(bits=b, scheme=s), 8)
                      for s in schemes.split(",") for b in map(int, bits.split(","))}))


def _median_us(call, calls: int = 200) -> float:
    """Median us of ``calls`` calls of ``call()`` after 3 untimed ones."""
    for _ in range(3):
        call()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[calls // 2] * 1e6


def latency(dtype: str, lgs: str, bits: str, schemes: str) -> None:
    """Median us per quantize and per dequantize call, one JSON line."""
    torch.set_num_threads(1)
    res = {}
    for lg in map(int, lgs.split(",")):
        x = torch.randn(1 << lg).to(getattr(torch, dtype))
        y = torch.empty_like(x)
        for s in schemes.split(","):
            for b in map(int, bits.split(",")):
                cfg = QuantConfig(bits=b, scheme=s)
                out = torch.empty(packed_nbytes(x.numel(), cfg), dtype=torch.uint8)
                packed = quantize(x, cfg, out=out)
                res[f"{dtype} 2^{lg} {s}{b} quantize"] = _median_us(
                    functools.partial(quantize, x, cfg, out=out))
                res[f"{dtype} 2^{lg} {s}{b} dequantize"] = _median_us(
                    functools.partial(dequantize, packed, out=y))
    print(json.dumps(res))


def main(mode: str, label: str = "", scheme: str = "minmax", bits: str = "8,4") -> None:
    torch.set_num_threads(1)
    if mode == "chunks":
        res = {}
        for dt in (torch.float32, torch.bfloat16):
            for lg in (24, 26):
                x = torch.randn(1 << lg).to(dt)
                for scheme in ("minmax", "nuq"):
                    for bits in (2, 4, 8):
                        res[f"{str(dt)[6:]} 2^{lg} {scheme}{bits}"] = rate(
                            x, QuantConfig(bits=bits, scheme=scheme), 3)
        print(json.dumps(res))
    elif mode == "fp32-8bit":
        x = torch.randn(1 << 24)
        print(f"{label:5s}", *(f"{s}8 {rate(x, QuantConfig(bits=8, scheme=s), 10):.3f}"
                               for s in ("minmax", "maxnorm", "nuq")))
    elif mode == "nuq-bf16":
        res = []
        for lg in (24, 26):
            x = torch.randn(1 << lg).bfloat16()
            for bits in (8, 4, 2):
                r = rate(x, QuantConfig(bits=bits, scheme="nuq"), 3 if lg == 26 else 6)
                res.append(f"2^{lg}/{bits}: {r:.3f}")
        print(f"{label:5s}", *res)
    elif mode == "bf16":
        res = []
        for lg in (24, 26):
            x = torch.randn(1 << lg).bfloat16()
            for b in map(int, bits.split(",")):
                res.append(f"2^{lg}/{b} {rate(x, QuantConfig(bits=b, scheme=scheme), 5):.3f}")
        print(label, *res)
    elif mode == "dynamo":
        from qcomm.constants import seed_key
        from qcomm.cpu import compiled
        from qcomm.cpu import quantize as cpu_quantize
        from qcomm.cpu.common import index_tensor

        n, cfg = 2048, QuantConfig(bits=8)
        x = torch.randn(n)
        out = torch.empty(packed_nbytes(n, cfg), dtype=torch.uint8)
        p = quantize(x, cfg, out=out)  # compiles, and its signatures are checked
        run = compiled.compiled(cpu_quantize.encode_buckets, bits=8, bucket_size=1024, sid=0,
                                l2=False, stochastic=True, wide=False)
        (through_dynamo,), (graph,) = run.functions(), run.graphs()
        c = p.codes().view(2, 1024)
        args = (x.view(2, 1024), p.meta().view(2, 2), c[:, :512], c[:, 512:],
                cpu_quantize.positions(512, x.device))
        kwargs = dict(first=index_tensor(0, x.device), divisor=torch.tensor(255.0),
                      key=torch.scalar_tensor(seed_key(0), dtype=torch.int64))
        with torch.no_grad():
            res = {"quantize": _median_us(functools.partial(quantize, x, cfg, out=out), 2000),
                   "graph through Dynamo": _median_us(
                       functools.partial(through_dynamo, *args, **kwargs), 2000),
                   "graph directly": _median_us(
                       functools.partial(graph.direct, args, kwargs), 2000)}
        print(json.dumps({k: round(v, 1) for k, v in res.items()}))
    elif mode == "overhead":
        def toy(a, b, c, d, k):
            c.copy_(a * 2 + k)
            d.copy_(b + k)

        args = [torch.randn(8, 16), torch.randn(8, 16), torch.empty(8, 16),
                torch.empty(8, 16), torch.tensor(3.0)]
        for t in args[:4]:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        fn = torch.compile(toy, dynamic=False)
        for _ in range(20):
            fn(*args)
        ts = []
        for _ in range(2000):
            t = time.perf_counter()
            fn(*args)
            ts.append(time.perf_counter() - t)
        print(f"compiled toy graph: median {sorted(ts)[len(ts) // 2] * 1e6:.0f} us per call")
    else:
        raise SystemExit(f"unknown mode {mode!r}: chunks, fp32-8bit, nuq-bf16, bf16, grid "
                         "or overhead")


if __name__ == "__main__":
    if sys.argv[1:2] == ["grid"]:
        grid(*sys.argv[2:])
    elif sys.argv[1:2] == ["latency"]:
        latency(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
