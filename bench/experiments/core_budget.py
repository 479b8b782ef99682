"""Whether a compressed call is bound by its rank's one core: the call's wall time and
the process's CPU time (every thread: the codec's and gloo's) against the same run's
codec alone and exact exchange of the payload bytes (wall and CPU), 2 ranks behind a
shaped link, each pinned to its own core (``bench.link``), as ``bench collectives`` runs.

On one core the codec and the transfer's own CPU work (gloo's threads copying and
the socket calls, charged to the process) cannot overlap, so a pipelined call takes
at least ``max(xfer, codec + xfer_cpu)``: the ``ceiling`` column. ``busy`` is the
call's CPU time over its wall time (1.0: the core never waited on the wire);
``caller`` the calling thread's share of ``call_cpu`` (the codec and qcomm's Python;
the rest is gloo's threads).

    python bench/experiments/core_budget.py [RATE] [ag|rs] [BITS,...] [LOG2N] [ROUNDS]
    # default: 1gbit rs 2,4,8 22 12

Run from the repository root. RATE "loopback" runs without a link. Medians over
ROUNDS calls of each step, the steps alternating; the slowest rank's median printed.
"""

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rank_main(what: str, widths: list[int], logn: int, rounds: int) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.link import pin_this_rank

    pin_this_rank()
    import torch
    import torch.distributed as dist

    import qcomm
    from qcomm import QuantConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 1 << logn
    x = torch.randn(world, n)
    rows = []
    for bits in widths:
        q = QuantConfig(bits=bits)
        nb = qcomm.packed_nbytes(n, q)
        send = torch.empty(world, nb, dtype=torch.uint8)
        recv = torch.empty(world, nb, dtype=torch.uint8)
        for j in range(world):
            qcomm.quantize(x[j], q, seed=j, out=send[j])
        acc = torch.zeros(n)
        y = torch.empty(world, n)
        peers = [j for j in range(world) if j != rank]
        if what == "rs":
            inp, out = x.reshape(-1), torch.empty(n)

            def call():
                qcomm.reduce_scatter_tensor(out, inp, config=q)

            def codec():
                for j in peers:
                    qcomm.quantize(x[j], q, seed=j, out=send[j])
                for j in peers:
                    qcomm.dequantize(qcomm.Packed(recv[j], n, torch.float32, q), out=acc,
                                     accumulate=True, check=False)

            def xfer():
                dist.all_to_all_single(recv.view(-1), send.view(-1))
        else:
            inp, out = x[rank], torch.empty(world * n)

            def call():
                qcomm.all_gather_into_tensor(out, inp, config=q)

            def codec():
                qcomm.quantize(x[rank], q, seed=rank, out=send[rank])
                for j in range(world):
                    qcomm.dequantize(qcomm.Packed(recv[j], n, torch.float32, q), out=y[j],
                                     check=False)

            def xfer():
                dist.all_gather_into_tensor(recv.view(-1), send[rank])

        steps = {"call": call, "codec": codec, "xfer": xfer}
        wall = {k: [] for k in steps}
        cpu = {k: [] for k in steps}
        mine = []  # the calling thread's CPU time in the call (the rest: gloo's threads)
        for fn in steps.values():  # warm-up: compiled graphs, buffers, connections
            fn(), fn()
        for _ in range(rounds):
            for k, fn in steps.items():
                dist.barrier()
                c, t, m = time.process_time(), time.perf_counter(), time.thread_time()
                fn()
                wall[k].append(time.perf_counter() - t)
                cpu[k].append(time.process_time() - c)
                if k == "call":
                    mine.append(time.thread_time() - m)
        med = [statistics.median(v[k]) for v in (wall, cpu) for k in steps]
        med.append(statistics.median(mine))
        t = torch.tensor(med, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append((bits, *(v * 1e3 for v in t.tolist())))
    if rank == 0:
        print(f"# {what} 2^{logn} elements a rank, {world} ranks, medians of {rounds} "
              f"calls (ms; the slowest rank's median each)", flush=True)
        print(f"{'bits':>4} {'call':>8} {'call_cpu':>8} {'caller':>8} {'busy':>5} {'codec':>8} "
              f"{'xfer':>8} {'xfer_cpu':>8} {'ceiling':>8} {'call/ceiling':>12} "
              f"{'call/max(codec,xfer)':>20}", flush=True)
        for bits, cw, codw, xw, cc, codc, xc, mine_ms in rows:
            ceiling = max(xw, codw + xc)
            print(f"{bits:4d} {cw:8.2f} {cc:8.2f} {mine_ms:8.2f} {cc / cw:5.2f} {codw:8.2f} {xw:8.2f} "
                  f"{xc:8.2f} {ceiling:8.2f} {cw / ceiling:12.2f} "
                  f"{cw / max(codw, xw):20.2f}", flush=True)
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from bench.common import format_header, run_header
    from bench.link import run_on

    rate = argv[0] if argv else "1gbit"
    rest = (argv[1:] + ["rs", "2,4,8", "22", "12"][len(argv[1:]):])[:4]
    command = " ".join(["python", "bench/experiments/core_budget.py", rate, *rest])
    print(format_header(run_header("core_budget", device="cpu", link=rate,
                                   command=command)), flush=True)
    run_on(rate, [__file__, "--rank", *rest], env={"PYTHONPATH": str(ROOT)})
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--rank":
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
        rank_main(sys.argv[2], [int(b) for b in sys.argv[3].split(",")],
                  int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit(main(sys.argv[1:]))
