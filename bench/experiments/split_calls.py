"""What cutting one quantize into calls costs: a 2^LOG2N-element fp32 tensor quantized
in 1, 2, 4, ..., 32 calls of equal slices (one thread, this process), the cuttings
alternating over ROUNDS rounds; medians in ms. The fixed cost of a codec call is what
each pipeline piece of a flat collective pays (``qcomm.collectives.pieces``).

    python bench/experiments/split_calls.py [BITS,...] [LOG2N] [ROUNDS]   # 2,8 22 15
"""

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    import torch

    import qcomm
    from bench.common import format_header, run_header

    widths = [int(b) for b in (argv[0] if argv else "2,8").split(",")]
    logn = int(argv[1]) if len(argv) > 1 else 22
    rounds = int(argv[2]) if len(argv) > 2 else 15
    torch.set_num_threads(1)
    print(format_header(run_header("split_calls", device="cpu", command=" ".join(
        ["python", "bench/experiments/split_calls.py", ",".join(map(str, widths)),
         str(logn), str(rounds)]))), flush=True)
    n = 1 << logn
    x = torch.randn(n)
    counts = (1, 2, 4, 8, 16, 32)
    for bits in widths:
        q = qcomm.QuantConfig(bits=bits)

        def cut(k: int):
            m = n // k
            outs = [torch.empty(qcomm.packed_nbytes(m, q), dtype=torch.uint8)
                    for _ in range(k)]

            def run():
                for i in range(k):
                    qcomm.quantize(x[i * m:(i + 1) * m], q, seed=1, out=outs[i])
            return run

        fns = {k: cut(k) for k in counts}
        for fn in fns.values():
            fn(), fn()
        times = {k: [] for k in counts}
        for _ in range(rounds):
            for k, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
        print(f"{bits} bits, 2^{logn} elements in 1/2/4/8/16/32 calls: " + " / ".join(
            f"{statistics.median(times[k]) * 1e3:.2f}" for k in counts) + " ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
