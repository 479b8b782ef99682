"""The quantized collectives, as plain functions over any process group.

Public entry points (torch's signatures plus ``config``); ``group`` may be a qcomm
group (its inner group, config, seeds and counters are used) or any plain group
(gloo, NCCL: a config from the environment and per-group seeds are kept here)::

    all_gather_into_tensor(out, inp, group=None, *, config=None, async_op=False)
    reduce_scatter_tensor(out, inp, op=SUM, group=None, *, config=None, async_op=False)
    all_reduce(tensor, op=SUM, group=None, *, config=None, async_op=False)

Each public function validates its tensors and hands one call to
:func:`qcomm.driver.run` (exact or compressed, call index, seeds, stats, Work); what the
driver runs when a call is compressed is :mod:`qcomm.algorithms` (the all-reduce is
CGX's scatter-reduce-allgather: the reduce-scatter into fp32, then the all-gather of
the re-quantized reduced chunk; sizes not divisible by ``world`` are zero-padded).

What is not compressible (integer/bool/float64 dtypes, ops other than SUM, AVG and
PREMUL_SUM, contributions under ``min_numel``, a collective switched off) goes
through the inner group exactly; PREMUL_SUM, which gloo rejects, is applied here.

A synchronous compressed call completes before it returns; ``async_op=True`` returns
at once, the call running on the group's worker thread (CPU) or its own stream (CUDA),
with a Work that tells the truth (:mod:`qcomm.engine`).

Failures are errors, never wrong numbers or hangs (tests/test_reliability.py):

- inf/NaN in an input decodes to NaN over its bucket (codec) on every receiving rank;
  the all-reduce's re-quantization of a non-finite sum keeps it non-finite.
- Ranks that disagree (size, dtype, config, collective, op, a skipped call) raise
  ``ValueError`` naming the field on every rank before any payload moves
  (:mod:`qcomm.handshake`: configs once per group, a descriptor per call on CPU
  groups, every received header). Under bits=auto every call of its kinds the group
  could compress is agreed so, exact ones too, whichever way each rank would send it.
- An input whose elements share memory (``expand``) is refused up front, naming it.
- A failed inner exchange (a dead peer, the group's timeout) raises
  ``DistBackendError`` naming the qcomm collective and the phase.
- Under fixed bits, exact calls go to the inner group as they are, unchecked: ranks
  that disagree there get what the inner group does (gloo aborts the process on
  mismatched sizes, or leaves a short receive unwritten); a call compressed on one
  rank and exact on another (its size or dtype) fails on every rank at the group's
  timeout, naming the phase, and fails the group. Async exact calls' Works fail with
  the inner group's own message. docs/design.md, "Reliability", says exactly what is
  promised where.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp

from . import algorithms as A
from . import inner as I
from .codec import FLOAT_DTYPES
from .driver import (
    COMPRESSIBLE_OPS,
    Call,
    exact_reduce,
    finish,
    group_state,
    inner_of,
    op_type,
    peer_bytes,
    run,
)
from .pieces import envelope_body, pieces

# ---------------------------------------------------------------------------------
# Validation (before any communication)


def check_tensor(name: str, t, fn: str = "qcomm") -> torch.Tensor:
    """``t`` if it is a tensor whose elements each have memory of their own; else a
    TypeError or ValueError naming ``fn``'s argument ``name``, before anything is sent."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    # 1: some elements share memory (an expand(), a stride of 0): read once and written
    # once per element, a collective would race with itself (gloo's own all-reduce
    # crashes the process on one); 2: torch cannot tell cheaply, left to the checks after
    if torch._debug_has_internal_overlap(t) == 1:
        raise ValueError(
            f"{fn}: {name} has elements that share memory (shape {tuple(t.shape)}, stride "
            f"{t.stride()}: e.g. made by expand()); pass a copy of its own (.clone())")
    return t


