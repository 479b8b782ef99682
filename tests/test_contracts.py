"""torch.distributed's contracts on a qcomm group: asynchronous Work that is
really asynchronous and correctly ordered, the inner backend reachable through
``_get_backend``, every ``_c10d_functional`` op, ``all_gather_coalesced`` and
coalescing windows.

Each rank is its own node (conftest), so calls above ``min_numel`` are compressed.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import qcomm
from tests.conftest import make, run_ranks

N = 1 << 14  # elements per rank: compressed (min_numel 1024), quick on the eager codec


def _store():
    return dist.distributed_c10d._get_default_store()


def _gloo():
    """A plain gloo group over the same ranks: the exact reference."""
    return dist.new_group(backend="gloo")


# ---------------------------------------------------------------------------------
# Asynchronous Work


def _async_one(rank, world, kind, store, ref_group):
    x = make(rank, world * N if kind == "reduce_scatter" else N)
    out = torch.empty(N if kind == "reduce_scatter" else world * N)
    joined = f"joined-{kind}"
    if rank == 1:
        time.sleep(1.5)  # rank 0's call cannot finish before this rank joins it
        store.set(joined, "1")
    if kind == "all_gather":
        work = dist.all_gather_into_tensor(out, x, async_op=True)
    else:
        work = dist.reduce_scatter_tensor(out, x, async_op=True)
    returned_early = not store.check([joined])
    completed_at_return = work.is_completed()
    future = work.get_future()
    assert work.wait() is True
    got = future.wait()
    assert work.is_completed() and work.is_success() and work.exception() is None
    want = torch.empty_like(out)
    if kind == "all_gather":
        dist.all_gather_into_tensor(want, x, group=ref_group)
    else:
        dist.reduce_scatter_tensor(want, x, group=ref_group)
    return {"early": returned_early, "completed": completed_at_return,
            "future_is_output": got[0].data_ptr() == out.data_ptr(),
            "err": ((out - want).norm() / want.norm()).item(),
            "compressed": qcomm.stats(dist.group.WORLD)[kind].calls_compressed}


def _async_body(rank, world):
    store, ref_group = _store(), _gloo()
    return {kind: _async_one(rank, world, kind, store, ref_group)
            for kind in ("all_gather", "reduce_scatter")}


@pytest.mark.parametrize("async_env", ["1", "0"])
def test_async_call_returns_before_the_collective_finishes(async_env):
    """A compressed async all-gather and reduce-scatter each return while their peer has
    not even joined (QCOMM_ASYNC=1, the default); with QCOMM_ASYNC=0 (the old
    behaviour) they only return once done."""
    got = run_ranks(_async_body, 2, env={"QCOMM_ASYNC": async_env})[0]
    for kind, res in got.items():
        assert res["compressed"] == 1, (kind, res)
        assert res["early"] is (async_env == "1"), (kind, res)
        assert res["completed"] is (async_env == "0"), (kind, res)
        assert res["future_is_output"] and res["err"] < 0.02, (kind, res)


def _order_body(rank, world):
    """Async compressed calls, exact calls and forwarded ones interleaved: every rank
    issues the inner collectives in the same order, so every result is right."""
    ref_group = _gloo()
    x = make(rank, N)
    gathered = torch.empty(world * N)
    y = torch.arange(8.0) if rank == 0 else torch.zeros(8)
    big = make(rank, world * N, salt=1)
    scattered = torch.empty(N)
    small = torch.full((16,), float(rank + 1))  # under min_numel: exact
    summed = make(rank, N, salt=2)
    summed_in = summed.clone()
    works = [dist.all_gather_into_tensor(gathered, x, async_op=True)]
    dist.broadcast(y, 0)  # forwarded, synchronous
    works.append(dist.reduce_scatter_tensor(scattered, big, async_op=True))
    works.append(dist.all_reduce(small, async_op=True))
    works.append(dist.all_reduce(summed, async_op=True))
    for work in reversed(works):
        work.wait()
    want_g, want_s, want_a = torch.empty_like(gathered), torch.empty_like(scattered), summed_in
    dist.all_gather_into_tensor(want_g, x, group=ref_group)
    dist.reduce_scatter_tensor(want_s, big, group=ref_group)
    dist.all_reduce(want_a, group=ref_group)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert torch.equal(y, torch.arange(8.0))
    assert torch.equal(small, torch.full((16,), 3.0))
    return [rel(gathered, want_g), rel(scattered, want_s), rel(summed, want_a)]


def test_async_calls_keep_the_order_of_every_call():
    for errs in run_ranks(_order_body, 2):
        assert max(errs) < 0.03, errs


def _failure_body(rank, world):
    """A peer that dies with an async compressed call in flight: wait() raises, naming
    the collective, and the group's later calls fail at once, naming that failure."""
    x = make(rank, N)
    out = torch.empty(world * N)
    dist.all_gather_into_tensor(out, x)  # both ranks up and agreed
    if rank == 1:
        import os
        os._exit(0)
    time.sleep(0.5)
    work = dist.all_gather_into_tensor(out, x, async_op=True)
    with pytest.raises(dist.DistBackendError, match="qcomm all_gather"):
        work.wait()
    later = dist.all_gather_into_tensor(out, x, async_op=True)
    with pytest.raises(dist.DistBackendError, match="earlier call on this group failed"):
        later.wait()
    assert later.is_completed() and not later.is_success()
    return True


