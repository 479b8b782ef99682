"""qcomm never returns a wrong number silently and never hangs (2-3 processes).

- Non-finite values reach every rank that receives them, for all three collectives,
  and an fp16 GradScaler run skips exactly the steps plain gloo skips.
- A peer killed with SIGKILL mid-collective (all-gather, reduce-scatter, an FSDP2
  step) makes every survivor raise an error naming the collective within the group's
  timeout plus 10 s.
- Ranks that disagree (environment, config, size, dtype, kind, op) get an error naming
  the mismatch on every rank, and the group stays usable; bad input is refused before
  anything is sent, inputs untouched.
- Two qcomm groups driven from two threads at once give correct results.
- The soak script's short version (300 checked collectives) runs end to end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import make, run_ranks
from torch.distributed import ReduceOp

import qcomm
from qcomm import CommConfig, QuantConfig

pytestmark = pytest.mark.slow

BUCKET = 1024  # the default QuantConfig's bucket: a poisoned bucket decodes to NaN
PG_TIMEOUT = 5.0  # seconds: the process groups' timeout in the dying-peer tests
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def buckets_of(positions, bucket: int = BUCKET) -> set[int]:
    return {p // bucket for p in positions}


def assert_region(out: torch.Tensor, bad: list[int], what: str, bucket: int = BUCKET,
                  offset: int = 0) -> None:
    """``out[bad]`` non-finite; everything outside their buckets finite. Buckets count
    from ``offset`` (the start of the payload the value travelled in)."""
    nonfinite = ~torch.isfinite(out.float())
    assert nonfinite[bad].all(), f"{what}: a poisoned element came back finite"
    poisoned = buckets_of([p - offset for p in bad], bucket)
    idx = torch.arange(out.numel()) - offset
    inside = torch.zeros_like(nonfinite)
    for b in poisoned:
        inside |= (idx >= b * bucket) & (idx < (b + 1) * bucket)
    stray = (nonfinite & ~inside).nonzero().flatten()[:8].tolist()
    assert not stray, f"{what}: non-finite outside the poisoned buckets at {stray}"


# ---------------------------------------------------------------------------------
# Non-finite values


def _nonfinite_body(rank, world):
    group = dist.group.WORLD
    n = 3000  # 3 buckets, the last one partial
    for dtype in FLOATS:
        for bad_value in (float("inf"), float("-inf"), float("nan")):
            what = f"{dtype} {bad_value}"
            # all-gather: rank 0 poisons element 5 of its shard, rank 1 element 2500
            x = make(rank, n, dtype)
            poison = {0: 5, 1: 2500}
            if rank in poison:
                x[poison[rank]] = bad_value
            out = torch.empty(world * n, dtype=dtype)
            qcomm.all_gather_into_tensor(out, x, group)
            for src, pos in poison.items():
                assert_region(out[src * n:(src + 1) * n], [pos], f"all-gather {what}")
            # reduce-scatter: rank 0 poisons chunk 1 (a peer's), rank 1 its own chunk 1
            big = make(rank, world * n, dtype, salt=1)
            if rank in (0, 1):
                big[n + 7] = bad_value
            o = torch.empty(n, dtype=dtype)
            qcomm.reduce_scatter_tensor(o, big, ReduceOp.SUM, group)
            if rank == 1:
                assert_region(o, [7], f"reduce-scatter {what}")
            else:
                assert torch.isfinite(o.float()).all(), f"reduce-scatter {what}: stray"
            # all-reduce: only the last rank poisons; the re-quantized sum keeps it
            t = make(rank, 2 * n + 1, dtype, salt=2)
            if rank == world - 1:
                t[n + 9] = bad_value
            qcomm.all_reduce(t, ReduceOp.AVG, group)
            chunk = -(-(2 * n + 1) // world)
            assert_region(t, [n + 9], f"all-reduce {what}",
                          offset=(n + 9) // chunk * chunk)
    # a finite fp16 sum that overflows is inf, as with gloo
    h = torch.full((4096,), 40000.0, dtype=torch.float16)
    qcomm.all_reduce(h, ReduceOp.SUM, group)
    assert torch.isinf(h).all()
    return True


def test_nonfinite_reaches_every_rank():
    run_ranks(_nonfinite_body, 2, backend="qcomm")


def _scaler_body(rank, world, steps):
    """DDP over the default group under fp16 autocast with a GradScaler: returns the
    steps each rank skipped. The scale starts high (the first steps overflow in fp16)
    and grows back every 3 steps; on steps 6 and 11 one rank alone overflows."""
    import torch.nn as nn

    from qcomm.demo import VOCAB, TinyLM, batch

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(TinyLM())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=3)
    skipped = []
    for step in range(steps):
        x, y = batch(rank, step)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1))
        if (step, rank) in ((6, 0), (11, 1)):
            loss = loss * 1e30  # this rank's gradients alone overflow
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.get_scale() < scale:
            skipped.append(step)
    return skipped


def test_grad_scaler_skips_the_steps_gloo_skips():
    steps = 14
    base = run_ranks(_scaler_body, 2, steps, backend="gloo")
    ours = run_ranks(_scaler_body, 2, steps, backend="qcomm")
    assert base[0] == base[1] and 6 in base[0] and 11 in base[0], base
    assert ours == base, f"gloo skipped {base[0]}, qcomm {ours}"


# ---------------------------------------------------------------------------------
# A dying peer


def _kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def _stop_self():  # alive, sockets open, never answering: only the timeout can tell
    os.kill(os.getpid(), signal.SIGSTOP)


def _dying_body(rank, world, where):
    """Rank 1 kills itself in the middle of a collective; survivors return the error
    they raised and how long it took."""
    import qcomm.algorithms as A
    import qcomm.inner as I

    group = dist.group.WORLD
    n = 1 << 16
    if rank == 1:
        if where in ("all_gather", "stuck"):  # from a timer, mid-transfer of a big gather
            threading.Timer(0.3, _kill_self if where == "all_gather" else _stop_self).start()
        elif where == "reduce_scatter":  # after the descriptors agreed, before payloads
            I.all_to_all = lambda *a, **k: _kill_self()
        elif where == "fsdp2":  # in the second reduce-scatter of the backward
            real, calls = A.packed_reduce_scatter, []

            def dying(*args, **kwargs):
                calls.append(1)
                if len(calls) == 2:
                    _kill_self()
                return real(*args, **kwargs)
            A.packed_reduce_scatter = dying
    start = time.monotonic()
    try:
        if where == "fsdp2":
            _fsdp2_steps(rank, steps=3)
        else:
            for i in range(10_000):
                if where in ("all_gather", "stuck"):
                    out = torch.empty(world * 4 * n)
                    qcomm.all_gather_into_tensor(out, make(rank, 4 * n, salt=i), group)
                else:
                    qcomm.reduce_scatter_tensor(torch.empty(n), make(rank, world * n), group=group)
    except Exception as err:  # noqa: BLE001 (what the survivor saw)
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _fsdp2_model(group=None):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from qcomm.demo import TinyLM

    torch.manual_seed(0)
    model = TinyLM()
    mesh = (init_device_mesh("cpu", (dist.get_world_size(),)) if group is None
            else DeviceMesh.from_group(group, "cpu"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train_steps(model, rank, steps):
    from qcomm.demo import train

    train(model, rank, steps, lr=1e-3)


def _fsdp2_steps(rank, steps):
    _train_steps(_fsdp2_model(), rank, steps)


@pytest.mark.parametrize("where,world", [("all_gather", 2), ("reduce_scatter", 3),
                                         ("fsdp2", 2), ("stuck", 2)])
def test_dying_peer_raises_naming_the_collective(where, world):
    """"stuck": the peer is stopped (SIGSTOP) instead, so the survivor learns it from
    the group's timeout alone."""
    results = run_ranks(_dying_body, world, where, dead=(1,), pg_timeout=PG_TIMEOUT,
                        timeout=90)
    kind = "reduce_scatter" if where in ("reduce_scatter", "fsdp2") else "all_gather"
    for rank, res in enumerate(results):
        if rank == 1:
            continue
        assert res["error"], f"rank {rank} finished without noticing the dead peer"
        named = f"qcomm {kind}" in res["error"] or (
            where == "fsdp2" and "qcomm all_gather" in res["error"])
        assert named, f"rank {rank}: {res['error'][:500]}"
        assert res["seconds"] < PG_TIMEOUT + 10, res


