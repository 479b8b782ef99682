"""Fused Triton kernels of the qcomm codec, installed as ``qcomm.kernels``.

One op per file (``quantize.py``, ``dequantize.py``, ``dequantize_sum.py``: the
reduce-scatter's decode, sum and reduce op in one launch); shared ``@triton.jit`` helpers
(the counter-based RNG, the level math, bit packing) in ``common.py``. Importing this
package does not import Triton; the op modules do, and nothing touches a GPU at import.
"""