def test_async_failure_reaches_wait_and_later_calls():
    res = run_ranks(_failure_body, 2, dead=(1,), pg_timeout=10, timeout=90)
    assert res[0] is True


def _beside_plain_body(rank, world, route):
    """An async compressed call in flight, then the user's own exact call on the plain
    group it came from (the loss all-reduce of a training step), ten times over: qcomm
    sends on connections of its own, so neither call waits on or mixes with the other's
    messages, and both give the right values on every rank."""
    plain = dist.group.WORLD  # a gloo default group
    qg = qcomm.wrap(plain) if route == "wrap" else plain
    errs = []
    for i in range(10):
        x = make(rank, N, salt=i)
        out = torch.empty(world * N)
        if route == "wrap":
            work = dist.all_gather_into_tensor(out, x, group=qg, async_op=True)
        else:
            work = qcomm.all_gather_into_tensor(out, x, plain, async_op=True)
        loss = torch.tensor([float(rank + i)])
        dist.all_reduce(loss, group=plain)
        assert loss.item() == sum(r + i for r in range(world)), loss
        work.wait()
        want = torch.cat([make(r, N, salt=i) for r in range(world)])
        errs.append(((out - want).norm() / want.norm()).item())
    s = qcomm.stats(qg)["all_gather"]
    assert s.calls_compressed == 10, s
    return max(errs)


@pytest.mark.parametrize("route", ["wrap", "direct"])
def test_async_call_beside_the_plain_group(route):
    for err in run_ranks(_beside_plain_body, 2, route, backend="gloo", timeout=90):
        assert 0 < err < 0.02, err


# ---------------------------------------------------------------------------------
# Coalescing


def _coalesced_body(rank, world):
    ref_group = _gloo()
    inputs = [make(rank, n, salt=k) for k, n in enumerate((N, 100, 3000))]
    outs = [[torch.empty_like(t) for t in inputs] for _ in range(world)]
    want = [[torch.empty_like(t) for t in inputs] for _ in range(world)]
    dist.all_gather_coalesced(outs, inputs)
    dist.all_gather_coalesced(want, inputs, group=ref_group)
    errs = []
    for r in range(world):
        for got, exp in zip(outs[r], want[r], strict=True):
            errs.append(((got - exp).norm() / exp.norm()).item())
    # the inputs of the other rank land in its list; rank r's own slots exactly match
    # what it would decode of itself (bit-equal to gloo where not compressed: 100 elements)
    assert torch.equal(outs[1 - rank][1], want[1 - rank][1])
    return max(errs)


def test_all_gather_coalesced_matches_gloo():
    """torch's layout: output_tensor_lists[r][i] receives rank r's input i."""
    for err in run_ranks(_coalesced_body, 2):
        assert err < 0.02, err


def _window_body(rank, world):
    store = _store()
    a, b = make(rank, N), make(rank, N, salt=1)
    want = [sum(make(r, N, salt=s) for r in range(world)) for s in (0, 1)]
    if rank == 1:
        time.sleep(1.0)  # rank 0's window cannot finish before this rank joins
    cm_module = dist.distributed_c10d
    with cm_module._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()  # must stand for both all-reduces
    store.set(f"done{rank}", "1")
    return max(((t - w).norm() / w.norm()).item() for t, w in zip((a, b), want, strict=True))


def test_coalescing_window_work_waits_for_its_collectives():
    for err in run_ranks(_window_body, 2):
        assert err < 0.02, err


# ---------------------------------------------------------------------------------
# The inner backend and _c10d_functional ops


