"""``python -m bench codec``: quantize and dequantize throughput against memcpy.

Providers, side by side on the same tensors:

- ``triton``: the fused kernels (``impl="triton"``); CUDA only (the CPU interpreter is
  a correctness tool, not a speed path, so it is skipped there).
- ``torch``: ``torch.compile`` of :mod:`qcomm.cpu` (``impl="torch"``), compiled
  once per config before the timed loop. On CPU this *is* qcomm's data path; on GPU
  it is the baseline the Triton kernels must beat.
- ``eager``: the same path uncompiled (off by default: slow).
- ``memcpy``: ``dst.copy_(src)`` of the source tensor, the bandwidth ceiling.

The environment's config is read once at the start (:func:`qcomm.comm_config_from_env`)
and applied as a group's calls apply theirs: ``QCOMM_COMPILE=0`` runs the ``torch``
provider eagerly, ``QCOMM_TRITON_WARPS`` sets the Triton warps per program
(``bench/device_check.sh`` compares settings; the header records both).

Exit status 1 when a provider asked for measured nothing (``--impls triton`` without
CUDA, or one that failed at its first point), 130 when interrupted (Ctrl-C, ``timeout
-s INT``): the points measured by then are written all the same, the header saying how
many of the sweep's they are. :func:`target_lines` judges the rows against the
kernels' target (``bench/device_check.sh`` prints them).

GB/s counts the bytes an op must move, the same for every provider: quantize reads
``n * itemsize`` and writes the payload (``packed_nbytes``: header, scales, codes);
dequantize reads the payload and writes ``n * itemsize``; memcpy reads and writes
``n * itemsize``. ``frac`` is a provider's GB/s over memcpy's at the same size and
dtype.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass

import torch

import qcomm
from qcomm.config import SCHEMES, CommConfig, QuantConfig, comm_config_from_env

from . import common
from .common import Column

IMPLS = ("triton", "torch", "eager")
OPS = ("quantize", "dequantize")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Point:
    """One cell of the sweep: a config at a size and dtype."""

    dtype: str
    scheme: str
    bits: int
    numel: int


def sweep(sizes, bits, schemes, dtypes) -> list[Point]:
    """The declarative sweep, ordered so one config's sizes run together (one compile)."""
    return [Point(d, s, b, n) for d in dtypes for s in schemes for b in bits for n in sizes]


def available_impls(device: torch.device, wanted: list[str]) -> tuple[list[str], list[str]]:
    """(impls that run here, notes on the ones skipped)."""
    run, notes = [], []
    for impl in wanted:
        if impl == "triton" and device.type != "cuda":
            notes.append("triton skipped: no CUDA (the CPU interpreter is not a speed path)")
        else:
            run.append(impl)
    return run, notes