def _check_pair(fn: str, out: torch.Tensor, inp: torch.Tensor, world: int,
                gathered: bool) -> None:
    if out.dtype != inp.dtype:
        raise TypeError(f"{fn}: output dtype {out.dtype} differs from input dtype {inp.dtype}")
    if out.device != inp.device:
        raise ValueError(f"{fn}: output on {out.device}, input on {inp.device}")
    big, small = (out, inp) if gathered else (inp, out)
    if big.numel() != world * small.numel():
        raise ValueError(
            f"{fn}: output has {out.numel()} elements and input {inp.numel()}; over "
            f"{world} ranks the {'output' if gathered else 'input'} must have {world} "
            f"times the elements of the {'input' if gathered else 'output'}"
        )


def _check_contiguous(fn: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (shape {tuple(t.shape)}, "
                         f"stride {t.stride()})")


def check_flat_pair(name: str, out, inp, group, *, gathered: bool):
    """Validate a flat collective's (out, inp) before any communication (``name`` is
    the caller, for the message); returns (out, inp, the resolved group, its size)."""
    out, inp = check_tensor("out", out, name), check_tensor("inp", inp, name)
    group = I.default(group)
    world = group_state(group).world
    _check_pair(name, out, inp, world, gathered=gathered)
    _check_contiguous(name, "out", out)
    _check_contiguous(name, "inp", inp)
    return out, inp, group, world


def summable(tensor: torch.Tensor, op) -> bool:
    """Whether an exact call's op over ``tensor``'s dtype can be summed here (bits=auto's
    exact calls that ride in their envelope, :func:`qcomm.algorithms.sum_rows`): a
    float dtype qcomm compresses, with SUM, AVG or PREMUL_SUM."""
    return tensor.dtype in FLOAT_DTYPES and op_type(op) in COMPRESSIBLE_OPS


# ---------------------------------------------------------------------------------
# Public functions


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group=None, *,
                           config=None, async_op: bool = False):
    """Gather ``inp`` of every rank into ``out`` (``world * inp.numel()`` elements),
    quantized per ``config`` (the group's by default). Like
    :func:`torch.distributed.all_gather_into_tensor`; ``inp`` may alias its slot of
    ``out``."""
    out, inp, group, world = check_flat_pair("all_gather_into_tensor", out, inp, group,
                                             gathered=True)
    outs = out.view(world, inp.numel()) if inp.numel() else []
    return gather_into(group, outs, out, inp, config=config, async_op=async_op)


def gather_into(group, outs: list[torch.Tensor], out_flat: torch.Tensor | None,
                inp: torch.Tensor, *, config=None, async_op: bool = False, exact=None,
                can_compress: bool = True, prepare=None):
    """All-gather into per-rank outputs ``outs`` (views of ``out_flat`` when given);
    ``exact()`` is the passthrough to run when the call is not compressed (default:
    the inner flat all-gather into ``out_flat``); ``can_compress=False`` forces it.
    ``prepare(call)``, when given, returns (what to quantize in place of ``inp``, a
    ``decode(p, a, b, rows)`` for :func:`qcomm.algorithms.packed_all_gather`) for a compressed call:
    :class:`qcomm.fsdp.DeltaAllGather` sends differences and decodes through its state."""
    group = I.default(group)
    world, n = group_state(group).world, inp.numel()

    def run_exact(async_op: bool):
        inner = inner_of(group)
        work = exact() if exact is not None else I.all_gather(inner, out_flat, inp)
        return finish(work, async_op, "all_gather", inner.rank())

    def agreed_exact(call: Call) -> tuple[int, int]:
        nbytes = n * inp.element_size()
        rides = exact is None and out_flat is not None  # into a flat output: any dtype
        check = call.check_descriptors(n, inp.dtype, None, inp.device, nbytes if rides else 0)
        got = A.ride(check, A.as_bytes(inp.reshape(1, -1)) if rides else None,
                     same_for_all=True)
        if got is None:
            run_exact(False)
            return call.flat_bytes(logical)
        A.as_bytes(out_flat.view(world, n)).copy_(got)
        return call.flat_bytes(logical)

    def compressed(call: Call) -> tuple[int, int]:
        send, decode = prepare(call) if prepare is not None else (inp, None)
        body = 0 if call.two_level else envelope_body(n, call.q)
        check = call.check_descriptors(n, send.dtype, None, inp.device, body)
        gather = A.two_level_all_gather if call.two_level else A.packed_all_gather
        sent = gather(call, outs, send, call.seed(call.rank), check=check, decode=decode)
        return sent if call.two_level else call.flat_bytes(peer_bytes(world, sent))

    logical = peer_bytes(world, n * inp.element_size())
    return run(group, "all_gather", tensor=inp, numel=n, logical=logical, exact=run_exact,
               compressed=compressed, agreed_exact=agreed_exact,
               result=[out_flat] if out_flat is not None else outs, config=config,
               can_compress=can_compress, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, op=ReduceOp.SUM, group=None,
                          *, config=None, async_op: bool = False):
    """Reduce ``inp`` (``world * out.numel()`` elements) over the group and scatter:
    rank r gets the reduction of chunk r in ``out``. SUM, AVG and PREMUL_SUM are
    compressed; other ops go exact. Like :func:`torch.distributed.reduce_scatter_tensor`."""
    out, inp, group, world = check_flat_pair("reduce_scatter_tensor", out, inp, group,
                                             gathered=False)
    chunks = inp.view(world, out.numel()) if out.numel() else []
    return scatter_from(group, out, chunks, inp, op, config=config, async_op=async_op)


