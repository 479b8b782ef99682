"""The quantized collectives, as plain functions over any process group.

Public entry points (torch's signatures plus ``config``); ``group`` may be a qcomm
group (its inner group, config, seeds and counters are used) or any plain group
(gloo, NCCL: a config from the environment and per-group seeds are kept here)::

    all_gather_into_tensor(out, inp, group=None, *, config=None, async_op=False)
    reduce_scatter_tensor(out, inp, op=SUM, group=None, *, config=None, async_op=False)
    all_reduce(tensor, op=SUM, group=None, *, config=None, async_op=False)

Each public function validates its tensors and hands one call to
:func:`qcomm.driver.run` (exact or compressed, call index, seeds, stats, Work); the
algorithms below are what the driver runs when a call is compressed.

Algorithms (``world`` ranks, payloads from :func:`qcomm.quantize`, fixed size per call):

- all-gather: quantize the local shard into one payload, all-gather the payloads,
  dequantize every shard (this rank's own included) into the output in one row call
  (:func:`qcomm.codec.dequantize_rows`): all ranks hold identical values. The input is
  read before the output is written (FSDP2 gathers in place: its input is a view into
  its output).
- reduce-scatter: quantize the ``world - 1`` peer chunks, one payload each (every payload
  carries its own header), in one row call (:func:`qcomm.codec.quantize_rows`), exchange
  them with one all-to-all, then sum in fp32 in one call
  (:func:`qcomm.codec.dequantize_sum`): this rank's own chunk exact, each received chunk
  decoded once, the op applied and the result cast to the output's dtype.
- all-reduce (CGX's scatter-reduce-allgather): the reduce-scatter above into fp32,
  then the all-gather above of the re-quantized reduced chunk. Sizes not divisible by
  ``world`` are zero-padded.

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
  groups, every received header).
- A failed inner exchange (a dead peer, the group's timeout) raises
  ``DistBackendError`` naming the qcomm collective and the phase.
- Not covered: a call that is compressed on one rank and exact on another because
  of its size or dtype (the exact call goes to gloo as it is, which aborts on
  mismatched sizes as plain gloo does), and async exact calls, whose Work fails
  with the inner group's own message.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed import ReduceOp

from . import inner as I
from .codec import dequantize_rows, dequantize_sum, quantize, quantize_rows
from .driver import (
    Call,
    exact_reduce,
    finish,
    group_state,
    inner_of,
    op_type,
    peer_bytes,
    premul_factor,
    run,
)
from .layout import packed_nbytes
from .pieces import envelope_body, pieces

_RedOpType = ReduceOp.RedOpType


# ---------------------------------------------------------------------------------
# The compressed algorithms (run by the driver under the group's lock; callers have
# validated the tensors)


def as_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` (1-D, contiguous, one size and dtype) as the rows of one [R, n] view
    where they are evenly spaced, non-overlapping slices of one storage (the chunks of a
    flat buffer: the row calls then cover all of them in one codec call); else None."""
    t0 = tensors[0]
    if len(tensors) == 1:
        return t0.view(1, -1)
    n, step = t0.numel(), tensors[1].storage_offset() - t0.storage_offset()
    base = t0.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if (t.dtype != t0.dtype or t.numel() != n or t.dim() != 1 or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != base
                or t.storage_offset() != t0.storage_offset() + i * step):
            return None
    if step < n:  # overlapping (or reversed) slices: not rows
        return None
    return t0.as_strided((len(tensors), n), (step, 1))


def rows_of(tensors) -> torch.Tensor | None:
    """Per-rank tensors as one [R, n] view: a 2-D tensor (the flat entry points pass
    ``out.view(world, n)``) as it is, a list as :func:`as_rows` finds it (None where
    its tensors are not rows of one buffer). The flat calls never build a list of
    per-rank views: at W = 64 the list (``chunk``) and :func:`as_rows` over it cost
    ~165 us of Python a call, 650 at W = 256, against ~1 us for the view (AMD EPYC
    2 cores, torch 2.13: ``list(t.chunk(w))`` 44 / 173 us, ``as_rows`` of it 120 / 474
    us, timed with ``timeit``)."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    return as_rows([t.reshape(-1) for t in tensors])


@functools.lru_cache(maxsize=64)
def _index(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``order`` as an index tensor on ``device``, made once (on CUDA each would be a
    host-to-device copy that blocks the host)."""
    return torch.tensor(order, device=device)