def _stuck_body(rank, world, route):
    """A plain gloo group (made with a 60 s timeout) used through qcomm: rank 1 stops
    (SIGSTOP: alive, sockets open) after the first call; rank 0 must raise at the
    group's timeout (PG_TIMEOUT), which qcomm's own connections follow. "wrap":
    qcomm.wrap of a group whose timeout was lowered before (read when connecting);
    "hook": FSDP2's comm hooks over the plain group (the direct calls' path), the
    timeout lowered with torch's setter after the first step (followed)."""
    from datetime import timedelta

    import qcomm.fsdp

    group = dist.group.WORLD
    lower = lambda: dist.distributed_c10d._set_pg_timeout(  # noqa: E731
        timedelta(seconds=PG_TIMEOUT), group)
    n = 1 << 16
    if route == "hook":
        model = _fsdp2_model(group)
        qcomm.fsdp.compress(model)
        step = lambda i: _train_steps(model, rank, 1)  # noqa: E731
    else:
        if route == "wrap":
            lower()
            group = qcomm.wrap(group)
        out = torch.empty(world * n)
        step = lambda i: qcomm.all_gather_into_tensor(out, make(rank, n, salt=i), group)  # noqa: E731
    step(0)  # connected: qcomm's own connections exist
    if route != "wrap":
        lower()
    if rank == 1:
        _stop_self()
    start = time.monotonic()
    try:
        for i in range(1, 10_000):
            step(i)
    except Exception as err:  # noqa: BLE001 (what the survivor saw)
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("route", ["wrap", "hook"])
def test_a_stopped_peer_raises_at_the_plain_groups_timeout(route):
    """Every connection qcomm makes for a plain group carries that group's timeout,
    also when torch's setter changes it later (torchtitan lowers it after the first
    step): not torch's 30-minute default."""
    results = run_ranks(_stuck_body, 2, route, backend="gloo", dead=(1,), pg_timeout=60,
                        timeout=90)
    res = results[0]
    assert res["error"] and "qcomm" in res["error"], res
    assert res["seconds"] < PG_TIMEOUT + 10, res


