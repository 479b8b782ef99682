"""``python -m bench launches``: codec calls, device launches and time per call of each
compressed collective, beside the exact call, by size and world size.

Each of ``--world`` self-launched ranks runs every collective (all-gather, reduce-scatter,
all-reduce; ``--bits``, min-max, flat) at each size (elements per rank) on a
:func:`qcomm.wrap` of its group, and the same call on the group itself (``exact``):

- ``codec``: :mod:`qcomm.codec` calls of one call (``qcomm.codec.calls``), which do not
  grow with W (``tests/test_collectives.py`` checks it at W = 2, 4, 8).
- ``launches``: on CUDA, the kernels one call puts on the GPU (``torch.profiler``, CUDA
  activity), split into compute kernels, ``Memcpy`` and ``Memset`` (NCCL's own kernels
  count as compute); on CPU, the torch path's graph and loop calls
  (``qcomm.cpu.cpu_common.calls``), the CPU's launches.
- ``time``: median over ``--iters`` calls (after warm-up; a barrier and, on CUDA, a
  synchronize before each call and a synchronize after), the slowest rank's median.

At W = 1 qcomm sends exact (no peer, nothing to lose: ``qcomm.driver.compressible``):
no codec call, and the row is qcomm's own cost on the exact path.

Devices: ``--device cuda`` runs NCCL where every rank has a GPU of its own (W = 1 on one
GPU) and gloo over CUDA tensors where not (NCCL refuses two ranks on one GPU: W = 2 on
one GPU is gloo), as ``bench memory`` does; ``--device cpu`` runs gloo.

    python -m bench launches                                 # CPU, W = 1, 2
    python -m bench launches --device cuda --worlds 1,2      # the GPU check (device_check.sh)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from . import common
from .common import Column
from .link import pin_this_rank, run_spec, worker_done
from .memory import cuda_backend, rank_device

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def add_arguments(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    p.add_argument("--sizes", type=common.arg(common.parse_sizes),
                   default=common.parse_sizes("10..22:4"),
                   help="elements per rank (default 2^10, 2^14, 2^18, 2^22)")
    p.add_argument("--worlds", type=common.arg(lambda s: [int(w) for w in s.split(",")]),
                   default=[1, 2], help="world sizes (default 1,2)")
    p.add_argument("--bits", type=int, default=8)
    p.add_argument("--collectives", type=common.arg(
        lambda s: common.parse_list(s, COLLECTIVES, "collective")),
        default=list(COLLECTIVES))
    p.add_argument("--iters", type=int, default=20, help="timed calls per point (median)")
    p.add_argument("--device", default="cuda" if on_gpu else "cpu")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds per world size before the ranks are stopped")


def _launches(fn, device: torch.device) -> dict:
    """What one call of ``fn`` launches: CUDA kernels by kind, or the CPU torch path's
    calls."""
    if device.type != "cuda":
        from qcomm.cpu import common as cpu_common

        before = sum(cpu_common.calls.values())
        fn()
        return {"launches": sum(cpu_common.calls.values()) - before}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    kinds = collections.Counter()
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        kinds["memcpy" if "memcpy" in name else "memset" if "memset" in name
              else "kernels"] += 1
    return {"launches": sum(kinds.values()), **kinds}


def _point(fn, device: torch.device, iters: int, sync, dist, codec) -> dict:
    """One collective's codec calls, launches and median time (the slowest rank's)."""
    for _ in range(3):  # warm-up: compiles, the group's first agreement
        fn()
    sync()
    dist.barrier()
    before = collections.Counter(codec.calls)
    got = _launches(fn, device)
    got["codec"] = sum((codec.calls - before).values())
    times = common.time_calls(fn, iters, sync=sync, before=dist.barrier)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return {"time_us": med.item() * 1e6, **got}


def worker(spec: dict) -> None:
    """Every point on this rank; its rows go back through :func:`worker_done`."""
    import torch.distributed as dist

    import qcomm
    from qcomm import codec

    pin_this_rank()
    world = int(os.environ["WORLD_SIZE"])
    device = rank_device(spec["device"])
    backend = cuda_backend(world) if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, **({"device_id": device} if backend == "nccl" else {}))
    rank = dist.get_rank()
    q = qcomm.QuantConfig(bits=spec["bits"])
    qg = qcomm.wrap(dist.group.WORLD, qcomm.CommConfig(
        all_gather=q, reduce_scatter=q, all_reduce=q, topology="flat"))
    sync = common.sync_fn(device)
    rows = []
    for n in spec["sizes"]:
        gen = torch.Generator(device=device).manual_seed(rank)
        shard = torch.randn(n, generator=gen, device=device)
        full = torch.randn(world * n, generator=gen, device=device)
        gathered, part = torch.empty(world * n, device=device), torch.empty(n, device=device)
        reduced = torch.empty(world * n, device=device)
        for coll in spec["collectives"]:
            for variant, group in (("exact", dist.group.WORLD), (f"qcomm{q.bits}", qg)):
                if coll == "all_gather":
                    def fn(g=group, out=gathered, inp=shard):
                        dist.all_gather_into_tensor(out, inp, group=g)
                elif coll == "reduce_scatter":
                    def fn(g=group, out=part, inp=full):
                        dist.reduce_scatter_tensor(out, inp, group=g)
                else:
                    def fn(g=group, out=reduced, inp=full):
                        dist.all_reduce(out.copy_(inp), group=g)
                row = {"collective": coll, "world": world, "backend": backend, "numel": n,
                       "variant": variant}
                try:
                    row.update(_point(fn, device, spec["iters"], sync, dist, codec))
                except RuntimeError as e:  # e.g. an exact op gloo lacks for CUDA tensors
                    # (every rank raises alike: the op is refused before any exchange)
                    row["error"] = str(e).splitlines()[0][:200]
                rows.append(row)
    worker_done(spec, rank, rows)


def columns(device: str) -> list[Column]:
    cols = [Column("collective", "collective"), Column("world", "W"),
            Column("backend", "backend"), Column("numel", "numel"),
            Column("variant", "variant"), Column("codec", "codec"),
            Column("launches", "launches")]
    if device == "cuda":
        cols += [Column("kernels", "kernels"), Column("memcpy", "memcpy"),
                 Column("memset", "memset")]
    return cols + [Column("time_us", "time(us)", "{:.1f}"),
                   Column("vs_exact", "vs exact", "{:.2f}x")]


def main(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench launches --device cuda: torch sees no CUDA device here")
    header = common.run_header("launches", device=args.device, command=args.command)
    header["sweep"] = {"sizes": args.sizes, "worlds": args.worlds, "bits": args.bits,
                       "collectives": args.collectives, "iters": args.iters}
    print(common.format_header(header), flush=True)
    rows = []
    for world in args.worlds:
        spec = {"device": args.device, "sizes": args.sizes, "bits": args.bits,
                "collectives": args.collectives, "iters": args.iters}
        # every rank's launches, the slowest rank's time (already the max)
        ranks = run_spec("bench.launches", spec, world, timeout_s=args.timeout)
        for i, row in enumerate(ranks[0]):
            for key in ("codec", "launches", "kernels", "memcpy", "memset"):
                if "error" not in row:
                    row[key] = max(r[i].get(key, 0) for r in ranks)
            rows.append(row)
    exact = {(r["collective"], r["world"], r["numel"]): r.get("time_us") for r in rows
             if r["variant"] == "exact"}
    for r in rows:
        base = exact.get((r["collective"], r["world"], r["numel"]))
        r["vs_exact"] = r["time_us"] / base if base and "time_us" in r else None
        if "error" in r:
            print(f"# {r['collective']} W={r['world']} {r['numel']} {r['variant']}: "
                  f"{r['error']}", flush=True)
    common.report("launches", header, columns(args.device), rows, args.out,
                  "launches" + ("-cuda" if args.device == "cuda" else ""))
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker(json.loads(Path(sys.argv[2]).read_text()))
