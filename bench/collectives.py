"""``python -m bench collectives``: all-gather, reduce-scatter and all-reduce, exact vs
qcomm at 8/4/2 bits vs a plain bf16 cast, in nccl-tests' layout.

The ranks are started by the benchmark itself (:func:`bench.link.run_spec`): on
loopback, or with ``--link RATE`` as two hosts (network namespaces) joined by a link
shaped to RATE. Several rates (``--link loopback,1gbit,100mbit``) run one after the
other, a result file each.

Columns, as nccl-tests defines them (``world`` ranks, ``t`` the median time per call):

- ``size``: bytes of the full buffer (all-gather output, reduce-scatter input,
  all-reduce tensor); ``count``: elements per rank's input (all-gather) or output
  (reduce-scatter), elements of the tensor (all-reduce); ``type``: the element type.
- ``algbw = size / t``; ``busbw = algbw * (world-1)/world`` (all-gather, reduce-scatter) or
  ``* 2(world-1)/world`` (all-reduce): the rate each rank's link really carries for exact.

Extra columns: ``wire`` (bytes one rank sends its peers per call, qcomm.stats'
definition; the same for exact gives ``size * factor``), ``ratio`` (exact wire /
wire), ``speedup`` (exact time / time), ``rel_err`` (``|y - y_exact| / |y_exact|``
against the exact fp32 result).

Each point: warm-up calls, then the median of ``--iters`` timed calls (fewer, never
under 3, when one point would exceed ``--budget`` seconds); every timed call starts
after a barrier and counts as the slowest rank's time. ``--rounds R`` times every
variant of a point R times, the variants interleaved round by round (on a shaped link
one point's medians of 3 calls swung by a third from run to run); the row's time is the
median of all its rounds' calls, ``spread`` the range of the round medians over their
median.

Nodes (qcomm's topology): every rank is told its node (``QCOMM_NODE``). Without
``--nodes``, each rank on loopback is a node and each ``--link`` namespace is one.
``--nodes N --ranks-per-node P`` runs ``N P`` ranks as N nodes of P (``--rank-order``
node-major or round-robin); with ``--link RATE`` (N = 2) each node is one network
namespace: the ranks of a node talk over its own address, unshaped, the nodes over
the shaped veth. On loopback the nodes are node ids only (bytes, not times, mean
something). The default configs are then ``exact``, ``bits=8,topology=flat`` and
``bits=8,topology=auto``::

    python -m bench collectives --nodes 2 --ranks-per-node 2 --link 100mbit --rounds 5

``--overlap`` adds what ``async_op=True`` is for (DDP's reducer, FSDP2's prefetching
all-gathers): per round and variant (but ``bf16``), the call then as much compute as the
call takes (256 x 256 matmuls, calibrated once), ``serial``, against the call with
``async_op=True``, the compute, then ``wait()``, ``overlap``; ``overlap/serial`` is 0.5
where the two hide each other fully, 1.0 where nothing overlaps (``async=0``);
``issue/call``: two async calls back to back, the longest the second took to return
over all tries, over the call's median time (a call must not wait for the one before
it runs: ~0.01, not ~1)::

    python -m bench collectives --link 100mbit --overlap --sizes 2^23 --rounds 3 \
        --collectives all_gather,reduce_scatter --config exact --config bits=8 \
        --config bits=8,async=0

``--sizes 2^23`` is 8 MiB per rank (each rank's all-gather shard and reduce-scatter
output, fp32) at 4 ranks.

Configs (``--config``, one variant each; its text labels the rows): ``exact`` (the inner
gloo/NCCL collective), ``bf16`` (a cast around it), else qcomm's keys
(:func:`qcomm.config.env_from_keys`: ``bits=4``, ``bits=8,topology=flat``, ...), a
:func:`qcomm.wrap` of the group with that config over the ``QCOMM_*`` environment; the
default ``exact``, ``bits=8``, ``bits=4``, ``bits=2``, ``bf16``. Columns added for
nodes: ``inter(B)`` / ``intra(B)``, the bytes one rank sends per call to
peers on other nodes / on its own (qcomm.stats' ``inter_node_bytes`` /
``intra_node_bytes``, averaged over the ranks; for exact and bf16 the same
direct-exchange count from the layout), and ``vs_flat`` (a ``topology=auto`` config's
time against the same config with ``topology=flat``). A ``bits=auto`` config adds what
its model chose for the point and the two times it predicted, beside the measured
``time(us)`` (the model is measured at the config's first call, in the warm-up)::

    python -m bench collectives --link 1gbit --config exact --config bits=8 \
        --config bits=auto --sizes 2^16..2^26:2
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import common
from .common import Column
from .link import (
    LinkError,
    ShapedLink,
    add_layout_arguments,
    default_nodes,
    layout_name,
    link_shaping,
    node_layout,
    parse_link,
    pin_this_rank,
    run_spec,
    worker_done,
)

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
BUS_FACTOR = {"all_gather": lambda w: (w - 1) / w, "reduce_scatter": lambda w: (w - 1) / w,
              "all_reduce": lambda w: 2 * (w - 1) / w}
CONFIGS = ("exact", "bits=8", "bits=4", "bits=2", "bf16")  # the default
NODE_CONFIGS = ("exact", "bits=8,topology=flat", "bits=8,topology=auto")  # with --nodes
BASELINES = ("exact", "bf16")  # torch's own calls, not qcomm configs
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MATMUL = 256  # --overlap's compute unit: a 256 x 256 fp32 matmul (~0.5-2 ms on one core)


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """``--config``: ``bf16``, or :func:`common.parse_config`'s keys (``exact`` too)."""
    return (text.strip(), {}) if text.strip() == "bf16" else common.parse_config(text)


