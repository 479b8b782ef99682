"""The compiled CPU path: :mod:`qcomm.cpu`'s pieces under ``torch.compile``, one
graph per configuration, and calls of that graph that skip Dynamo once it is known to
serve them.

Why skip it: a call of a compiled function goes through Dynamo's frame evaluation, its
guards and its disable/enable wrappers before the graph runs. Here (2-core Zen 3 VM,
torch 2.13) the 8-bit quantize graph of 2048 fp32 elements took 140-162 us a call
through Dynamo and 44-48 us called directly, arguments gathered as below included
(two runs of ``bench/experiments/side_by_side.py dynamo`` at f72c4cf). A codec
call makes one to three such calls.

How it stays correct: the graph is the one Dynamo compiled (a backend that hands
Inductor's callable back to Dynamo keeps a reference to it). A call goes straight to it
only when its *signature* (every argument's type, dtype, device, shape, strides,
storage offset, requires_grad, which arguments share a storage; non-tensors by value) is one
Dynamo has already run on that same graph, so Dynamo's guards held for exactly these
inputs, and the graph depends on nothing else: it was the only graph Dynamo ever
compiled for the function (no graph break, no recompile), all its inputs are the
function's arguments or their sizes, strides and storage offsets, and it returns
nothing (every result written into an argument) or exactly the tensors the function
returns. For a graph that returns tensors, the first call of each signature runs twice,
through Dynamo and directly, and the signature is kept only if both give the same
tensors in the same order; such a function must give the same result when run twice
(:func:`qcomm.cpu.quantize.encode_buckets` from 16-bit inputs: it writes its metadata and
returns its codes). Any other call goes through Dynamo as before, which then may add its
signature. Calls run with grad mode off, so it is one state for every call (Dynamo
guards on it: under a caller's grad mode the graphs would recompile).
"""

from __future__ import annotations

import functools
import threading
import types

import torch

from . import common

# Signatures kept per graph: one per distinct shape and layout of its calls (each a
# small tuple); past this many, calls of new shapes keep going through Dynamo.
MAX_SIGNATURES = 4096

_lock = threading.Lock()

# Calls of compiled pieces, by how they ran: "direct" (skipped Dynamo) or "dynamo" (one
# counter with the eager pieces' calls)
calls = common.calls


@functools.cache
def inductor_options() -> dict:
    """Options of the CPU quantize graphs and 16-bit decodes. Inductor stores a value in a
    full-size buffer of its own when the expression that computes it grows past ~50
    operations or a few reads (its ``realize_*`` thresholds); these graphs are one pass
    each by design, and a stored intermediate costs a round trip through memory and, on
    AVX2, the 16-wide tiling of a bf16/fp16 loop. Measured side by side (Zen 3, 2^24
    elements, 1 thread, G elements/s): bf16 quantize 8-bit 0.44 -> 0.64-0.67, 4-bit
    0.39 -> 0.53-0.58, fp32 unchanged; nuq 8-bit decode into bf16 0.29 -> 2.77, the
    other 16-bit decodes within noise. Not for fp32 decodes: nuq lost 10-20% with them
    (an expression read twice is then computed twice). Only the options this torch
    knows (their names have moved between versions)."""
    from torch._inductor import config

    return {name: 1 << 20 for name in ("realize_opcount_threshold", "realize_reads_threshold",
                                       "realize_acc_reads_threshold") if hasattr(config, name)}


