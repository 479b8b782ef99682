"""``python -m bench rows``: a collective's codec calls per piece, one call per payload
against one call for all of them, by world size W and size.

What each side of a compressed collective runs on one piece of ``numel`` elements per
rank, timed side by side in one process on the same buffers (8 bits, min-max,
buckets of 1024 unless told otherwise):

- ``ag-decode``: an all-gather's receive side, W payloads decoded into the output's W
  slots: W ``dequantize`` calls (``per-payload``) against one ``dequantize_rows``.
- ``rs-encode``: a reduce-scatter's send side, the W - 1 peer chunks quantized: W - 1
  ``quantize`` calls against one ``quantize_rows(skip=rank)``.
- ``rs-decode``: its receive side, own chunk plus W - 1 payloads summed in fp32,
  averaged and stored into the output: a copy, W - 1 accumulating ``dequantize`` calls,
  a divide and a copy out against one ``dequantize_sum``.
- ``delta-update``: qcomm.fsdp's weight-difference gather's receive side, W state rows
  (:data:`qcomm.fsdp.DEFAULT_STATE`) plus W received difference payloads (the chosen
  bits and scheme) into the output and back into the state: the three row calls it ran
  before (``dequantize_rows`` of the state into the output, an accumulating one of the
  differences, ``quantize_rows`` back, then the NaN meta zeroed; commit 58a027d) against
  one ``update_state_rows``.

``calls``: codec calls of each way; ``pieces``: the torch path's graph or loop calls
inside them (on CPU), read from the path's counter. ``rows GB/s``: the bytes the rows
way reads and writes (:func:`moved_bytes`) over its time; ``rows/copy``: that over a
same-run ``copy_`` of as many bytes (half read, half written), the bandwidth ceiling.
The per-payload way is what the collectives ran before the row calls (commit 91d1fec);
"loop" below names it, and the three calls of ``delta-update``; "rows" the one call.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

import qcomm
from qcomm.config import SCHEMES, QuantConfig
from qcomm.cpu import common as cpu_common

from . import common
from .common import Column

OPS = ("ag-decode", "rs-encode", "rs-decode", "delta-update")


def add_arguments(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    p.add_argument("--sizes", type=common.arg(common.parse_sizes),
                   default=common.parse_sizes("10..20:2"),
                   help="elements per rank's piece (default 2^10..2^20, every other power)")
    p.add_argument("--worlds", type=common.arg(lambda s: [int(w) for w in s.split(",")]),
                   default=[2, 4, 8, 16], help="world sizes W (default 2,4,8,16)")
    p.add_argument("--bits", type=int, default=8)
    p.add_argument("--scheme", choices=SCHEMES, default="minmax")
    p.add_argument("--iters", type=int, default=20, help="timed calls per point (median)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="seconds of timed calls per point and way at most (default 0.5)")
    p.add_argument("--ops", type=common.arg(_parse_ops), default=list(OPS[:3]),
                   help=f"ops to time, of {','.join(OPS)} (default the first three)")
    p.add_argument("--device", default="cuda" if on_gpu else "cpu")


def _parse_ops(text: str) -> list[str]:
    ops = text.split(",")
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"unknown op {bad[0]!r}: choose from {', '.join(OPS)}")
    return ops


def _ways(op: str, q: QuantConfig, W: int, n: int, device):
    """(per-payload, rows) callables of one op, on buffers of their own."""
    g = torch.Generator().manual_seed(W * n)
    x = torch.randn(W, n, generator=g).to(device)
    nb = qcomm.packed_nbytes(n, q)
    seeds = list(range(W))
    payloads = torch.empty(W, nb, dtype=torch.uint8, device=device)
    qcomm.quantize_rows(x, q, seeds, out=payloads)
    out = torch.empty(W, n, device=device)
    if op == "ag-decode":
        packed = [qcomm.Packed(payloads[r], n, torch.float32, q) for r in range(W)]

        def per_payload():
            for r in range(W):
                qcomm.dequantize(packed[r], out=out[r], check=False)

        return per_payload, lambda: qcomm.dequantize_rows(payloads, n, torch.float32, q,
                                                          out=out, check=False)
    if op == "delta-update":
        from qcomm.fsdp import DEFAULT_STATE as S
        from qcomm.layout import HEADER_NBYTES, meta_nbytes

        state = torch.empty(W, qcomm.packed_nbytes(n, S), dtype=torch.uint8, device=device)
        qcomm.quantize_rows(x, S, [0] * W, out=state)
        qcomm.quantize_rows(x * 0.01, q, seeds, out=payloads)
        meta = state[:, HEADER_NBYTES:HEADER_NBYTES + meta_nbytes(n, S)].view(torch.float32)

        def three_calls():
            qcomm.dequantize_rows(state, n, torch.float32, S, out=out, check=False)
            qcomm.dequantize_rows(payloads, n, torch.float32, q, out=out, accumulate=True,
                                  check=False)
            qcomm.quantize_rows(out, S, [0] * W, out=state)
            meta.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

        return three_calls, lambda: qcomm.update_state_rows(state, payloads, n, S, q, out=out,
                                                            check=False)
    if op == "rs-encode":
        def per_payload():
            for r in range(1, W):
                qcomm.quantize(x[r], q, seed=seeds[r], out=payloads[r])

        return per_payload, lambda: qcomm.quantize_rows(x, q, seeds, out=payloads, skip=0)
    acc = torch.empty(n, device=device)
    packed = [qcomm.Packed(payloads[r], n, torch.float32, q) for r in range(W)]

    def per_payload():
        acc.copy_(x[0])
        for r in range(1, W):
            qcomm.dequantize(packed[r], out=acc, accumulate=True, check=False)
        acc.div_(W)
        out[0].copy_(acc)

    return per_payload, lambda: qcomm.dequantize_sum(payloads, n, torch.float32, q, own=x[0],
                                                     out=out[0], skip=0, op="avg", factor=W,
                                                     check=False)


def moved_bytes(op: str, q: QuantConfig, W: int, n: int) -> int:
    """Bytes the rows way reads and writes (fp32 values, payloads of ``q``): what a
    same-run copy of as many bytes (half read, half written) is the ceiling of."""
    nb = qcomm.packed_nbytes(n, q)
    if op == "ag-decode":  # W payloads in, W rows out
        return W * (nb + 4 * n)
    if op == "rs-encode":  # W - 1 rows in, W - 1 payloads out
        return (W - 1) * (4 * n + nb)
    if op == "rs-decode":  # W - 1 payloads and the own row in, one row out
        return (W - 1) * nb + 8 * n
    from qcomm.fsdp import DEFAULT_STATE as S  # delta-update: state and deltas in,
    ns = qcomm.packed_nbytes(n, S)             # rows and state out
    return W * (2 * ns + nb + 4 * n)


def _counted(fn) -> tuple[int, int]:
    from qcomm import codec

    before, pieces = sum(codec.calls.values()), sum(cpu_common.calls.values())
    fn()
    return sum(codec.calls.values()) - before, sum(cpu_common.calls.values()) - pieces


@torch.no_grad()
def run(args) -> list[dict]:
    device = torch.device(args.device)
    q = QuantConfig(bits=args.bits, scheme=args.scheme)
    timeit = functools.partial(common.measure, iters=args.iters, budget_s=args.budget,
                               device=device)
    rows = []
    copies: dict[int, float] = {}  # bytes moved -> seconds of a same-run copy
    for op in args.ops:
        for W in args.worlds:
            for n in args.sizes:
                loop, batched = _ways(op, q, W, n, device)
                loop(), batched()  # compiles
                row = {"op": op, "world": W, "numel": n}
                row["loop_calls"], row["loop_pieces"] = _counted(loop)
                row["rows_calls"], row["rows_pieces"] = _counted(batched)
                row["loop_us"] = timeit(loop) * 1e6
                row["rows_us"] = timeit(batched) * 1e6
                row["speedup"] = row["loop_us"] / row["rows_us"]
                moved = row["bytes"] = moved_bytes(op, q, W, n)
                if moved not in copies:
                    src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
                    dst = torch.empty_like(src)
                    copies[moved] = timeit(lambda d=dst, s=src: d.copy_(s))
                row["rows_gbps"] = common.gbps(moved, row["rows_us"] / 1e6)
                row["copy_gbps"] = common.gbps(moved, copies[moved])
                row["rows_frac"] = row["rows_gbps"] / row["copy_gbps"]
                rows.append(row)
                print(f"# {op} W={W} n={n}: {row['loop_us']:.0f} -> {row['rows_us']:.0f} us",
                      file=sys.stderr, flush=True)
    return rows


def columns() -> list[Column]:
    return [Column("op", "op"), Column("world", "W"), Column("numel", "elements"),
            Column("loop_calls", "calls per payload"), Column("rows_calls", "calls rows"),
            Column("loop_pieces", "pieces per payload"), Column("rows_pieces", "pieces rows"),
            Column("loop_us", "per payload us", "{:.1f}"), Column("rows_us", "rows us", "{:.1f}"),
            Column("speedup", "speedup", "{:.2f}x"), Column("bytes", "bytes moved"),
            Column("rows_gbps", "rows GB/s", "{:.2f}"), Column("copy_gbps", "copy GB/s", "{:.2f}"),
            Column("rows_frac", "rows/copy", "{:.2f}")]


def main(args) -> int:
    header = common.start_local("rows", args, {
        "ops": args.ops, "sizes": args.sizes, "worlds": args.worlds, "bits": args.bits,
        "scheme": args.scheme,
        "iters": args.iters, "budget_s": args.budget})
    rows = run(args)
    stem = "rows" if args.ops == list(OPS[:3]) else "rows-" + "+".join(args.ops)
    common.report("rows", header, columns(), rows, args.out, stem)
    return 0