# --------------------------------------------------------------------------- ranks


@dataclass
class Case:
    """One collective at one size on this rank: its input, output and exact answer."""

    coll: str
    numel: int  # elements of the full buffer (nccl-tests' size / itemsize)
    world: int
    rank: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(1000 * self.rank + self.numel)
        shard = self.numel // self.world
        n_in = shard if self.coll == "all_gather" else self.numel
        self.inp = torch.randn(n_in, generator=g).to(self.device, self.dtype)
        n_out = shard if self.coll == "reduce_scatter" else self.numel
        self.out = torch.empty(n_out, dtype=self.dtype, device=self.device)
        self.count = self.numel if self.coll == "all_reduce" else shard

    def reset(self) -> None:
        """all_reduce works in place: restore its input before each call."""
        if self.coll == "all_reduce":
            self.out.copy_(self.inp)


def direct(api, case: Case, group, async_op: bool = False) -> Callable[[], object]:
    """``case``'s collective through ``api``'s direct call on ``group``:
    ``torch.distributed`` (the exact call on the plain group) or ``qcomm`` (on a config's
    qcomm group); with ``async_op`` the call returns its Work."""
    if case.coll == "all_gather":
        return lambda: api.all_gather_into_tensor(case.out, case.inp, group=group,
                                                  async_op=async_op)
    if case.coll == "reduce_scatter":
        return lambda: api.reduce_scatter_tensor(case.out, case.inp, group=group,
                                                 async_op=async_op)
    return lambda: api.all_reduce(case.out, group=group, async_op=async_op)


def _bf16(case: Case, group, dist) -> Callable[[], None]:
    """Cast to bf16, the exact collective in bf16, cast back: the naive 2x."""
    low_in = torch.empty_like(case.inp, dtype=torch.bfloat16)
    low_out = torch.empty_like(case.out, dtype=torch.bfloat16)

    def call():
        if case.coll == "all_reduce":
            low_out.copy_(case.out)
            dist.all_reduce(low_out, group=group)
        else:
            low_in.copy_(case.inp)
            if case.coll == "all_gather":
                dist.all_gather_into_tensor(low_out, low_in, group=group)
            else:
                dist.reduce_scatter_tensor(low_out, low_in, group=group)
        case.out.copy_(low_out)

    return call


