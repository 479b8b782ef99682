"""How close can Inductor's CPU code get to memcpy here? Toy graphs simpler than any
quantizer, timed side by side with memcpy and the codec's own 8-bit fp32 quantize, all
in one process, in alternating rounds (this VM drifts 10-30% between runs of a point).

    inductor_ceiling.py ROUNDS OUT.json [THREADS]   (from /tmp, PYTHONPATH = the tree)

An OUT.json without a folder goes to ``bench/results/cpu-amd-epyc-2c-avx2/``.

2^24 fp32 elements, THREADS torch threads (default 1). Each point: GB/s of bytes read + written (as
``python -m bench codec`` counts them), the median over rounds of the best of 5 calls
per round, and that as a fraction of the same rounds' memcpy. The toys:

- ``cast``: ``x.to(uint8)`` into a preallocated buffer: read 4 bytes, write 1; no math.
- ``affine``: ``floor(x * a + b).to(uint8)``: one multiply-add and a floor more.
- ``hash``: ``affine`` plus fmix32 of the element index per element (the codec hashes
  once per two elements).
- ``bucket``: per 1024-element bucket min and max, then ``floor((x - min) / step + 0.5)``
  to uint8, and the two per-bucket values stored: a min-max 8-bit quantize, nearest,
  without non-finite handling, the codec's layout or a uniform.

Any quantizer reads each bucket, reduces it and writes codes, so ``bucket`` bounds what
the codec's compiled CPU path can reach on this machine.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from qcomm import QuantConfig, packed_nbytes, quantize

N, B = 1 << 24, 1024
RESULTS = Path(__file__).resolve().parent.parent / "results" / "cpu-amd-epyc-2c-avx2"


def _srl(h, s):
    return (h >> s) & ((1 << (32 - s)) - 1)


def cast(x, o):
    o.copy_(x.to(torch.uint8))


def affine(x, o):
    o.copy_(torch.floor(x * 0.5 + 0.25).to(torch.uint8))


def hashed(x, o):
    h = torch.arange(x.numel(), dtype=torch.int32) * -1640531535 + 12345
    h = h ^ _srl(h, 16)
    h = h * -2048144789
    h = h ^ _srl(h, 13)
    h = h * -1028477387
    h = h ^ _srl(h, 16)
    u = (h & 0xFFFF).to(torch.float32) * (1.0 / 65536.0)
    o.copy_(torch.floor(x * 0.5 + u).to(torch.uint8))


def bucket(x, o, m):
    nb = x.shape[0]
    lo = torch.amin(torch.amin(x.view(nb, B // 16, 16), dim=1), dim=1, keepdim=True)
    hi = torch.amax(torch.amax(x.view(nb, B // 16, 16), dim=1), dim=1, keepdim=True)
    step = (hi - lo) / 255.0
    inv = torch.where(step > 0, 1.0 / step, 0.0)
    o.copy_(torch.floor((x - lo) * inv + 0.5).to(torch.uint8))
    m.copy_(torch.cat([lo, step], dim=1))


def best(fn, calls: int = 5) -> float:
    t_best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        t_best = min(t_best, time.perf_counter() - t)
    return t_best


def main(rounds: int, out: str, threads: int = 1) -> None:
    torch.set_num_threads(threads)
    x = torch.randn(N)
    y, o8 = torch.empty(N), torch.empty(N, dtype=torch.uint8)
    xb, ob, mb = x.view(-1, B), o8.view(-1, B), torch.empty(N // B, 2)
    points = {"memcpy": (lambda: y.copy_(x), 8 * N)}
    for name, fn in (("cast", cast), ("affine", affine), ("hash", hashed)):
        compiled = torch.compile(fn, dynamic=False)
        points[name] = (lambda c=compiled: c(x, o8), 5 * N)
    compiled_bucket = torch.compile(bucket, dynamic=False)
    points["bucket"] = (lambda: compiled_bucket(xb, ob, mb), 5 * N + 8 * (N // B))
    for rounding in ("nearest", "stochastic"):
        for scheme in ("minmax", "maxnorm"):
            cfg = QuantConfig(bits=8, scheme=scheme, rounding=rounding)
            buf = torch.empty(packed_nbytes(N, cfg), dtype=torch.uint8)
            points[f"qcomm {scheme} 8 {rounding}"] = (
                lambda c=cfg, b=buf: quantize(x, c, out=b), 4 * N + buf.numel())
    for fn, _ in points.values():  # compile and warm up
        fn()
    runs = {name: [] for name in points}
    for _ in range(rounds):
        for name, (fn, moved) in points.items():
            runs[name].append(moved / best(fn) / 1e9)
    med = {name: statistics.median(v) for name, v in runs.items()}
    with open(out if "/" in out else RESULTS / out, "w") as f:
        json.dump({"numel": N, "rounds": rounds, "threads": threads, "torch": torch.__version__,
                   "capability": torch.backends.cpu.get_cpu_capability(),
                   "gbps_runs": runs}, f, indent=1)
        f.write("\n")
    print(f"# 2^24 fp32, {threads} thread(s), {rounds} rounds, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}: GB/s moved, median (min-max)")
    for name, v in runs.items():
        print(f"{name:28s} {med[name]:6.2f} ({min(v):.2f}-{max(v):.2f})"
              f"  {med[name] / med['memcpy']:.2f}x memcpy")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:4]))
