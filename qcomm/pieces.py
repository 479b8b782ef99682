"""The piece pipeline: how a call is cut into pieces, and how each piece's payloads
move.

Every large compressed call runs as a pipeline over pieces (the codec of one piece while
another crosses the wire), and a one-piece call's payload may ride in its descriptor's
envelope (:mod:`qcomm.envelope`). :func:`pieces` is the cut the algorithms
(:mod:`qcomm.algorithms`), error feedback's state (:mod:`qcomm.fsdp`) and bits=auto's
model (:mod:`qcomm.auto`) agree on; :class:`PieceExchange` hands an algorithm each
piece's send rows, sends them and hands back the received rows, alike whether the
payload rides or goes on its own, so each algorithm is one loop that quantizes and
starts every piece, then one that decodes them::

    ex = PieceExchange(call, GATHER, sizes, device, check)
    for p, (a, b) in enumerate(parts):
        quantize(x[a:b], ..., out=ex.send(p))
        ex.start(p)            # piece 0: the descriptor check finishes first
    for p, (a, b) in enumerate(parts):
        decode(ex.received(p), ...)
"""

from __future__ import annotations

import itertools

import torch

from . import inner as I
from .layout import packed_nbytes

# Elements per piece at 8 bits: every large call runs as a pipeline over pieces, the
# codec of one piece (flat), or the exact exchange inside the node (two-level), while
# another piece crosses the wire on gloo's own threads. 2^19 fp32 elements are a 0.5 MiB
# payload at 8 bits (42 ms at 100 Mbit/s, 4 ms at 1 Gbit/s): 4 pieces for an 8 MiB
# shard, against ~0.1-0.3 ms of fixed cost per piece (one inner collective, one codec
# call per payload). Narrower codes keep a piece's payload bytes: 2^20 elements at 4
# bits, 2^21 at 2; but a tensor is cut into at least MIN_PIECES pieces of at least PIECE
# elements where it can. Chosen by timing pieces of 2^19, 2^20 and 2^21 elements side by
# side at 1 Gbit/s, 2^22 and 2^24 elements a rank, 2-8 bits
# (`bench/experiments/pipeline_toggle.py pieces 1gbit ag|rs` at f72c4cf, AMD EPYC 2 cores AVX-512:
# docs/results.md, "Flat collectives at 1 Gbit/s"): no one size wins everywhere; these
# were within 5% of the best at 4 and 8 bits and within 20% at 2. Rounded to whole
# buckets, so pieces quantize exactly as the unsplit chunk would.
PIECE = 1 << 19
MIN_PIECES = 4


def envelope_body(n: int, q) -> int:
    """Bytes a flat one-piece call of ``n``-element payloads would carry to each peer in
    its descriptor's envelope (:mod:`qcomm.envelope`): one payload; 0 for a pipeline of
    pieces, which never rides."""
    return packed_nbytes(n, q) if len(pieces(n, q)) == 1 else 0


def pieces(n: int, q) -> list[tuple[int, int]]:
    """``[start, stop)`` pieces of ``n`` elements sent in QuantConfig ``q`` (sizes: see
    :data:`PIECE`), each a whole number of buckets but the last."""
    step = min(PIECE * 8 // q.bits, max(PIECE, n // MIN_PIECES))
    step = max(q.bucket_size, step // q.bucket_size * q.bucket_size)
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


GATHER, EXCHANGE = "all-gather", "all-to-all"


class PieceExchange:
    """The payloads of one flat call, piece by piece, over ``call.inner``.

    ``how``: :data:`GATHER` (one payload a piece, which every peer gets: :meth:`send`
    is its bytes) or :data:`EXCHANGE` (a payload per peer: :meth:`send` is [world,
    nbytes] rows, row j for rank j, this rank's own never sent). ``sizes``: each piece's
    payload bytes. ``check``, the call's started descriptor check (None on CUDA), is
    finished when piece 0 starts, before any payload moves; where the call rides
    (``check.rides``: one piece), the send rows are its envelope's and starting sends
    the envelope. ``roles`` name the group's scratch buffers (send, receive) and
    ``where`` the exchange in a failure's message."""

    def __init__(self, call, how: str, sizes: list[int], device: torch.device, check=None,
                 *, roles: tuple[str, str] | None = None, where: str = "") -> None:
        self.call, self.how, self.sizes, self.check = call, how, sizes, check
        self.where = where
        self.rides = check is not None and check.rides
        self.offsets = list(itertools.accumulate(sizes[:-1], initial=0))
        self.inflight: list = []
        world, total = call.world, sum(sizes)
        if not self.rides:
            send_role, recv_role = roles or (("ag_send", "ag_recv") if how == GATHER
                                             else ("rs_send", "rs_recv"))
            self._send = call.buffer(send_role, total if how == GATHER else world * total,
                                     torch.uint8, device)
            self._recv = call.buffer(recv_role, world * total, torch.uint8, device)

    def send(self, p: int) -> torch.Tensor:
        """Piece ``p``'s send bytes (:data:`GATHER`) or rows (:data:`EXCHANGE`)."""
        if self.rides:
            rows = self.check.payloads()
            return rows[0] if self.how == GATHER else rows
        s, n, world = self.offsets[p], self.sizes[p], self.call.world
        if self.how == GATHER:
            return self._send[s:s + n]
        return self._send[world * s: world * (s + n)].view(world, n)

    def start(self, p: int) -> None:
        """Send piece ``p`` (piece 0: once every rank's descriptor agreed)."""
        call = self.call
        if self.rides:
            self.check.start(same_for_all=self.how == GATHER)
            self.check.finish()
            return
        if p == 0 and self.check is not None:
            self.check.finish()
        s, n = self.offsets[p], self.sizes[p]
        fn = I.all_gather if self.how == GATHER else I.all_to_all
        self.inflight.append(I.start(
            fn, call.kind, f"the {self.how} of payloads{self.where}", call.rank, call.inner,
            self._recv[call.world * s: call.world * (s + n)], self.send(p).reshape(-1)))

    def received(self, p: int) -> torch.Tensor:
        """Piece ``p``'s [world, nbytes] received payloads, in rank order (waited for)."""
        n = self.sizes[p]
        if self.rides:
            return self.check.received(0, n)
        call, s = self.call, self.offsets[p]
        I.wait(self.inflight[p], call.kind, f"the {self.how} of {n}-byte payloads{self.where}",
               call.rank)
        return self._recv[call.world * s: call.world * (s + n)].view(call.world, n)