class Timer:
    """The one timing loop of every rank: warm-up, barrier before each call, the slowest
    rank's time per call, median; the iteration count agreed by all ranks."""

    def __init__(self, group, dist, device: torch.device, iters: int, warmup: int,
                 budget_s: float):
        self.group, self.dist, self.device = group, dist, device
        self.sync = common.sync_fn(device)
        self.iters, self.warmup, self.budget = iters, warmup, budget_s

    def _max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def times(self, fn: Callable[[], object],
              before: Callable[[], None] | None = None) -> list[float]:
        """Seconds of each timed call (the slowest rank's), after the warm-up."""
        def barrier_then():
            if before is not None:
                before()
            self.dist.barrier(group=self.group)

        warm = common.time_calls(fn, max(1, self.warmup), before=barrier_then, sync=self.sync)
        estimate = self._max([min(warm)])[0]
        n = common.plan_iters(estimate, self.iters, self.budget)
        return self._max(common.time_calls(fn, n, before=barrier_then, sync=self.sync))


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _call(case: Case, variant: str, vgroup, dist, async_op: bool = False) -> Callable:
    """``variant``'s call on ``case``; with ``async_op`` it returns the Work (bf16's cast
    around the exact call has none)."""
    if variant == "bf16":
        if async_op:
            raise ValueError("bf16 has no asynchronous form")
        return _bf16(case, vgroup, dist)
    import qcomm

    return direct(dist if variant == "exact" else qcomm, case, vgroup, async_op)


def _compute(units: int, ab: tuple) -> None:
    """``--overlap``'s compute: ``units`` matmuls of the same operands (no drift into
    denormals)."""
    a, b, c = ab
    for _ in range(units):
        torch.mm(a, b, out=c)


def _overlap(case: Case, variant: str, vgroup, dist, timer: Timer, units: int,
             ab: tuple) -> tuple[list[float], list[float]]:
    """``--overlap``: the call then ``units`` of compute (serial), and the call with
    ``async_op=True``, the compute, then ``wait()`` (overlapped); each call's seconds."""
    sync, start = _call(case, variant, vgroup, dist), _call(case, variant, vgroup, dist, True)

    def overlapped():
        work = start()
        _compute(units, ab)
        work.wait()

    return (timer.times(lambda: (sync(), _compute(units, ab)), before=case.reset),
            timer.times(overlapped, before=case.reset))


def _issue(case: Case, variant: str, vgroup, dist, timer: Timer) -> list[float]:
    """``--overlap``'s issue time: two calls with ``async_op=True`` back to back, the
    seconds the second takes to return (it must not wait for the first to run: a few
    percent of a call's time), each timed try's, the slowest rank's."""
    start, seconds = _call(case, variant, vgroup, dist, True), []

    def two():
        first = start()
        t0 = time.perf_counter()
        second = start()
        seconds.append(time.perf_counter() - t0)
        first.wait()
        second.wait()

    timed = len(timer.times(two, before=case.reset))
    return timer._max(seconds[-timed:])


def _split_bytes(row: dict, stat, case: Case, nodes: list[int], group, dist) -> None:
    """``intra`` / ``inter``: this call's bytes to peers on this rank's node / on other
    nodes, averaged over the ranks. qcomm variants: their stats (without node counters,
    all as inter); exact and bf16: ``wire`` spread evenly over the peers (qcomm.stats'
    direct-exchange count)."""
    if stat is not None:
        intra = getattr(stat, "intra_node_bytes", 0)
        inter = getattr(stat, "inter_node_bytes", stat.wire_bytes - intra)
    else:
        same = nodes.count(nodes[case.rank]) - 1
        intra = row["wire"] * same / (case.world - 1)
        inter = row["wire"] - intra
    t = torch.tensor([intra, inter], dtype=torch.float64, device=case.device)
    dist.all_reduce(t, group=group)
    row["intra"], row["inter"] = (t / case.world).tolist()


