"""Every benchmark at a tiny size, so none rots. No timing is asserted: only that each
run completes, writes its files, and that the numbers it reports are self-consistent
(bytes, ratios, exact error 0). The codec runs uncompiled (QCOMM_COMPILE=0: a compile
costs ~25 s per config; the codec tests cover the compiled path)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

import qcomm
from bench import collectives, common, link, train
from bench.__main__ import main, parser

ROOT_AND_IP = os.geteuid() == 0 and shutil.which("ip") is not None


@pytest.fixture(autouse=True)
def _eager_codec(monkeypatch):
    from qcomm.config import env_config

    monkeypatch.setenv("QCOMM_COMPILE", "0")  # inherited by the ranks
    # and read anew by this process's direct codec calls (once per process otherwise)
    env_config.cache_clear()
    yield
    env_config.cache_clear()


def _load(path):
    data = json.loads(path.read_text())
    assert (path.with_suffix(".csv")).exists()
    return data["header"], data["rows"]


def _netns():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.parametrize(
    "text, sizes",
    [("16..18", [1 << 16, 1 << 17, 1 << 18]), ("10..14:2", [1 << 10, 1 << 12, 1 << 14]),
     ("2^20,1000", [1 << 20, 1000]), ("2^3..2^4", [8, 16])],
)
def test_parse_sizes(text, sizes):
    assert common.parse_sizes(text) == sizes


@pytest.mark.parametrize("bad", ["", "18..16", "x", "2^", "-5", "0"])
def test_parse_sizes_rejects(bad):
    with pytest.raises(ValueError, match="size"):
        common.parse_sizes(bad)


def test_parse_rate():
    assert link.parse_rate("1gbit") == ("1gbit", 10**9)
    assert link.parse_rate("100Mbit") == ("100mbit", 10**8)
    assert link.parse_rate("2.5gbit") == ("2.5gbit", 25 * 10**8)
    assert link.parse_rate("loopback") is None
    # --link: a rate's canonical text, unshaped, or None for loopback; one parser for all
    assert collectives.parse_links("loopback,100Mbit,Unshaped") == [None, "100mbit", "unshaped"]
    with pytest.raises(ValueError, match="or unshaped"):
        link.parse_link("fast")
    assert link.link_shaping("unshaped", [0, 1])["rate_bit_s"] is None
    for bad in ("fast", "1gb", "10bit", "1000gbit"):
        with pytest.raises(ValueError, match="rate"):
            link.parse_rate(bad)


def test_sizes_that_do_not_split_into_shards_are_refused(capsys):
    assert main(["collectives", "--sizes", "15,16", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "--sizes 15: the full buffer must split into 2 equal shards" in err, err
    # an all-reduce has no shards: any size
    assert collectives.resolve(parser().parse_args(
        ["collectives", "--sizes", "15", "--collectives", "all_reduce"])) is None


def test_bad_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["collectives", "--link", "fast"])
    assert exit_.value.code == 2
    assert "bad link rate 'fast'" in capsys.readouterr().err


def test_table_and_header():
    cols = [common.Column("a", "A"), common.Column("b", "bee", "{:.1f}")]
    assert common.format_table(cols, [{"a": 1, "b": 2.25}, {"a": 10}]).splitlines() == [
        " A  bee", " 1  2.2", "10    -"]
    h = common.run_header("codec", device="cpu", link="1gbit")
    assert h["versions"]["qcomm"] == qcomm.__version__ and h["versions"]["torch"]
    assert h["cpu"]["cores"] >= 1 and h["link"] == "1gbit"
    text = common.format_header(h)
    assert "torch" in text and "link 1gbit" in text
    assert common.machine_name(h) and "/" not in common.machine_name(h)
    # Two CPUs of one model name with different vector units get different folders.
    isa = h["cpu"]["isa"]
    assert isa and isa in text
    if isa != "DEFAULT":
        assert common.machine_name(h).endswith("-" + isa.lower())


def test_codec(tmp_path, capsys):
    # 1000: a size that is a multiple of nothing; eager alongside the torch path.
    assert main(["codec", "--sizes", "1000,4096", "--bits", "2,8", "--dtypes", "all",
                 "--schemes", "minmax,nuq", "--impls", "torch,eager", "--iters", "1",
                 "--budget", "0", "--out", str(tmp_path)]) == 0
    header, rows = _load(tmp_path / "codec.json")
    assert header["benchmark"] == "codec" and header["versions"]["torch"]
    assert len(rows) == 2 * 2 * 3 * 2 * 2  # ops x sizes x dtypes x schemes x bits
    for r in rows:
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[r["dtype"]]
        payload = qcomm.packed_nbytes(r["numel"], qcomm.QuantConfig(bits=r["bits"],
                                                                     scheme=r["scheme"]))
        assert r["bytes"] == r["numel"] * itemsize + payload
        assert r["torch_gbps"] > 0 and r["eager_frac"] > 0
        assert "triton_us" not in r  # no CUDA here: the interpreter is not a speed path
    out = capsys.readouterr().out
    assert "torch/memcpy" in out
    assert header["command"].startswith("python -m bench codec --sizes 1000,4096")
    assert header["sweep"]["points_measured"] == len(rows) // 2
    assert (tmp_path / "codec.png").exists() == common.have_matplotlib()


def _codec_args(tmp_path, *more):
    return ["codec", "--sizes", "1000,4096", "--bits", "8", "--iters", "1", "--budget", "0",
            "--no-plot", "--out", str(tmp_path), *more]


@pytest.mark.skipif(torch.cuda.is_available(), reason="triton measures nothing without CUDA")
def test_codec_fails_when_a_provider_it_was_asked_for_measured_nothing(tmp_path, capsys):
    """--impls triton without CUDA times only the copy: exit 1, the provider named (the
    files still written); the default providers here are those that run here."""
    assert main(_codec_args(tmp_path, "--impls", "triton,eager")) == 1
    assert "triton measured nothing" in capsys.readouterr().err
    header, rows = _load(tmp_path / "codec.json")
    assert rows and all("eager_us" in r and "triton_us" not in r for r in rows)
    assert parser().parse_args(["codec"]).impls == ["torch"]


def test_codec_interrupted_writes_what_it_measured(tmp_path, monkeypatch):
    from bench import codec

    real = codec._measure_points

    def cut(points, rows, *rest):  # the first point, then Ctrl-C
        real(points[:1], rows, *rest)
        raise KeyboardInterrupt

    monkeypatch.setattr(codec, "_measure_points", cut)
    assert main(_codec_args(tmp_path, "--impls", "eager")) == 130
    header, rows = _load(tmp_path / "codec.json")
    assert len(rows) == 2 and header["sweep"]["points_measured"] == 1
    assert {r["numel"] for r in rows} == {1000} and all(r["eager_us"] > 0 for r in rows)


def test_codec_target_lines():
    """The worst fraction of a copy from 2^24 elements up, per dtype, op and scheme."""
    from bench import codec

    def row(op, scheme, bits, numel, frac):
        return {"op": op, "dtype": "float32", "scheme": scheme, "bits": bits, "numel": numel,
                "triton_frac": frac}

    rows = [row("quantize", "minmax", 8, 1 << 24, 0.95),
            row("quantize", "minmax", 4, 1 << 26, 0.92),
            row("quantize", "minmax", 2, 1 << 22, 0.10),  # under 2^24: not judged
            row("quantize", "maxnorm", 8, 1 << 24, 0.85),
            row("quantize", "maxnorm", 8, 1 << 28, 0.99),
            row("dequantize", "minmax", 8, 1 << 24, 0.90)]
    lines = codec.target_lines(rows, ["float32"])
    assert len(lines) == 2 * 3
    by = {line.split(" >= 2^24")[0].split("triton ")[1]: line for line in lines}
    assert by["quantize float32 minmax"].startswith(
        "TARGET codec triton quantize float32 minmax >= 2^24: 0.92x copy (worst of 2, at 4 bits")
    assert by["quantize float32 minmax"].endswith("target >= 0.90x copy: met")
    assert by["quantize float32 maxnorm"].endswith(": NOT met") and "0.85x" in by[
        "quantize float32 maxnorm"]
    assert by["dequantize float32 minmax"].endswith(": met")
    assert by["quantize float32 nuq"].endswith("not measured; target >= 0.90x copy: NOT met")


def test_breakeven_interrupted_writes_what_it_measured(tmp_path, monkeypatch):
    """The exact-path points first, then the compressed ones, every collective at a point
    before the next; Ctrl-C keeps them; a call that saved nothing fails the run."""
    from bench import breakeven

    real, calls = breakeven.measure, []

    def cut(*args):
        calls.append(args)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(breakeven, "measure", cut)
    common_args = ["--bits", "8", "--iters", "1", "--exact-numel", "2^8", "--out",
                   str(tmp_path), "--no-plot"]
    assert main(["breakeven", "--sizes", "2^10,2^12", "--worlds", "8,2", *common_args]) == 130
    data = json.loads((tmp_path / "breakeven-cpu.json").read_text())
    assert [(r["collective"], r["world"], r["numel"]) for r in data["rows"]] == [
        (c, 8, 1 << 10) for c in breakeven.COLLECTIVES]
    exact = data["header"]["exact_path"]
    assert [(r["collective"], r["world"]) for r in exact] == [
        (c, w) for w in (8, 2) for c in breakeven.COLLECTIVES]
    assert all(r["numel"] == 256 and r["exact_us"] > 0 and r["inner_us"] > 0 for r in exact)
    assert data["header"]["sweep"]["points_measured"] == 3 + 6

    monkeypatch.setattr(breakeven, "measure", lambda *a: dict(real(*a), saved_mib=0.0))
    assert main(["breakeven", "--sizes", "2^10", "--worlds", "2", *common_args]) == 1


def test_breakeven_target_lines():
    from bench import breakeven

    rows = [{"collective": "all_gather", "world": 8, "numel": 1 << 24, "bits": 8,
             "breakeven_gbs": 1500.0, "codec_ms": 0.1},
            {"collective": "reduce_scatter", "world": 8, "numel": 1 << 24, "bits": 8,
             "breakeven_gbs": 700.0, "codec_ms": 0.2},
            {"collective": "all_reduce", "world": 8, "numel": 1 << 24, "bits": 4,
             "breakeven_gbs": 5000.0, "codec_ms": 0.2}]  # 4 bits: not the target's
    exact = [{"collective": "all_gather", "world": 8, "numel": 4096, "exact_us": 20.0,
              "inner_us": 10.0, "over_us": 10.0},
             {"collective": "all_reduce", "world": 8, "numel": 4096, "exact_us": 40.0,
              "inner_us": 10.0, "over_us": 30.0},
             {"collective": "reduce_scatter", "world": 2, "numel": 4096, "exact_us": 1.0,
              "inner_us": 1.0, "over_us": 0.0}]  # W = 2: not the target's
    lines = breakeven.target_lines(rows, exact)
    assert len(lines) == 6 and all(line.startswith("TARGET ") for line in lines)
    assert lines[0].endswith(">= 1000 GB/s a GPU: met") and "1500 GB/s" in lines[0]
    assert lines[1].endswith(": NOT met") and "700 GB/s" in lines[1]
    assert "all_reduce" in lines[2] and "not measured" in lines[2]
    assert lines[3].endswith("target <= 15 us: met") and "+10.0 us" in lines[3]
    assert "reduce_scatter" in lines[4] and "not measured" in lines[4]
    assert lines[5].endswith(": NOT met") and "+30.0 us" in lines[5]


def test_auto_choices_are_the_table_design_md_shows(capsys):
    """``python -m bench auto-choices`` on the committed H200 codec results prints the
    table of docs/design.md, line for line; its device-check target is met on them, and
    not met (naming each choice that moved) on a codec 8x slower."""
    from pathlib import Path

    from bench import auto_choices

    assert main(["auto-choices"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    design = (Path(__file__).parents[1] / "docs" / "design.md").read_text().splitlines()
    assert printed and all(line in design for line in printed), printed
    rows = json.loads(auto_choices.DEFAULT_CODEC.read_text())["rows"]
    assert auto_choices.target_lines(rows)[-1].endswith("24 of 24 as predicted; target: "
                                                       "the choices predicted from the "
                                                       "2026-12-04 lease: met")
    slow = auto_choices.target_lines([dict(r, triton_us=r["triton_us"] * 8) for r in rows])
    assert slow[-1].endswith(": NOT met") and "NVLink W=8 all_gather fp32 2^24: exact" in slow[-1]
    assert auto_choices.target_lines([])[-1].endswith("not measured; target: the choices "
                                                      "predicted from the 2026-12-04 lease: "
                                                      "NOT met")


def test_memory_names_a_variant_that_compressed_nothing_and_keeps_the_rest(tmp_path,
                                                                            monkeypatch,
                                                                            capsys):
    from bench import memory

    def variant(args, name, env, compressed=3):
        if name == "bits=2":
            raise RuntimeError("rank 1 exited with 1")
        if name == "bits=8":
            raise KeyboardInterrupt
        return {"variant": name, "params": 10, "peak": 2**20, "rss_after": 2**20,
                "state": 0, "state_per_param": 0.0, "ranks": [],
                "compressed": 0 if name in ("exact", "bits=4") else compressed}

    monkeypatch.setattr(memory, "run_variant", variant)
    base = ["memory", "--out", str(tmp_path), "--no-plot"]
    assert main(base + ["--config", "exact", "--config", "bits=4"]) == 1
    assert "bits=4 compressed nothing" in capsys.readouterr().err
    assert main(base + ["--config", "exact", "--config", "bits=2", "--config", "bits=3"]) == 1
    assert "bits=2 failed" in capsys.readouterr().err
    _, rows = _load(tmp_path / "memory.json")
    assert [r["variant"] for r in rows] == ["exact", "bits=3"]
    assert main(base + ["--config", "bits=3", "--config", "bits=8", "--config", "exact"]) == 130
    header, rows = _load(tmp_path / "memory.json")
    assert [r["variant"] for r in rows] == ["bits=3"]
    assert header["sweep"]["variants_measured"] == 1


def _check_collectives(rows, tag, variants, colls=collectives.COLLECTIVES):
    assert {r["collective"] for r in rows} == set(colls)
    for r in rows:
        assert r["link"] == tag and 0 < r["best_us"] <= r["time_us"]
        assert r["busbw"] == pytest.approx(
            r["algbw"] * collectives.BUS_FACTOR[r["collective"]](r["world"]))
        if r["variant"] == "exact":
            assert r["rel_err"] == 0 and r["ratio"] == 1 and r["speedup"] == 1
        elif r["variant"] == "bf16":
            assert r["ratio"] == 2 and 0 < r["rel_err"] < 1e-2
        else:
            assert r["compressed"] and r["ratio"] > 1
            assert 0 < r["rel_err"] < 1.5
    assert {r["variant"] for r in rows} == set(variants)


def test_collectives_loopback(tmp_path, capsys):
    # 2^12 elements: 1024 per rank's chunk at 2 ranks, qcomm's min_numel.
    assert main(["collectives", "--sizes", "2^12", "--iters", "1", "--warmup", "1",
                 "--timeout", "120", "--out", str(tmp_path)]) == 0
    header, rows = _load(tmp_path / "collectives-loopback.json")
    assert header["link"] == "loopback"
    _check_collectives(rows, "loopback", collectives.CONFIGS)
    assert header["sweep"]["configs"] == list(collectives.CONFIGS)
    assert {r["bits"] for r in rows if r["variant"].startswith("bits=")} == {8, 4, 2}
    out = capsys.readouterr().out
    assert "busbw(GB/s)" in out and "all_reduce" in out


def test_collectives_overlap(tmp_path):
    """--overlap: every variant but bf16 is timed serial and behind compute too."""
    configs = ["exact", "bits=8", "bits=8,async=0", "bf16"]
    assert main(["collectives", "--overlap", "--sizes", "2^14", "--iters", "1", "--warmup",
                 "1", "--timeout", "120", "--out", str(tmp_path),
                 *(a for c in configs for a in ("--config", c))]) == 0
    header, rows = _load(tmp_path / "collectives-loopback-overlap.json")
    assert header["sweep"]["overlap"]
    _check_collectives(rows, "loopback", configs)
    for r in rows:
        if r["variant"] == "bf16":
            assert "overlap" not in r
        else:
            assert r["serial_ms"] > 0 and r["overlap_ms"] > 0, r
            assert r["overlap"] == pytest.approx(r["overlap_ms"] / r["serial_ms"])
            assert r["issue_max"] > 0, r


def test_link_needs_root(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(link.os, "geteuid", lambda: 1000)
    with pytest.raises(link.LinkError, match="needs root"):
        with link.ShapedLink("1gbit"):
            pass
    assert main(["collectives", "--link", "1gbit", "--out", str(tmp_path)]) == 2
    assert "--link needs root" in capsys.readouterr().err


@pytest.mark.skipif(not ROOT_AND_IP, reason="network namespaces need root and iproute2")
def test_collectives_shaped_link(tmp_path):
    before = _netns()
    assert main(["collectives", "--link", "loopback,1gbit", "--sizes", "2^12", "--iters", "1",
                 "--warmup", "1", "--config", "exact", "--config", "bits=8",
                 "--collectives", "all_gather",
                 "--timeout", "120", "--out", str(tmp_path)]) == 0
    assert _netns() == before  # torn down
    _, rows = _load(tmp_path / "collectives-1gbit.json")
    _check_collectives(rows, "1gbit", ["exact", "bits=8"], ["all_gather"])
    assert (tmp_path / "collectives-loopback.json").exists()  # one file a rate


@pytest.mark.skipif(not ROOT_AND_IP, reason="network namespaces need root and iproute2")
def test_train_counts_the_interfaces(tmp_path):
    """bench train between two unshaped hosts: each interface's bytes against the stats
    and the exact calls' bytes, the namespaces torn down after."""
    before = _netns()
    assert main(["train", "--link", "unshaped", "--config", "exact", "--config", "bits=8",
                 "--steps", "3", "--eval-every", "3", "--layers", "1", "--width", "64",
                 "--heads", "2", "--seq", "16", "--batch", "2", "--eval-windows", "4",
                 "--limit-bytes", "100000", "--timeout", "180", "--out", str(tmp_path),
                 "--no-plot"]) == 0
    assert _netns() == before
    _, summary = _load(tmp_path / "train-unshaped.json")
    got = {s["variant"]: s for s in summary}
    assert set(got) == {"exact", "bits=8"}
    # every interface sent at least what the stats say went to peers, and not much more
    for s in summary:
        assert 0.5 < s["counted_vs_iface"] <= 1.0, s
    # fewer bytes left the host, but never more than 32 / 8 times fewer
    assert 3.0 < got["bits=8"]["fewer_bytes"] < 4.0, got["bits=8"]


