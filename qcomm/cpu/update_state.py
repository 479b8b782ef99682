"""The state update of a weight-difference gather on the tuned torch path: the values and
bytes of :func:`qcomm.oracle.update_state`, row by row, as the three passes it fuses on
a GPU (``qcomm.kernels.update_state``): decode the state (into the output itself where
that is fp32), add the decoded differences, quantize the sum back into the state.

Why not one compiled graph here: written as one (decode both, add, store, bucket
statistics, codes), Inductor kept full-size fp32 and int32 temporaries of it (the sum,
the unpacked codes), and it ran slower than the three tuned passes except at small
sizes. ``bench/experiments/fused_state_update.py`` (at f72c4cf) (8-bit state, 4-bit differences in
1024-element buckets; AMD EPYC, 2 cores, AVX-512, torch 2.13; one run, one graph / three
passes, ms): W = 2 x 2^16 0.35 / 0.72; W = 8 x 2^17 1.44 / 1.43; W = 2 x 2^20
3.45 / 2.13; W = 8 x 2^20 50.9 / 11.0, and in calls of 128 spans (2^17 elements a row)
13.1 / 10.1. On a GPU, where such passes are bound by memory, the kernel moves 6.5
bytes an element (fp32 output) instead of the three launches' 18.5.
"""

from __future__ import annotations

import torch

from .common import eager, write
from .dequantize import dequantize
from .quantize import quantize


def update_state(s_meta: torch.Tensor, s_codes: torch.Tensor, d_meta: torch.Tensor,
                 d_codes: torch.Tensor, out: torch.Tensor, state_config, delta_config,
                 scratch: torch.Tensor | None, *, wrap=eager) -> None:
    """Rows: ``s_meta``/``s_codes`` [R, ...] views of R state payloads (rewritten),
    ``d_meta``/``d_codes`` of R difference payloads, ``out`` [R, n] (any float dtype,
    rows of any stride), ``scratch`` fp32 of at least R * n elements or None: the
    signature of ``qcomm.kernels.update_state.update_state``, plus ``wrap``. Checked by
    :mod:`qcomm.codec`."""
    R, n = out.shape
    # the sum in fp32: the output itself, else the scratch (or a new buffer) cast into it
    # at the end
    if out.dtype == torch.float32:
        y = out
    elif scratch is not None:
        y = scratch[: R * n].view(R, n)
    else:
        y = torch.empty(R, n, dtype=torch.float32, device=out.device)
    if R == 1:  # one payload: the 1-D calls (a [1, ...] graph would be one more compile)
        dequantize(s_meta[0], s_codes[0], y[0], state_config, False, wrap=wrap)
        dequantize(d_meta[0], d_codes[0], y[0], delta_config, True, wrap=wrap)
        quantize(y[0], s_meta[0], s_codes[0], state_config, 0, wrap=wrap)
    else:
        dequantize(s_meta, s_codes, y, state_config, False, wrap=wrap)
        dequantize(d_meta, d_codes, y, delta_config, True, wrap=wrap)
        quantize(y, s_meta, s_codes, state_config, [0] * R, wrap=wrap)
    if y is not out:
        write(out, y)  # one cast, NaNs canonical
    # a non-finite bucket's meta is NaN (qcomm/layout.py): zero meta decodes to 0 in
    # every scheme (its codes are all zero), a few bytes a bucket, not a pass
    s_meta.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
