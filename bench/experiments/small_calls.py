"""Per-call time of small compressed collectives (2 ranks on loopback, 2^10-2^16 fp32
elements per rank) for several trees, alternating trees in rounds: issue 20's "small
calls must not get slower", checked against the tree before its work (e087f85).

    small_calls.py ROUNDS OUT.json LABEL=TREE ...

Each round runs every tree once, in fresh processes (``PYTHONPATH`` = the tree, from
/tmp), as 2 ranks pinned to one core each, 1 thread. A rank times, per collective
(all-gather, reduce-scatter, all-reduce) and size, ``CALLS`` synchronous calls one by
one on a qcomm group over the default gloo group (8-bit min-max, the default config,
``topology="flat"``) and, before them, the same calls on the gloo group itself (exact:
the control, the same code in every tree); rank 0's median per point is the run's figure. A first
run of each tree, not counted, fills Inductor's cache. Printed: per point and tree the
median and the minimum over rounds (us; noise here only adds time, so the minimum is
the steadier estimate) and each tree's ratio to the first; the control rows show how
much the machine itself drifts between trees. Then the same for CPU time per call
(``time.process_time`` over the ``CALLS`` calls: every thread of the rank, user and
system): a wait for the peer costs no CPU, so this is the code's own cost per call, the
part a change to qcomm can move, without the wake-up latencies that dominate the wall
time of a call this small on this VM (docs/results.md, "Flat collectives at 1 Gbit/s").
Uses only what every tree since e087f85 has: ``qcomm.wrap``, ``CommConfig(all_gather=,
reduce_scatter=, all_reduce=, topology=)``, ``QuantConfig``.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = (10, 12, 14, 16)
CALLS = 150
WARM = 20
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def worker(out_path: str) -> None:
    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import qcomm

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    q = qcomm.QuantConfig(bits=8)
    groups = {"gloo": dist.group.WORLD,
              "qcomm8": qcomm.wrap(dist.group.WORLD, qcomm.CommConfig(
                  all_gather=q, reduce_scatter=q, all_reduce=q, topology="flat"))}
    rows = []
    for log2 in SIZES:
        n = 1 << log2
        x, big = torch.randn(n), torch.randn(world * n)
        out, part = torch.empty(world * n), torch.empty(n)
        for name, g in groups.items():
            calls = {
                "all_gather": lambda g=g, o=out, i=x: dist.all_gather_into_tensor(o, i, group=g),
                "reduce_scatter": lambda g=g, o=part, i=big: dist.reduce_scatter_tensor(
                    o, i, group=g),
                "all_reduce": lambda g=g, t=x, s=big[:n]: dist.all_reduce(t.copy_(s), group=g),
            }
            for coll in COLLECTIVES:
                fn = calls[coll]
                for _ in range(WARM):
                    fn()
                dist.barrier()
                ts = []
                cpu = time.process_time()
                for _ in range(CALLS):
                    t = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t)
                cpu = time.process_time() - cpu
                rows.append({"variant": name, "collective": coll, "log2": log2,
                             "us": statistics.median(ts) * 1e6, "cpu_us": cpu / CALLS * 1e6})
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_tree(tree: str, out_path: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=tree, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", out_path], cwd="/tmp",
                              env=dict(env, RANK=str(r)), stderr=subprocess.DEVNULL)
             for r in range(2)]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise RuntimeError(f"{tree}: a rank exited with {p.returncode}")
    return json.loads(Path(out_path).read_text())


def main(argv: list[str]) -> int:
    rounds, out = int(argv[0]), Path(argv[1])
    trees = dict(a.split("=", 1) for a in argv[2:])
    tmp = "/tmp/small_calls_rank0.json"
    for tree in trees.values():  # fills Inductor's cache; not counted
        run_tree(tree, tmp)
    runs = []
    for r in range(rounds):
        for label, tree in trees.items():
            runs.append({"round": r, "tree": label, "path": tree, "rows": run_tree(tree, tmp)})
            print(f"# round {r} {label} done", file=sys.stderr, flush=True)
    out.write_text(json.dumps({"rounds": rounds, "trees": trees, "calls": CALLS,
                               "runs": runs}, indent=1))
    labels = list(trees)
    keys = [(row["variant"], row["collective"], row["log2"]) for row in runs[0]["rows"]]
    for metric, what in (("us", f"wall us, each run's median of {CALLS} calls"),
                         ("cpu_us", f"CPU us a call, each run's mean over {CALLS} calls")):
        print(f"# {what}: median and min over {rounds} rounds; ratio = tree / {labels[0]}")
        print("variant  collective       size  " + "  ".join(f"{t:>14}" for t in labels))
        for key in keys:
            got = {t: [row[metric] for run in runs if run["tree"] == t for row in run["rows"]
                       if (row["variant"], row["collective"], row["log2"]) == key]
                   for t in labels}
            med = {t: statistics.median(v) for t, v in got.items()}
            low = {t: min(v) for t, v in got.items()}
            cells = [f"{med[t]:6.0f} ({med[t] / med[labels[0]]:.2f}) min {low[t]:6.0f} "
                     f"({low[t] / low[labels[0]]:.2f})" for t in labels]
            print(f"{key[0]:8} {key[1]:15} 2^{key[2]:<3} " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        sys.exit(main(sys.argv[1:]))