def test_node_layout():
    assert link.node_layout(None, None, 4) is None  # no --nodes: the caller's default
    assert link.node_layout(2, 2, None) == [0, 0, 1, 1]
    assert link.node_layout(2, 2, 4, "round-robin") == [0, 1, 0, 1]
    assert link.node_layout(3, 2, None) == [0, 0, 1, 1, 2, 2]  # loopback: any count
    assert link.node_layout(2, None, None, link=True) == [0, 1]  # one rank per node
    assert link.layout_name([0, 0, 1, 1]) == "2x2" and link.layout_name([0, 1, 0, 1]) == "2x2-rr"
    assert link.layout_name(None) is None
    assert link.default_nodes(4, True) == [0, 0, 1, 1] and link.default_nodes(3, False) == [0, 1, 2]
    for args, kw, match in (((3, 2, None), {"link": True}, "--nodes must be 2"),
                            ((2, 2, 8), {}, "--world 8"), ((None, 2, None), {}, "needs --nodes"),
                            ((1, 1, None), {}, "at least 2 ranks"), ((0, 2, None), {}, ">= 1")):
        with pytest.raises(ValueError, match=match):
            link.node_layout(*args, **kw)
    shaped = link.ShapedLink("1gbit")
    assert [h.hostname for h in shaped.hosts] == [h.netns for h in shaped.hosts]
    assert shaped.hosts[0].wrap(["python"])[:5] == ["ip", "netns", "exec",
                                                     shaped.hosts[0].netns, "unshare"]
    assert link.link_shaping("1gbit", [0, 0, 1, 1])["ranks"] == {"a": [0, 1], "b": [2, 3]}


