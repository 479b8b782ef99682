"""Following one collective's input through the package enters each file at most twice.

The trace records every call of a function in ``qcomm/`` or ``kernels/`` that receives the
input tensor (or a view of its storage) as an argument, in call order; consecutive calls
in one file are one stay. A file entered a third time is the same step split across
modules (a helper of the CPU path kept in another file, an orchestration restated): the
reader following the data has to come back to it. All-reduce is a reduce-scatter then an
all-gather of the reduced chunk, so it passes each step's files once per half.
"""

from __future__ import annotations

import collections
import itertools
import sys
from pathlib import Path

import pytest
import torch

import qcomm

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = (ROOT / "qcomm", ROOT / "kernels")


def follow(call, tensor: torch.Tensor) -> tuple[list[tuple[str, str]], collections.Counter]:
    """(the package calls that received ``tensor``, stays per file) of one ``call()``."""
    call()  # the first call agrees on the config and fills the caches
    storage = tensor.untyped_storage().data_ptr()

    def holds(value) -> bool:
        return (isinstance(value, torch.Tensor)
                and value.untyped_storage().data_ptr() == storage)

    seen = []

    def tracer(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if event == "call" and any(p in path.parents for p in PACKAGE):
            code = frame.f_code
            names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
            values = []
            for name in names:
                v = frame.f_locals.get(name)
                values += list(v) if isinstance(v, (list, tuple)) else [v]
            if any(holds(v) for v in values):
                seen.append((str(path.relative_to(ROOT)), code.co_name))
        return None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    stays = [f for f, _ in itertools.groupby(f for f, _ in seen)]
    return seen, collections.Counter(stays)


N = 1 << 12


@pytest.mark.parametrize("collective, most", [("all_gather", 2), ("backend all_gather", 2),
                                              ("reduce_scatter", 2), ("all_reduce", 3)])
def test_an_input_enters_each_file_at_most_twice(collective, most):
    from torch._C._distributed_c10d import AllgatherOptions

    from bench.simulated import simulated_group

    group = simulated_group(2, compile=False)
    x, full = torch.randn(N), torch.randn(2 * N)
    if collective == "all_gather":
        out = torch.empty(2 * N)
        call, tensor = (lambda: qcomm.all_gather_into_tensor(out, x, group)), x
    elif collective == "backend all_gather":  # torch's entry point, synchronous: this thread
        out, opts = torch.empty(2 * N), AllgatherOptions()
        opts.asyncOp = False
        call, tensor = (lambda: group.all_gather_single(out, x, opts)), x
    elif collective == "reduce_scatter":
        out = torch.empty(N)
        call, tensor = (lambda: qcomm.reduce_scatter_tensor(out, full, group=group)), full
    else:
        y = torch.empty(2 * N)
        call, tensor = (lambda: qcomm.all_reduce(y.copy_(full), group=group)), y
    seen, stays = follow(call, tensor)
    route = " -> ".join(f"{f}:{fn}" for f, fn in seen)
    # the trace saw the whole compressed call: the codec's quantize on the CPU path
    kind = collective.split()[-1]
    assert "qcomm/cpu/quantize.py" in stays and qcomm.stats(group)[kind].calls_compressed
    assert max(stays.values()) <= most, (stays.most_common(3), route)