class CompiledPiece:
    """What Dynamo compiled for one function: the graph count, and the first graph's
    callable with the recipe for its flat inputs (None where it cannot be called
    directly)."""

    def __init__(self, params: tuple[str, ...], options: dict):
        self.params = params  # the function's positional parameter names
        self.options = options
        self.graphs = 0  # graphs compiled for the function: direct calls need exactly 1
        self.call = None  # Inductor's callable over the graph's flat inputs
        self.inputs: list[tuple[str, str | None, int | None]] = []
        self.outputs = 0  # tensors the graph returns (the function returns them as a tuple)
        self.served: set = set()  # signatures Dynamo ran on this graph

    def backend(self, gm, example_inputs):
        """The ``torch.compile`` backend: Inductor, as ``torch.compile(options=...)`` runs
        it, keeping the callable if this is the function's only graph."""
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        compiled = compile_fx(gm, example_inputs, config_patches=self.options)
        recipe = _input_recipe(gm) if self.graphs == 1 else None
        self.call = compiled if recipe is not None else None
        self.inputs, self.outputs = recipe or ([], 0)
        self.served.clear()
        return compiled

    def direct(self, args: tuple, kwargs: dict):
        """Run the graph on the call's arguments, without Dynamo."""
        out = self.call(*self.flat_inputs(args, kwargs))
        return tuple(out) if self.outputs else None

    def check(self, sig, args: tuple, kwargs: dict, result) -> None:
        """After Dynamo ran a call of signature ``sig`` with ``result``: keep ``sig`` if
        a direct call of these arguments gives that result."""
        if sig is None or self.call is None or self.graphs != 1:
            return
        if len(self.served) >= MAX_SIGNATURES:
            return
        if self.outputs == 0:
            ok = result is None
        else:  # the same tensors, in the same order, from a second run
            ok = (isinstance(result, tuple) and len(result) == self.outputs
                  and all(isinstance(t, torch.Tensor) for t in result)
                  and all(a.dtype == b.dtype and torch.equal(a, b)
                          for a, b in zip(result, self.direct(args, kwargs), strict=True)))
        if ok:
            self.served.add(sig)

    def flat_inputs(self, args: tuple, kwargs: dict) -> list:
        bound = dict(zip(self.params, args, strict=False))  # the rest come as keywords
        bound.update(kwargs)
        flat = []
        for name, prop, idx in self.inputs:
            value = bound[name]
            flat.append(value if prop is None else value.size(idx) if prop == "SIZE"
                        else value.stride(idx) if prop == "STRIDE" else value.storage_offset())
        return flat


def _input_recipe(gm) -> tuple[list, int] | None:
    """How to get each input of Dynamo's graph ``gm`` from the function's arguments,
    ``(argument name, None | "SIZE" | "STRIDE" | "STORAGE_OFFSET", dim)``, and how many
    tensors it returns; None if it reads anything else (a global, a closure, an
    attribute) or returns anything but graph values."""
    recipe, outputs = [], 0
    for node in gm.graph.nodes:
        if node.op == "output":
            values = tuple(node.args[0] or ())
            if not all(isinstance(v, torch.fx.Node) for v in values):
                return None
            outputs = len(values)
        if node.op != "placeholder":
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        prop = idx = None
        if type(source).__name__ == "TensorPropertySource":
            prop, idx = getattr(source.prop, "name", None), source.idx
            source = source.base
            if prop not in ("SIZE", "STRIDE", "STORAGE_OFFSET"):
                return None
        if type(source).__name__ != "LocalSource":
            return None
        recipe.append((source.local_name, prop, idx))
    return recipe, outputs


def _signature(args: tuple, kwargs: dict):
    """What Dynamo's guards on these arguments read, as a hashable tuple; None if some
    argument is neither a tensor nor a hashable scalar. (~10 us for the 8 arguments of
    the quantize graph: one pass, no sorting.)"""
    storages: dict[int, int] = {}  # storage address -> its number, in order of appearance
    sig = [tuple(kwargs)]
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):  # (type: a Parameter or a subclass is another one)
            base = v.untyped_storage().data_ptr()
            sig.append((type(v), v.dtype, v.device, v.requires_grad, v.shape, v.stride(),
                        v.storage_offset(), storages.setdefault(base, len(storages))))
        elif v is None or isinstance(v, (bool, int, float, str)):
            sig.append((type(v), v))
        else:
            return None
    return tuple(sig)


