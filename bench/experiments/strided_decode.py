"""Decode of payload rows into a strided output, one row call against a call per row:
the figures of ``STRIDED_ROWS_SPLIT`` in ``qcomm/cpu/dequantize.py``.

    python bench/experiments/strided_decode.py BITS R [--no-split]

R output rows of 2^21 fp32 elements, decoded piece by piece (pieces of 2^15..2^20
elements: columns ``[a, b)`` of every row, as a collective's all-gather does) by one
``dequantize_rows`` of the R rows (``strided``) or one per row (``perrow``); 1 thread,
core 0, medians of 15 rounds, ms. ``--no-split`` sets ``STRIDED_ROWS_SPLIT`` out of
reach, so ``strided`` times the rows graph itself (how the figures were taken).
"""

import os
import statistics
import sys
import time

import torch

import qcomm.cpu.dequantize as D
from qcomm import QuantConfig
from qcomm.codec import dequantize_rows, packed_nbytes, quantize

N = 1 << 21


def main(bits: int, rows: int) -> None:
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    cfg = QuantConfig(bits=bits)
    out = torch.empty(rows, N)
    line = []
    for logp in range(15, 21):
        pn = 1 << logp
        count, pb = N // pn, packed_nbytes(pn, cfg)
        send = torch.empty(pb, dtype=torch.uint8)
        quantize(torch.randn(pn), cfg, out=send)
        payloads = send.expand(count, rows, pb).contiguous()

        def strided(pn=pn, count=count, payloads=payloads):
            for p in range(count):
                dequantize_rows(payloads[p], pn, torch.float32, cfg,
                                out=out[:, p * pn:(p + 1) * pn], check=False)

        def perrow(pn=pn, count=count, payloads=payloads):
            for p in range(count):
                for r in range(rows):
                    dequantize_rows(payloads[p, r:r + 1], pn, torch.float32, cfg,
                                    out=out[r:r + 1, p * pn:(p + 1) * pn], check=False)

        fns = {"strided": strided, "perrow": perrow}
        for fn in fns.values():
            fn()
            fn()
        times = {k: [] for k in fns}
        for _ in range(15):
            for k, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
        s, p = (statistics.median(times[k]) * 1e3 for k in ("strided", "perrow"))
        line.append(f"2^{logp}: {s:.2f}/{p:.2f} ({s / p:.2f}x)")
    print(f"bits {bits} R {rows} (strided/perrow ms for {rows} x 2^21): " + "  ".join(line))


if __name__ == "__main__":
    if "--no-split" in sys.argv:
        D.STRIDED_ROWS_SPLIT = 1 << 62
    main(int(sys.argv[1]), int(sys.argv[2]))