class Inputs:
    """One source tensor (and its copy/decode targets) per (dtype, size), made once."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cache: dict = {}

    def get(self, dtype: str, numel: int):
        key = (dtype, numel)
        if key not in self._cache:
            self._cache.clear()  # one size at a time: 2^28 fp32 elements are 1 GiB
            g = torch.Generator(device=self.device).manual_seed(numel)
            x = torch.randn(numel, generator=g, device=self.device).to(DTYPES[dtype])
            self._cache[key] = (x, torch.empty_like(x))
        return self._cache[key]


def _row(point: Point, op: str) -> dict:
    return {"op": op, "dtype": point.dtype, "scheme": point.scheme, "bits": point.bits,
            "numel": point.numel}


@torch.no_grad()  # as the collectives call the codec (grad mode is part of a compile's key)
def run(args, env: CommConfig | None = None) -> list[dict]:
    """The sweep's rows; ``env``: the config whose ``compile`` and ``triton_warps`` the
    codec calls take (default: the environment's)."""
    env = comm_config_from_env() if env is None else env
    device = torch.device(args.device)
    timeit = functools.partial(common.measure, iters=args.iters, budget_s=args.budget,
                               device=device)
    impls, notes = available_impls(device, args.impls)
    inputs = Inputs(device)
    rows: list[dict] = []
    memcpy_s: dict = {}
    points = sweep(args.sizes, args.bits, args.schemes, args.dtypes)
    try:
        _measure_points(points, rows, impls, inputs, timeit, memcpy_s, device, env)
    except KeyboardInterrupt:  # Ctrl-C (or `timeout -s INT`): keep what was measured
        print(f"# interrupted after {len(rows) // 2} of {len(points)} points: reporting "
              "those", file=sys.stderr, flush=True)
        args.interrupted = True
    for note in notes:
        print(f"# {note}", file=sys.stderr)
    rows.sort(key=lambda r: (OPS.index(r["op"]), r["dtype"], r["scheme"], r["bits"], r["numel"]))
    return rows


def _measure_points(points, rows, impls, inputs, timeit, memcpy_s, device,
                    env: CommConfig) -> None:
    """Measure ``points`` in order, appending two rows (quantize, dequantize) per point;
    the codec keywords from ``env`` (:func:`codec_keywords`)."""
    for i, p in enumerate(points):
        x, y = inputs.get(p.dtype, p.numel)
        itemsize = x.element_size()
        if (p.dtype, p.numel) not in memcpy_s:
            memcpy_s[p.dtype, p.numel] = timeit(lambda x=x, y=y: y.copy_(x))
        copy_gbps = common.gbps(2 * p.numel * itemsize, memcpy_s[p.dtype, p.numel])
        config = QuantConfig(bits=p.bits, scheme=p.scheme)
        payload = torch.empty(qcomm.packed_nbytes(p.numel, config), dtype=torch.uint8,
                              device=device)
        moved = p.numel * itemsize + payload.numel()
        rq, rd = _row(p, "quantize"), _row(p, "dequantize")
        for row in (rq, rd):
            row.update(bytes=moved, memcpy_gbps=copy_gbps)
        for impl in list(impls):
            try:
                kw = codec_keywords(impl, env)
                packed = qcomm.quantize(x, config, seed=1, out=payload, **kw)  # compiles
                # timed here, before the loop moves on: the lambdas' names are this point's
                tq = timeit(lambda: qcomm.quantize(x, config, seed=1, out=payload,  # noqa: B023
                                                   **kw))  # noqa: B023
                td = timeit(lambda: qcomm.dequantize(packed, out=y, check=False,  # noqa: B023
                                                     **kw))  # noqa: B023
            except Exception as e:  # one broken provider must not lose the others' sweep
                print(f"# {impl} FAILED at {p}: {type(e).__name__}: {e}; dropped from the "
                      "rest of the sweep", file=sys.stderr, flush=True)
                impls.remove(impl)
                continue
            for row, t in ((rq, tq), (rd, td)):
                row[f"{impl}_us"] = t * 1e6
                row[f"{impl}_gbps"] = common.gbps(moved, t)
                row[f"{impl}_frac"] = row[f"{impl}_gbps"] / copy_gbps
        if "triton_us" in rq and "torch_us" in rq:
            for row in (rq, rd):
                row["triton_vs_torch"] = row["torch_us"] / row["triton_us"]
        rows += [rq, rd]
        print(f"# [{i + 1}/{len(points)}] {p}", file=sys.stderr, flush=True)


def codec_keywords(impl: str, env: CommConfig) -> dict:
    """A provider's codec keywords under ``env``: its path (``torch`` runs eagerly where
    ``env.compile`` is off) and ``env.triton_warps``."""
    path = "eager" if impl == "torch" and not env.compiles() else impl
    return {"impl": path, "warps": env.triton_warps}


def columns(impls: list[str]) -> list[Column]:
    cols = [Column("op", "op"), Column("dtype", "dtype"), Column("scheme", "scheme"),
            Column("bits", "bits"), Column("numel", "elements"),
            Column("bytes", "bytes moved"), Column("memcpy_gbps", "memcpy GB/s", "{:.2f}")]
    for impl in impls:
        cols += [Column(f"{impl}_us", f"{impl} us", "{:.1f}"),
                 Column(f"{impl}_gbps", f"{impl} GB/s", "{:.2f}"),
                 Column(f"{impl}_frac", f"{impl}/memcpy", "{:.2f}")]
    if "triton" in impls and "torch" in impls:
        cols.append(Column("triton_vs_torch", "triton speedup vs compiled", "{:.2f}x"))
    return cols


def plot(folder, rows: list[dict], impls: list[str], header: dict):
    """GB/s vs size: a panel per op and scheme, a line per provider and bits, for one
    dtype (float32 when measured); memcpy of that dtype in every panel."""
    if not rows:
        return None
    dtypes = {r["dtype"] for r in rows}
    dtype = "float32" if "float32" in dtypes else rows[0]["dtype"]
    schemes = [s for s in SCHEMES if any(r["scheme"] == s for r in rows)]
    panels = {}
    for op in OPS:
        for scheme in schemes:
            sel = [r for r in rows
                   if r["op"] == op and r["dtype"] == dtype and r["scheme"] == scheme]
            series = {}
            for bits in sorted({r["bits"] for r in sel}):
                pts = [r for r in sel if r["bits"] == bits]
                for impl in impls:
                    series[f"{impl} {bits}b"] = ([r["numel"] for r in pts],
                                                 [r.get(f"{impl}_gbps", float("nan"))
                                                  for r in pts])
            first = [r for r in sel if r["bits"] == sel[0]["bits"]] if sel else []
            series["memcpy"] = ([r["numel"] for r in first], [r["memcpy_gbps"] for r in first])
            panels[f"{op} ({dtype}, {scheme})"] = series
    return common.plot_lines(
        folder / "codec.png", panels, xlabel="elements", ylabel="GB/s (bytes read + written)",
        suptitle=f"qcomm codec on {common.machine_name(header)} "
                 f"(torch {header['versions']['torch']})", logy=True, ncols=len(schemes))


def add_arguments(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    p.add_argument("--sizes", type=common.arg(common.parse_sizes), default=common.parse_sizes(
        "16..28" if on_gpu else "16..26"),
        help="element counts: LO..HI[:STEP] powers of two, 2^K, or counts "
             "(default 16..26 on CPU, 16..28 on GPU)")
    p.add_argument("--bits", type=common.arg(parse_bits), default=[2, 4, 8],
                   help="comma list of bit widths, 1..8 (default 2,4,8)")
    p.add_argument("--schemes",
                   type=common.arg(lambda s: common.parse_list(s, SCHEMES, "--schemes")),
                   default=list(SCHEMES) if on_gpu else ["minmax"],
                   help="comma list or 'all' (default: all on GPU, minmax on CPU)")
    p.add_argument("--dtypes",
                   type=common.arg(lambda s: common.parse_list(s, list(DTYPES), "--dtypes")),
                   default=list(DTYPES) if on_gpu else ["float32", "bfloat16"],
                   help="comma list or 'all' (default: all on GPU, float32,bfloat16 on CPU)")
    p.add_argument("--impls", type=common.arg(lambda s: common.parse_list(s, IMPLS, "--impls")),
                   default=["triton", "torch"] if on_gpu else ["torch"],
                   help="providers besides memcpy (default triton,torch on GPU, torch on "
                   "CPU; triton runs on CUDA only, and asked for without it is an error; "
                   "'eager' is the uncompiled torch path)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per point (median)")
    p.add_argument("--budget", type=float, default=1.0,
                   help="seconds per point; fewer iterations (>= 3) for slow points")
    p.add_argument("--device", default="cuda" if on_gpu else "cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default torch's: one per core). On a shared "
                        "machine an OpenMP barrier waits for a descheduled thread, ~4 ms a "
                        "call; --threads 1 measures one core without that noise")


def parse_bits(text: str) -> list[int]:
    bits = [int(b) for b in text.split(",") if b.strip()]
    for b in bits:
        QuantConfig(bits=b)  # ValueError naming a bad width
    return bits


def main(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench codec --device cuda: torch sees no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    env = comm_config_from_env()  # once: QCOMM_COMPILE, QCOMM_TRITON_WARPS
    header = common.start_local("codec", args, {
        "sizes": args.sizes, "bits": args.bits, "schemes": args.schemes, "dtypes": args.dtypes,
        "iters": args.iters, "budget_s": args.budget, "compile": env.compiles(),
        "triton_warps": env.triton_warps})
    args.interrupted = False
    rows = run(args, env)
    header["sweep"]["points_measured"] = len(rows) // 2
    # the providers that measured anything (one that failed at its first point is gone)
    impls = [i for i in args.impls if any(f"{i}_us" in r for r in rows)]
    folder = common.report("codec", header, columns(impls), rows, args.out, "codec")
    if not args.no_plot:
        png = plot(folder, rows, impls, header)
        if png:
            print(f"# wrote {png}", file=sys.stderr)
    missing = [i for i in args.impls if i not in impls]
    if missing:
        print(f"# codec: {', '.join(missing)} measured nothing (asked for with --impls)",
              file=sys.stderr)
        return 1
    return 130 if args.interrupted else 0


# The kernels' target (issue #43): at 2^24 elements and more, every scheme and width,
# quantize and dequantize of fp32 and bf16 at >= 0.9x a copy of the same run.
TARGET_NUMEL = 1 << 24
TARGET_FRAC = 0.9


def target_lines(rows: list[dict], dtypes: list[str], impl: str = "triton",
                 min_numel: int = TARGET_NUMEL, frac: float = TARGET_FRAC) -> list[str]:
    """One line per (dtype, op, scheme): the worst of ``impl``'s fractions of the
    same-run copy over the widths and sizes from ``min_numel`` up, against ``frac``
    (``not measured`` where no row has it: NOT met)."""
    lines, size = [], f"2^{min_numel.bit_length() - 1}"
    for dtype in dtypes:
        for op in OPS:
            for scheme in SCHEMES:
                sel = [r for r in rows if r["dtype"] == dtype and r["op"] == op
                       and r["scheme"] == scheme and r["numel"] >= min_numel
                       and r.get(f"{impl}_frac") is not None]
                worst = min(sel, key=lambda r: r[f"{impl}_frac"]) if sel else None
                lines.append(common.target_line(
                    f"codec {impl} {op} {dtype} {scheme} >= {size}",
                    f"target >= {frac:.2f}x copy",
                    worst and (f"{worst[f'{impl}_frac']:.2f}x copy (worst of {len(sel)}, at "
                               f"{worst['bits']} bits, {worst['numel']} elements)"),
                    bool(worst) and worst[f"{impl}_frac"] >= frac))
    return lines