def _measure(case: Case, variant: str, rounds: list[list[float]], ref: torch.Tensor, group,
             vgroup, cfg, dist, spec: dict) -> dict:
    """One row from ``variant``'s timed rounds on ``case`` (``cfg``: its CommConfig,
    None for a baseline): its time, then (one call more) its error, wire bytes and their
    split by node."""
    import qcomm

    fn = _call(case, variant, vgroup, dist)
    t = statistics.median(x for r in rounds for x in r)
    medians = [statistics.median(r) for r in rounds]
    case.reset()
    qcomm.stats(vgroup, reset=True)
    fn()  # once more, untimed: the error and the bytes this call put on the wire
    itemsize = case.inp.element_size()
    size = case.numel * itemsize
    factor = BUS_FACTOR[case.coll](case.world)
    exact_wire = int(size * factor)
    q = getattr(cfg, case.coll, None)
    # auto, and some node holds several ranks: the call may run two-level
    two_level = (cfg is not None and cfg.topology == "auto"
                 and max(spec["nodes"].count(n) for n in spec["nodes"]) > 1)
    row = {"collective": case.coll, "variant": variant, "size": size, "count": case.count,
           "type": spec["dtype"], "time_us": t * 1e6, "algbw": size / t / 1e9,
           "busbw": size / t / 1e9 * factor, "rel_err": _rel_err(case.out, ref),
           "world": case.world, "link": spec["link"], "bits": q and q.bits,
           "two_level": two_level, "layout": spec["layout"], "rank_bytes": case.count * itemsize,
           "rounds": len(rounds), "round_us": [m * 1e6 for m in medians],
           "best_us": min(x for r in rounds for x in r) * 1e6,  # the fastest timed call
           "spread": (max(medians) - min(medians)) / statistics.median(medians)}
    stat = None
    if cfg is None:
        row["wire"] = exact_wire * 2 // itemsize if variant == "bf16" else exact_wire
    else:
        stat = qcomm.stats(vgroup, reset=True)[case.coll]
        row["wire"] = stat.wire_bytes
        row["compressed"] = stat.calls_compressed > 0
        if stat.auto_exact + stat.auto_compressed:  # bits=auto: its choice and why
            row.update(auto="compressed" if stat.auto_compressed else "exact",
                       pred_exact_us=stat.predicted_exact_s * 1e6,
                       pred_compressed_us=stat.predicted_compressed_s * 1e6)
    row["ratio"] = exact_wire / row["wire"] if row["wire"] else float("nan")
    _split_bytes(row, stat, case, spec["nodes"], group, dist)
    return row


def _compare(point: list[dict]) -> None:
    """Within one point: ``speedup`` over exact, and each auto row's ``vs_flat``."""
    by = {r["variant"]: r for r in point}
    for row in point:
        if "exact" in by:
            row["speedup"] = by["exact"]["time_us"] / row["time_us"]
        flat = by.get(common.flat_twin(row["variant"]))
        if flat:
            row["vs_flat"] = flat["time_us"] / row["time_us"]


