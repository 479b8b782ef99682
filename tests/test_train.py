"""The end-to-end training benchmark runs (2 steps, 2 ranks, tiny model): it must not rot."""

import argparse
import json
import math

import pytest

from bench import train


def test_variant_parsing():
    assert train.parse_variant("fp32")["QCOMM_AG_BITS"] == "off"
    env = train.parse_variant("w4g8-nuq")
    assert (env["QCOMM_AG_BITS"], env["QCOMM_RS_BITS"], env["QCOMM_SCHEME"]) == ("4", "8", "nuq")
    assert train.parse_variant("w4g4-wd-ge") == train.parse_variant("w4g4")  # no env
    env = train.parse_variant("w4g4-gb128-gn")
    assert (env["QCOMM_RS_BUCKET"], env["QCOMM_RS_ROUNDING"]) == ("128", "nearest")
    env = train.parse_variant("w4g4-wn-wb128")
    assert (env["QCOMM_AG_ROUNDING"], env["QCOMM_AG_BUCKET"]) == ("nearest", "128")
    for bad in ("w9g8", "w4", "x4g4", "w4g4-qsgd", "w0g8", "w4g4-wbx", "w4g4-wd-ws9",
                "w4g4-wd-wsx"):
        with pytest.raises(ValueError, match="variant"):
            train.parse_variant(bad)
    # the state of qcomm.fsdp's collectives: read from the name, not the environment
    assert train.parse_variant("w4g4-wd-ws32") == train.parse_variant("w4g4")
    import qcomm.fsdp

    assert train.fsdp_state("ws32") == "float32" and train.fsdp_state("wsd") == "dtype"
    assert train.fsdp_state("ws8") == qcomm.fsdp.DEFAULT_STATE
    assert train.fsdp_state("ws4").bits == 4


def test_corpus_is_stdlib_source_with_held_out_tail():
    files = train.corpus_files()
    assert len(files) > 100 and files == sorted(files)
    tr, ev = train.load_corpus(limit_bytes=100_000)
    assert tr.numel() >= 100_000 and ev.numel() > 10_000
    assert b"def " in bytes(tr[:100_000].tolist())


def test_train_two_steps_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("QCOMM_COMPILE", "0")
    p = argparse.ArgumentParser()
    train.add_arguments(p, False)
    args = p.parse_args(["--steps", "2", "--eval-every", "1", "--variants", "fp32,w4g4-nuq-wd-ge",
                         "--layers", "1", "--width", "32", "--heads", "2", "--seq", "16",
                         "--batch", "2", "--eval-windows", "4", "--limit-bytes", "100000",
                         "--timeout", "240"])
    args.out, args.no_plot, args.command = str(tmp_path), True, "test"
    assert train.main(args) == 0
    runs = json.loads((tmp_path / "train-loopback-runs.json").read_text())["runs"]
    assert [r["variant"] for r in runs] == ["fp32", "w4g4-nuq-wd-ge"]
    fp32, quant = runs
    for r in runs:
        assert len(r["curve"]) == 2 and all(math.isfinite(c[1]) for c in r["curve"])
    # Same init and data: the first held-out loss before much training differs little,
    # and the quantized run really sent fewer bytes.
    assert abs(quant["curve"][0][1] - fp32["curve"][0][1]) < 0.05
    assert quant["wire_bytes_per_step"] < fp32["wire_bytes_per_step"] / 4


def test_train_under_torchrun(tmp_path):
    """``torchrun --nproc-per-node 2 -m bench train``: every run in torchrun's own ranks,
    one process group after another on torchrun's store (each a different config)."""
    import os
    import subprocess
    import sys

    from bench import common

    # both ranks on this one host: one node, which QCOMM_TOPOLOGY=auto would send exact
    env = {**os.environ, "QCOMM_COMPILE": "0", "QCOMM_INTRA_NODE": "compress",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(common.ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "bench", "train", "--steps", "2", "--eval-every", "1", "--variants",
           "fp32,w4g4-nuq-wd,w8g8", "--layers", "1", "--width", "32", "--heads", "2",
           "--seq", "16", "--batch", "2", "--eval-windows", "4", "--limit-bytes", "100000",
           "--out", str(tmp_path), "--no-plot"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("# qcomm bench train") == 1  # rank 0 alone reports
    runs = json.loads((tmp_path / "train-torchrun-runs.json").read_text())["runs"]
    assert [r["variant"] for r in runs] == ["fp32", "w4g4-nuq-wd", "w8g8"]
    assert all(r["link"] == "torchrun" for r in runs)
    assert runs[1]["wire_bytes_per_step"] < runs[0]["wire_bytes_per_step"] / 4


def test_memory_bench_measures_state_and_peak(tmp_path, monkeypatch):
    """``python -m bench memory`` on a tiny model: every variant's peak and state, the
    default state's bytes per parameter (the other kinds: tests/test_weight_deltas.py)."""
    from bench import __main__ as bench_main

    monkeypatch.setenv("QCOMM_COMPILE", "0")  # no first-call compile in the ranks
    variants = ["fsdp2", "w4g4-wd-wn-wb128"]
    assert bench_main.main(["memory", "--layers", "1", "--width", "64", "--steps", "1",
                            "--variants", ",".join(variants), "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "memory.json").read_text())
    rows = {r["variant"]: r for r in got["rows"]}
    assert list(rows) == variants
    assert rows["fsdp2"]["state"] == 0 and rows["fsdp2"]["over_mib"] == 0
    assert 1.0 < rows["w4g4-wd-wn-wb128"]["state_per_param"] < 1.25  # one bucket's meta
    for r in rows.values():
        assert r["peak"] > 50 * 2**20 and r["params"] == 2 * (64 * 64 + 64)
        assert all(math.isfinite(rank["loss"]) for rank in r["ranks"])