def _functional_body(rank, world):
    f = torch.ops._c10d_functional
    wait = f.wait_tensor
    pg, ref = dist.group.WORLD, _gloo()
    x, xs = make(rank, N), [make(rank, N, salt=1), make(rank, 2 * N, salt=2)]
    ops = {
        "all_gather_into_tensor": lambda g: [wait(f.all_gather_into_tensor(x, world, g))],
        "all_gather_into_tensor_out": lambda g: [wait(f.all_gather_into_tensor_out(
            x, world, g, out=torch.empty(world * N)))],
        "all_gather_into_tensor_coalesced": lambda g: [
            wait(t) for t in f.all_gather_into_tensor_coalesced(xs, world, g)],
        "reduce_scatter_tensor": lambda g: [wait(f.reduce_scatter_tensor(x, "sum", world, g))],
        "reduce_scatter_tensor_coalesced": lambda g: [
            wait(t) for t in f.reduce_scatter_tensor_coalesced(xs, "sum", world, g)],
        "all_reduce": lambda g: [wait(f.all_reduce(x, "sum", g))],
        "all_reduce_": lambda g: [wait(f.all_reduce_(x.clone(), "avg", g))],
        "all_reduce_coalesced": lambda g: [wait(t) for t in f.all_reduce_coalesced(xs, "sum", g)],
        "all_to_all_single": lambda g: [wait(f.all_to_all_single(x, [N // 2] * 2, [N // 2] * 2,
                                                                 g))],
        "broadcast": lambda g: [wait(f.broadcast(x, 0, g))],
    }
    errs, seen = {}, {}
    for name, op in ops.items():
        if not hasattr(f, name):
            continue  # an older torch
        before = qcomm.stats(pg)
        got = op(pg.group_name)
        after = qcomm.stats(pg)
        seen[name] = sum(after[k].calls_compressed - before[k].calls_compressed
                         for k in after)
        want = op(ref.group_name)
        errs[name] = max(((a - b).norm() / b.norm()).item() for a, b in
                         zip(got, want, strict=True))
    # the _out form behind an async compressed call in flight: ordered with it (it went
    # to the inner backend from C++ before, and gloo aborted on the mixed messages)
    out = torch.empty(world * N)
    work = dist.all_gather_into_tensor(out, make(rank, N, salt=3), async_op=True)
    got = wait(f.all_gather_into_tensor_out(x, world, pg.group_name,
                                            out=torch.empty(world * N)))
    work.wait()
    want = torch.cat([make(r, N) for r in range(world)])
    errs["out_behind_async"] = ((got - want).norm() / want.norm()).item()
    backend = pg._get_backend(torch.device("cpu"))
    return errs, seen, type(backend).__name__, dist.get_backend(pg)


def test_functional_ops_on_a_qcomm_group():
    """Every _c10d_functional op (what compiled code and DTensor emit) runs on a qcomm
    group, compressed within the codec's error or exact; the exact ones equal gloo's.
    Every all-gather, reduce-scatter and all-reduce among them reaches qcomm (counted,
    compressed), the _out form included."""
    errs, seen, backend, name = run_ranks(_functional_body, 2)[0]
    assert backend == "ProcessGroupGloo" and name == "qcomm"
    assert len(errs) >= 10, errs
    for op in ("all_to_all_single", "broadcast"):
        assert errs[op] == 0.0, (op, errs)
    for op, err in errs.items():
        assert err < 0.02, (op, errs)
    for op, count in seen.items():
        if op not in ("all_to_all_single", "broadcast"):
            assert count >= 1, (op, seen)


def _avg_body(rank, world):
    """An exact AVG on gloo (SUM, then a division) stays asynchronous: the Work does
    the division when the sum arrives."""
    store = _store()
    t = torch.full((64,), float(rank + 1))  # under min_numel: exact
    if rank == 1:
        time.sleep(1.0)
        store.set("joined", "1")
    work = dist.all_reduce(t, ReduceOp.AVG, async_op=True)
    early = not store.check(["joined"])
    work.wait()
    return early, t.tolist()


def test_exact_avg_stays_asynchronous():
    early, values = run_ranks(_avg_body, 2)[0]
    assert early
    assert values == [1.5] * 64


def _options_body(rank, world):
    gloo_options = dist.ProcessGroupGloo._Options()
    gloo_options._devices = [dist.ProcessGroupGloo.create_default_device()]
    gloo_options._threads = 1
    group = dist.new_group(backend="qcomm", pg_options=gloo_options)
    t = make(rank, 100)
    dist.all_reduce(t, group=group)
    with pytest.raises(TypeError, match="pg_options must be the options of an inner backend"):
        dist.new_group(backend="qcomm", pg_options=object())
    return torch.allclose(t, make(0, 100) + make(1, 100))


def test_pg_options_for_the_inner_backend_or_refused():
    assert all(run_ranks(_options_body, 2))