def reduce_op(op, world: int) -> tuple[str, float]:
    """The codec's (op, factor) of a compressible reduce op: ("sum", 1), ("avg", world)
    or ("premul", its factor)."""
    kind = op_type(op)
    if kind == _RedOpType.AVG:
        return "avg", float(world)
    if kind == _RedOpType.PREMUL_SUM:
        # sum(f * x_i) == f * sum(x_i): applied once, in fp32, after the sum.
        return "premul", float(premul_factor(op))
    return "sum", 1.0


@torch.no_grad()
def packed_all_gather(call: Call, outs, inp: torch.Tensor, seed: int, *,
                      check=None, accumulate: bool = False, decode=None) -> int:
    """All-gather ``inp`` from every rank into ``outs[r]`` (``outs``: a [world, n] tensor
    or a list of tensors) as payloads (``accumulate``:
    added into fp32 ``outs``); returns the bytes this rank sends each peer. ``check``, a
    started descriptor check, is finished after the first quantize and before anything
    is sent or written. ``decode(p, a, b, rows)``, when given, decodes piece ``p``
    (elements ``[a, b)`` of every shard; ``rows`` its [world, nbytes] payloads in rank
    order) instead (:class:`qcomm.fsdp.DeltaAllGather`'s reconstruction).

    A shard of more than one piece (:func:`pieces`) goes as a pipeline of pieces, one
    payload each (seeds ``seed ^ p << 56``; piece 0's is ``seed``, so a one-piece call
    sends what an unsplit one would): piece p is quantized while piece p - 1 is on the
    wire (gloo sends on its own threads), and decoded while the later ones travel.
    Every quantize precedes every output write (FSDP2's input is a view into its
    output). Per piece, one quantize and one decode of all the received rows
    (:func:`qcomm.codec.dequantize_rows`) where ``outs`` are rows of one buffer (an
    all-gather into a tensor), whatever the world size; a list of separate outputs is
    decoded row by row."""
    n, world, q = inp.numel(), len(outs), call.q
    flat_in = inp.reshape(-1)
    out_rows = rows_of(outs)
    parts = pieces(n, q)
    sizes = [packed_nbytes(b - a, q) for a, b in parts]
    total = sum(sizes)
    riding = check is not None and check.rides  # one piece, in the descriptor's envelope
    if riding:  # every peer's row of the envelope: this payload
        quantize(flat_in, q, seed=seed, out=check.payloads()[0], **call.codec)
        check.start(same_for_all=True)
        check.finish()
    else:
        send = call.buffer("ag_send", total, torch.uint8, inp.device)
        recv = call.buffer("ag_recv", world * total, torch.uint8, inp.device)
    inflight, start = [], 0
    for p, (a, b) in enumerate(parts if not riding else ()):
        nbytes = sizes[p]
        mine = send[start:start + nbytes]
        quantize(flat_in[a:b], q, seed=seed ^ (p << 56), out=mine, **call.codec)
        if p == 0 and check is not None:
            check.finish()
        got = recv[world * start: world * (start + nbytes)]
        inflight.append(I.start(I.all_gather, call.kind, "the all-gather of payloads",
                                call.rank, call.inner, got, mine))
        start += nbytes
    start = 0
    for p, (a, b) in enumerate(parts):
        nbytes = sizes[p]
        if riding:
            rows = check.received(0, nbytes)
        else:
            I.wait(inflight[p], call.kind, f"the all-gather of {nbytes}-byte payloads",
                   call.rank)
            rows = recv[world * start: world * (start + nbytes)].view(world, nbytes)
        call.check_received(rows, b - a, inp.dtype)
        # payload sizes are multiples of 16 bytes: every row's fp32 meta view is aligned
        if decode is not None:
            decode(p, a, b, rows)
        elif out_rows is not None:
            dequantize_rows(rows, b - a, inp.dtype, q, out=out_rows[:, a:b],
                            accumulate=accumulate, check=False, **call.codec)
        else:
            for r, out in enumerate(outs):
                dequantize_rows(rows[r:r + 1], b - a, inp.dtype, q,
                                out=out.view(1, -1)[:, a:b], accumulate=accumulate,
                                check=False, **call.codec)
        start += nbytes
    return total