def test_config_flag(capsys):
    """--config SPEC, repeatable, in order: the label as written and its QCOMM_*
    variables (qcomm.config.env_from_keys); a bad key or value is a usage error naming
    it; the old grammars are gone."""
    args = parser().parse_args(["collectives", "--config", "exact", "--config",
                                "bits=4,scheme=nuq", "--config", "bf16"])
    assert args.config == [("exact", {"QCOMM_BITS": "off"}),
                           ("bits=4,scheme=nuq", {"QCOMM_BITS": "4", "QCOMM_SCHEME": "nuq"}),
                           ("bf16", {})]
    args = parser().parse_args(["collectives", "--overlap", "--config", "bits=8,async=0"])
    assert args.config == [("bits=8,async=0", {"QCOMM_BITS": "8", "QCOMM_ASYNC": "0"})]
    args = parser().parse_args(["memory", "--config", "bits=4,ag_bucket=128,deltas=1"])
    assert args.config == [("bits=4,ag_bucket=128,deltas=1",
                            {"QCOMM_BITS": "4", "QCOMM_AG_BUCKET": "128"})]
    for what, bad, named in (("collectives", "bitz=4", "'bitz=4'"),
                             ("collectives", "bits=9", "QCOMM_BITS"),
                             ("train", "bf16", "'bf16'"), ("train", "qcomm8", "'qcomm8'"),
                             ("train", "w8g8", "'w8g8'"), ("train", "fp32", "'fp32'"),
                             ("train", "bits=4,deltas=2", "deltas='2'"),
                             ("memory", "bits=4,state=8", "needs deltas=1"),
                             ("memory", "fsdp2", "'fsdp2'")):
        with pytest.raises(SystemExit) as exit_:
            main([what, "--config", bad])
        assert exit_.value.code == 2
        assert named in capsys.readouterr().err, (what, bad)
    for what in ("collectives", "train", "memory"):
        with pytest.raises(SystemExit):
            main([what, "--variants", "exact"])


