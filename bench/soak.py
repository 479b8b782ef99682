"""``python -m bench soak``: thousands of mixed qcomm collectives on self-launched ranks,
every result checked.

    python -m bench soak                          # 10,000 collectives, 2 ranks, loopback
    python -m bench soak --count 300 --out /tmp/s # the short version the tests run

Each call draws (from one seed, identically on every rank) a collective (all-gather,
reduce-scatter, all-reduce), a size log-uniform in 1..2^``--max-log2`` elements (per
rank's contribution; all-reduce: the tensor), a dtype (float32, bfloat16, float16, and
int32 that always goes exact), an op (SUM, AVG; MAX goes exact), synchronous or async.
Every rank regenerates every rank's input from the seed, so each result is checked
locally without a second collective: exact calls bit for bit against the exact sum
(2 ranks: a two-term float sum does not depend on order), compressed calls against
the codec's bound (a stochastic min-max code is off by less than one step
``(max - min) / (2^b - 1)`` of its bucket; sums add the peers' steps, the
all-reduce's re-quantization one more step of the reduced bucket).

Memory: resident set size every ``--sample`` calls, read after ``malloc_trim(0)`` hands
back the freed heap glibc keeps for reuse (without it the figure swings by +-20% with
whatever the last calls freed: measured here 380-506 MiB over 10,000 calls, no trend);
the untrimmed figure is kept as ``rss_raw_mib``. Growth is measured from the end of
warm-up (the first ``--warmup`` fraction of calls) to the end, and must stay under
``--max-growth`` percent. The group's payload buffer cache (grow-only, bounded per
buffer) is reported alongside: its size must not change after warm-up beyond what
larger sizes first seen late require.

Results (rank 0): ``soak.json`` / ``soak.csv`` under ``bench/results/<machine>/`` (or
``--out``): the run header, memory figures, and one row per (collective, dtype, path)
with calls and the worst error as a fraction of its bound.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from qcomm import QuantConfig
from qcomm.oracle import minmax_steps

from . import common
from .common import Column
from .link import pin_this_rank, run_spec, worker_done

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int32": torch.int32}
# Asynchronous calls kept in flight before they are waited for and checked.
MAX_PENDING = 4


def plan(seed: int, count: int, max_log2: int) -> list[dict]:
    """The calls, drawn from ``seed`` (the same list on every rank)."""
    rng = random.Random(seed)
    calls = []
    for i in range(count):
        kind = rng.choice(KINDS)
        dtype = rng.choices(list(DTYPES), weights=[4, 2, 2, 1])[0]
        op = "none" if kind == "all_gather" else rng.choices(
            ["SUM", "AVG", "MAX"], weights=[4, 4, 1])[0]
        if dtype == "int32" and op == "AVG":  # an integer mean is not defined alike everywhere
            op = "SUM"
        calls.append({
            "i": i, "kind": kind, "dtype": dtype, "op": op,
            "numel": max(1, int(2 ** rng.uniform(0, max_log2))),
            "async": rng.random() < 0.3,
        })
    return calls


def make_input(seed: int, call: dict, rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + call["i"]) * 64 + rank)
    dtype = DTYPES[call["dtype"]]
    if dtype == torch.int32:
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int32)
    return (torch.randn(numel, generator=g) * (1 + rank)).to(dtype)


def bucket_steps(x: torch.Tensor, bits: int, bucket: int) -> torch.Tensor:
    """Per-element quantization step of ``x``'s min-max bucket (buckets from index 0)."""
    return minmax_steps(x, QuantConfig(bits=bits, bucket_size=bucket))