@torch.no_grad()
def packed_reduce_scatter(call: Call, chunks: list[torch.Tensor], seeds: list[int], *,
                          out: torch.Tensor, op=None, world: int | None = None, check=None,
                          residuals=None) -> int:
    """Sum ``chunks[j]`` of every rank into rank j: ``out`` (1-D, contiguous, any float
    dtype; may be this rank's own chunk) gets this rank's chunk summed in fp32, the
    reduce ``op`` applied (AVG divides by ``world``, default the group's size) and cast;
    returns the bytes sent to each peer. ``check`` as in :func:`packed_all_gather`, and
    piece by piece like it: piece p's peer chunks are quantized while piece p - 1's
    all-to-all is on the wire, and decoded into the sum while the later ones travel.
    Per piece, one quantize of the peer chunks (:func:`qcomm.codec.quantize_rows`) and
    one fused decode, sum, op and cast (:func:`qcomm.codec.dequantize_sum`), whatever
    the world size. ``residuals`` (error feedback, :class:`qcomm.fsdp.PieceState`): per
    piece, ``load(call, p, a, b)`` gives a copy of the fp32 [size, b - a] rows of what
    the last call's quantization left out of each peer chunk, which is added to the
    chunk before it is quantized, and ``store(p, rows)`` keeps what this one leaves out,
    once the descriptor check has passed (a refused call keeps nothing)."""
    size, rank, q = len(chunks), call.rank, call.q
    n = chunks[0].numel()
    dtype, device = chunks[0].dtype, chunks[0].device
    x = rows_of(chunks)
    if x is None:  # not rows of one buffer: one copy makes them so
        x = torch.stack([c.reshape(-1) for c in chunks])
    name, factor = reduce_op(op, world or size) if op is not None else ("sum", 1.0)
    parts = pieces(n, q)
    sizes = [packed_nbytes(b - a, q) for a, b in parts]
    total = sum(sizes)
    riding = check is not None and check.rides  # one piece, in the descriptor's envelope
    if not riding:
        send_all = call.buffer("rs_send", size * total, torch.uint8, device)
        recv_all = call.buffer("rs_recv", size * total, torch.uint8, device)
    inflight, start = [], 0
    for p, (a, b) in enumerate(parts):
        nbytes = sizes[p]
        if riding:  # row j of the envelope goes to rank j (this rank's stays local)
            send = check.payloads()
        else:
            send = send_all[size * start: size * (start + nbytes)].view(size, nbytes)
        piece_seeds = [s ^ (p << 56) for s in seeds]
        if residuals is None:
            # the own chunk stays exact; its slot only travels to itself
            quantize_rows(x[:, a:b], q, piece_seeds, out=send, skip=rank, **call.codec)
        else:  # into a copy of the residuals: a refused call leaves them as they were
            fed = residuals.load(call, p, a, b)
            _quantize_fed(call, x[:, a:b], fed, piece_seeds, send)
        if riding:
            check.start()
        if p == 0 and check is not None:
            check.finish()
        if residuals is not None:
            residuals.store(p, fed)
        if riding:
            break
        recv = recv_all[size * start: size * (start + nbytes)]
        inflight.append(I.start(I.all_to_all, call.kind, "the all-to-all of payloads", rank,
                                call.inner, recv, send.view(-1)))
        start += nbytes
    start = 0
    for p, (a, b) in enumerate(parts):
        nbytes = sizes[p]
        if riding:
            rows = check.received(0, nbytes)
        else:
            I.wait(inflight[p], call.kind, f"the all-to-all of {nbytes}-byte payloads", rank)
            rows = recv_all[size * start: size * (start + nbytes)].view(size, nbytes)
        call.check_received(rows, b - a, dtype, skip=rank)
        dequantize_sum(rows, b - a, dtype, q, own=x[rank, a:b], out=out[a:b], skip=rank,
                       op=name, factor=factor, check=False, **call.codec)
        start += nbytes
    return total


def _quantize_fed(call: Call, x: torch.Tensor, fed: torch.Tensor, seeds: list[int],
                  send: torch.Tensor) -> None:
    """Error feedback's quantize of one piece's peer rows: each residual row becomes what
    is owed (residual + chunk), is quantized, and keeps what its payload leaves out.
    The rows on either side of this rank's own go as two blocks: a constant number of
    codec calls and elementwise ops whatever the world size."""
    rank, q, m = call.rank, call.q, x.shape[1]
    for a, b in ((0, rank), (rank + 1, x.shape[0])):
        if b == a:
            continue
        owed = fed[a:b].add_(x[a:b])
        quantize_rows(owed.to(x.dtype), q, seeds[a:b], out=send[a:b], **call.codec)
        # owed - decode in place: no fp32 buffer of the decoded rows, which the group's
        # cache would keep for good (W - 1 rows of the piece: 252 MiB at W = 64,
        # 2^20-element pieces), and one pass over them fewer.
        dequantize_rows(send[a:b], m, x.dtype, q, out=owed, subtract=True, check=False,
                        **call.codec)
        # A non-finite gradient is sent as it is (its bucket decodes NaN: GradScaler
        # sees the overflow and skips the step) but not owed: an inf kept in the
        # residual would poison every later step of this chunk.
        owed.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


