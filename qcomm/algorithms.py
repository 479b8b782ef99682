"""The compressed algorithms: what :func:`qcomm.driver.run` runs when a call is
compressed (under the group's lock; the public functions of :mod:`qcomm.collectives`
have validated the tensors).

Flat (``world`` ranks, payloads from :func:`qcomm.quantize`, fixed size per call; each
a pipeline of pieces, :mod:`qcomm.pieces`):

- all-gather (:func:`packed_all_gather`): quantize the local shard into one payload,
  all-gather the payloads, dequantize every shard (this rank's own included) into the
  output in one row call (:func:`qcomm.codec.dequantize_rows`): all ranks hold
  identical values. The input is read before the output is written (FSDP2 gathers in
  place: its input is a view into its output).
- reduce-scatter (:func:`packed_reduce_scatter`): quantize the ``world - 1`` peer
  chunks, one payload each (every payload carries its own header), in one row call
  (:func:`qcomm.codec.quantize_rows`), exchange them with one all-to-all, then sum in
  fp32 in one call (:func:`qcomm.codec.dequantize_sum`): this rank's own chunk exact,
  each received chunk decoded once, the op applied and the result cast to the output's
  dtype.
- all-reduce: the reduce-scatter into fp32, then the all-gather of the re-quantized
  reduced chunk (:func:`qcomm.collectives.all_reduce`).

Two-level (:mod:`qcomm.topology`: N nodes x P ranks; exact inside a node, compressed
among the N ranks of one local index): :func:`two_level_reduce_scatter` and
:func:`two_level_all_gather`.

FSDP's per-module collectives (:mod:`qcomm.fsdp`) reach in through two arguments:
``decode`` (the all-gather's received rows go through weight differences' state) and
``residuals`` (error feedback's state of the reduce-scatter).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed import ReduceOp

from . import inner as I
from .codec import dequantize_rows, dequantize_sum, quantize, quantize_rows
from .driver import Call, op_type, premul_factor
from .layout import packed_nbytes
from .pieces import EXCHANGE, GATHER, PieceExchange, pieces

_RedOpType = ReduceOp.RedOpType

# ---------------------------------------------------------------------------------
# Rows


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
    n, q = inp.numel(), call.q
    flat_in = inp.reshape(-1)
    out_rows = rows_of(outs)
    parts = pieces(n, q)
    sizes = [packed_nbytes(b - a, q) for a, b in parts]
    ex = PieceExchange(call, GATHER, sizes, inp.device, check)
    for p, (a, b) in enumerate(parts):
        quantize(flat_in[a:b], q, seed=seed ^ (p << 56), out=ex.send(p), **call.codec)
        ex.start(p)
    for p, (a, b) in enumerate(parts):
        rows = ex.received(p)
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
    return sum(sizes)


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
    rank, q = call.rank, call.q
    n, dtype = chunks[0].numel(), chunks[0].dtype
    x = rows_of(chunks)
    if x is None:  # not rows of one buffer: one copy makes them so
        x = torch.stack([c.reshape(-1) for c in chunks])
    name, factor = reduce_op(op, world or len(chunks)) if op is not None else ("sum", 1.0)
    parts = pieces(n, q)
    sizes = [packed_nbytes(b - a, q) for a, b in parts]
    ex = PieceExchange(call, EXCHANGE, sizes, chunks[0].device, check)
    for p, (a, b) in enumerate(parts):
        piece_seeds = [s ^ (p << 56) for s in seeds]
        if residuals is None:
            # the own chunk stays exact; its slot only travels to itself
            quantize_rows(x[:, a:b], q, piece_seeds, out=ex.send(p), skip=rank, **call.codec)
        else:  # into a copy of the residuals: a refused call leaves them as they were
            fed = residuals.load(call, p, a, b)
            _quantize_fed(call, x[:, a:b], fed, piece_seeds, ex.send(p))
        ex.start(p)
        if residuals is not None:  # kept once the descriptors agreed (piece 0 started)
            residuals.store(p, fed)
    for p, (a, b) in enumerate(parts):
        rows = ex.received(p)
        call.check_received(rows, b - a, dtype, skip=rank)
        dequantize_sum(rows, b - a, dtype, q, own=x[rank, a:b], out=out[a:b], skip=rank,
                       op=name, factor=factor, check=False, **call.codec)
    return sum(sizes)


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
# Exact calls under bits=auto: agreed like compressed ones, small ones riding in the
# descriptor's envelope (qcomm.envelope: one exchange, the exact call's own)


def ride(check, rows: torch.Tensor | None, *, same_for_all: bool) -> torch.Tensor | None:
    """Finish an exact call's descriptor check (``check``: started with ``rows``' bytes a
    peer as its body, or None where the call is agreed already), its exact bytes riding
    in the envelope where it rides: ``rows`` ([world, nbytes] uint8, row j for rank j;
    ``same_for_all``: one row, every peer's). Returns the [world, nbytes] rows received,
    in rank order (this rank's own among them); None where the call did not ride (its
    descriptors agreed: the caller sends it exact)."""
    if check is None:
        return None
    if not check.rides:
        check.finish()
        return None
    payloads = check.payloads()
    payloads[:1 if same_for_all else None].copy_(rows)
    check.start(same_for_all=same_for_all)
    check.finish()
    return check.received(0, check.body)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([R, n], rows of one dtype, each contiguous) as [R, n * itemsize] bytes."""
    try:
        return t.view(torch.uint8)
    except RuntimeError:  # rows whose spacing is not a whole number of elements
        return t.contiguous().view(torch.uint8)


@torch.no_grad()
def sum_rows(rows: torch.Tensor, op, world: int, out: torch.Tensor) -> None:
    """``out`` = ``op`` over ``rows`` ([R, n] in rank order; AVG over ``world``), summed
    in fp32 a row at a time in rank order: every rank that sums the same rows gets the
    same bits, whatever machine it runs on (one rounding per elementwise add; a
    reduction kernel's order depends on its vector width)."""
    acc = rows[0].to(torch.float32, copy=True)
    for r in range(1, rows.shape[0]):
        acc.add_(rows[r])
    name, factor = reduce_op(op, world)
    if name == "avg":
        acc.div_(factor)
    elif name == "premul":
        acc.mul_(factor)
    out.copy_(acc.view(out.shape))


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
    across = PieceExchange(call.on(inter, topo.node, nodes), GATHER, sizes, device, check,
                           roles=("ag2_send", "ag2_inter"), where=" across nodes")
    for p, (a, b) in enumerate(parts):  # every piece on its way before the first wait
        quantize(flat_in[a:b], q, seed=seed ^ (p << 56), out=across.send(p), **call.codec)
        across.start(p)
    inter_bytes = intra_bytes = 0
    rows_all = call.buffer("ag2_intra", per_node * nodes * max(sizes), torch.uint8, device)
    for p, (a, b) in enumerate(parts):
        nbytes = sizes[p]
        rows = rows_all[: per_node * nodes * nbytes]
        inside = I.start(I.all_gather, call.kind, "the all-gather inside the node",
                         call.rank, intra, rows, across.received(p).view(-1))
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