# ---------------------------------------------------------------------------------
# A call that fails after its inner work started fails the group


def _fault_body(rank, world, mode):
    """Rank 0 finds piece 1 of a 3-piece all-gather bad (an injected header check
    failure, after every piece's exchange has started): that call raises on rank 0, and
    every later call on the group there (compressed, exact, forwarded) raises
    DistBackendError naming it. Rank 1 completed the call; its next one finds no peer
    and fails by the group's timeout, never hangs; and then the group is failed there."""
    import qcomm.handshake as H
    import qcomm.pieces as P

    P.PIECE = 1024
    group = dist.group.WORLD
    n = 3001
    out = torch.empty(world * n)
    qcomm.all_gather_into_tensor(out, make(rank, n), group)  # agreed, in step
    if rank == 0:
        real, seen = H.Agreement.check_received, []

        def faulty(self, rows, *args, **kwargs):
            seen.append(1)
            if len(seen) == 2:
                raise ValueError("injected: a bad header in piece 1")
            return real(self, rows, *args, **kwargs)

        H.Agreement.check_received = faulty
    res = {}
    try:
        work = qcomm.all_gather_into_tensor(out, make(rank, n), group,
                                            async_op=mode == "async")
        if work is not None:
            work.wait()
        res["first"] = None
    except Exception as err:  # noqa: BLE001 (what the rank saw)
        res["first"] = f"{type(err).__name__}: {err}"
    later = []
    for call in (lambda: qcomm.all_gather_into_tensor(out, make(rank, n), group),
                 lambda: qcomm.all_reduce(torch.ones(8), group=group),  # exact: too small
                 lambda: dist.broadcast(torch.ones(8), 0)):
        start = time.monotonic()
        try:
            call()
            later.append(None)
        except Exception as err:  # noqa: BLE001
            later.append((f"{type(err).__name__}: {err}", time.monotonic() - start))
    res["later"] = later
    return res


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failure_after_the_exchange_started_fails_the_group(mode):
    results = run_ranks(_fault_body, 2, mode, pg_timeout=PG_TIMEOUT, timeout=120)
    r0, r1 = results
    assert r0["first"] and "injected" in r0["first"], r0
    for err in r0["later"]:  # every later call: failed at once, naming the first error
        assert err and err[0].startswith("DistBackendError") and "injected" in err[0], err
        assert err[1] < 1.0, err
    assert r1["first"] is None, r1  # its call completed: rank 0 had sent every piece
    err = r1["later"][0]
    assert err and "qcomm all_gather" in err[0] and err[1] < PG_TIMEOUT + 10, err
    for err in r1["later"][1:]:  # and then its group is failed too
        assert err and "earlier call on this group failed" in err[0], err