@torch.no_grad()  # as the collectives run: the compiled codec recompiles on grad mode
def worker(spec: dict) -> None:
    """One rank: run the sweep; rank 0's result is the rows (:func:`worker_done`)."""
    import torch.distributed as dist

    import qcomm
    from qcomm.config import comm_config_from_env

    start = time.monotonic()
    pin_this_rank()
    device = torch.device("cpu")
    if spec["backend"] == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(spec["backend"], device_id=device if device.type == "cuda" else None,
                            timeout=datetime.timedelta(seconds=spec["op_timeout"]))
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[spec["dtype"]]
    timer = Timer(group, dist, device, spec["iters"], spec["warmup"], spec["budget"])
    variants = [label for label, _ in spec["configs"]]
    # each config's CommConfig, its variables over the environment's (None: a baseline),
    # and the group it calls: a qcomm.wrap of the plain one, made in one order everywhere
    cfgs = {label: None if label in BASELINES else comm_config_from_env({**os.environ, **env})
            for label, env in spec["configs"]}
    vgroups = {v: group if c is None else qcomm.wrap(group, c) for v, c in cfgs.items()}
    rows = []
    where = spec["link"] + (f" {spec['layout']}" if spec["layout"] else "")
    if spec["overlap"]:  # the compute unit, calibrated once: the slowest rank's
        ab = (torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL),
              torch.empty(MATMUL, MATMUL))
        unit = min(timer.times(lambda: _compute(20, ab))) / 20
    if rank == 0:
        print(f"# {where}: {world} ranks up ({time.monotonic() - start:.1f} s)",
              file=sys.stderr, flush=True)
    for coll in spec["collectives"]:
        for numel in spec["sizes"]:
            case = Case(coll, numel, world, rank, dtype, device)
            case.reset()
            direct(dist, case, group)()
            ref = case.out.clone()  # the exact fp32 answer for rel_err
            times = {v: [] for v in variants}
            serial, overlapped, issued = ({v: [] for v in variants} for _ in range(3))
            for k in range(spec["rounds"]):  # interleaved, each round from the next variant
                for v in variants[k % len(variants):] + variants[:k % len(variants)]:
                    times[v].append(timer.times(_call(case, v, vgroups[v], dist),
                                                before=case.reset))
                    if spec["overlap"] and v != "bf16":  # compute as long as the call
                        units = max(1, round(statistics.median(times[v][0]) / unit))
                        got = _overlap(case, v, vgroups[v], dist, timer, units, ab)
                        serial[v].append(statistics.median(got[0]))
                        overlapped[v].append(statistics.median(got[1]))
                        issued[v] += _issue(case, v, vgroups[v], dist, timer)
            point = [_measure(case, v, times[v], ref, group, vgroups[v], cfgs[v], dist, spec)
                     for v in variants]
            for row in point:
                s, o = serial[row["variant"]], overlapped[row["variant"]]
                if s:  # the medians of the rounds' medians
                    call = statistics.median(sum(times[row["variant"]], []))
                    row.update(serial_ms=statistics.median(s) * 1e3,
                               overlap_ms=statistics.median(o) * 1e3,
                               overlap=statistics.median(o) / statistics.median(s),
                               issue_max=max(issued[row["variant"]]) / call)
            _compare(point)
            rows += point
            if rank == 0:
                print(f"# {where}: {coll} {common.human_bytes(point[0]['size'])} done "
                      f"({time.monotonic() - start:.1f} s)", file=sys.stderr, flush=True)
    hosts = [None] * world  # what each rank saw: its hostname and node id
    dist.all_gather_object(hosts, {"hostname": socket.gethostname(),
                                   "node": os.environ.get("QCOMM_NODE")}, group=group)
    worker_done(spec, rank, {"rows": rows, "hosts": hosts} if rank == 0 else None)


# --------------------------------------------------------------------------- driver


def columns(*, topology: bool = False, rounds: int = 1, overlap: bool = False,
            auto: bool = False) -> list[Column]:
    """The table: nccl-tests' columns, ours, the bytes by node; ``topology``: auto's
    ``vs_flat``; ``rounds`` > 1: the spread of the round medians; ``overlap``: the
    serial and overlapped times and their ratio; ``auto``: bits=auto's choice and the
    two times its model predicted, beside ``time(us)``, the measured one."""
    cols = [Column("size", "size"), Column("count", "count"), Column("type", "type"),
            Column("variant", "variant"), Column("time_us", "time(us)", "{:.1f}"),
            Column("algbw", "algbw(GB/s)", "{:.3f}"), Column("busbw", "busbw(GB/s)", "{:.3f}"),
            Column("wire", "wire(B)"), Column("ratio", "ratio", "{:.2f}x"),
            Column("speedup", "speedup", "{:.2f}x"), Column("rel_err", "rel_err", "{:.2e}")]
    cols += [Column("inter", "inter(B)", "{:.0f}"), Column("intra", "intra(B)", "{:.0f}")]
    if topology:
        cols.append(Column("vs_flat", "vs_flat", "{:.2f}x"))
    if rounds > 1:
        cols.append(Column("spread", "spread", "{:.0%}"))
    if overlap:
        cols += [Column("serial_ms", "serial(ms)", "{:.1f}"),
                 Column("overlap_ms", "overlap(ms)", "{:.1f}"),
                 Column("overlap", "overlap/serial", "{:.2f}"),
                 Column("issue_max", "issue/call", "{:.3f}")]
    if auto:
        cols += [Column("auto", "auto"), Column("pred_exact_us", "pred_exact(us)", "{:.1f}"),
                 Column("pred_compressed_us", "pred_compr(us)", "{:.1f}")]
    return cols