def test_node_flags(capsys):
    args = parser().parse_args(["collectives", "--nodes", "2", "--ranks-per-node", "2",
                                "--link", "100mbit", "--rounds", "3"])
    assert collectives.resolve(args) is None
    on_nccl = parser().parse_args(["collectives", "--overlap", "--backend", "nccl"])
    assert "runs with --backend gloo" in collectives.resolve(on_nccl)
    assert args.world == 4 and args.node_of_rank == [0, 0, 1, 1]
    assert [c[0] for c in args.config] == list(collectives.NODE_CONFIGS) and args.rounds == 3
    assert args.config[2][1] == {"QCOMM_BITS": "8", "QCOMM_TOPOLOGY": "auto"}
    args = parser().parse_args(["collectives"])
    assert collectives.resolve(args) is None and args.node_of_rank is None
    assert [c[0] for c in args.config] == list(collectives.CONFIGS) and args.world >= 2
    args = parser().parse_args(["train", "--nodes", "2", "--ranks-per-node", "2",
                                "--mode", "fsdp2,hsdp", "--rank-order", "round-robin"])
    assert train.resolve(args) is None and args.mode == ["fsdp2", "hsdp"]
    assert args.mesh == [[0, 2], [1, 3]] and args.layout == "2x2-rr"
    assert [c[0] for c in args.config] == list(train.NODE_CONFIGS)
    assert common.flat_twin("bits=8,topology=auto,deltas=1") == "bits=8,topology=flat,deltas=1"
    assert common.flat_twin("bits=8") is None and common.flat_twin("topology=flat") is None
    # refused with a clear message, before anything starts
    assert main(["collectives", "--nodes", "3", "--link", "100mbit"]) == 2
    assert "--nodes must be 2" in capsys.readouterr().err
    assert main(["train", "--nodes", "2", "--world", "3"]) == 2
    assert "drop --world" in capsys.readouterr().err
    assert main(["train", "--world", "3", "--link", "1gbit", "--mode", "hsdp"]) == 2
    assert "nodes of equal size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--mode", "ddp"])


