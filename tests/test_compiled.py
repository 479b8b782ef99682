"""The compiled CPU path's calls that skip Dynamo (qcomm.cpu.compiled): taken only for
calls Dynamo already ran on the function's one graph, and the same bytes as the eager
path either way."""

import pytest
import torch

from qcomm import QuantConfig, dequantize, quantize
from qcomm.cpu import compiled as qc


def _new_toy():
    """``out = 2a + 1`` as a new function object: a compile cache of its own per test
    (qcomm.compiled caches per function and copies its code object)."""
    def toy(a, out):
        out.copy_(a * 2.0 + 1.0)
    return toy


def _toy_with_break(a, out):
    out.copy_(a * 2.0)
    print(end="")  # a graph break: two graphs for one function
    out.add_(1.0)


def _toy_pair(a, out):  # returns its results as a tuple: checked by a second run
    out.copy_(a - 1.0)
    return a * 2.0, a + 1.0


def _toy_returns(a, out):
    out.copy_(a * 2.0 + 1.0)
    return out.sum()


def _counts():
    return qc.calls["direct"], qc.calls["dynamo"]


def _delta(before):
    d, y = _counts()
    return d - before[0], y - before[1]


# Configurations test_kernels.py compiles as well (one compile each per process: ~10-25 s)
@pytest.mark.parametrize("cfg,dtype", [(QuantConfig(bits=8), torch.float32),
                                       (QuantConfig(bits=4), torch.float32),
                                       (QuantConfig(bits=8, bucket_size=40), torch.bfloat16)],
                         ids=["minmax8", "minmax4", "minmax8-b40-bf16"])
def test_repeated_codec_calls_skip_dynamo_with_the_same_bytes(cfg, dtype):
    """(From bf16 the quantize graph returns the codes of both bucket halves; impl="torch"
    compiles whatever QCOMM_COMPILE says.)"""
    n = 4 * cfg.bucket_size + 37  # whole buckets and a partial one: two graphs per op
    x = torch.randn(n).to(dtype)
    want = quantize(x, cfg, seed=3, impl="eager")
    want_y = dequantize(want, impl="eager")
    quantize(x, cfg, seed=3, impl="torch")  # compiles, or runs through Dynamo once
    dequantize(want, impl="torch")
    before = _counts()
    for seed in (3, 4):  # a new seed is new data, not a new signature
        got = quantize(x, cfg, seed=seed, impl="torch")
        ref = want if seed == 3 else quantize(x, cfg, seed=seed, impl="eager")
        assert torch.equal(got.payload, ref.payload)
    y = dequantize(want, impl="torch")
    assert torch.equal(y, want_y)
    direct, dynamo = _delta(before)
    assert dynamo == 0 and direct >= 6, (direct, dynamo)

    # The same shape at another storage offset is a new signature: Dynamo runs it once.
    big = torch.randn(n + 1).to(dtype)
    big[1:].copy_(x)
    before = _counts()
    assert torch.equal(quantize(big[1:], cfg, seed=3, impl="torch").payload, want.payload)
    assert _delta(before)[1] >= 1
    before = _counts()
    assert torch.equal(quantize(big[1:], cfg, seed=3, impl="torch").payload, want.payload)
    assert _delta(before)[1] == 0


def test_direct_calls_need_a_validated_signature():
    run = qc.compiled(_new_toy())
    # The first length compiles; another is served by the dynamic graph (no recompile):
    # each goes through Dynamo once, then directly.
    for rows in (6, 9):
        a, out = torch.randn(rows, 4), torch.empty(rows, 4)
        before = _counts()
        run(a, out)
        run(a, out)
        assert _delta(before) == (1, 1)
        torch.testing.assert_close(out, a * 2.0 + 1.0, rtol=0, atol=0)
    # In place (out aliases a): a new storage pattern, not the validated one (Dynamo
    # compiles a graph for it, which turns direct calls off: the next test).
    c = torch.randn(6, 4)
    want = c * 2.0 + 1.0
    before = _counts()
    run(c, c)
    assert _delta(before) == (0, 1)
    torch.testing.assert_close(c, want, rtol=0, atol=0)


def test_a_recompile_turns_direct_calls_off():
    run = qc.compiled(_new_toy())
    a, out = torch.randn(5, 3), torch.empty(5, 3)
    run(a, out)
    run(a, out)
    one, out_one = torch.randn(1, 3), torch.empty(1, 3)  # Dynamo specializes size 1
    run(one, out_one)
    graph = next(g for g in run.graphs() if g.graphs == 2)
    assert graph.call is None
    before = _counts()
    run(a, out)
    assert _delta(before) == (0, 1)
    torch.testing.assert_close(out, a * 2.0 + 1.0, rtol=0, atol=0)


def test_the_callers_grad_mode_does_not_recompile():
    """Calls run with grad mode off: Dynamo guards on it, and a collective under
    torch.no_grad() after a call with grad on would compile a second graph (each call
    a new length, so that Dynamo runs it). Inference mode gets a graph of its own."""
    run = qc.compiled(_new_toy())
    modes = (torch.enable_grad, torch.no_grad, torch.enable_grad, torch.inference_mode,
             torch.inference_mode)
    for rows, mode in enumerate(modes, start=5):
        a, out = torch.randn(rows, 3), torch.empty(rows, 3)
        with mode():
            run(a, out)
            run(a, out)
        torch.testing.assert_close(out, a * 2.0 + 1.0, rtol=0, atol=0)
    assert [(g.graphs, g.call is not None) for g in run.graphs()] == [(1, True)] * 2
    assert torch.is_grad_enabled()  # and the caller's mode is back


def test_a_graph_returning_a_tuple_runs_directly_in_order():
    run = qc.compiled(_toy_pair)
    a, out = torch.randn(5, 2), torch.empty(5, 2)
    before = _counts()
    results = [run(a, out) for _ in range(3)]
    assert _delta(before) == (2, 1)
    for twice, plus in results:
        torch.testing.assert_close(twice, a * 2.0, rtol=0, atol=0)
        torch.testing.assert_close(plus, a + 1.0, rtol=0, atol=0)
    torch.testing.assert_close(out, a - 1.0, rtol=0, atol=0)


@pytest.mark.parametrize("fn", [_toy_with_break, _toy_returns], ids=["graph-break", "returns"])
def test_no_direct_calls_for_graph_breaks_or_a_lone_result(fn):
    run = qc.compiled(fn)
    a, out = torch.randn(4, 2), torch.empty(4, 2)
    before = _counts()
    results = [run(a, out) for _ in range(3)]
    assert _delta(before) == (0, 3)
    torch.testing.assert_close(out, a * 2.0 + 1.0, rtol=0, atol=0)
    if fn is _toy_returns:
        for r in results:  # (a compiled sum: another summation order)
            torch.testing.assert_close(r, (a * 2.0 + 1.0).sum())
