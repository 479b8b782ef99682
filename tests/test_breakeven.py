"""W ranks simulated in one process (bench.simulated): a compressed call runs whole at W =
8 and 64 on one device, with the codec calls of a real one and the bytes it would save;
bench breakeven reports from it, with the launches behind the codec calls."""

from __future__ import annotations

import json

import pytest
import torch

import qcomm
from qcomm import codec
from qcomm.layout import DESC_NBYTES, packed_nbytes


@pytest.mark.parametrize("world", [8, 64])
def test_simulated_peers_run_the_whole_compressed_call(world):
    from bench.simulated import simulated_group

    group = simulated_group(world, bits=4, compile=False)  # eager: the calls, not speed
    n = 3000
    x = torch.randn(n)
    out = torch.empty(world * n)
    codec.calls.clear()
    qcomm.all_gather_into_tensor(out, x, group)
    # one quantize and one decode of all W rows: not W of anything
    assert dict(codec.calls) == {"quantize": 1, "dequantize_rows": 1}, codec.calls
    # every simulated peer sent this rank's payload: every row decodes to the same values
    rows = out.view(world, n)
    assert torch.equal(rows, rows[:1].expand(world, -1))
    assert (rows[0] - x).abs().max() < (x.max() - x.min()) / 15 * 1.001 + 1e-6
    part = torch.empty(n)
    qcomm.reduce_scatter_tensor(part, torch.randn(world * n), group=group)
    s = qcomm.stats(group)
    q = group.config.all_gather
    # what a real rank would hand its peers: the payload (and the bare descriptor) each
    assert s["all_gather"].wire_bytes - s["all_gather"].control_bytes == (
        (world - 1) * packed_nbytes(n, q))
    assert s["reduce_scatter"].wire_bytes == (world - 1) * (DESC_NBYTES + packed_nbytes(n, q))
    assert group.inner.calls >= 3 and group.inner.seconds > 0


def test_breakeven_bench_reports(tmp_path):
    from bench.__main__ import main

    rc = main(["breakeven", "--sizes", "2^12", "--worlds", "8", "--bits", "8",
               "--iters", "2", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    rows = json.loads((tmp_path / "breakeven-cpu.json").read_text())["rows"]
    assert [r["collective"] for r in rows] == ["all_gather", "reduce_scatter", "all_reduce"]
    # a quantize and a decode of all W rows; the all-reduce's two halves, each of them
    want = {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 4}
    for r in rows:
        assert r["codec_calls"] == want[r["collective"]], r
        # the torch path's graph or loop calls behind them (the CPU's launches)
        assert r["launches"] >= r["codec_calls"], r
        assert r["saved_mib"] > 0 and r["breakeven_gbs"] > 0, r
        assert r["codec_ms"] <= r["call_ms"], r