@pytest.mark.skipif(not common.have_matplotlib(), reason="plots need matplotlib")
def _check_nodes(rows, header):
    """Bytes by node add up; auto sends half flat's across at 2 x 2; hostnames by node."""
    hosts = header["ranks"]
    assert [h["node"] for h in hosts] == ["node0", "node0", "node1", "node1"]
    by = {(r["collective"], r["variant"]): r for r in rows}
    for (coll, variant), r in by.items():
        assert r["intra"] + r["inter"] == pytest.approx(r["wire"])
        assert r["layout"] == "2x2" and r["world"] == 4 and r["rounds"] == 2
        if variant == "exact":  # 3 peers, one on the node
            assert r["intra"] == pytest.approx(r["wire"] / 3)
        if variant == "bits=8,topology=auto":
            flat = by[(coll, "bits=8,topology=flat")]
            assert r["inter"] < 0.6 * flat["inter"] and r["vs_flat"] > 0
            assert r["rel_err"] < 1.5 * flat["rel_err"]
            assert r["two_level"] and not flat["two_level"]
    return hosts


@pytest.mark.slow
@pytest.mark.skipif(not ROOT_AND_IP, reason="network namespaces need root and iproute2")
def test_collectives_nodes_shaped_link(tmp_path, capsys):
    """2 nodes x 2 ranks behind a shaped link: each node a namespace with its hostname."""
    before = _netns()
    assert main(["collectives", "--nodes", "2", "--ranks-per-node", "2", "--link", "1gbit",
                 "--sizes", "2^14", "--iters", "1", "--warmup", "1", "--rounds", "2",
                 "--collectives", "all_gather,reduce_scatter", "--timeout", "120",
                 "--out", str(tmp_path)]) == 0
    assert _netns() == before  # torn down
    header, rows = _load(tmp_path / "collectives-1gbit-2x2.json")
    assert header["layout"] == "2x2" and header["link_shaping"]["ranks"]["b"] == [2, 3]
    _check_collectives(rows, "1gbit", collectives.NODE_CONFIGS,
                       ["all_gather", "reduce_scatter"])
    hosts = _check_nodes(rows, header)
    names = [h["hostname"] for h in hosts]
    if shutil.which("unshare"):  # a UTS namespace per rank, the node's name in each
        assert names[0] == names[1] != names[2] == names[3]
    out = capsys.readouterr().out
    assert "vs_flat" in out