# ---------------------------------------------------------------------------------
# Ranks that disagree


def _env_mismatch_body(rank, world):
    """Ranks started with different QCOMM_* variables (the last rank alone differs, so
    a rank that compared with rank 0 alone would miss it): new_group("qcomm") fails on
    every rank with the same error, naming both configs. Then the same for a wrap
    (through the store, at once), a plain group's agreement (its first call through
    qcomm, here the hook route's install) and a call's descriptors: every rank refuses
    in the same words, and the group stays usable."""
    errors = {}
    last = rank == world - 1
    for var, values in (("QCOMM_AG_BITS", ("8", "4")), ("QCOMM_BUCKET", ("1024", "512")),
                        ("QCOMM_SCHEME", ("minmax", "nuq"))):
        os.environ[var] = values[last]
        with pytest.raises(ValueError, match="config differs between ranks") as info:
            dist.new_group(backend="qcomm")
        errors[var] = str(info.value)
        del os.environ[var]
    ok = dist.new_group(backend="qcomm")  # the same environment again: fine
    t = make(rank, 4096)
    dist.all_reduce(t, group=ok)
    with pytest.raises(ValueError, match="config differs between ranks") as info:
        qcomm.wrap(dist.group.WORLD, CommConfig(min_numel=4096 if last else 1024))
    errors["wrap"] = str(info.value)
    plain = dist.new_group(backend="gloo")  # the hook route's: agreed at install
    with pytest.raises(ValueError, match="config differs between ranks") as info:
        qcomm.driver.adopt(plain, CommConfig(min_numel=4096 if last else 1024),
                           torch.device("cpu"))
    errors["plain"] = str(info.value)
    out = torch.empty(world * 4096)
    config = QuantConfig(bits=4 if last else 8)
    with pytest.raises(ValueError, match="ranks disagree") as info:
        qcomm.all_gather_into_tensor(out, make(rank, 4096), ok, config=config)
    errors["descriptor"] = str(info.value)
    qcomm.all_gather_into_tensor(out, make(rank, 4096), ok)  # still usable
    assert (out.view(world, -1)[rank] - make(rank, 4096)).abs().max() < 0.1
    return errors


def test_env_mismatch_fails_at_group_creation():
    results = run_ranks(_env_mismatch_body, 3, backend="gloo")
    errors = results[0]
    assert "bits=4" in errors["QCOMM_AG_BITS"] and "bits=8" in errors["QCOMM_AG_BITS"]
    assert "bucket_size=512" in errors["QCOMM_BUCKET"]
    assert "'nuq'" in errors["QCOMM_SCHEME"]
    assert "min_numel=4096" in errors["wrap"] and "rank 2" in errors["wrap"]
    assert "min_numel=4096" in errors["plain"] and "rank 2" in errors["plain"]
    assert "bits: rank 2 has 4, rank 0 8" in errors["descriptor"]
    for other in results[1:]:  # every rank: the same error, word for word
        assert other == errors, (other, errors)