def scatter_from(group, out: torch.Tensor, chunks: list[torch.Tensor],
                 inp_flat: torch.Tensor | None, op, *, config=None, async_op: bool = False,
                 exact=None, can_compress: bool = True, residuals=None):
    """Reduce-scatter of per-rank input ``chunks`` (views of ``inp_flat`` when given)
    into ``out``; ``exact(op, chunks)`` is the passthrough (default: the inner flat
    reduce-scatter of ``inp_flat``); ``can_compress=False`` forces it.
    ``residuals(call, n, dtype, device, parts)``, when given, returns the
    error-feedback state of a compressed call
    (:func:`qcomm.algorithms.packed_reduce_scatter`; ``parts`` its pieces)."""
    group = I.default(group)
    world, n = group_state(group).world, out.numel()

    def run_exact(async_op: bool):
        inner = inner_of(group)
        send_op, factor, avg = exact_reduce(op, out, inner)
        parts, flat = chunks, inp_flat
        if factor is not None:  # scaled copies: the inputs are never written
            if exact is None:
                flat = inp_flat * factor
            else:
                parts = [c * factor for c in chunks]
        work = exact(send_op, parts) if exact is not None else I.reduce_scatter(
            inner, out, flat, send_op)
        return finish(work, async_op, "reduce_scatter", inner.rank(),
                      divide=(out, world) if avg else None)

    def agreed_exact(call: Call) -> tuple[int, int]:
        rows = A.rows_of(chunks) if summable(out, op) else None
        nbytes = n * out.element_size() if rows is not None else 0
        check = call.check_descriptors(n, out.dtype, op, out.device, nbytes)
        got = A.ride(check, A.as_bytes(rows) if nbytes else None, same_for_all=False)
        if got is None:
            run_exact(False)
        else:  # chunk `rank` of every rank, summed here
            A.sum_rows(got.contiguous().view(out.dtype), op, world, out)
        return call.flat_bytes(logical)

    def compressed(call: Call) -> tuple[int, int]:
        seeds = [call.seed(call.rank * world + j) for j in range(world)]
        two_level = call.two_level and residuals is None
        body = 0 if two_level else envelope_body(n, call.q)
        check = call.check_descriptors(n, out.dtype, op, out.device, body)
        flat_out = out.view(-1)
        if two_level:
            return A.two_level_reduce_scatter(call, chunks, seeds, out=flat_out, op=op,
                                            check=check)
        # error feedback keeps per-peer residuals: one level
        nbytes = A.packed_reduce_scatter(
            call, chunks, seeds, out=flat_out, op=op, check=check,
            residuals=None if residuals is None else residuals(
                call, n, chunks[0].dtype, out.device, pieces(n, call.q)))
        return call.flat_bytes(peer_bytes(world, nbytes))

    logical = peer_bytes(world, n * out.element_size())
    return run(group, "reduce_scatter", tensor=out, numel=n, logical=logical, exact=run_exact,
               compressed=compressed, agreed_exact=agreed_exact, result=[out], op=op,
               config=config, can_compress=can_compress, async_op=async_op,
               keep=[inp_flat] if inp_flat is not None else chunks)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, *, config=None,
               async_op: bool = False):
    """Reduce ``tensor`` in place over the group (SUM, AVG, PREMUL_SUM compressed by
    scatter-reduce-allgather; other ops exact); every rank ends with identical values.
    Like :func:`torch.distributed.all_reduce`."""
    tensor = check_tensor("tensor", tensor, "all_reduce")
    group = I.default(group)
    world, numel = group_state(group).world, tensor.numel()
    chunk = -(-numel // world)

    def run_exact(async_op: bool):
        inner = inner_of(group)
        send_op, factor, avg = exact_reduce(op, tensor, inner)
        if factor is not None:  # the tensor is the output: scaled in place
            with torch.no_grad():
                tensor.mul_(factor)
        return finish(I.all_reduce(inner, tensor, send_op), async_op, "all_reduce",
                      inner.rank(), divide=(tensor, world) if avg else None)

    def agreed_exact(call: Call) -> tuple[int, int]:
        # every rank gets the whole tensor of every other and sums them in rank order:
        # one exchange, the same bits everywhere (a small call: latency, not bytes)
        rides = summable(tensor, op) and tensor.is_contiguous()
        nbytes = numel * tensor.element_size() if rides else 0
        check = call.check_descriptors(numel, tensor.dtype, op, tensor.device, nbytes)
        got = A.ride(check, A.as_bytes(tensor.view(1, -1)) if nbytes else None,
                     same_for_all=True)
        if got is None:
            run_exact(False)
            return call.flat_bytes(logical)
        A.sum_rows(got.contiguous().view(tensor.dtype), op, world, tensor)
        return call.flat_bytes(peer_bytes(world, nbytes))

    def compressed(call: Call) -> tuple[int, int]:
        rank = call.rank
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        padded = flat
        if chunk * world != numel:
            padded = call.buffer("ar_pad", chunk * world, tensor.dtype, tensor.device)
            padded[numel:].zero_()
            padded[:numel].copy_(flat)
        chunks = padded.view(world, chunk)
        seeds = [call.seed(2 * (rank * world + j)) for j in range(world)]
        body = 0 if call.two_level else envelope_body(chunk, call.q)
        check = call.check_descriptors(numel, tensor.dtype, op, tensor.device, body)
        seed_ag = call.seed(2 * (rank * world + rank) + 1)
        # the reduced chunk in fp32 (op applied), then gathered: padded is scratch (or
        # the tensor itself), written by the gather after every read
        acc = call.buffer("ar_acc", chunk, torch.float32, tensor.device)
        if call.two_level:
            wire_rs, intra_rs = A.two_level_reduce_scatter(call, chunks, seeds, out=acc,
                                                           op=op, check=check)
            wire_ag, intra_ag = A.two_level_all_gather(call, chunks, acc, seed_ag)
            sent = (wire_rs + wire_ag, intra_rs + intra_ag)
        else:
            nbytes_rs = A.packed_reduce_scatter(call, chunks, seeds, out=acc, op=op, check=check)
            nbytes_ag = A.packed_all_gather(call, chunks, acc, seed_ag)
            sent = call.flat_bytes(peer_bytes(world, nbytes_rs + nbytes_ag))
        if padded is not flat:
            flat.copy_(padded[:numel])
        if work is not tensor:
            tensor.copy_(work)
        return sent

    logical = 2 * peer_bytes(world, chunk * tensor.element_size())
    return run(group, "all_reduce", tensor=tensor, numel=numel, logical=logical,
               exact=run_exact, compressed=compressed, agreed_exact=agreed_exact,
               result=[tensor], op=op, config=config, async_op=async_op)