def plot_busbw(folder: Path, stem: str, rows: list[dict], header: dict):
    panels = {}
    for coll in COLLECTIVES:
        sel = [r for r in rows if r["collective"] == coll]
        if sel:
            panels[coll] = {v: ([r["size"] for r in sel if r["variant"] == v],
                                [r["busbw"] for r in sel if r["variant"] == v])
                            for v in dict.fromkeys(r["variant"] for r in sel)}
    return common.plot_lines(
        folder / f"{stem}.png", panels, xlabel="size (bytes)", ylabel="bus bandwidth (GB/s)",
        suptitle=f"qcomm collectives, {header['link']}, {rows[0]['world']} ranks"
                 + (f" ({header['layout']} nodes x ranks)" if header.get("layout") else "")
                 + f", {common.machine_name(header)}", logy=True)


def run_one(args, rate: str | None) -> None:
    """Launch the ranks for one link rate; print and write the results."""
    tag = rate or "loopback"
    device = "cuda (nccl)" if args.backend == "nccl" else "cpu (gloo)"
    header = common.run_header("collectives", device=device, link=tag, command=args.command)
    nodes = args.node_of_rank or default_nodes(args.world, rate is not None)
    layout = layout_name(args.node_of_rank)
    header["layout"] = layout  # None: no --nodes (a node per rank, or per --link host)
    header["node_of_rank"] = nodes
    if rate is not None:
        header["link_shaping"] = link_shaping(rate, nodes)
    labels = [label for label, _ in args.config]
    header["sweep"] = {"sizes": args.sizes, "collectives": args.collectives,
                       "configs": labels, "iters": args.iters, "warmup": args.warmup,
                       "budget_s": args.budget, "world": args.world, "dtype": args.dtype,
                       "rounds": args.rounds, "overlap": args.overlap}
    print(common.format_header(header), flush=True)
    spec = {"sizes": args.sizes, "collectives": args.collectives,
            "configs": args.config, "iters": args.iters, "warmup": args.warmup,
            "budget": args.budget, "dtype": args.dtype, "overlap": args.overlap,
            "backend": args.backend, "rounds": args.rounds, "nodes": nodes,
            "layout": layout, "link": tag, "op_timeout": args.op_timeout}
    with ShapedLink(rate) if rate else contextlib.nullcontext() as link:
        result = run_spec("bench.collectives", spec, args.world, timeout_s=args.timeout,
                          link=link, nodes=nodes)[0]
    rows, header["ranks"] = result["rows"], result["hosts"]
    print("# ranks (node@hostname): " + ", ".join(
        f"{r} {h['node']}@{h['hostname']}" for r, h in enumerate(header["ranks"])))
    cols = columns(rounds=args.rounds, overlap=args.overlap,
                   topology=any(common.flat_twin(v) for v in labels),
                   auto=any("auto" in r for r in rows))
    folder = common.results_dir(args.out, header)
    stem = (f"collectives-{tag}" + (f"-{layout}" if layout else "")
            + ("-overlap" if args.overlap else "") + (f"-{args.tag}" if args.tag else ""))
    where = f"{args.world} ranks" + (f" ({layout} nodes x ranks)" if layout else "")
    for coll in args.collectives:
        print(f"\n# {coll}, {where}, link {tag}")
        print(common.format_table(cols, [r for r in rows if r["collective"] == coll]))
    common.write_results(folder, stem, header, cols, rows)
    print(f"# wrote {folder}/{stem}.json, .csv", file=sys.stderr)
    if not args.no_plot and plot_busbw(folder, stem, rows, header):
        print(f"# wrote {folder}/{stem}.png", file=sys.stderr)


