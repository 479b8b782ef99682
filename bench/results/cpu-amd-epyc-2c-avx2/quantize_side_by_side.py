"""CPU quantize throughput, G elements/s (best of 3 calls after one warm-up call), per
dtype, size, scheme and bits, as one JSON line: run once per tree, alternating (see
README.md, "Quantize in 2^24-element chunks"). 1 thread; the compiled path."""

import json
import time

import torch

from qcomm import QuantConfig, packed_nbytes, quantize

torch.set_num_threads(1)
res = {}
for dt in (torch.float32, torch.bfloat16):
    for lg in (24, 26):
        n = 1 << lg
        x = torch.randn(n).to(dt)
        for scheme in ("minmax", "nuq"):
            for bits in (2, 4, 8):
                cfg = QuantConfig(bits=bits, scheme=scheme)
                out = torch.empty(packed_nbytes(n, cfg), dtype=torch.uint8)
                quantize(x, cfg, out=out)
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    quantize(x, cfg, out=out)
                    best = min(best, time.perf_counter() - t)
                res[f"{str(dt)[6:]} 2^{lg} {scheme}{bits}"] = n / best / 1e9
print(json.dumps(res))
