"""auto's choices on a GPU: what ``bits=auto`` (:mod:`qcomm.auto`) would decide on an
H200 behind NVLink and behind a 400 Gbit/s NIC, from a GPU's measured codec costs.

``python -m bench auto-choices [--codec bench/results/nvidia-h200/codec.json]`` fits
the codec's cost lines (a call's fixed cost and an element's) to the Triton fp32 8-bit
min-max quantize and dequantize of the two largest sizes of a ``python -m bench codec``
run (decode-sum taken as decode), builds :class:`qcomm.auto.Model` with ring exchanges
over each assumed link (:data:`LINKS`: a call's latency and a GPU's bus bandwidth, not
measured: one GPU has no peer) and prints, per link and world, each call's choice with
its predicted exact and compressed milliseconds, the table ``docs/design.md`` shows. The
device check runs it on the lease's own codec results, so the next lease checks the
prediction written down before it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qcomm import QuantConfig
from qcomm.auto import Line, Model

from . import common

# (name, latency s, bus bandwidth B/s a GPU): assumed, not measured
LINKS = (("NVLink", 20e-6, 360e9), ("400 Gbit/s", 15e-6, 45e9))
WORLDS = (8, 64)
# (collective, dtype, elements a rank): the table's columns
CALLS = (("all_gather", torch.float32, 1 << 24), ("all_gather", torch.bfloat16, 1 << 24),
         ("reduce_scatter", torch.float32, 1 << 24),
         ("reduce_scatter", torch.bfloat16, 1 << 24),
         ("all_reduce", torch.float32, 1 << 24), ("all_reduce", torch.float32, 1 << 20))
Q8 = QuantConfig(bits=8)
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
DEFAULT_CODEC = Path(__file__).parent / "results" / "nvidia-h200" / "codec.json"


def codec_lines(rows: list[dict]) -> tuple[Line, Line]:
    """(quantize, decode) lines through the two largest fp32 8-bit min-max Triton rows."""
    def line(op: str) -> Line:
        got = sorted((r["numel"], r["triton_us"] * 1e-6) for r in rows
                     if r["op"] == op and r["dtype"] == "float32" and r["scheme"] == "minmax"
                     and r["bits"] == 8 and r.get("triton_us"))
        if len(got) < 2:
            raise ValueError(f"the codec results hold {len(got)} fp32 8-bit min-max {op} "
                             "rows with a Triton time: need 2 sizes")
        return Line.fit(got[-2], got[-1])
    return line("quantize"), line("dequantize")


def model(world: int, latency: float, bandwidth: float, quant: Line, decode: Line) -> Model:
    """Ring exchanges over one link: a rank's bytes cross it (W - 1) times, an
    all-reduce's 2 (W - 1) / W times, in two steps."""
    ring = Line(latency, (world - 1) / bandwidth)
    exact = {"all_gather": ring, "reduce_scatter": ring,
             "all_reduce": Line(2 * latency, 2 * (world - 1) / world / bandwidth)}
    return Model(world=world, exact=exact, gather=ring, exchange=ring, intra_gather=None,
                 intra_exchange=None, nodes=world, codec={Q8: (quant, decode, decode)})


def decisions(rows: list[dict]) -> dict[tuple, tuple[bool, float, float]]:
    """(link, world, collective, dtype, elements) -> auto's (compress?, predicted exact
    s, predicted compressed s) from the codec results ``rows``."""
    quant, decode = codec_lines(rows)
    got = {}
    for name, latency, bandwidth in LINKS:
        for world in WORLDS:
            m = model(world, latency, bandwidth, quant, decode)
            for kind, dtype, numel in CALLS:
                got[(name, world, kind, dtype, numel)] = m.decide(kind, numel, dtype, Q8)
    return got


def table(rows: list[dict]) -> list[str]:
    """The markdown table of auto's choices, (exact / compressed) ms predicted."""
    got = decisions(rows)
    head = ["link", "W"] + [f"{DTYPES[d]} {k.replace('_', '-')} 2^{n.bit_length() - 1}"
                            for k, d, n in CALLS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, _, _ in LINKS:
        for world in WORLDS:
            cells = []
            for kind, dtype, numel in CALLS:
                compress, exact_s, compressed_s = got[(name, world, kind, dtype, numel)]
                cells.append(f"{'compressed' if compress else 'exact'} "
                             f"({exact_s * 1e3:.3g} / {compressed_s * 1e3:.3g})")
            lines.append("| " + " | ".join([name, str(world)] + cells) + " |")
    return lines


def target_lines(rows: list[dict]) -> list[str]:
    """``bench/device_check.sh``'s check of the prediction written down: this run's
    table, then one target line, met where every choice is the one the committed
    codec results (:data:`DEFAULT_CODEC`, the table in docs/design.md) give."""
    name = "bits=auto's choices on an H200 (NVLink, 400 Gbit/s; docs/design.md)"
    want = "target: the choices predicted from the 2026-12-04 lease"
    try:
        got = decisions(rows)
    except ValueError as err:  # the codec phase wrote no fp32 8-bit rows
        return [f"AUTO {err}", common.target_line(name, want, None)]
    predicted = decisions(json.loads(DEFAULT_CODEC.read_text())["rows"])
    differ = [k for k in predicted if got[k][0] != predicted[k][0]]
    shown = (f"{len(predicted) - len(differ)} of {len(predicted)} as predicted"
             + "".join(f"; {k[0]} W={k[1]} {k[2]} {DTYPES[k[3]]} 2^{k[4].bit_length() - 1}:"
                       f" {'compressed' if got[k][0] else 'exact'}" for k in differ))
    return ["AUTO " + line for line in table(rows)] + [
        common.target_line(name, want, shown, not differ)]


def add_arguments(p) -> None:
    p.add_argument("--codec", default=str(DEFAULT_CODEC),
                   help="a python -m bench codec results JSON with Triton fp32 rows "
                        "(default: the H200 lease's)")


def main(args) -> int:
    path = Path(args.codec)
    data = json.loads(path.read_text())
    if path.is_absolute() and path.is_relative_to(Path.cwd()):
        path = path.relative_to(Path.cwd())
    quant, decode = codec_lines(data["rows"])
    versions = data["header"].get("versions", {})
    gpus = data["header"].get("gpus") or [{}]
    print(f"# codec: {path} ({gpus[0].get('name', data['header'].get('device'))}, qcomm "
          f"{versions.get('qcomm_git')}): quantize {quant.latency * 1e6:.2f} us a call + "
          f"{quant.per_byte * 1e12:.3f} ps an element, decode {decode.latency * 1e6:.2f} us "
          f"+ {decode.per_byte * 1e12:.3f} ps")
    print("\n".join(table(data["rows"])))
    return 0