# ---------------------------------------------------------------------------------
# Two-level plans (qcomm.topology): N nodes x P ranks; exact inside a node, compressed
# among the N ranks of one local index. ``members[k][l]`` is the group rank of local
# index l on node k; ranks may be in any order.


@torch.no_grad()
def two_level_reduce_scatter(call: Call, chunks: list[torch.Tensor], seeds: list[int], *,
                             out: torch.Tensor, op=None, check=None) -> tuple[int, int]:
    """:func:`packed_reduce_scatter` in two levels: an exact all-to-all inside the node
    gives local rank l the node's fp32 sum of the chunks of every rank of local index
    l (N of them); the ranks of local index l then reduce-scatter those node sums,
    compressed, each quantized once. Piece by piece (:data:`PIECE`), the next piece's
    exchange inside the node in flight while this one's crosses nodes. ``seeds[j]``:
    the payload for group rank j. ``out`` and ``op`` as in
    :func:`packed_reduce_scatter` (AVG divides by the group's size). Returns (bytes
    sent, of them inside the node)."""
    topo = call.topology
    intra, inter = call.subgroups()
    nodes, per_node = topo.nodes, topo.per_node
    n, dtype, device = chunks[0].numel(), chunks[0].dtype, chunks[0].device
    rows = rows_of(chunks)
    flat = None if rows is not None else [c.reshape(-1) for c in chunks]
    layout = topo.local_major  # block l of the send buffer: what local rank l sums
    parts = pieces(n, call.q)
    width = parts[0][1] - parts[0][0]
    sub = call.on(inter, topo.node, nodes)

    def start(p: int):
        """Lay out piece p (block l: the chunks local rank l sums) and send it."""
        a, b = parts[p]
        send = call.buffer(f"rs2_send{p % 2}", per_node * nodes * width, dtype, device)
        send = send[: per_node * nodes * (b - a)].view(per_node, nodes, b - a)
        blocks = send.view(per_node * nodes, b - a)
        if rows is not None:  # one gather of the rows, whatever the world size
            torch.index_select(rows[:, a:b], 0, _index(layout, device), out=blocks)
        else:
            for i, g in enumerate(layout):
                blocks[i].copy_(flat[g][a:b])
        recv = call.buffer(f"rs2_recv{p % 2}", per_node * nodes * width, dtype, device)
        recv = recv[: per_node * nodes * (b - a)]
        work = I.start(I.all_to_all, call.kind, "the exact all-to-all inside the node",
                       call.rank, intra, recv, send.view(-1))
        return work, recv, send  # send stays referenced until the work is waited on

    if check is not None:
        check.finish()
    inflight = start(0)
    inter_bytes = 0
    for p, (a, b) in enumerate(parts):
        work, recv, _ = inflight
        I.wait(work, call.kind, "the exact all-to-all inside the node", call.rank)
        if p + 1 < len(parts):
            inflight = start(p + 1)
        node_sums = call.buffer("rs2_sum", nodes * (b - a), torch.float32, device)
        node_sums = node_sums.view(nodes, b - a)
        torch.sum(recv.view(per_node, nodes, b - a), dim=0, dtype=torch.float32,
                  out=node_sums)
        piece_seeds = [seeds[topo.members[k][topo.local]] ^ (p << 56) for k in range(nodes)]
        nbytes = packed_reduce_scatter(sub, node_sums, piece_seeds, out=out[a:b], op=op,
                                       world=call.world)
        inter_bytes += (nodes - 1) * nbytes
    intra_bytes = (per_node - 1) * nodes * n * chunks[0].element_size()
    return intra_bytes + inter_bytes, intra_bytes