@pytest.mark.slow
def test_collectives_nodes_loopback(tmp_path):
    """The same layout on loopback (node ids only), round-robin rank order."""
    assert main(["collectives", "--nodes", "2", "--ranks-per-node", "2", "--sizes", "2^14",
                 "--iters", "1", "--warmup", "1", "--collectives", "all_reduce",
                 "--rank-order", "round-robin", "--config", "exact", "--config",
                 "bits=8,topology=flat", "--config", "bits=8,topology=auto",
                 "--timeout", "120", "--out", str(tmp_path)]) == 0
    header, rows = _load(tmp_path / "collectives-loopback-2x2-rr.json")
    assert [h["node"] for h in header["ranks"]] == ["node0", "node1", "node0", "node1"]
    _check_collectives(rows, "loopback", collectives.NODE_CONFIGS, ["all_reduce"])
    by = {r["variant"]: r for r in rows}
    assert by["bits=8,topology=auto"]["inter"] < 0.6 * by["bits=8,topology=flat"]["inter"]


@pytest.mark.slow
@pytest.mark.skipif(not ROOT_AND_IP, reason="network namespaces need root and iproute2")
def test_train_nodes_shaped_link(tmp_path, capsys):
    """FSDP2 and HSDP on 2 nodes x 2 ranks behind a link, exact and auto (2 steps)."""
    before = _netns()
    assert main(["train", "--nodes", "2", "--ranks-per-node", "2", "--link", "1gbit",
                 "--mode", "fsdp2,hsdp", "--config", "exact", "--config",
                 "bits=8,topology=auto", "--steps", "2",
                 "--eval-every", "2", "--layers", "1", "--width", "32", "--heads", "2",
                 "--seq", "16", "--batch", "2", "--eval-windows", "4", "--limit-bytes",
                 "100000", "--timeout", "120", "--out", str(tmp_path), "--no-plot"]) == 0
    assert _netns() == before
    header, summary = _load(tmp_path / "train-1gbit-2x2.json")
    assert header["mesh"] == [[0, 1], [2, 3]] and header["layout"] == "2x2"
    runs = json.loads((tmp_path / "train-1gbit-2x2-runs.json").read_text())["runs"]
    AUTO = "bits=8,topology=auto"
    assert [(r["mode"], r["variant"]) for r in runs] == [
        ("fsdp2", "exact"), ("fsdp2", AUTO), ("hsdp", "exact"), ("hsdp", AUTO)]
    by = {(r["mode"], r["variant"]): r for r in runs}
    for r in runs:
        assert r["inter_bytes_per_step"] > 0 and r["intra_bytes_per_step"] > 0
    # auto compresses only what crosses: fewer inter-node bytes than exact
    for mode in ("fsdp2", "hsdp"):
        assert (by[(mode, AUTO)]["inter_bytes_per_step"]
                < by[(mode, "exact")]["inter_bytes_per_step"] / 2)
    # HSDP shards inside a node: less crosses than with a full shard over all ranks
    assert by[("hsdp", "exact")]["inter_bytes_per_step"] < by[("fsdp2", "exact")][
        "inter_bytes_per_step"]
    assert {(s["mode"], s["variant"]) for s in summary} == set(by)


