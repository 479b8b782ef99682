"""What qcomm's exact path adds to one call: a 2^10-element fp32 all-gather on a
1-rank gloo group, through qcomm (a :func:`qcomm.wrap` of it, so nothing compresses:
no peer) against the inner group's own call, with the inner issue and wait inside
qcomm's call timed apart. Medians of 5 rounds of 2000 calls, us a call.

    python bench/experiments/exact_path.py     # from the repository root
"""

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    import torch
    import torch.distributed as dist

    from bench.common import format_header, run_header
    from bench.link import free_port

    print(format_header(run_header("exact_path", device="cpu",
                                   command="python bench/experiments/exact_path.py")))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    import qcomm
    from qcomm import inner as I

    q = qcomm.QuantConfig(bits=8)
    qg = qcomm.wrap(dist.group.WORLD, qcomm.CommConfig(all_gather=q, topology="flat"))
    inner = I.inner_group(qg)
    x, out = torch.randn(1024), torch.empty(1024)
    spent = {"issue": 0.0, "wait": 0.0}
    plain_start, plain_wait = I.all_gather, I.wait

    def timed(name, fn):
        def wrapper(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[name] += time.perf_counter() - t
        return wrapper

    cases = {"inner call + wait": lambda: I.all_gather(inner, out, x).wait(),
             "qcomm.all_gather_into_tensor": lambda: qcomm.all_gather_into_tensor(out, x, qg)}
    times = {k: [] for k in cases}
    inside = []
    for fn in cases.values():
        for _ in range(200):
            fn()
    n = 2000
    for _ in range(5):
        for k, fn in cases.items():
            if k.startswith("qcomm"):
                I.all_gather, I.wait = timed("issue", plain_start), timed("wait", plain_wait)
                spent.update(issue=0.0, wait=0.0)
            t = time.perf_counter()
            for _ in range(n):
                fn()
            times[k].append((time.perf_counter() - t) / n * 1e6)
            if k.startswith("qcomm"):
                I.all_gather, I.wait = plain_start, plain_wait
                inside.append((spent["issue"] / n * 1e6, spent["wait"] / n * 1e6))
    for k, v in times.items():
        print(f"{k:32s} {statistics.median(v):7.1f} us")
    issue = statistics.median(i for i, _ in inside)
    wait = statistics.median(w for _, w in inside)
    total = statistics.median(times["qcomm.all_gather_into_tensor"])
    print(f"inside qcomm's call: inner issue {issue:.1f} us, wait {wait:.1f} us, the rest "
          f"(qcomm's Python) {total - issue - wait:.1f} us")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