@functools.cache
def compiled(fn, **static):
    """``fn`` (a :mod:`qcomm.cpu` piece) with the keyword arguments ``static``
    fixed, compiled: one graph per static key (scheme, bits, bucket size, ...), device
    type and dtypes of the tensors passed and the first one's rank, dynamic in every
    dimension but the last (length, bucket count, rows) unless ``fn.static_shapes``
    (then one graph per shape of the first tensor).

    A flat FSDP shard changes length per parameter group, and recompiling per size would
    cost seconds per call. Dynamo caches compiled graphs on the code object it runs, at
    most 8 per code object (recompile_limit) before it silently falls back to eager, and
    a partial would be run through one shared wrapper: a group with three collectives,
    two dtypes and two ops would pass that. A copy of the function with its own code
    object, the static key baked in as keyword defaults, gives every configuration and
    dtype its own cache. The lock keeps two threads from compiling at once."""
    by_dtypes: dict = {}
    dynamic = not getattr(fn, "static_shapes", False)
    params = fn.__code__.co_varnames[: fn.__code__.co_argcount]

    def compile_fresh(device_type, dtypes):
        # inductor_options: quantize graphs, and decodes that store bf16/fp16, on CPU
        # (on a GPU Inductor writes Triton, where the thresholds guard register pressure)
        unrealized = device_type == "cpu" and (
            fn.__name__.startswith("encode")
            or (fn.__name__.startswith("decode") and not {torch.bfloat16, torch.float16}
                .isdisjoint(dtypes)))
        fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                   fn.__defaults__, fn.__closure__)
        fresh.__kwdefaults__ = {**(fn.__kwdefaults__ or {}), **static}
        graph = CompiledPiece(params, inductor_options() if unrealized else {})
        # Only the leading dimensions are dynamic: dynamic=True would make the baked-in ints
        # (bits, bucket size) symbolic too, and loops of symbolic length over a bucket
        # vectorize badly (a max over [2^14, 1024]: 5 GB/s against 15 static).
        return torch.compile(fresh, dynamic=False, backend=graph.backend), graph

    def run(*args, **kwargs):
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        # inference mode is part of the key: Dynamo guards on it, and a recompile of the
        # shared graph would turn its direct calls off
        # and so is the first tensor's rank (dynamic graphs: a batch of rows is a
        # [rows, buckets, B] graph of its own beside the [buckets, B] one, so neither
        # recompiles the other) or shape (static graphs: one per row count)
        # Rows ([rows, buckets, B] views) also key on which are contiguous: Dynamo
        # writes a contiguous tensor's strides as products of its sizes and guards on it,
        # so a strided call of that graph would recompile it (and a piece of every row
        # is strided where a whole row is not).
        key = (tensors[0].device.type, torch.is_inference_mode_enabled(),
               (tensors[0].dim(), *(t.is_contiguous() for t in tensors if t.dim() >= 3))
               if dynamic else tuple(tensors[0].shape),
               *(t.dtype for t in tensors))
        sig = _signature(args, kwargs)
        with _lock, torch.no_grad():
            entry = by_dtypes.get(key)
            if entry is None:
                entry = by_dtypes[key] = compile_fresh(key[0], key[3:])
            function, graph = entry
            if graph.call is not None and sig in graph.served:
                calls["direct"] += 1
                return graph.direct(args, kwargs)
            if dynamic:  # every dimension but the last (a bucket's elements or words)
                for t in tensors:
                    for d in range(max(1, t.dim() - 1) if t.dim() else 0):
                        torch._dynamo.maybe_mark_dynamic(t, d)
            calls["dynamo"] += 1
            result = function(*args, **kwargs)
            graph.check(sig, args, kwargs, result)
            return result

    run.graphs = lambda: [g for _, g in by_dtypes.values()]  # for the tests
    run.functions = lambda: [f for f, _ in by_dtypes.values()]  # Dynamo's (benchmarks)
    return run
