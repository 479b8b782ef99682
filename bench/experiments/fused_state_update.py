"""qcomm.fsdp's state update on the CPU as one Inductor graph against the three tuned
passes the torch path runs (``qcomm/cpu/update_state.py`` says why it keeps them).

The graph: decode the 8-bit state (qcomm.fsdp.DEFAULT_STATE, 128-element buckets) and the
4-bit differences (1024-element buckets), add, store the fp32 output, bucket statistics
and codes back into the state, over ``[rows, 1024-element spans, ...]`` views; optionally
``CHUNK`` spans of every row a call. Checks its bytes against ``update_state_rows``, then
prints the median ms of each way per (W, elements a row).

    cd /tmp; PYTHONPATH=$R $R/.venv/bin/python $R/bench/experiments/fused_state_update.py [CHUNK]
"""

from __future__ import annotations

import sys
import time

import torch

import qcomm
from qcomm import QuantConfig
from qcomm.codec import _payload_views
from qcomm.cpu.common import unpack_codes
from qcomm.cpu.quantize import bucket_stats, _codes, _divisor_tensor
from qcomm.fsdp import DEFAULT_STATE as S

Q = QuantConfig(bits=4, bucket_size=1024)
K = 1024 // S.bucket_size  # state buckets a span


def graph(s_meta, s_codes, d_meta, d_codes, out, divisor):
    sm = s_meta.unflatten(-1, (K, 2))
    s = sm[..., 0:1] + s_codes.unflatten(-1, (K, 128)).to(torch.int32).to(torch.float32) * sm[
        ..., 1:2]
    k = unpack_codes(d_codes, 4).unflatten(-1, (K, 128))
    y = s + (d_meta[..., None, 0:1] + k.to(torch.float32) * d_meta[..., None, 1:2])
    out.unflatten(-1, (K, 128)).copy_(y)
    meta, per = bucket_stats(y, None, sid=0, bits=8, l2=False, divisor=divisor)
    s_meta.copy_(torch.nan_to_num(meta, nan=0.0, posinf=0.0, neginf=0.0).flatten(-2))
    s_codes.copy_(_codes(y, per, None, sid=0, bits=8).to(torch.uint8).flatten(-2))


def median_ms(fn, k=7):
    fn(), fn()
    ts = []
    for _ in range(k):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[k // 2] * 1e3


def main(chunk: int | None) -> None:
    fused = torch.compile(graph, dynamic=False)
    divisor = _divisor_tensor(0, 8, "cpu")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, chunk "
          f"{chunk or 'all'} spans")
    for W, n in [(2, 1 << 16), (8, 1 << 17), (2, 1 << 20), (8, 1 << 20)]:
        point(fused, divisor, W, n, chunk)


def point(fused, divisor, W: int, n: int, chunk: int | None) -> None:
    x = torch.randn(W, n)
    state = torch.empty(W, qcomm.packed_nbytes(n, S), dtype=torch.uint8)
    deltas = torch.empty(W, qcomm.packed_nbytes(n, Q), dtype=torch.uint8)
    qcomm.quantize_rows(x, S, [0] * W, out=state)
    qcomm.quantize_rows(x * 0.01, Q, list(range(W)), out=deltas)
    want_state, want_out = state.clone(), torch.empty(W, n)
    qcomm.update_state_rows(want_state, deltas, n, S, Q, out=want_out, impl="eager")
    sm, sc = _payload_views(state, n, S)
    dm, dc = _payload_views(deltas, n, Q)
    spans = n // 1024
    sm, sc = sm.unflatten(1, (spans, 2 * K)), sc.unflatten(1, (spans, 1024))
    dm, dc = dm.unflatten(1, (spans, 2)), dc.unflatten(1, (spans, 512))
    out = torch.empty(W, n)
    o = out.unflatten(1, (spans, 1024))
    step = chunk or spans

    def one_graph():
        for a in range(0, spans, step):
            b = min(a + step, spans)
            meta = sm[:, a:b].clone()  # mutated views of two dtypes: one a copy
            fused(meta, sc[:, a:b], dm[:, a:b], dc[:, a:b], o[:, a:b], divisor)
            sm[:, a:b].copy_(meta)

    start = state.clone()
    one_graph()
    same = torch.equal(out, want_out) and torch.equal(state, want_state)
    state.copy_(start)
    g = median_ms(one_graph)
    state.copy_(start)
    three = median_ms(lambda: qcomm.update_state_rows(state, deltas, n, S, Q, out=out))
    print(f"W={W} n=2^{n.bit_length() - 1}: {'same bytes' if same else 'DIFFERENT'}, "
          f"one graph {g:.2f} ms, three passes {three:.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else None)
