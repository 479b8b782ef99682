"""nuq quantize from bf16, G elements/s (best of 6 calls at 2^24, 3 at 2^26, after one
warm-up), bits 8/4/2, 1 thread, the compiled path; one line labelled with argv[1]. Run
once per tree, alternating (README.md, "nuq from bf16 through fp32")."""

import sys
import time

import torch

from qcomm import QuantConfig, packed_nbytes, quantize

torch.set_num_threads(1)
res = []
for lg in (24, 26):
    n = 1 << lg
    xb = torch.randn(n).bfloat16()
    for bits in (8, 4, 2):
        cfg = QuantConfig(bits=bits, scheme="nuq")
        out = torch.empty(packed_nbytes(n, cfg), dtype=torch.uint8)
        quantize(xb, cfg, out=out)
        best = float("inf")
        for _ in range(3 if lg == 26 else 6):
            t = time.perf_counter()
            quantize(xb, cfg, out=out)
            best = min(best, time.perf_counter() - t)
        res.append(f"2^{lg}/{bits}: {n / best / 1e9:.3f}")
print(f"{sys.argv[1]:5s}", *res)