def _disagree_body(rank, world):
    group = dist.group.WORLD
    n = 4096
    x = make(rank, n)

    def refused(match, call):
        snapshot = [t.clone() for t in call.keep]
        with pytest.raises(ValueError, match=match):
            call()
        for before, t in zip(snapshot, call.keep, strict=True):
            assert torch.equal(before, t), "input written by a refused call"
        # nothing but the descriptors moved: the group still works
        out = torch.empty(world * n)
        qcomm.all_gather_into_tensor(out, x, group)
        assert (out[rank * n:(rank + 1) * n] - x).abs().max() < 0.1

    def ag(inp, config=None, out=None):
        out = torch.empty(world * inp.numel(), dtype=inp.dtype) if out is None else out
        call = lambda: qcomm.all_gather_into_tensor(out, inp, group, config=config)  # noqa: E731
        call.keep = [inp]
        return call

    other = lambda **kw: QuantConfig(**kw) if rank else QuantConfig()  # noqa: E731
    # configs that change the payload size (gloo would abort the process) ...
    refused("bits: rank 1 has 4, rank 0 8", ag(x, other(bits=4)))
    refused("bucket_size", ag(x, other(bucket_size=512)))
    refused("scheme", ag(x, other(scheme="nuq")))
    # ... and ones that keep it
    refused("rounding", ag(x, other(rounding="nearest")))
    refused("norm", ag(x, other(scheme="maxnorm", norm="l2") if rank else
                       QuantConfig(scheme="maxnorm")))
    # sizes and dtypes that differ across ranks
    refused("numel", ag(make(rank, n + 100 * rank)))
    refused("dtype", ag(make(rank, n, torch.bfloat16 if rank else torch.float32)))
    # different collectives, ops
    inp = make(rank, 2 * n)
    if rank == 0:
        call = ag(make(rank, 2 * n))
    else:
        out = torch.empty(n)
        call = lambda: qcomm.reduce_scatter_tensor(out, inp, group=group)  # noqa: E731
        call.keep = [inp]
    refused("collective", call)
    t = make(rank, 3 * n)
    call = lambda: qcomm.all_reduce(t, ReduceOp.AVG if rank else ReduceOp.SUM, group)  # noqa: E731
    call.keep = [t]
    refused("reduce op", call)
    # a group wrapped with different configs: the wrap says so, through the store
    with pytest.raises(ValueError, match="config differs between ranks.*min_numel=4096"):
        qcomm.wrap(group, CommConfig(min_numel=4096 if rank else 1024))
    # the payload header check alone (descriptors off): equal-size payloads that differ
    # are named, after the exchange; the payloads had moved, so each group fails for good
    import qcomm.handshake as H

    real = H.Agreement.check_call
    H.Agreement.check_call = lambda *a, **k: None
    try:
        for match, inp, config in (
                ("payload from rank .*rounding", x, other(rounding="nearest")),
                # 2001 and 2002 elements take the same bytes at 8 bits: numel tells
                ("payload from rank .*numel", make(rank, 2001 + rank), None)):
            fresh = qcomm.wrap(group)
            out = torch.empty(world * inp.numel())
            with pytest.raises(ValueError, match=match):
                qcomm.all_gather_into_tensor(out, inp, fresh, config=config)
            with pytest.raises(dist.DistBackendError, match="earlier call.*" + match):
                qcomm.all_gather_into_tensor(out, inp, fresh, config=config)
    finally:
        H.Agreement.check_call = real
    return True


def test_disagreeing_ranks_get_a_clear_error():
    run_ranks(_disagree_body, 2, backend="gloo")


