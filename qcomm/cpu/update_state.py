"""The state update of a weight-difference gather on the tuned torch path: the values and
bytes of :func:`qcomm.oracle.update_state`, row by row, as the three passes it fuses on
a GPU (``qcomm.kernels.update_state``): decode the state (into the output itself where
that is fp32), add the decoded differences, quantize the sum back into the state.

Why not one compiled graph here: written as one (decode both, add, store, bucket
statistics, codes), Inductor kept full-size fp32 and int32 temporaries of it (the sum,
the unpacked codes), and on this path's CPUs it ran slower than the three tuned passes
at the sizes a collective's pieces have: W = 8 rows of 2^19 elements, 6.3-7.1 ms a call
in chunks of 2^17-2^18 elements (18.5 ms in chunks of 2^15) against 4.8-5.2 ms for the
three passes; W = 2, 1.8-1.9 against 1.2-1.3 ms; only at 2^16 elements a row, W = 2,
was it ahead (0.32 against 0.40 ms). One run each, AMD EPYC, 2 cores, AVX-512, torch
2.13, 4-bit differences in 1024-element buckets, the default 8-bit state. On a GPU,
where such passes are bound by memory, the kernel moves 6.5 bytes an element (fp32
output) instead of the three launches' 18.5.
"""

from __future__ import annotations

import torch

from ._common import eager
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
        out.copy_(y)
    # a non-finite bucket's meta is NaN (qcomm/layout.py): zero meta decodes to 0 in
    # every scheme (its codes are all zero), a few bytes a bucket, not a pass
    s_meta.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
