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


# ---------------------------------------------------------------------------------
# The house (issue 45): no import cycles, the public API apart from the algorithms, and
# a group's state changed only by the driver


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, at module level or inside a function (a
    lazy import is a cycle all the same: the two modules cannot be read apart)."""
    import ast

    package = "qcomm" if path.parent.name != "cpu" else "qcomm.cpu"
    if path.parent == ROOT / "kernels":
        package = "qcomm.kernels"
    mod = package + ("" if path.stem == "__init__" else f".{path.stem}")
    base = mod if path.stem == "__init__" else package
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                root = ".".join(parts[:len(parts) - node.level + 1])
                name = f"{root}.{node.module}" if node.module else root
            else:
                name = node.module or ""
            targets = [name] + [f"{name}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found |= {t for t in targets if t.startswith("qcomm")}
    return found


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted((ROOT / "qcomm").rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[0] == "kernels":
            parts = ["qcomm", "kernels"] + parts[1:]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def test_no_import_cycle_in_the_package():
    """No module of qcomm imports, at any depth and however lazily, one that imports it
    back (the package's ``__init__`` aside: it re-exports the API)."""
    mods = _modules()
    graph = {m: {t for t in _imports(p) if t in mods and t != m and t != "qcomm"}
             for m, p in mods.items() if m != "qcomm"}
    cycles = []

    def visit(m, path):
        for t in graph.get(m, ()):
            if t == path[0]:
                cycles.append(" -> ".join(path + [t]))
            elif t not in path and len(path) < 12:
                visit(t, path + [t])

    for m in graph:
        visit(m, [m])
    assert not cycles, cycles[:5]


def test_the_api_is_apart_from_the_algorithms():
    """collectives.py keeps the public functions and their validation (at most 350
    lines); the algorithms are qcomm.algorithms', the piece pipeline qcomm.pieces'."""
    import qcomm.algorithms as A
    import qcomm.collectives as C

    assert len((ROOT / "qcomm/collectives.py").read_text().splitlines()) <= 350
    assert not any(name.startswith(("packed_", "two_level_")) for name in vars(C))
    assert {"packed_all_gather", "packed_reduce_scatter", "two_level_all_gather",
            "two_level_reduce_scatter"} <= set(vars(A))


def test_only_the_driver_changes_a_groups_state():
    """A GroupState's fields are assigned in qcomm/driver.py alone: nothing outside
    writes into a group's state."""
    import ast

    from qcomm.driver import GroupState

    fields = set(vars(GroupState(qcomm.CommConfig(), None)))
    found = []
    for path in sorted((ROOT / "qcomm").rglob("*.py")):
        if path.name == "driver.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if (isinstance(e, ast.Attribute) and e.attr in fields
                            and not (isinstance(e.value, ast.Name) and e.value.id == "self")):
                        found.append(f"{path.relative_to(ROOT)}:{e.lineno} {ast.unparse(e)}")
    assert not found, found