def _refused_body(rank, world):
    """A refused call changes nothing and counts every byte: a call whose payload rode
    in the envelope is refused (rank 1 asks for 4 bits): what every inner group qcomm
    made was handed equals the stats, byte for byte, and the call index and history
    stay; an error-feedback reduce-scatter refused (the ranks' ops differ) leaves its
    residuals as they were, so the next call gives the bytes of a run without it."""
    from test_wire import ByteCounter

    import qcomm.inner as I
    from qcomm.driver import group_state
    from qcomm.fsdp import ErrorFeedbackReduceScatter

    counters, real = [], I.make_inner

    def counted(*args, **kwargs):
        counters.append(ByteCounter(real(*args, **kwargs)))
        return counters[-1]

    I.make_inner = counted
    res = {}
    group = dist.new_group(backend="gloo")
    n = 1024
    out = torch.empty(world * n)
    for i in range(9):  # a period of one call: the 9th call's payload rides
        qcomm.all_gather_into_tensor(out, make(rank, n, salt=i), group)
    state = group_state(group)
    history = state.agreement.history
    before = (state.calls, len(history.keys), history.room())
    with pytest.raises(ValueError, match="ranks disagree.*bits: rank 1 has 4, rank 0 8"):
        qcomm.all_gather_into_tensor(out, make(rank, n), group,
                                     config=QuantConfig(bits=4) if rank else None)
    res["rode"] = before[2] > 0
    res["unchanged"] = before == (state.calls, len(history.keys), history.room())
    s = qcomm.stats(group)
    res["counted"] = sum(c.to_peers for c in counters)
    res["wire"] = sum(v.wire_bytes for v in s.values())
    I.make_inner = real

    def feedback(refuse: bool) -> list[torch.Tensor]:
        g = dist.new_group(backend="gloo")
        ef = ErrorFeedbackReduceScatter(QuantConfig(bits=4))
        outs = []
        for i in range(2):
            if i == 1 and refuse:
                with pytest.raises(ValueError, match="ranks disagree.*reduce op"):
                    ef(torch.empty(n), make(rank, world * n, salt=7), g,
                       op=ReduceOp.AVG if rank else ReduceOp.SUM)
            outs.append(torch.empty(n))
            ef(outs[-1], make(rank, world * n, salt=i), g)
        return outs

    res["feedback"] = [torch.equal(a, b) for a, b in zip(feedback(False), feedback(True),
                                                          strict=True)]
    return res


def test_a_refused_call_changes_nothing_and_counts_every_byte():
    for r in run_ranks(_refused_body, 2, backend="gloo"):
        assert r["rode"] and r["unchanged"], r
        assert r["counted"] == r["wire"], r
        assert r["feedback"] == [True, True], r


def _async_body(rank, world):
    """Rank 0 issues two async compressed all-gathers back to back while rank 1 holds
    back (the first cannot finish): the second must return with the first still
    running, not after it. Rank 1 joins when told, or after 30 s."""
    from datetime import timedelta

    from qcomm.driver import group_state

    group = dist.group.WORLD  # qcomm, each rank its own node: compressed
    store = dist.distributed_c10d._get_default_store()
    n = 1 << 16
    outs = [torch.empty(world * n) for _ in range(2)]
    res = {}
    if rank == 0:
        w1 = dist.all_gather_into_tensor(outs[0], make(rank, n), group=group, async_op=True)
        state = group_state(group)
        deadline = time.monotonic() + 10
        while not state.lock.locked() and time.monotonic() < deadline:
            time.sleep(0.001)  # until the first call runs on the worker
        res["running"] = state.lock.locked()
        w2 = dist.all_gather_into_tensor(outs[1], make(rank, n, salt=1), group=group,
                                         async_op=True)
        res["first_done_when_second_returned"] = w1.is_completed()
        store.set("qcomm-test/go", "1")
    else:
        try:
            store.wait(["qcomm-test/go"], timedelta(seconds=30))
        except RuntimeError:
            pass  # rank 0 never said go: its second call must have waited
        w1 = dist.all_gather_into_tensor(outs[0], make(rank, n), group=group, async_op=True)
        w2 = dist.all_gather_into_tensor(outs[1], make(rank, n, salt=1), group=group,
                                         async_op=True)
    w1.wait()
    w2.wait()
    res["close"] = all((outs[i].view(world, n)[r] - make(r, n, salt=i)).abs().max() < 0.1
                       for i in range(2) for r in range(world))
    return res


