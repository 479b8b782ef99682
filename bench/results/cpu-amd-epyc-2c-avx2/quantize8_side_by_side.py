"""fp32 8-bit quantize, G elements/s (best of 10 calls after one warm-up), minmax,
maxnorm and nuq at 2^24 elements, 1 thread, the compiled path; one line, labelled with
argv[1]. Run once per tree, alternating (README.md, "The full codec table again")."""

import sys
import time

import torch

from qcomm import QuantConfig, packed_nbytes, quantize

torch.set_num_threads(1)
n = 1 << 24
x = torch.randn(n)
res = []
for scheme in ("minmax", "maxnorm", "nuq"):
    cfg = QuantConfig(bits=8, scheme=scheme)
    out = torch.empty(packed_nbytes(n, cfg), dtype=torch.uint8)
    quantize(x, cfg, out=out)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        quantize(x, cfg, out=out)
        best = min(best, time.perf_counter() - t)
    res.append(f"{scheme}8 {n / best / 1e9:.3f}")
print(f"{sys.argv[1]:5s}", *res)
