"""The end-to-end training benchmark runs (2 steps, 2 ranks, tiny model): it must not rot."""

import argparse
import json
import math

import pytest

from bench import train


def test_config_parsing():
    """--config SPEC: qcomm's keys as the run's QCOMM_* variables, the label as written,
    qcomm.fsdp's keys set aside and checked."""
    assert train.parse_config("exact") == ("exact", {"QCOMM_BITS": "off"})
    label, env = train.parse_config("ag_bits=4,rs_bits=8,scheme=nuq")
    assert label == "ag_bits=4,rs_bits=8,scheme=nuq"
    assert env == {"QCOMM_AG_BITS": "4", "QCOMM_RS_BITS": "8", "QCOMM_SCHEME": "nuq"}
    env = train.parse_config("bits=4,rs_bucket=128,rs_rounding=nearest,topology=flat")[1]
    assert (env["QCOMM_RS_BUCKET"], env["QCOMM_RS_ROUNDING"], env["QCOMM_TOPOLOGY"]) == (
        "128", "nearest", "flat")
    # qcomm.fsdp's keys never reach the environment
    label, env = train.parse_config("bits=4,deltas=1,feedback=1,state=32")
    assert label == "bits=4,deltas=1,feedback=1,state=32" and env == {"QCOMM_BITS": "4"}
    assert train.parse_config("deltas=1")[1] == {}  # the environment's config, with deltas
    assert train.split_config("bits=4,deltas=1,state=dtype") == (
        {"deltas": "1", "state": "dtype"}, "bits=4")
    for bad, match in (("bitz=4", "'bitz=4'"), ("bits=9", "QCOMM_BITS"),
                       ("scheme=qsgd", "QCOMM_SCHEME"), ("bits=4,deltas=2", "deltas='2'"),
                       ("bits=4,deltas=1,state=9", "state='9'"),
                       ("bits=4,deltas=1,state=x", "state='x'"),
                       ("bits=4,state=32", "needs deltas=1 or feedback=1"), ("w4g4", "w4g4"),
                       ("", "KEY=VALUE")):
        with pytest.raises(ValueError, match=match):
            train.parse_config(bad)
    import qcomm.fsdp

    assert train.fsdp_state("32") == "float32" and train.fsdp_state("dtype") == "dtype"
    assert train.fsdp_state("8") == qcomm.fsdp.DEFAULT_STATE
    assert train.fsdp_state("4").bits == 4


def test_stateful_keys_reach_qcomm_fsdp(monkeypatch):
    """deltas=1 / feedback=1 install qcomm.fsdp's collectives with state= as given."""
    import qcomm.fsdp

    calls = []
    for name in ("quantize_weight_deltas", "feed_back_gradient_errors"):
        monkeypatch.setattr(qcomm.fsdp, name, lambda model, name=name, **kw: (
            calls.append((name, model, kw)) or [name]))
    model = object()
    assert train.install_stateful(model, "bits=4,deltas=1,feedback=1,state=32") == [
        "quantize_weight_deltas", "feed_back_gradient_errors"]
    assert calls == [("quantize_weight_deltas", model, {"state": "float32"}),
                     ("feed_back_gradient_errors", model, {"state": "float32"})]
    calls.clear()
    assert train.install_stateful(model, "feedback=1") == ["feed_back_gradient_errors"]
    assert calls == [("feed_back_gradient_errors", model, {})]
    calls.clear()
    assert train.install_stateful(model, "bits=4,deltas=0") == [] and not calls
    assert train.install_stateful(model, "exact") == [] and not calls


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
    args = p.parse_args(["--steps", "2", "--eval-every", "1", "--config", "exact", "--config",
                         "bits=4,scheme=nuq,deltas=1,feedback=1", "--layers", "1", "--width",
                         "32", "--heads", "2", "--seq", "16", "--batch", "2", "--eval-windows",
                         "4", "--limit-bytes", "100000", "--timeout", "240"])
    args.out, args.no_plot, args.command = str(tmp_path), True, "test"
    assert train.main(args) == 0
    runs = json.loads((tmp_path / "train-loopback-runs.json").read_text())["runs"]
    assert [r["variant"] for r in runs] == ["exact", "bits=4,scheme=nuq,deltas=1,feedback=1"]
    exact, quant = runs
    for r in runs:
        assert len(r["curve"]) == 2 and all(math.isfinite(c[1]) for c in r["curve"])
    # Same init and data: the first held-out loss before much training differs little,
    # and the quantized run really sent fewer bytes.
    assert abs(quant["curve"][0][1] - exact["curve"][0][1]) < 0.05
    assert quant["wire_bytes_per_step"] < exact["wire_bytes_per_step"] / 4


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
           "2", "-m", "bench", "train", "--steps", "2", "--eval-every", "1", "--config", "exact",
           "--config", "bits=4,scheme=nuq,deltas=1", "--config", "bits=8", "--layers", "1",
           "--width", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--eval-windows", "4",
           "--limit-bytes", "100000", "--out", str(tmp_path), "--no-plot"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("# qcomm bench train") == 1  # rank 0 alone reports
    runs = json.loads((tmp_path / "train-torchrun-runs.json").read_text())["runs"]
    assert [r["variant"] for r in runs] == ["exact", "bits=4,scheme=nuq,deltas=1", "bits=8"]
    assert all(r["link"] == "torchrun" for r in runs)
    assert runs[1]["wire_bytes_per_step"] < runs[0]["wire_bytes_per_step"] / 4


def test_memory_bench_measures_state_and_peak(tmp_path, monkeypatch):
    """``python -m bench memory`` on a tiny model: every variant's peak and state, the
    default state's bytes per parameter (the other kinds: tests/test_weight_deltas.py)."""
    from bench import __main__ as bench_main

    monkeypatch.setenv("QCOMM_COMPILE", "0")  # no first-call compile in the ranks
    variants = ["exact", "bits=4,ag_rounding=nearest,ag_bucket=128,deltas=1"]
    assert bench_main.main(["memory", "--layers", "1", "--width", "64", "--steps", "1",
                            "--config", variants[0], "--config", variants[1],
                            "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "memory.json").read_text())
    rows = {r["variant"]: r for r in got["rows"]}
    assert list(rows) == variants
    assert rows["exact"]["state"] == 0 and rows["exact"]["over_mib"] == 0
    # deltas=1 reached qcomm.fsdp: the default 8-bit state, one bucket's meta over a byte
    assert 1.0 < rows[variants[1]]["state_per_param"] < 1.25
    for r in rows.values():
        assert r["peak"] > 50 * 2**20 and r["params"] == 2 * (64 * 64 + 64)
        assert all(math.isfinite(rank["loss"]) for rank in r["ranks"])