def test_an_async_call_never_waits_for_a_running_one():
    r0, r1 = run_ranks(_async_body, 2)
    assert r0["running"] and r0["first_done_when_second_returned"] is False, r0
    assert r0["close"] and r1["close"], (r0, r1)


def _bad_input_body(rank, world):
    group = dist.group.WORLD
    n = 4096
    x = make(rank, n)
    keep = x.clone()
    cases = [
        (TypeError, "dtype", lambda: qcomm.all_gather_into_tensor(
            torch.empty(world * n, dtype=torch.float16), x, group)),
        (ValueError, "times the elements", lambda: qcomm.all_gather_into_tensor(
            torch.empty(world * n + 1), x, group)),
        (ValueError, "times the elements", lambda: qcomm.reduce_scatter_tensor(
            torch.empty(n), x, group=group)),
        (ValueError, "inp must be contiguous", lambda: qcomm.all_gather_into_tensor(
            torch.empty(world * n // 2), x[::2], group)),
        (ValueError, "out must be contiguous", lambda: qcomm.all_gather_into_tensor(
            torch.empty(2 * world * n)[::2], x, group)),
        (ValueError, "inp must be contiguous", lambda: qcomm.reduce_scatter_tensor(
            torch.empty(n // 4), x[::2], group=group)),
        (ValueError, "out must be contiguous", lambda: qcomm.reduce_scatter_tensor(
            torch.empty(n)[::2], x, group=group)),
        (TypeError, "torch.Tensor", lambda: qcomm.all_reduce(x.tolist(), group=group)),
    ]
    for err, match, call in cases:
        with pytest.raises(err, match=match):
            call()
        assert torch.equal(x, keep), f"{match}: input written"
    # a non-contiguous all-reduce works (as on gloo), written back in place
    m = make(rank, 128 * 64).view(128, 64).t()
    want = torch.stack([make(r, 128 * 64).view(128, 64).t() for r in range(world)]).sum(0)
    qcomm.all_reduce(m, group=group)
    assert (m - want).abs().max() < 0.2
    # exact AVG on gloo (which rejects AVG itself): SUM, then one division
    s = make(rank, 100)
    qcomm.all_reduce(s, ReduceOp.AVG, group)
    assert torch.allclose(s, sum(make(r, 100) for r in range(world)) / world)
    return True


def test_bad_input_refused_before_sending():
    run_ranks(_bad_input_body, 2, backend="gloo")


# ---------------------------------------------------------------------------------
# Concurrency


def _threads_body(rank, world):
    groups = [qcomm.wrap(dist.new_group(backend="gloo")) for _ in range(2)]
    errors = []

    def drive(g, salt):
        try:
            for i in range(20):
                n = 2048 + 512 * i
                x = make(rank, n, salt=salt + i)
                out = torch.empty(world * n)
                qcomm.all_gather_into_tensor(out, x, g)
                want = torch.cat([make(r, n, salt=salt + i) for r in range(world)])
                assert (out - want).abs().max() < 0.15, "all-gather off"
                t = make(rank, n, salt=salt + i)
                qcomm.all_reduce(t, group=g)
                want = sum(make(r, n, salt=salt + i) for r in range(world))
                assert (t - want).abs().max() < 0.3, "all-reduce off"
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=drive, args=(g, 100 * k)) for k, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert all(qcomm.stats(g)["all_reduce"].calls_compressed == 20 for g in groups)
    return True


def test_two_groups_from_two_threads():
    run_ranks(_threads_body, 2, backend="gloo")


# ---------------------------------------------------------------------------------
# Soak, short


def test_soak_short(tmp_path):
    env = {**os.environ, "QCOMM_COMPILE": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "soak", "--count", "300", "--out", str(tmp_path),
         "--max-growth", "1000", "--timeout", "150"],
        capture_output=True, text=True, timeout=180, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "soak.json").read_text())
    assert sum(r["calls"] for r in result["rows"]) == 300
    assert all(r["worst"] <= 1.0 for r in result["rows"]), result["rows"]
    assert {r["path"] for r in result["rows"]} == {"compressed", "exact"}