@torch.no_grad()
def two_level_all_gather(call: Call, outs, inp: torch.Tensor, seed: int,
                         *, check=None, accumulate: bool = False,
                         decode=None) -> tuple[int, int]:
    """:func:`packed_all_gather` in two levels: the ranks of this rank's local index
    all-gather their payloads across nodes, then the node all-gathers those payloads
    (bytes, exact: a quarter of the decoded fp32 shards at 8 bits), and every rank
    decodes all of them, so every rank of the group holds the same bytes.

    Piece by piece (:data:`PIECE`): every piece is quantized and its exchange across
    nodes started before the first is waited on, so the slow link never idles between
    pieces (at 2 x 2, 100 Mbit/s, waiting on piece p before quantizing and sending
    p + 1 left the link idle for each quantize and hand-over: 1.28x over flat, against
    the bytes' 1.5x); piece p is exchanged inside the node and decoded while the later
    ones cross. Every quantize precedes every output write (FSDP2's input is a view
    into its output). ``accumulate`` and ``decode`` as there. Returns (bytes sent, of
    them inside the node)."""
    topo = call.topology
    intra, inter = call.subgroups()
    nodes, per_node = topo.nodes, topo.per_node
    n, q, device = inp.numel(), call.q, inp.device
    flat_in = inp.reshape(-1)
    out_rows = rows_of(outs)
    flat_out = None if out_rows is not None else [o.view(-1) for o in outs]
    # received rows come in topo.local_major order: group rank g's payload is row
    # local_of[g] * nodes + node_of[g]
    order = tuple(topo.local_of[g] * nodes + topo.node_of[g]
                  for g in range(nodes * per_node))
    parts = pieces(n, q)
    sizes = [packed_nbytes(b - a, q) for a, b in parts]
    starts = [sum(sizes[:p]) for p in range(len(parts))]
    total, most = sum(sizes), max(sizes)
    send_all = call.buffer("ag2_send", total, torch.uint8, device)
    across_all = call.buffer("ag2_inter", nodes * total, torch.uint8, device)
    inflight = []
    for p, (a, b) in enumerate(parts):
        s, nbytes = starts[p], sizes[p]
        send = send_all[s:s + nbytes]
        quantize(flat_in[a:b], q, seed=seed ^ (p << 56), out=send, **call.codec)
        if p == 0 and check is not None:
            check.finish()  # the ranks agree before anything is sent
        across = across_all[nodes * s: nodes * (s + nbytes)]
        inflight.append((I.start(I.all_gather, call.kind, "the all-gather across nodes",
                                 call.rank, inter, across, send), across))
    inter_bytes = intra_bytes = 0
    rows_all = call.buffer("ag2_intra", per_node * nodes * most, torch.uint8, device)
    for p, (a, b) in enumerate(parts):
        work, across = inflight[p]
        nbytes = sizes[p]
        I.wait(work, call.kind, f"the all-gather of {nbytes}-byte payloads across nodes",
               call.rank)
        rows = rows_all[: per_node * nodes * nbytes]
        inside = I.start(I.all_gather, call.kind, "the all-gather inside the node",
                         call.rank, intra, rows, across)
        I.wait(inside, call.kind, "the all-gather of the payloads inside the node",
               call.rank)
        rows = rows.view(per_node * nodes, nbytes)
        call.check_received(rows, b - a, inp.dtype)
        if out_rows is not None or decode is not None:
            # into group-rank order: one copy of the payload bytes
            ordered = call.buffer("ag2_order", per_node * nodes * nbytes, torch.uint8, device)
            ordered = ordered.view(per_node * nodes, nbytes)
            torch.index_select(rows, 0, _index(order, device), out=ordered)
            if decode is not None:
                decode(p, a, b, ordered)
            else:
                dequantize_rows(ordered, b - a, inp.dtype, q, out=out_rows[:, a:b],
                                accumulate=accumulate, check=False, **call.codec)
        else:
            for i, g in enumerate(order):
                dequantize_rows(rows[g:g + 1], b - a, inp.dtype, q,
                                out=flat_out[i].view(1, -1)[:, a:b], accumulate=accumulate,
                                check=False, **call.codec)
        inter_bytes += (nodes - 1) * nbytes
        intra_bytes += (per_node - 1) * nodes * nbytes
    return inter_bytes + intra_bytes, intra_bytes


# ---------------------------------------------------------------------------------
# Validation (before any communication)


