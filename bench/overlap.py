"""``python -m bench overlap``: an asynchronous collective overlapped with compute.

What ``async_op=True`` is for (DDP's reducer, FSDP2's prefetching all-gathers): the
caller computes while the collective runs. Per collective and variant, side by side
in one run, each timed after a barrier as the slowest rank's time:

- ``comm``: the collective alone (synchronous);
- ``compute``: matmuls calibrated to take as long as ``comm`` ("equal compute");
- ``serial``: the collective, then the compute;
- ``overlap``: the collective with ``async_op=True``, the compute, then ``wait()``;
- ``ratio = overlap / (comm + compute)``: 1.0 is no overlap at all, 0.5 a perfect
  one at equal compute.

Configs (``--config``): ``exact`` (gloo, whose own threads run the transfer), else
qcomm's keys (a :func:`qcomm.wrap` of the group): the default ``bits=8`` (the group's
worker thread runs codec and transfer: qcomm.engine) and ``bits=8,async=0`` (the call
completes before it returns, as before the engine).

    python -m bench overlap --link 100mbit        # 16 MiB per rank
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from . import common
from .link import LinkError, ShapedLink, parse_rate, pin_this_rank, run_spec, worker_done

CONFIGS = ("exact", "bits=8", "bits=8,async=0")
COLLECTIVES = ("all_gather", "reduce_scatter")
MATMUL = 256  # compute unit: one 256 x 256 fp32 matmul (~0.5-2 ms on one core)
COLUMNS = [
    common.Column("collective", "collective"),
    common.Column("numel", "numel"),
    common.Column("variant", "variant"),
    common.Column("comm_ms", "comm(ms)", "{:.1f}"),
    common.Column("compute_ms", "compute(ms)", "{:.1f}"),
    common.Column("serial_ms", "serial(ms)", "{:.1f}"),
    common.Column("overlap_ms", "overlap(ms)", "{:.1f}"),
    common.Column("ratio", "overlap/serial", "{:.2f}"),
    common.Column("spread", "spread", "{:.0%}"),
    common.Column("ratios", "per round", "{}"),
]


class _Clock:
    """Times a step on every rank after a barrier; the slowest rank's seconds."""

    def __init__(self, dist, ref_group):
        self.dist, self.group = dist, ref_group

    def __call__(self, fn) -> float:
        self.dist.barrier(group=self.group)
        start = time.perf_counter()
        fn()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        self.dist.all_reduce(took, self.dist.ReduceOp.MAX, group=self.group)
        return took.item()


def _compute(units: int, ab: tuple) -> None:
    a, b, c = ab
    for _ in range(units):  # the same operands every time: no drift into denormals
        torch.mm(a, b, out=c)


