"""How a call is cut into pieces: every large compressed call runs as a pipeline over
them (the codec of one piece while another crosses the wire), and a one-piece call's
payload may ride in its descriptor's envelope. What the algorithms
(:mod:`qcomm.collectives`), error feedback's state (:mod:`qcomm.fsdp`) and bits=auto's
model (:mod:`qcomm.auto`) agree on."""

from __future__ import annotations

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