def check_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
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
    out, inp = check_tensor("out", out), check_tensor("inp", inp)
    group = I.default(group)
    world = group_state(group).world
    _check_pair(name, out, inp, world, gathered=gathered)
    _check_contiguous(name, "out", out)
    _check_contiguous(name, "inp", inp)
    return out, inp, group, world


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
    ``decode(p, a, b, rows)`` for :func:`packed_all_gather`) for a compressed call:
    :class:`qcomm.fsdp.DeltaAllGather` sends differences and decodes through its state."""
    group = I.default(group)
    world, n = group_state(group).world, inp.numel()

    def run_exact():
        inner = inner_of(group)
        work = exact() if exact is not None else I.all_gather(inner, out_flat, inp)
        return finish(work, async_op, "all_gather", inner.rank())

    def compressed(call: Call) -> tuple[int, int]:
        send, decode = prepare(call) if prepare is not None else (inp, None)
        body = 0 if call.two_level else envelope_body(n, call.q)
        check = call.check_descriptors(n, send.dtype, None, inp.device, body)
        gather = two_level_all_gather if call.two_level else packed_all_gather
        sent = gather(call, outs, send, call.seed(call.rank), check=check, decode=decode)
        return sent if call.two_level else call.flat_bytes(peer_bytes(world, sent))

    return run(group, "all_gather", tensor=inp, numel=n,
               logical=peer_bytes(world, n * inp.element_size()), exact=run_exact,
               compressed=compressed, result=[out_flat] if out_flat is not None else outs,
               config=config, can_compress=can_compress, async_op=async_op)


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
    ``residuals(world, n, dtype, device, parts)``, when given, returns the error-feedback
    state of a compressed call (:func:`packed_reduce_scatter`; ``parts`` its pieces)."""
    group = I.default(group)
    world, n = group_state(group).world, out.numel()

    def run_exact():
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

    def compressed(call: Call) -> tuple[int, int]:
        seeds = [call.seed(call.rank * world + j) for j in range(world)]
        two_level = call.two_level and residuals is None
        body = 0 if two_level else envelope_body(n, call.q)
        check = call.check_descriptors(n, out.dtype, op, out.device, body)
        flat_out = out.view(-1)
        if two_level:
            return two_level_reduce_scatter(call, chunks, seeds, out=flat_out, op=op,
                                            check=check)
        # error feedback keeps per-peer residuals: one level
        nbytes = packed_reduce_scatter(
            call, chunks, seeds, out=flat_out, op=op, check=check,
            residuals=None if residuals is None else residuals(
                world, n, chunks[0].dtype, out.device, pieces(n, call.q)))
        return call.flat_bytes(peer_bytes(world, nbytes))

    return run(group, "reduce_scatter", tensor=out, numel=n,
               logical=peer_bytes(world, n * out.element_size()), exact=run_exact,
               compressed=compressed, result=[out], op=op, config=config,
               can_compress=can_compress, async_op=async_op,
               keep=[inp_flat] if inp_flat is not None else chunks)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, *, config=None,
               async_op: bool = False):
    """Reduce ``tensor`` in place over the group (SUM, AVG, PREMUL_SUM compressed by
    scatter-reduce-allgather; other ops exact); every rank ends with identical values.
    Like :func:`torch.distributed.all_reduce`."""
    tensor = check_tensor("tensor", tensor)
    group = I.default(group)
    world, numel = group_state(group).world, tensor.numel()
    chunk = -(-numel // world)

    def run_exact():
        inner = inner_of(group)
        send_op, factor, avg = exact_reduce(op, tensor, inner)
        if factor is not None:  # the tensor is the output: scaled in place
            with torch.no_grad():
                tensor.mul_(factor)
        return finish(I.all_reduce(inner, tensor, send_op), async_op, "all_reduce",
                      inner.rank(), divide=(tensor, world) if avg else None)

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
            wire_rs, intra_rs = two_level_reduce_scatter(call, chunks, seeds, out=acc, op=op,
                                                         check=check)
            wire_ag, intra_ag = two_level_all_gather(call, chunks, acc, seed_ag)
            sent = (wire_rs + wire_ag, intra_rs + intra_ag)
        else:
            nbytes_rs = packed_reduce_scatter(call, chunks, seeds, out=acc, op=op, check=check)
            nbytes_ag = packed_all_gather(call, chunks, acc, seed_ag)
            sent = call.flat_bytes(peer_bytes(world, nbytes_rs + nbytes_ag))
        if padded is not flat:
            flat.copy_(padded[:numel])
        if work is not tensor:
            tensor.copy_(work)
        return sent

    return run(group, "all_reduce", tensor=tensor, numel=numel,
               logical=2 * peer_bytes(world, chunk * tensor.element_size()), exact=run_exact,
               compressed=compressed, result=[tensor], op=op, config=config,
               async_op=async_op)