@pytest.mark.skipif(not ROOT_AND_IP, reason="network namespaces need root and iproute2")
def test_link_torn_down_on_failure():
    before = _netns()
    with pytest.raises(TimeoutError, match="--timeout"):
        with link.ShapedLink("100mbit") as shaped:
            assert _netns() - before == {h.netns for h in shaped.hosts}
            link.run_ranks(["-c", "import time; time.sleep(60)"], 2, link=shaped, timeout_s=1)
    assert _netns() == before


def test_crossdevice_compare_sees_bits_values_hide():
    """crossdevice.py judges by bits: a signed zero or a NaN payload counts."""
    from crossdevice import compare, same_counters

    a = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.float16)
    side = lambda t: [{"outs": {"x": t}}, {"outs": {"x": t}}]  # noqa: E731
    assert compare(side(a), side(a.clone())) == []
    flipped = a.clone()
    flipped[0] = -0.0
    lines = compare(side(a), side(flipped))
    assert len(lines) == 2 and "1 of 4 differ" in lines[0] and "0x8000" in lines[0]
    nan2 = a.clone()
    nan2.view(torch.int16)[2] = 0x7E01  # another NaN
    assert "1 of 4 differ" in compare(side(a), side(nan2))[0]
    s = {"all_gather": {"calls_compressed": 1, "calls_exact": 0, "logical_bytes": 8,
                        "wire_bytes": 2, "control_bytes": 48}}
    other = {"all_gather": dict(s["all_gather"], control_bytes=0)}
    assert same_counters(s, other)
    assert not same_counters(s, {"all_gather": dict(s["all_gather"], wire_bytes=3)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_memory_bench_on_cuda_without_a_gpu_says_so():
    with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device"):
        main(["memory", "--device", "cuda", "--layers", "1", "--width", "64"])
    with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device"):
        main(["breakeven", "--device", "cuda"])
    with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device"):
        main(["codec", "--device", "cuda", "--impls", "triton"])


def test_a_dirty_tree_is_named_by_its_diff(monkeypatch):
    """Results from a tree with uncommitted changes carry the hash of the diff."""
    outputs = {"describe": "abc1234567-dirty\n", "diff": b"diff --git a/x b/x\n+1\n"}

    def fake_run(args, **kwargs):
        import subprocess
        out = outputs["describe"] if "describe" in args else outputs["diff"]
        return subprocess.CompletedProcess(args, 0, stdout=out)

    monkeypatch.setattr(common.subprocess, "run", fake_run)
    import hashlib
    want = hashlib.sha256(outputs["diff"]).hexdigest()[:12]
    assert common._git_commit() == f"abc1234567-dirty-{want}"
    outputs["describe"] = "abc1234567\n"
    assert common._git_commit() == "abc1234567"
