"""Error feedback's quantize of a reduce-scatter piece (``qcomm.collectives._quantize_fed``)
two ways, side by side in one process, 1 thread, the compiled CPU path:

- ``buffer``: decode the payload rows into an fp32 scratch buffer of the rows' size,
  then ``owed -= sent`` and zero the non-finite values (qcomm before 2026-12-03; the
  group's cache kept that buffer for good: W - 1 fp32 rows of the piece);
- ``subtract``: one ``dequantize_rows(..., subtract=True)`` into the owed rows, then
  the same zeroing (no buffer).

Both start from the same owed rows (W - 1 rows of one piece, random normal) and must end
with equal values (checked). ms per call of quantize + residual, median of ROUNDS calls
in alternating order, and the scratch bytes the first way needs.

    python bench/experiments/ef_residual.py BITS LOG2_PIECE WORLDS [ROUNDS]

e.g. ``python bench/experiments/ef_residual.py 4 20 2,4,8 12`` (from the repository root).
"""

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.common import machine_name, run_header  # noqa: E402
from qcomm import QuantConfig, dequantize_rows, packed_nbytes, quantize_rows  # noqa: E402


def buffer(owed, q, seeds, send, scratch):
    quantize_rows(owed, q, seeds, out=send)
    dequantize_rows(send, owed.shape[1], torch.float32, q, out=scratch, check=False)
    owed.sub_(scratch).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def subtract(owed, q, seeds, send, scratch):
    quantize_rows(owed, q, seeds, out=send)
    dequantize_rows(send, owed.shape[1], torch.float32, q, out=owed, subtract=True,
                    check=False)
    owed.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def main() -> None:
    bits, log2, worlds = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 12
    torch.set_num_threads(1)
    q = QuantConfig(bits=bits, rounding="nearest")
    m = 1 << log2
    rows = []
    for world in (int(w) for w in worlds.split(",")):
        R = world - 1
        base = torch.randn(R, m, generator=torch.Generator().manual_seed(world))
        send = torch.empty(R, packed_nbytes(m, q), dtype=torch.uint8)
        seeds = list(range(R))
        scratch = torch.empty(R, m)
        owed = {k: torch.empty(R, m) for k in ("buffer", "subtract")}

        ways = {"buffer": buffer, "subtract": subtract}
        times = {k: [] for k in ways}
        for i in range(rounds + 1):
            for k in (("buffer", "subtract") if i % 2 else ("subtract", "buffer")):
                owed[k].copy_(base)
                t = time.perf_counter()
                ways[k](owed[k], q, seeds, send, scratch)
                if i:  # the first round warms up (compiles)
                    times[k].append(time.perf_counter() - t)
        assert torch.equal(owed["buffer"], owed["subtract"]), "the two ways disagree"
        row = {"world": world, "bits": bits, "piece": m,
               **{f"{k}_ms": round(1e3 * statistics.median(v), 2) for k, v in times.items()},
               "scratch_mib": round(scratch.numel() * 4 / 2**20, 1)}
        row["ratio"] = round(row["subtract_ms"] / row["buffer_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    header = run_header("ef_residual", device="cpu", command=" ".join(sys.argv))
    print(json.dumps({"machine": machine_name(header), "rounds": rounds,
                      "qcomm_git": header["versions"]["qcomm_git"],
                      "torch": header["versions"]["torch"]}))


if __name__ == "__main__":
    main()
