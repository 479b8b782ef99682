"""``python -m bench breakeven``: what a compressed all-gather, reduce-scatter and all-reduce
cost one rank at W ranks, measured on one device, and the fastest link on which they still pay.

One process plays rank 0 of ``--worlds`` ranks over simulated peers
(:mod:`bench.simulated`: every exchange completes at once, each peer's payload a copy of
this rank's), so the whole compressed call runs (codec, descriptor, header checks, the
decode of W rows) on one GPU or one core. Per collective, width, W and size (elements
per rank), the median of ``--iters`` calls after a warm-up:

- ``call``: the call's wall time on the host (CUDA: synchronized after), and on CUDA
  ``device``, its time on the GPU's clock (events);
- ``exchange``: the part spent in the copies that stand in for the network (a real
  transfer's bytes go by the NIC), subtracted: ``codec = call - exchange``;
- ``codec calls``: qcomm.codec calls a call makes (constant in W: one per piece);
- ``launches``: what one call puts on the device: on CUDA its kernels by
  ``torch.profiler`` (CUDA activity), split into compute kernels, ``Memcpy`` and
  ``Memset`` (the copies that stand in for the network are among the memcpys); on CPU
  the torch path's graph and loop calls (``qcomm.cpu.common.calls``);
- ``saved``: the bytes the call does not send, ``logical - wire`` of ``qcomm.stats``
  (control included);
- ``break-even``: ``saved / codec``, the per-rank link bandwidth at which the codec's
  time equals the transfer time it saves. On any slower link compression pays (the
  codec could even run unoverlapped); on a faster one it costs.

First, per collective and W, what qcomm's exact path costs over the call it makes: the
same call sent exact (``with qcomm.exact()``) against the inner group's own method
called directly, ``--exact-numel`` elements a rank, host time a call (CUDA: calls back
to back, synchronized once a block, so the host's cost is what shows); the header's
``exact_path``.

Exit status 1 when nothing was measured or a compressed call saved no bytes, 130 when
interrupted (Ctrl-C, ``timeout -s INT``): what was measured by then is written all the
same. :func:`target_lines` judges the results against their targets
(``bench/device_check.sh`` prints them).

    python -m bench breakeven                        # CPU: 2^16..2^20, W = 8, 64
    python -m bench breakeven --device cuda --sizes 20..26:2
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch
import torch.distributed as dist

from . import common
from .collectives import Case, direct
from .common import Column
from .simulated import simulated_group

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def columns(device: str) -> list[Column]:
    cols = [Column("collective", "collective"), Column("bits", "bits"), Column("world", "W"),
            Column("numel", "numel/rank"), Column("call_ms", "call(ms)", "{:.3f}"),
            Column("device_ms", "device(ms)", "{:.3f}"),
            Column("exchange_ms", "exchange(ms)", "{:.3f}"),
            Column("codec_ms", "codec(ms)", "{:.3f}"), Column("codec_calls", "codec calls"),
            Column("launches", "launches")]
    if device == "cuda":
        cols += [Column("kernels", "kernels"), Column("memcpy", "memcpy"),
                 Column("memset", "memset")]
    return cols + [Column("saved_mib", "saved(MiB)", "{:.2f}"),
                   Column("breakeven_gbs", "break-even(GB/s)", "{:.2f}")]


def add_arguments(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    p.add_argument("--device", default="cuda" if on_gpu else "cpu")
    p.add_argument("--sizes", type=common.arg(common.parse_sizes),
                   default=common.parse_sizes("20..26:2" if on_gpu else "16..20:2"),
                   help="elements per rank (default 2^16..2^20 on CPU, 2^20..2^26 on CUDA)")
    p.add_argument("--worlds", type=common.arg(lambda s: [int(w) for w in s.split(",")]),
                   default=[8, 64])
    p.add_argument("--bits", type=common.arg(lambda s: [int(b) for b in s.split(",")]),
                   default=[8, 4])
    p.add_argument("--collectives", type=common.arg(
        lambda s: common.parse_list(s, COLLECTIVES, "collective")), default=list(COLLECTIVES))
    p.add_argument("--iters", type=int, default=5, help="timed calls per point (median)")
    p.add_argument("--exact-numel", type=common.arg(common.parse_sizes),
                   default=[1 << 12], help="elements a rank of the exact path's calls "
                   "(default 2^12: the copies that stand in for the network stay short; "
                   "one size)")


def launches(fn, device: torch.device) -> dict:
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


def measure(collective: str, world: int, n: int, bits: int, device: torch.device,
            iters: int) -> dict:
    import qcomm
    from qcomm import codec

    group = simulated_group(world, bits)
    sim = group.inner
    case = Case(collective, world * n, world, 0, torch.float32, device)
    fn = direct(qcomm, case, group)

    def call():
        case.reset()  # the all-reduce works in place: its simulated sum grows W-fold a call
        fn()

    sync = common.sync_fn(device)
    call()  # warm-up: compile, buffers, the config agreement
    launched = launches(call, device)
    qcomm.stats(group, reset=True)
    sim.seconds, codec.calls = 0.0, type(codec.calls)()
    walls, devices = [], []
    for _ in range(iters):
        sync()
        if device.type == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            end_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        start = time.perf_counter()
        call()
        sync()
        walls.append(time.perf_counter() - start)
        if device.type == "cuda":
            end_event.record()
            end_event.synchronize()
            devices.append(start_event.elapsed_time(end_event) / 1e3)
    s = qcomm.stats(group)[collective]
    call_s = statistics.median(walls)
    exchange_s = sim.seconds / iters
    codec_s = max(call_s - exchange_s, 1e-9)
    saved = (s.logical_bytes - s.wire_bytes) / iters
    return {"collective": collective, "bits": bits, "world": world, "numel": n,
            "call_ms": 1e3 * call_s,
            "device_ms": 1e3 * statistics.median(devices) if devices else None,
            "exchange_ms": 1e3 * exchange_s, "codec_ms": 1e3 * codec_s,
            "codec_calls": sum(codec.calls.values()) // iters, **launched,
            "saved_mib": saved / 2**20, "breakeven_gbs": saved / codec_s / 1e9}


def _exact_group(world: int):
    """A simulated group (:func:`simulated_group`) whose peers also answer an exact
    reduce-scatter: every peer holds this rank's input, so this rank's chunk, W times."""
    group = simulated_group(world)
    peers = group.inner

    def reduce_scatter(out, inp, opts=None):
        chunk = inp.view(peers.size(), -1)[peers.rank()]
        return peers._timed(lambda: torch.mul(chunk, peers.size(), out=out.view(-1)))

    peers.reduce_scatter_single = peers._reduce_scatter_base = reduce_scatter
    return group


def exact_path(collective: str, world: int, n: int, device: torch.device,
               blocks: int = 9, calls: int = 10) -> dict:
    """Host microseconds a call of ``collective`` sent exact through qcomm
    (``exact_us``) and of the inner group's method it reaches called directly
    (``inner_us``), ``n`` elements a rank at W = ``world``; ``over_us`` the difference.
    Medians over ``blocks`` blocks of ``calls`` calls each, the two kinds alternating."""
    import qcomm
    from qcomm import inner as I

    group = _exact_group(world)
    peers = group.inner
    case = Case(collective, world * n, world, 0, torch.float32, device)
    through = direct(qcomm, case, group)
    inner_calls = {"all_reduce": lambda: I.all_reduce(peers, case.out, dist.ReduceOp.SUM),
                   "all_gather": lambda: I.all_gather(peers, case.out, case.inp),
                   "reduce_scatter": lambda: I.reduce_scatter(peers, case.out, case.inp,
                                                              dist.ReduceOp.SUM)}
    inner = inner_calls[collective]

    def exact():
        with qcomm.exact():
            through()

    sync = common.sync_fn(device)
    times: dict[str, list[float]] = {"exact": [], "inner": []}
    for fn in (exact, inner):  # warm-up: the group's first call agrees on its config
        fn()
    for _ in range(blocks):
        for name, fn in (("exact", exact), ("inner", inner)):
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times[name].append((time.perf_counter() - start) / calls)
    exact_us = 1e6 * statistics.median(times["exact"])
    inner_us = 1e6 * statistics.median(times["inner"])
    return {"collective": collective, "world": world, "numel": n, "exact_us": exact_us,
            "inner_us": inner_us, "over_us": exact_us - inner_us}


def main(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench breakeven --device cuda: torch sees no CUDA device here")
    header = common.start_local("breakeven", args, {
        "sizes": args.sizes, "worlds": args.worlds, "bits": args.bits,
        "collectives": args.collectives, "iters": args.iters,
        "exact_numel": args.exact_numel[0]})
    header["exact_path"] = rows_exact = []
    rows: list[dict] = []
    points = len(args.collectives) * (1 + len(args.bits) * len(args.sizes)) * len(args.worlds)
    interrupted = False
    try:
        for world in args.worlds:  # W = 8 first where the device check asks so
            for collective in args.collectives:
                rows_exact.append(exact_path(collective, world, args.exact_numel[0], device))
        # in the order given, every collective at a point before the next point: a run cut
        # short has the first points of all three (the device check lists its targets'
        # first)
        for bits in args.bits:
            for world in args.worlds:
                for n in args.sizes:
                    for collective in args.collectives:
                        rows.append(measure(collective, world, n, bits, device, args.iters))
    except KeyboardInterrupt:  # Ctrl-C (or `timeout -s INT`): keep what was measured
        interrupted = True
        print(f"# interrupted after {len(rows_exact) + len(rows)} of {points} points: "
              "reporting those", file=sys.stderr, flush=True)
    header["sweep"]["points_measured"] = len(rows_exact) + len(rows)
    rows.sort(key=lambda r: (COLLECTIVES.index(r["collective"]), -r["bits"], r["world"],
                             r["numel"]))
    common.report("breakeven", header, columns(device.type), rows, args.out,
                  f"breakeven-{device.type}")
    for r in rows_exact:
        print(f"#  exact {r['collective']}, W = {r['world']}: {r['exact_us']:.1f} us a call "
              f"through qcomm, {r['inner_us']:.1f} us the inner call: {r['over_us']:+.1f} us")
    for r in rows:
        if r["world"] == 8 and r["bits"] == 8 and r["numel"] == max(args.sizes):
            print(f"#  {r['collective']}, W = 8, 8 bits, {r['numel']} elements a rank: "
                  f"compression pays on links up to {r['breakeven_gbs']:.2f} GB/s a rank "
                  f"(codec {r['codec_ms']:.2f} ms a call)")
    unsaved = [r for r in rows if not r["saved_mib"] > 0]
    for r in unsaved:
        print(f"# breakeven: {r['collective']} at {r['bits']} bits, W = {r['world']}, "
              f"{r['numel']} elements saved no bytes: nothing compressed", file=sys.stderr)
    if not rows or unsaved:
        if not rows:
            print("# breakeven: no compressed call measured", file=sys.stderr)
        return 1
    return 130 if interrupted else 0


# Targets (issue #43): at W = 8, 2^24 elements a rank, 8 bits, compression pays on links
# up to 1 TB/s a GPU at least; the exact path within 15 us of the inner call.
TARGET_BREAKEVEN = dict(world=8, numel=1 << 24, bits=8, gbs=1000.0)
TARGET_EXACT_US = 15.0


def target_lines(rows: list[dict], exact: list[dict]) -> list[str]:
    """One line per collective and target: the break-even link of ``rows`` at
    :data:`TARGET_BREAKEVEN`, and the exact path's cost over the inner call at W = 8
    (``exact``, the header's ``exact_path``); ``not measured`` where absent (NOT met)."""
    t = TARGET_BREAKEVEN
    lines = []
    for collective in COLLECTIVES:
        row = next((r for r in rows if r["collective"] == collective and r["world"] == t["world"]
                    and r["numel"] == t["numel"] and r["bits"] == t["bits"]), None)
        lines.append(common.target_line(
            f"break-even {collective}, W = {t['world']}, 2^{t['numel'].bit_length() - 1} "
            f"elements, {t['bits']} bits", f"target >= {t['gbs']:.0f} GB/s a GPU",
            row and f"{row['breakeven_gbs']:.0f} GB/s a GPU (codec {row['codec_ms']:.3f} ms)",
            bool(row) and row["breakeven_gbs"] >= t["gbs"]))
    for collective in COLLECTIVES:
        row = next((r for r in exact if r["collective"] == collective
                    and r["world"] == t["world"]), None)
        lines.append(common.target_line(
            f"exact path over the inner call, {collective}, W = {t['world']}",
            f"target <= {TARGET_EXACT_US:.0f} us",
            row and (f"{row['over_us']:+.1f} us ({row['exact_us']:.1f} us against "
                     f"{row['inner_us']:.1f}, {row['numel']} elements)"),
            bool(row) and row["over_us"] <= TARGET_EXACT_US))
    return lines