def add_arguments(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    p.add_argument("--link", type=common.arg(parse_links), default=[None],
                   help="comma list of link rates (100mbit, 1gbit, ...), unshaped or "
                        "loopback; a rate or unshaped runs the ranks in two network "
                        "namespaces (needs root)")
    p.add_argument("--world", type=common.arg(parse_world), default=None,
                   help="ranks (split over the two hosts with --link; default 2, or one per "
                        "GPU; with --nodes: nodes x ranks per node)")
    add_layout_arguments(p)
    p.add_argument("--backend", choices=["gloo", "nccl"],
                   default="nccl" if torch.cuda.device_count() >= 2 else "gloo",
                   help="the inner backend: gloo on CPU tensors, nccl on one GPU per rank "
                        "(default where there are 2+ GPUs)")
    p.add_argument("--sizes", type=common.arg(common.parse_sizes),
                   default=common.parse_sizes("10..26:2"),
                   help="elements of the full buffer: LO..HI[:STEP] powers of two, 2^K, counts "
                        "(default 10..26:2)")
    p.add_argument("--collectives", type=common.arg(
        lambda s: common.parse_list(s, COLLECTIVES, "--collectives")), default=list(COLLECTIVES))
    p.add_argument("--config", action="append", type=common.arg(parse_config),
                   metavar="SPEC", help="one variant, repeatable: exact, bf16 or qcomm's "
                   "keys, e.g. bits=4,scheme=nuq (default: " + " ".join(CONFIGS) + ")")
    p.add_argument("--tag", default="", help="a suffix of the results' file names "
                   "(NAME-TAG.json): a run beside another of the same link and layout")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every variant of a point this many times, interleaved (the "
                        "median over all rounds' calls)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--iters", type=int, default=10, help="timed calls per point (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=float, default=5.0,
                   help="seconds per point; fewer iterations (>= 3) for slow points")
    p.add_argument("--overlap", action="store_true",
                   help="also time each call (but bf16) behind compute: async_op=True, "
                        "matmuls as long as the call, wait(), against the call then them")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per link rate, all in")
    p.add_argument("--op-timeout", type=float, default=600,
                   help="seconds one collective may block before the ranks fail")


def parse_links(text: str) -> list[str | None]:
    """``"loopback,1gbit,unshaped"`` -> ``[None, "1gbit", "unshaped"]`` (:func:`parse_link`);
    ValueError on a bad one."""
    return [parse_link(t) for t in text.split(",") if t.strip()] or [None]


def parse_world(text: str) -> int:
    world = int(text)
    if world < 2:
        raise ValueError(f"--world must be >= 2, got {world}")
    return world


def resolve(args) -> str | None:
    """Fill in the layout (``args.node_of_rank``), world and configs; the error text
    of a bad combination, else None."""
    try:
        args.node_of_rank = node_layout(args.nodes, args.ranks_per_node, args.world,
                                        args.rank_order, link=any(args.link))
    except ValueError as err:
        return str(err)
    if args.rounds < 1:
        return f"--rounds must be >= 1, got {args.rounds}"
    if args.overlap and args.backend == "nccl":
        return "--overlap times CPU matmuls against the call: it runs with --backend gloo"
    if args.node_of_rank is not None:
        args.world = len(args.node_of_rank)
    elif args.world is None:
        args.world = max(2, torch.cuda.device_count())
    if args.config is None:
        args.config = [parse_config(c) for c in (NODE_CONFIGS if args.node_of_rank
                                                 else CONFIGS)]
    uneven = [n for n in args.sizes if n % args.world]
    if uneven and set(args.collectives) & {"all_gather", "reduce_scatter"}:
        # a shard each: gloo refuses the call from inside a rank otherwise
        return (f"--sizes {', '.join(map(str, uneven))}: the full buffer must split into "
                f"{args.world} equal shards (a multiple of --world {args.world})")
    return None


def main(args) -> int:
    error = resolve(args)
    if error:
        print(f"python -m bench collectives: {error}", file=sys.stderr)
        return 2
    for rate in args.link:
        try:
            run_one(args, rate)
        except LinkError as err:
            print(f"python -m bench collectives: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker(json.loads(Path(sys.argv[2]).read_text()))
