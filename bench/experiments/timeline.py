"""Where one flat pipelined call spends its time: every codec call, inner start and
inner wait of a compressed all-gather or reduce-scatter timed on rank 0, 2 ranks behind
a shaped link (``bench.link``), printed as a timeline (ms from the call's start) of the
median of ROUNDS calls.

    python bench/experiments/timeline.py [RATE] [ag|rs] [BITS] [LOG2N] [ROUNDS]
    # default: 1gbit ag 2 22 8

Run from the repository root. RATE "loopback" runs without a link.
"""

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rank_main(what: str, bits: int, logn: int, rounds: int) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.link import pin_this_rank

    pin_this_rank()
    import torch
    import torch.distributed as dist

    import qcomm
    import qcomm.collectives as C
    from qcomm import QuantConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    events: list[tuple[str, float, float]] = []

    def timed(name, fn, what=None):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:  # an inner start or wait: its description names what it moves
                label = f"{name} ({args[what]})" if what is not None else name
                events.append((label, t, time.perf_counter()))
        return wrapper

    for name in ("quantize", "quantize_rows", "dequantize_rows", "dequantize_sum"):
        setattr(C, name, timed(name, getattr(C, name)))
    C.I.start = timed("start", C.I.start, 2)
    C.I.wait = timed("wait", C.I.wait, 2)

    n = 1 << logn
    q = QuantConfig(bits=bits)
    g = qcomm.wrap(dist.group.WORLD, qcomm.CommConfig(all_gather=q, reduce_scatter=q,
                                                      topology="flat"))
    if what == "rs":
        inp, out = torch.randn(world * n), torch.empty(n)
        def fn():
            dist.reduce_scatter_tensor(out, inp, group=g)
    else:
        inp, out = torch.randn(n), torch.empty(world * n)
        def fn():
            dist.all_gather_into_tensor(out, inp, group=g)
    for _ in range(3):
        fn()
    calls = []
    for _ in range(rounds):
        dist.barrier()
        events.clear()
        t = time.perf_counter()
        fn()
        calls.append((time.perf_counter() - t, t, list(events)))
    everyone = [None] * world  # perf_counter is CLOCK_MONOTONIC: one clock for all ranks
    dist.all_gather_object(everyone, calls)
    if rank == 0:
        i = sorted(range(rounds), key=lambda k: calls[k][0])[rounds // 2]
        total, t0, _ = calls[i]
        print(f"{what} 2^{logn} {bits} bits: median {total * 1e3:.2f} ms "
              f"(min {min(c[0] for c in calls) * 1e3:.2f}, "
              f"max {max(c[0] for c in calls) * 1e3:.2f}); pieces {len(C.pieces(n, q))}; "
              f"ms from rank 0's call start", flush=True)
        for r, theirs in enumerate(everyone):
            took, start, evs = theirs[i]
            print(f" rank {r}: call {(start - t0) * 1e3:.2f} -> "
                  f"{(start + took - t0) * 1e3:.2f}", flush=True)
            for name, a, b in evs:
                print(f"  {name:50s} {(a - t0) * 1e3:8.2f} -> {(b - t0) * 1e3:8.2f} "
                      f"({(b - a) * 1e3:6.2f})", flush=True)
            busy = sum(b - a for name, a, b in evs if not name.startswith(("wait", "start")))
            print(f"  codec {busy * 1e3:.2f} ms", flush=True)
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from bench.link import run_on

    rate = argv[0] if argv else "1gbit"
    rest = (argv[1:] + ["ag", "2", "22", "8"][len(argv[1:]):])[:4]
    cmd = [__file__, "--rank", *rest]
    env = {"PYTHONPATH": str(ROOT)}
    run_on(rate, cmd, env=env)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--rank":
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
        rank_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit(main(sys.argv[1:]))