def worker(spec: dict) -> None:
    import torch.distributed as dist

    import qcomm
    from qcomm.config import comm_config_from_env

    pin_this_rank()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["op_timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = dist.group.WORLD
    # each config's group: gloo's for exact, else a qcomm group of its variables over the
    # environment's (made in one order on every rank)
    groups = {label: ref if label == "exact" else
              qcomm.wrap(ref, comm_config_from_env({**os.environ, **env}))
              for label, env in spec["configs"]}
    variants = list(groups)
    clock = _Clock(dist, ref)
    n = spec["numel"]
    a = (torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL), torch.empty(MATMUL, MATMUL))
    unit = min(clock(lambda: _compute(20, a)) for _ in range(3)) / 20
    rows = []
    for coll in spec["collectives"]:
        x = torch.randn(n if coll == "all_gather" else world * n, generator=torch.Generator()
                        .manual_seed(rank))
        out = torch.empty(world * n if coll == "all_gather" else n)

        def call(group, async_op, x=x, out=out, coll=coll):
            if coll == "all_gather":
                return dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
            return dist.reduce_scatter_tensor(out, x, group=group, async_op=async_op)

        samples = {v: {"comm": [], "compute": [], "serial": [], "overlap": []}
                   for v in variants}
        for group in groups.values():  # warm-up (compile, buffers) and calibration
            call(group, False)
        for k in range(spec["rounds"]):
            for v in variants[k % len(variants):] + variants[:k % len(variants)]:
                group = groups[v]
                comm = clock(lambda group=group: call(group, False))
                units = max(1, round(comm / unit))
                s = samples[v]
                s["comm"].append(comm)
                s["compute"].append(clock(lambda units=units: _compute(units, a)))
                s["serial"].append(clock(lambda group=group, units=units: (
                    call(group, False), _compute(units, a))))

                def overlapped(group=group, units=units):
                    work = call(group, True)
                    _compute(units, a)
                    work.wait()

                s["overlap"].append(clock(overlapped))
        for v, s in samples.items():
            med = {key: statistics.median(vals) for key, vals in s.items()}
            ratios = [o / (c + m) for o, c, m in zip(s["overlap"], s["comm"], s["compute"],
                                                     strict=True)]
            rows.append({"collective": coll, "numel": n, "variant": v,
                         "comm_ms": med["comm"] * 1e3, "compute_ms": med["compute"] * 1e3,
                         "serial_ms": med["serial"] * 1e3, "overlap_ms": med["overlap"] * 1e3,
                         "ratio": statistics.median(ratios),
                         "spread": (max(ratios) - min(ratios)) / statistics.median(ratios),
                         "rounds": len(ratios), "ratios": [round(r, 3) for r in ratios]})
            if rank == 0:
                r = rows[-1]
                print(f"# {coll} {v}: comm {r['comm_ms']:.0f} ms, overlap/serial "
                      f"{r['ratio']:.2f}", file=sys.stderr, flush=True)
    dist.barrier(group=ref)
    worker_done(spec, rank, rows)


def add_arguments(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    p.add_argument("--link", default="100mbit",
                   help="link rate between the two hosts (needs root), or loopback")
    p.add_argument("--sizes", type=common.arg(common.parse_sizes), default=[1 << 22],
                   help="elements per rank (default 2^22: 16 MiB fp32)")
    p.add_argument("--collectives", type=common.arg(
        lambda t: common.parse_list(t, COLLECTIVES, "collective")), default=list(COLLECTIVES))
    p.add_argument("--config", action="append", type=common.arg(common.parse_config),
                   metavar="SPEC", help="one variant, repeatable: exact or qcomm's keys, "
                   "e.g. bits=4,async=0 (default: " + " ".join(CONFIGS) + ")")
    p.add_argument("--rounds", type=int, default=7, help="rounds, variants interleaved")
    p.add_argument("--timeout", type=float, default=1800, help="whole run, seconds")
    p.add_argument("--op-timeout", type=float, default=300, help="process groups' timeout")


def main(args) -> int:
    rate = None if args.link in (None, "loopback") else args.link
    if rate is not None and parse_rate(rate) is None:
        print(f"python -m bench overlap: bad --link {args.link!r}", file=sys.stderr)
        return 2
    tag = rate or "loopback"
    configs = args.config or [common.parse_config(c) for c in CONFIGS]
    header = common.run_header("overlap", device="cpu (gloo)", link=tag, command=args.command)
    header["sweep"] = {"sizes": args.sizes, "collectives": args.collectives,
                       "configs": [label for label, _ in configs], "rounds": args.rounds,
                       "world": 2}
    print(common.format_header(header), flush=True)
    rows = []
    for numel in args.sizes:
        spec = {"numel": numel, "collectives": args.collectives, "configs": configs,
                "rounds": args.rounds, "op_timeout": args.op_timeout}
        try:
            with ShapedLink(rate) if rate else contextlib.nullcontext() as link:
                rows += run_spec("bench.overlap", spec, 2, timeout_s=args.timeout,
                                 link=link)[0]
        except LinkError as err:
            print(f"python -m bench overlap: {err}", file=sys.stderr)
            return 2
    common.report("overlap", header, COLUMNS, rows, args.out, f"overlap-{tag}")
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker(json.loads(Path(sys.argv[2]).read_text()))
