"""Every rank acts alike, and an error is never garbage, under every mode and route.

An adversary's faults, each on one rank only: rank 1 calls with another size, dtype or
op; rank 0 makes an extra call; rank 0 waits on its calls later than rank 1 (async on
one rank). They run under fixed bits and ``bits=auto`` on each route: the backend
(``init_process_group("qcomm")``), ``qcomm.wrap`` of a gloo group, FSDP2's comm objects
on a plain group (the hook route) and DDP's comm hook; on 2 ranks, and on 4 as 2 nodes
x 2 (two-level). Each fault either raises the same :class:`qcomm.handshake.Refused` on
every rank, or leaves every output bit-identical to a run without it; either way every
later output, every count and auto's whole model are those of the run without it.

Auto decides from a fixed model (slow link: a 4096-element call compresses, a
64-element one goes exact) and observes time on a fake clock (every call 1 ms), so its
decisions, refreshes and trials follow from the calls alone, never from this machine's
load.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import make, run_ranks
from torch.distributed import ReduceOp

import qcomm
from qcomm.driver import op_type

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
ROUTES = ("backend", "wrap", "hook", "ddp")
FAULTS = ("size", "dtype", "op", "extra", "async")
BIG, SMALL = 4096, 64  # under the fixed model: compressed, exact
# (world, per-rank environment): 2 ranks each its own node; 2 nodes x 2 ranks
LAYOUTS = {"2": (2, None), "2x2": (4, [{"QCOMM_NODE": f"node{r // 2}"} for r in range(4)])}


def fixed_model(state, kind, device, configs):
    """:func:`qcomm.auto.calibrate`'s stand-in: a 12.5 MB/s link, 100 us a call (inside
    a node: 10 GB/s, 10 us); a codec of 50 us a call and 2 ns an element; the same on
    every rank."""
    from qcomm.auto import Line, Model

    line, node, op = Line(1e-4, 1 / 12.5e6), Line(1e-5, 1e-10), Line(50e-6, 2e-9)
    two = state.plan == "two_level"
    return Model(world=state.world, exact=dict.fromkeys(KINDS, line), gather=line,
                 exchange=line, intra_gather=node if two else None,
                 intra_exchange=node if two else None,
                 nodes=state.topology.nodes if two else state.world,
                 codec={q: (op, op, op) for q in configs}, agreed=device.type == "cpu")


def fake_clock(step: float = 1e-3):
    """A clock that moves ``step`` each time it is read: every observed call takes it."""
    now = [0.0]

    def clock() -> float:
        now[0] += step
        return now[0]

    return clock


def install_fixed_auto() -> None:
    import qcomm.auto as A

    A.calibrate = fixed_model
    A.clock = fake_clock()


# ---------------------------------------------------------------------------------
# The routes: a fresh group in a mode, and the three calls through it


class Route:
    def __init__(self, name: str, world: int) -> None:
        self.name, self.world = name, world

    def group(self, mode: str):
        """A fresh group of every rank running ``mode`` ("fixed": 8 bits; "auto")."""
        import os

        from qcomm.driver import adopt

        config = qcomm.CommConfig(min_numel=0, auto=mode == "auto")
        if self.name == "backend":
            os.environ.update(QCOMM_BITS="auto" if mode == "auto" else "8",
                              QCOMM_MIN_NUMEL="0")
            return dist.new_group(backend="qcomm")
        plain = dist.new_group(backend="gloo")
        if self.name == "wrap":
            return qcomm.wrap(plain, config)
        adopt(plain, config, torch.device("cpu"))
        return plain

    def all_gather(self, out, inp, group, async_op):
        if self.name == "hook":
            from qcomm.fsdp import CompressedAllGather

            return CompressedAllGather()(out, inp, group, async_op=async_op)
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)

    def reduce_scatter(self, out, inp, op, group, async_op):
        if self.name == "hook":
            from qcomm.fsdp import CompressedReduceScatter

            return CompressedReduceScatter()(out, inp, group, op=op, async_op=async_op)
        return dist.reduce_scatter_tensor(out, inp, op=op, group=group, async_op=async_op)

    def all_reduce(self, t, op, group, async_op):
        if self.name == "ddp":  # DDP's hook: a bucket's AVG, its future
            from types import SimpleNamespace

            fut = qcomm.ddp_comm_hook(group, SimpleNamespace(buffer=lambda: t))
            if async_op:
                return _Waits(fut)
            fut.wait()
            return None
        if self.name == "hook":
            return qcomm.all_reduce(t, op, group, async_op=async_op)
        return dist.all_reduce(t, op=op, group=group, async_op=async_op)


class _Waits:
    """A future as a Work (``wait()``)."""

    def __init__(self, fut) -> None:
        self.fut = fut

    def wait(self) -> None:
        self.fut.wait()


def _calls(route: Route, world: int) -> list[tuple]:
    """The run's calls: (kind, elements, dtype, op, salt). DDP's hook all-reduces (AVG)
    only."""
    if route.name == "ddp":
        return [("all_reduce", n, torch.float32, ReduceOp.AVG, i)
                for i, n in enumerate([BIG, SMALL, BIG, BIG, SMALL, BIG, BIG, BIG, SMALL, BIG])]
    shapes = [("all_gather", BIG, ReduceOp.SUM), ("reduce_scatter", BIG, ReduceOp.SUM),
              ("all_reduce", SMALL, ReduceOp.SUM), ("all_gather", SMALL, ReduceOp.SUM),
              ("all_reduce", BIG, ReduceOp.AVG), ("reduce_scatter", SMALL, ReduceOp.AVG)]
    return [(k, n, torch.float32, op, i) for i, (k, n, op) in enumerate(shapes * 2)]


def _issue(route: Route, group, rank: int, world: int, call: tuple, async_op: bool):
    """One call on this rank; returns (its output, its Work or None)."""
    kind, n, dtype, op, salt = call
    x = make(rank, n if kind != "reduce_scatter" else world * n, dtype, salt=salt)
    if kind == "all_gather":
        out = torch.empty(world * n, dtype=dtype)
        return out, route.all_gather(out, x, group, async_op)
    if kind == "reduce_scatter":
        out = torch.empty(n, dtype=dtype)
        return out, route.reduce_scatter(out, x, op, group, async_op)
    return x, route.all_reduce(x, op, group, async_op)


def _faulty(call: tuple, fault: str, rank: int) -> tuple:
    """Rank 1's version of ``call`` under ``fault`` (size, dtype or op): the same bytes
    where it can be (bf16 of twice the elements)."""
    kind, n, dtype, op, salt = call
    if fault == "size":
        return (kind, SMALL if n == BIG else BIG, dtype, op, salt)
    if fault == "dtype":
        return (kind, 2 * n, torch.bfloat16, op, salt)
    return (kind, n, dtype, ReduceOp.AVG if op_type(op) != ReduceOp.AVG else ReduceOp.SUM,
            salt)


def _run(route: Route, group, rank: int, world: int, fault: str | None) -> dict:
    """The calls on ``group``, with ``fault`` at the third: its Refused words (every
    rank's), then the call again on every rank; every output, the stats and auto's
    model."""
    from qcomm.handshake import Refused

    calls = _calls(route, world)
    outs, works, said = [], [], None
    late = fault == "async" and rank == 0  # rank 0 waits on its calls at the end only
    for i, call in enumerate(calls):
        if i == 2 and fault in ("size", "dtype", "op", "extra"):
            if fault == "extra":
                mine = (("all_reduce", SMALL, torch.float32, ReduceOp.AVG, 99) if rank == 0
                        else call)
            else:
                mine = _faulty(call, fault, rank) if rank == 1 else call
            with pytest.raises(Refused) as refused:
                out, work = _issue(route, group, rank, world, mine, False)
                if work is not None:
                    work.wait()
            said = str(refused.value)
        out, work = _issue(route, group, rank, world, call, late)
        outs.append(out)
        works.append(work)
    for work in works:
        if work is not None:
            work.wait()
    state = qcomm.driver.group_state(group)
    stats = {k: (s.calls_exact, s.calls_compressed, s.auto_exact, s.auto_compressed,
                 s.logical_bytes) for k, s in qcomm.stats(group).items()}
    model = state.auto
    auto = None if model is None else (
        model.describe(), dict(model.since), dict(model.refreshes), dict(model.taken),
        {k: list(v) for k, v in model.explore.items()}, state.calls)
    return {"outs": outs, "said": said, "stats": stats, "auto": auto, "calls": state.calls,
            "plan": state.plan}


def _adversary_body(rank, world, route_name):
    install_fixed_auto()
    route = Route(route_name, world)
    res = {}
    for mode in ("fixed", "auto"):
        res[mode] = {None: _run(route, route.group(mode), rank, world, None)}
        for fault in FAULTS:
            if fault == "op" and route.name == "ddp":
                continue  # DDP's hook always averages
            res[mode][fault] = _run(route, route.group(mode), rank, world, fault)
    return res


def _check(results: list[dict]) -> None:
    for mode in ("fixed", "auto"):
        for fault in results[0][mode]:
            if fault is None:
                continue
            said = [r[mode][fault]["said"] for r in results]
            if fault == "async":
                assert said == [None] * len(results), (mode, said)
            else:  # the same words on every rank
                assert said[0] and said == [said[0]] * len(results), (mode, fault, said)
            for rank, r in enumerate(results):
                got, want = r[mode][fault], r[mode][None]
                where = (mode, fault, rank)
                assert len(got["outs"]) == len(want["outs"]), where
                for i, (a, b) in enumerate(zip(got["outs"], want["outs"], strict=True)):
                    assert torch.equal(a, b), (*where, "call", i)
                assert got["stats"] == want["stats"], (*where, got["stats"], want["stats"])
                assert got["auto"] == want["auto"], where
                assert got["calls"] == want["calls"], where
        ref = results[0][mode][None]
        if mode == "auto":  # auto decided both ways and refreshed (its state was exercised)
            decided = [(s[2], s[3]) for s in ref["stats"].values()]
            assert any(e for e, _ in decided) and any(c for _, c in decided), decided
            assert ref["auto"][2], ref["auto"]  # refreshes
        for r in results[1:]:  # every rank decoded the same all-gathers and all-reduces
            for i, (a, b) in enumerate(zip(r[mode][None]["outs"], ref["outs"], strict=True)):
                if _calls_kind(r, i) != "reduce_scatter":
                    assert torch.equal(a, b), (mode, i)


def _calls_kind(result, i):
    return result["kinds"][i]


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_two_ranks_refuse_alike_or_match_a_run_without_the_fault(route):
    backend = "qcomm" if route == "backend" else "gloo"
    results = run_ranks(_tagged, 2, route, backend=backend, timeout=240)
    _check(results)


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_two_nodes_of_two_refuse_alike_or_match_a_run_without_the_fault(route):
    backend = "qcomm" if route == "backend" else "gloo"
    env = [{"QCOMM_NODE": f"node{r // 2}"} for r in range(4)]
    results = run_ranks(_tagged, 4, route, backend=backend, env=env, timeout=300)
    for r in results:  # two-level: the plan every group ran
        plans = {run["plan"] for mode in ("fixed", "auto") for run in r[mode].values()}
        assert plans == {"two_level"}, plans
    _check(results)


def _tagged(rank, world, route_name):
    """:func:`_adversary_body`, with each call's kind."""
    res = _adversary_body(rank, world, route_name)
    res["kinds"] = [c[0] for c in _calls(Route(route_name, world), world)]
    return res


# ---------------------------------------------------------------------------------
# A wrap of a qcomm group never shares its connections


def _wrap_of_qcomm_body(rank, world):
    """2 nodes x 2 ranks, the default group qcomm (two-level) and ``B = qcomm.wrap()`` of
    it: an async all-gather on the default group beside a synchronous one on B, each its
    own constant values (a constant bucket decodes exactly), 30 times: every output
    exact. Sharing the default group's node subgroups, B's messages interleaved with
    the async call's (19-21 of 30 wrong on every rank, no error)."""
    n = 4096
    b = qcomm.wrap()
    a_values, b_values = [1.0, 3.0, 4.0, 200.0], [2.0, 100.0, 300.0, 400.0]
    want_a = torch.tensor(a_values).repeat_interleave(n)
    want_b = torch.tensor(b_values).repeat_interleave(n)
    wrong = 0
    for _ in range(30):
        out_a, out_b = torch.empty(world * n), torch.empty(world * n)
        work = dist.all_gather_into_tensor(out_a, torch.full((n,), a_values[rank]),
                                           async_op=True)
        dist.all_gather_into_tensor(out_b, torch.full((n,), b_values[rank]), group=b)
        work.wait()
        wrong += not (torch.equal(out_a, want_a) and torch.equal(out_b, want_b))
    mine, theirs = (qcomm.driver.group_state(g) for g in (None, b))
    return {"wrong": wrong, "plans": (mine.plan, theirs.plan),
            "compressed": (qcomm.stats()["all_gather"].calls_compressed,
                           qcomm.stats(b)["all_gather"].calls_compressed),
            "shared": bool(set(map(id, mine.subgroups.made or ()))
                           & set(map(id, theirs.subgroups.made or ())))}


@pytest.mark.slow
def test_a_wrap_of_a_qcomm_group_never_shares_its_connections():
    env = [{"QCOMM_NODE": f"node{r // 2}"} for r in range(4)]
    for r in run_ranks(_wrap_of_qcomm_body, 4, env=env, timeout=240):
        assert r["plans"] == ("two_level", "two_level"), r
        assert r["compressed"] == (30, 30) and not r["shared"], r
        assert r["wrong"] == 0, r


# ---------------------------------------------------------------------------------
# A failure inside auto's own collectives fails the group, naming the probe


def _probe_dies_body(rank, world, where):
    """Rank 1 dies inside auto's calibration (its third link probe) or inside the first
    refresh: rank 0's call fails naming auto's probe or agreement, and every later call
    on the group raises that first error, not gloo's next one."""
    import os

    import qcomm.auto as A

    if where == "refresh":
        install_fixed_auto()
        A.FIRST_REFRESH = 2
        real_refresh = A.refresh

        def refresh(*args, **kwargs):
            if rank == 1:
                os._exit(3)
            return real_refresh(*args, **kwargs)

        A.refresh = refresh
    else:
        probes, real_time = [0], A._Probes._time

        def timed(self, *args, **kwargs):
            probes[0] += 1
            if rank == 1 and probes[0] == 3:
                os._exit(3)
            return real_time(self, *args, **kwargs)

        A._Probes._time = timed
    group = qcomm.wrap(dist.group.WORLD, qcomm.CommConfig(auto=True, min_numel=0))
    said = []
    for _ in range(4):
        out = torch.empty(world * BIG)
        try:
            qcomm.all_gather_into_tensor(out, make(rank, BIG), group)
        except dist.DistBackendError as err:
            said.append(str(err))
            if len(said) == 2:
                break
    return said


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("where", ["calibration", "refresh"])
def test_a_peer_stopped_inside_auto_fails_the_group_naming_the_probe(where, layout):
    world, env = LAYOUTS[layout]
    got = run_ranks(_probe_dies_body, world, where, backend="gloo", env=env, dead=(1,),
                    pg_timeout=10)
    for rank, said in enumerate(got):
        if rank == 1:
            continue
        # rank 1's direct peers see it go; the others find it at the group's timeout, in
        # a probe or in the agreement of the probes' times
        named = [n for n in ("auto's probe of the link", "auto's agreement") if n in said[0]]
        assert len(said) == 2 and named, (rank, said)
        assert "an earlier call on this group failed" in said[1] and named[0] in said[1], said


# ---------------------------------------------------------------------------------
# Asynchronous calls are observed: a model wrong by 4x is corrected on async routes


def _observed_body(rank, world, route):
    """A fixed model whose prediction of the path taken is 4x too fast: every call
    observed at 4x (a fake clock). DDP's hook (every bucket async) and FSDP2's async
    all-gathers (``unshard(async_op=True)``): after the first refreshes the path's
    correction is 4, agreed on every rank."""
    import qcomm.auto as A

    install_fixed_auto()
    A.FIRST_REFRESH = 4
    torch.manual_seed(0)
    if route == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(torch.nn.Linear(64, 64))
        model.register_comm_hook(qcomm.CommConfig(auto=True, min_numel=0), qcomm.ddp_comm_hook)
        kind, numel = "all_reduce", 64 * 64 + 64

        def step():
            model(torch.randn(8, 64)).sum().backward()
    else:
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(torch.nn.Linear(64, 64))
        from qcomm.fsdp import compress

        compress(model, qcomm.CommConfig(auto=True, min_numel=0))
        kind, numel = "all_gather", (64 * 64 + 64) // world

        def step():
            model.unshard(async_op=True).wait()
            model.reshard()

    step()  # the first call: measures the model; not observed
    state = qcomm.driver.group_state(None)
    q = qcomm.QuantConfig()
    compress, exact_s, compressed_s = state.auto.predicted(kind, numel, torch.float32, q)
    A.clock = fake_clock(4 * (compressed_s if compress else exact_s))
    for _ in range(12):
        step()
    from qcomm.auto import size_class

    key = (kind, compress, size_class(numel * 4))
    return {"path": compress, "correction": state.auto.correction.get(key),
            "refreshes": state.auto.refreshes.get(kind), "model": qcomm.auto_model()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("route", ["ddp", "fsdp2"])
def test_async_calls_correct_a_model_wrong_by_4x(route, layout):
    world, env = LAYOUTS[layout]
    got = run_ranks(_observed_body, world, route, backend="gloo", env=env, timeout=180)
    r0 = got[0]
    assert r0["path"] is True, r0  # the fixed model compresses these calls
    assert r0["refreshes"] >= 2 and r0["correction"] == pytest.approx(4.0), r0
    for r in got[1:]:
        assert r["model"] == r0["model"], (r, r0)


# ---------------------------------------------------------------------------------
# Two-level calibration: every probe byte counted against the link it crossed


def _probe_links_body(rank, world):
    """2 nodes x 2, bits=auto measured for real: the bytes of each inner group (the
    group's own, its node's, across nodes) counted as they are handed over; qcomm's
    stats split them by link exactly."""
    from test_wire import ByteCounter

    import qcomm.inner as I

    real = I.make_inner
    counters = []

    def counted(*args, **kwargs):
        counters.append(ByteCounter(real(*args, **kwargs)))
        return counters[-1]

    I.make_inner = counted
    group = qcomm.wrap(dist.group.WORLD, qcomm.CommConfig(auto=True))
    out = torch.empty(world * BIG)
    qcomm.all_gather_into_tensor(out, make(rank, BIG), group)
    state = qcomm.driver.group_state(group)
    intra, inter = state.subgroups.made
    own = next(c for c in counters if c is state.inner)
    s = qcomm.stats(group)["all_gather"]
    same = state.topology.same_node_peers()
    return {"plan": state.plan, "stats": (s.intra_node_bytes, s.inter_node_bytes),
            "counted": (intra.to_peers + own.to_peers * same // (world - 1),
                        inter.to_peers + own.to_peers * (world - 1 - same) // (world - 1))}


@pytest.mark.slow
def test_two_level_probes_are_counted_against_the_link_they_crossed():
    env = [{"QCOMM_NODE": f"node{r // 2}"} for r in range(4)]
    for r in run_ranks(_probe_links_body, 4, backend="gloo", env=env, timeout=180):
        assert r["plan"] == "two_level", r
        assert r["stats"] == r["counted"], r


# ---------------------------------------------------------------------------------
# Bad input and a bad environment


def _overlap_body(rank, world):
    """An input whose elements share memory (``expand``) is refused up front on every
    entry, naming the argument; nothing moves, and the group stays usable."""
    from types import SimpleNamespace

    from qcomm.fsdp import CompressedAllGather, CompressedReduceScatter

    one = torch.ones(1)
    flat = one.expand(BIG)
    out = torch.empty(world * BIG)
    plain = dist.new_group(backend="gloo")
    entries = {
        "all_reduce": lambda: qcomm.all_reduce(flat, group=plain),
        "all_gather_into_tensor": lambda: qcomm.all_gather_into_tensor(out, flat, plain),
        "reduce_scatter_tensor": lambda: qcomm.reduce_scatter_tensor(
            torch.empty(BIG), one.expand(world * BIG), group=plain),
        "backend all_reduce": lambda: dist.all_reduce(flat),
        "backend allgather (list)": lambda: dist.all_gather(
            [torch.empty(BIG) for _ in range(world)], flat),
        "backend reduce_scatter (list)": lambda: dist.reduce_scatter(
            torch.empty(BIG), [flat] * world),
        "hook all-gather": lambda: CompressedAllGather()(out, flat, plain),
        "hook reduce-scatter": lambda: CompressedReduceScatter()(
            torch.empty(BIG), one.expand(world * BIG), plain),
        "ddp hook": lambda: qcomm.ddp_comm_hook(plain, SimpleNamespace(buffer=lambda: flat)),
    }
    said = {}
    for name, fn in entries.items():
        with pytest.raises(ValueError, match="share memory") as info:
            fn()
        said[name] = str(info.value)
    t = torch.full((BIG,), float(rank + 1))
    dist.all_reduce(t)
    qcomm.all_reduce(t, group=plain)
    said["usable"] = torch.equal(t, torch.full((BIG,), float(world * sum(range(1, world + 1)))))
    return said


@pytest.mark.parametrize("layout", LAYOUTS)
def test_overlapping_inputs_are_refused_up_front_on_every_entry(layout):
    world, env = LAYOUTS[layout]
    for said in run_ranks(_overlap_body, world, env=env):
        assert said.pop("usable"), said
        for name, words in said.items():
            arg = "tensor" if "all_reduce" in name or "ddp" in name else (
                "inp" if "tensor" in name or "hook" in name else "input")
            assert f"{arg} has elements that share memory" in words, (name, words)


def _bad_env_body(rank, world):
    """The last rank's ``QCOMM_BITS`` cannot be read: a new qcomm group, a wrap and a
    plain group's first call through qcomm each fail on every rank with the same words,
    naming the rank and the variable (that rank posts the error as its config), where
    they waited out the store's timeout for a config it never posted."""
    import os

    said = {}
    if rank == world - 1:
        os.environ["QCOMM_BITS"] = "eight"
    for name, fn in (("new_group", lambda: dist.new_group(backend="qcomm")),
                     ("wrap", lambda: qcomm.wrap(dist.group.WORLD)),
                     ("plain", lambda: qcomm.all_reduce(torch.ones(BIG),
                                                        group=dist.new_group(backend="gloo")))):
        with pytest.raises(ValueError) as info:
            fn()
        said[name] = str(info.value)
    return said


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_bad_environment_on_one_rank_is_named_by_every_rank(layout):
    world, env = LAYOUTS[layout]
    got = run_ranks(_bad_env_body, world, backend="gloo", env=env, pg_timeout=60)
    for r in got[1:]:
        assert r == got[0], (r, got[0])
    for words in got[0].values():
        assert f"rank {world - 1} cannot use its qcomm environment" in words, words
        assert "QCOMM_BITS='eight'" in words, words


# ---------------------------------------------------------------------------------
# Exact calls under fixed bits: the inner group's behaviour, nothing worse


def _mixed_paths_body(rank, world):
    """Fixed bits: rank 0's all-gather compresses (4096 elements), rank 1's goes exact
    (512: under min_numel). Nothing decides them alike (an exact call has no descriptor
    under fixed bits): each fails at the group's timeout naming its phase, rank 0's
    group failed for good; no process aborts, no output is returned."""
    n = 4096 if rank == 0 else 512
    group = qcomm.wrap(dist.group.WORLD, qcomm.CommConfig())
    said = []
    for _ in range(2):
        with pytest.raises(dist.DistBackendError) as info:
            qcomm.all_gather_into_tensor(torch.zeros(world * n), make(rank, n), group)
        said.append(str(info.value))
    return said


@pytest.mark.slow
def test_fixed_bits_exact_calls_on_mixed_paths_fail_at_the_timeout_naming_the_phase():
    r0, r1 = run_ranks(_mixed_paths_body, 2, backend="gloo", pg_timeout=5, fresh=True)
    assert "the descriptor exchange failed on rank 0" in r0[0], r0
    assert "an earlier call on this group failed" in r0[1], r0
    assert all("the exact (uncompressed) call failed on rank 1" in s for s in r1), r1


_SIZE_MISMATCH = """
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
import qcomm
dist.init_process_group(sys.argv[2], init_method="file://" + sys.argv[3], rank=rank,
                        world_size=2)
t = torch.ones(512 if rank == 0 else 256, dtype=torch.int64)
dist.all_reduce(t)
print("returned", t[:2].tolist(), flush=True)
"""


@pytest.mark.slow
def test_fixed_bits_exact_size_mismatch_is_what_gloo_does(tmp_path):
    """An exact call (int64) whose sizes differ across ranks goes to gloo as it is:
    under qcomm as under plain gloo, a rank's process aborts on gloo's "Received data
    size doesn't match" and no rank returns a value."""
    import os
    import subprocess
    import sys

    seen = {}
    for backend in ("gloo", "qcomm"):
        store = tmp_path / f"store-{backend}"
        env = {**os.environ, "QCOMM_NODE": "", "QCOMM_COMPILE": "0"}
        procs = [subprocess.Popen([sys.executable, "-c", _SIZE_MISMATCH, str(r), backend,
                                   str(store)], env={**env, "QCOMM_NODE": f"n{r}"},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        seen[backend] = ([p.returncode != 0 for p in procs],
                         any("Received data size doesn't match" in err for _, err in outs),
                         any("returned" in out for out, _ in outs))
    assert seen["qcomm"] == seen["gloo"] == ([True, True], True, False), seen
