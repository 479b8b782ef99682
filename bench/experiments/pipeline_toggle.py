"""Two knobs of the flat pipeline, both ways in alternating rounds of one run, on 2 ranks
behind a shaped link (``bench.link``): the figures in ``qcomm/cpu/dequantize.py``
(``STRIDED_ROWS_SPLIT``) and ``qcomm/collectives.py`` (``PIECE``) and docs/results.md.

    python bench/experiments/pipeline_toggle.py split [RATE] [LOG2N]   # default 1gbit 22
    python bench/experiments/pipeline_toggle.py pieces [RATE] [ag|rs]
    python bench/experiments/pipeline_toggle.py count [RATE] [ag|rs] [LOG2N]  # 22

``split``: the all-gather at 2/4/8 bits with strided decode rows split per row
(STRIDED_ROWS_SPLIT = 2^18) and not (2^62), 12 rounds. ``pieces``: all-gather or
reduce-scatter at 2^22 and 2^24 elements a rank with pieces of 2^19, 2^20 and 2^21
elements at 8 bits (``PIECE`` set and ``MIN_PIECES`` = 1; 4 and 2 bits scale it by 2
and 4 up to the tensor, :func:`qcomm.collectives.pieces`), 10 rounds. ``count``: 2^LOG2N
elements a rank cut into 1, 2, 4, 8 and 16 pieces at every width (``PIECE`` = n / k,
``MIN_PIECES`` = k), 10 rounds.
RATE "loopback" runs without a link. Rank 0 prints medians (ms). Run from the repository
root.
"""

import os
import statistics as st
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rank_main(mode: str, arg: str) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.link import pin_this_rank

    pin_this_rank()
    import torch
    import torch.distributed as dist

    import qcomm
    import qcomm.collectives as C
    import qcomm.cpu.dequantize as D
    from qcomm import QuantConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    what = "ag"
    if mode == "count":
        arg, logn = arg.split(":")
        logns = [int(logn)]
    else:
        logns = [int(arg)] if mode == "split" else [22, 24]
    if mode != "split" and arg == "rs":
        what = "rs"
    for logn in logns:
        n = 1 << logn
        x, out = torch.randn(n), torch.empty(world * n)
        big, part = torch.randn(world * n), torch.empty(n)
        groups = {b: qcomm.wrap(dist.group.WORLD, qcomm.CommConfig(
            all_gather=QuantConfig(bits=b), reduce_scatter=QuantConfig(bits=b),
            topology="flat")) for b in (2, 4, 8)}
        if what == "rs":
            def fn(g, o=part, i=big):
                dist.reduce_scatter_tensor(o, i, group=g)
        else:
            def fn(g, o=out, i=x):
                dist.all_gather_into_tensor(o, i, group=g)
        if mode == "split":
            settings = {"rows graph": ("STRIDED_ROWS_SPLIT", 1 << 62),
                        "split": ("STRIDED_ROWS_SPLIT", 1 << 18)}
            rounds = 12
        elif mode == "count":
            settings = {f"{k} pieces": (("PIECE", n // k), ("MIN_PIECES", k))
                        for k in (1, 2, 4, 8, 16)}
            rounds = 10
        else:
            settings = {f"piece 2^{k}": ("PIECE", 1 << k) for k in (19, 20, 21)}
            C.MIN_PIECES = 1
            rounds = 10

        def use(name, settings=settings):
            pairs = settings[name]
            for attr, value in pairs if isinstance(pairs[0], tuple) else (pairs,):
                setattr(D if attr == "STRIDED_ROWS_SPLIT" else C, attr, value)

        for name in settings:  # warm up every setting
            use(name)
            for g in groups.values():
                fn(g)
        res = {}
        for _ in range(rounds):
            for name in settings:
                use(name)
                for b, g in groups.items():
                    dist.barrier()
                    t = time.perf_counter()
                    fn(g)
                    res.setdefault((b, name), []).append(time.perf_counter() - t)
        if rank == 0:
            for b in groups:
                print(f"{what} 2^{logn} {b} bits: " + "  ".join(
                    f"{name} {st.median(res[(b, name)]) * 1e3:.1f} ms" for name in settings),
                    flush=True)
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from bench.link import run_on

    mode = argv[0]
    rate = argv[1] if len(argv) > 1 else "1gbit"
    arg = argv[2] if len(argv) > 2 else ("22" if mode == "split" else "ag")
    if mode == "count":
        arg += ":" + (argv[3] if len(argv) > 3 else "22")
    cmd = [__file__, "--rank", mode, arg]
    env = {"PYTHONPATH": str(ROOT)}
    run_on(rate, cmd, env=env)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rank":
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
        rank_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main(sys.argv[1:]))
