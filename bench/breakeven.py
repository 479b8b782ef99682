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

    python -m bench breakeven                        # CPU: 2^16..2^20, W = 8, 64
    python -m bench breakeven --device cuda --sizes 20..26:2
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

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


def main(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench breakeven --device cuda: torch sees no CUDA device here")
    header = common.start_local("breakeven", args, {
        "sizes": args.sizes, "worlds": args.worlds, "bits": args.bits,
        "collectives": args.collectives, "iters": args.iters})
    rows = []
    for collective in args.collectives:
        for bits in args.bits:
            for world in args.worlds:
                for n in args.sizes:
                    rows.append(measure(collective, world, n, bits, device, args.iters))
    common.report("breakeven", header, columns(device.type), rows, args.out,
                  f"breakeven-{device.type}")
    for r in rows:
        if r["world"] == 8 and r["bits"] == 8 and r["numel"] == max(args.sizes):
            print(f"#  {r['collective']}, W = 8, 8 bits, {r['numel']} elements a rank: "
                  f"compression pays on links up to {r['breakeven_gbs']:.2f} GB/s a rank "
                  f"(codec {r['codec_ms']:.2f} ms a call)")
    return 0