class Checker:
    """What one call must produce, from every rank's regenerated input."""

    def __init__(self, seed: int, world: int, rank: int, q, min_numel: int) -> None:
        self.seed, self.world, self.rank, self.q, self.min_numel = seed, world, rank, q, min_numel
        self.worst: dict[tuple, dict] = {}

    def compressed(self, call: dict) -> bool:
        dtype = DTYPES[call["dtype"]]
        return dtype.is_floating_point and call["op"] != "MAX" and call["numel"] >= max(
            self.min_numel, 1)

    def check(self, call: dict, result: torch.Tensor) -> None:
        w, r, n = self.world, self.rank, call["numel"]
        kind, dtype = call["kind"], DTYPES[call["dtype"]]
        big = n if kind == "all_reduce" else (w * n if kind == "reduce_scatter" else n)
        xs = [make_input(self.seed, call, p, big) for p in range(w)]
        compressed = self.compressed(call)
        if kind == "all_gather":
            want = torch.cat(xs).double()
            limit = (torch.cat([bucket_steps(x, self.q.bits, self.q.bucket_size) for x in xs])
                     if compressed else None)
        else:
            stack = torch.stack([x.double() for x in xs])
            total = stack.amax(0) if call["op"] == "MAX" else stack.sum(0)
            scale = 1.0 / w if call["op"] == "AVG" else 1.0
            if kind == "reduce_scatter":
                want = total[r * n:(r + 1) * n] * scale
                limit = None
                if compressed:
                    limit = sum(bucket_steps(xs[p][r * n:(r + 1) * n], self.q.bits,
                                             self.q.bucket_size)
                                for p in range(w) if p != r).double() * scale
            else:
                want = total * scale
                limit = self._all_reduce_limit(xs, total, scale) if compressed else None
        if not compressed and not dtype.is_floating_point:
            ok = torch.equal(result.double(), want)
            ratio = 0.0 if ok else math.inf
        elif not compressed:
            # exact float path: the two-term sum is order-free; AVG divides once more,
            # and the output dtype rounds
            slack = torch.finfo(dtype).eps * want.abs() + 1e-30
            err = (result.double() - want).abs()
            ratio = float((err / slack).max()) if err.numel() else 0.0
            ok = bool((err <= slack).all())
        else:
            # the output dtype's own rounding of the answer on top of the codec's bound
            slack = limit * 1.001 + 2 * torch.finfo(dtype).eps * want.abs() + 1e-6
            err = (result.double() - want).abs()
            ratio = float((err / slack).max())
            ok = bool((err <= slack).all())
        key = (kind, call["dtype"], "compressed" if compressed else "exact")
        row = self.worst.setdefault(key, {"calls": 0, "worst": 0.0})
        row["calls"] += 1
        row["worst"] = max(row["worst"], ratio)
        if not ok:
            raise AssertionError(f"rank {r}: call {call} out of bound: worst error is "
                                 f"{ratio:.3g}x its allowance")

    def _all_reduce_limit(self, xs, total, scale):
        """Peers' steps on each chunk, then one step of the reduced chunk's bucket
        (its range widened by the first phase's error), all in chunk coordinates."""
        w, bits, bucket = self.world, self.q.bits, self.q.bucket_size
        n = total.numel()
        chunk = -(-n // w)
        padded = [torch.nn.functional.pad(x.double(), (0, chunk * w - n)) for x in xs]
        tot = torch.nn.functional.pad(total, (0, chunk * w - n)) * scale
        limits = []
        for j in range(w):
            part = slice(j * chunk, (j + 1) * chunk)
            first = sum(bucket_steps(padded[p][part], bits, bucket)
                        for p in range(w) if p != j).double() * scale
            # re-quantized: the reduced chunk's range, widened by twice the first error
            widest = torch.nn.functional.pad(first, (0, (-chunk) % bucket)).view(-1, bucket)
            widen = (2 * widest.amax(1)).repeat_interleave(bucket)[:chunk]
            second = bucket_steps(tot[part], bits, bucket).double() + widen / (2**bits - 1)
            limits.append(first + second)
        return torch.cat(limits)[:n]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trimmed_rss_bytes() -> int:
    """Resident bytes once garbage and glibc's free heap are handed back."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the raw figure
        pass
    return _rss_bytes()


def _run_call(call: dict, seed: int, rank: int, world: int, group, dist):
    """Issue one call; returns (work or None, result tensor)."""
    from torch.distributed import ReduceOp

    n, kind = call["numel"], call["kind"]
    op = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "MAX": ReduceOp.MAX}.get(call["op"])
    if kind == "all_gather":
        x = make_input(seed, call, rank, n)
        out = torch.empty(world * n, dtype=x.dtype)
        work = dist.all_gather_into_tensor(out, x, group=group, async_op=call["async"])
    elif kind == "reduce_scatter":
        x = make_input(seed, call, rank, world * n)
        out = torch.empty(n, dtype=x.dtype)
        work = dist.reduce_scatter_tensor(out, x, op=op, group=group, async_op=call["async"])
    else:
        out = make_input(seed, call, rank, n)
        work = dist.all_reduce(out, op=op, group=group, async_op=call["async"])
    return work, out


@torch.no_grad()
def worker(spec: dict) -> None:
    """One rank: run the calls, check each, sample memory; rank 0 writes the summary."""
    import torch.distributed as dist

    import qcomm
    from qcomm.driver import group_state

    pin_this_rank()
    dist.init_process_group("qcomm", timeout=datetime.timedelta(seconds=spec["op_timeout"]))
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    state = group_state(group)
    checker = Checker(spec["seed"], world, rank, state.config.all_gather,
                      state.config.min_numel)
    calls = plan(spec["seed"], spec["count"], spec["max_log2"])
    warm_end = max(1, int(len(calls) * spec["warmup"]))
    samples, pending = [], []
    start = time.monotonic()
    rss_warm = cache_warm = None
    for call in calls:
        work, out = _run_call(call, spec["seed"], rank, world, group, dist)
        if work is not None:
            pending.append((work, call, out))
        else:
            checker.check(call, out)
        if len(pending) >= MAX_PENDING or work is None:
            for w, c, o in pending:
                w.wait()
                checker.check(c, o)
            pending.clear()
        done = call["i"] + 1
        if done % spec["sample"] == 0 or done == len(calls) or done == warm_end:
            raw = _rss_bytes()
            rss = _trimmed_rss_bytes()
            samples.append({"call": done, "rss_mib": rss / 2**20, "rss_raw_mib": raw / 2**20,
                            "cache_mib": state.buffers.nbytes() / 2**20,
                            "seconds": time.monotonic() - start})
            if done == warm_end:
                rss_warm, cache_warm = rss, state.buffers.nbytes()
            if rank == 0 and done % (spec["sample"] * 10) == 0:
                print(f"# soak: {done}/{len(calls)} calls, rss {samples[-1]['rss_mib']:.0f} MiB, "
                      f"{samples[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    for w, c, o in pending:
        w.wait()
        checker.check(c, o)
    dist.barrier()
    rss_end = _trimmed_rss_bytes()
    after = [s["rss_mib"] for s in samples if s["call"] >= warm_end]
    half = next(s["rss_mib"] for s in samples if s["call"] >= len(calls) // 2)
    memory = {
        "rank": rank,
        "rss_warm_mib": rss_warm / 2**20, "rss_end_mib": rss_end / 2**20,
        "rss_max_after_warm_mib": max(after),
        "growth_pct": 100 * (rss_end - rss_warm) / rss_warm,
        "growth_max_pct": 100 * (max(after) * 2**20 - rss_warm) / rss_warm,
        # the second half alone: a leak keeps growing there, warm-up effects do not
        "growth_late_pct": 100 * (rss_end / 2**20 - half) / half,
        "cache_warm_mib": cache_warm / 2**20,
        "cache_end_mib": state.buffers.nbytes() / 2**20,
        "seconds": time.monotonic() - start,
    }
    stats = {k: vars(v) for k, v in qcomm.stats(group).items()}
    result = {"memory": memory, "samples": samples, "stats": stats,
              "rows": [{"collective": k[0], "dtype": k[1], "path": k[2], **v}
                       for k, v in sorted(checker.worst.items())]}
    worker_done(spec, rank, result)


COLUMNS = [Column("collective", "collective"), Column("dtype", "dtype"), Column("path", "path"),
           Column("calls", "calls"), Column("worst", "worst err/bound", "{:.3f}")]


def add_arguments(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    p.add_argument("--count", type=int, default=10_000, help="collectives (default 10000)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-log2", type=int, default=20, help="largest size 2^N elements")
    # 0.2: the grow-only buffer cache keeps growing while ever larger sizes first appear
    # per (role, dtype); measured here it held 86% of its final 18.6 MiB after 10% of the
    # calls and 95% after 20% (RSS growth from 10%: +4.6% / +5.0%, from 50%: +0.5%).
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of calls before "
                   "memory growth is measured (default 0.2)")
    p.add_argument("--sample", type=int, default=100, help="calls between RSS samples")
    p.add_argument("--max-growth", type=float, default=5.0,
                   help="fail if RSS grows more than this percent after warm-up")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    p.add_argument("--op-timeout", type=float, default=120,
                   help="seconds one collective may block before the ranks fail")


def main(args) -> int:
    header = common.run_header("soak", device="cpu (gloo)", command=args.command)
    header["soak"] = {k: getattr(args, k) for k in ("count", "world", "seed", "max_log2",
                                                    "warmup", "sample", "max_growth")}
    header["env"] = {k: v for k, v in os.environ.items() if k.startswith("QCOMM_")}
    print(common.format_header(header), flush=True)
    spec = {"count": args.count, "seed": args.seed, "max_log2": args.max_log2,
            "warmup": args.warmup, "sample": args.sample, "op_timeout": args.op_timeout}
    ranks = run_spec("bench.soak", spec, args.world, timeout_s=args.timeout)
    rows = ranks[0]["rows"]
    header["memory"] = [r["memory"] for r in ranks]
    header["stats_rank0"] = ranks[0]["stats"]
    header["samples_rank0"] = ranks[0]["samples"]
    folder = common.report("soak", header, COLUMNS, rows, args.out, "soak")
    bad = [m for m in header["memory"] if m["growth_pct"] > args.max_growth]
    for m in header["memory"]:
        print(f"# rank {m['rank']}: rss {m['rss_warm_mib']:.1f} MiB after warm-up -> "
              f"{m['rss_end_mib']:.1f} MiB at the end ({m['growth_pct']:+.2f}%, peak "
              f"{m['growth_max_pct']:+.2f}%, second half {m['growth_late_pct']:+.2f}%); "
              f"buffer cache {m['cache_warm_mib']:.1f} -> "
              f"{m['cache_end_mib']:.1f} MiB; {m['seconds']:.0f} s")
    print(f"# {args.count} collectives checked on {args.world} ranks; results in {folder}")
    if bad:
        print(f"# FAIL: resident memory grew more than {args.max_growth}% after warm-up",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker(json.loads(Path(sys.argv[2]).read_text()))
