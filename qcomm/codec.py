"""The codec: validation, the wire payload, and the one place that picks a data path.

Paths (``impl=``):

- ``"triton"``: the fused kernels of ``qcomm.kernels`` (CUDA tensors; CPU tensors only
  under ``TRITON_INTERPRET=1``, how CI runs them).
- ``"torch"``: :mod:`qcomm.reference` compiled with ``torch.compile`` (one compile per
  scheme, bits, bucket and dtype, cached; dynamic in the size; repeated calls of one
  signature skip Dynamo, :mod:`qcomm.compiled`). Set ``QCOMM_COMPILE=0`` to run it
  eagerly instead.
- ``"eager"``: the reference uncompiled (slow; the oracle tests compare against).

``impl=None`` picks ``"triton"`` for CUDA tensors and ``"torch"`` otherwise. All paths
produce the same bytes for the same seed.

Non-contiguous inputs are accepted (read through a contiguous copy); inputs are never
written.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from . import layout, reference
from .compiled import compiled
from .config import QuantConfig
from .layout import DTYPE_IDS, HEADER_NBYTES, packed_nbytes

IMPLS = ("triton", "torch", "eager")
FLOAT_DTYPES = tuple(DTYPE_IDS)


@dataclass(frozen=True)
class Packed:
    """A quantized tensor: ``payload`` is everything that crosses the wire."""

    payload: torch.Tensor  # uint8 [packed_nbytes(numel, config)], layout.py's format
    numel: int  # elements encoded
    dtype: torch.dtype  # dtype of the source tensor (and of dequantize's default output)
    config: QuantConfig  # how it was encoded
    shape: torch.Size | None = None  # source shape (dequantize's default output shape)

    @property
    def nbytes(self) -> int:
        return self.payload.numel()

    def meta(self) -> torch.Tensor:
        """The fp32 per-bucket metadata (a view into the payload)."""
        end = HEADER_NBYTES + layout.meta_nbytes(self.numel, self.config)
        return self.payload[HEADER_NBYTES:end].view(torch.float32)

    def codes(self) -> torch.Tensor:
        """The packed codes (a view into the payload, without the tail padding)."""
        start = HEADER_NBYTES + layout.meta_nbytes(self.numel, self.config)
        return self.payload[start:start + layout.codes_nbytes(self.numel, self.config.bits)]

    @staticmethod
    def from_payload(payload: torch.Tensor, numel: int, dtype: torch.dtype,
                     config: QuantConfig, shape: torch.Size | None = None) -> Packed:
        """Wrap a received payload, checking its header against what the caller expects."""
        packed = Packed(payload, numel, dtype, config, shape)
        _check_payload(packed)
        return packed


def _header_tensor(numel: int, dtype: torch.dtype, config: QuantConfig,
                   device: torch.device) -> torch.Tensor:
    return _header_cached(numel, dtype, config, str(device))


@functools.lru_cache(maxsize=256)
def _header_cached(numel, dtype, config, device) -> torch.Tensor:
    raw = layout.encode_header(numel, dtype, config)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


@functools.lru_cache(maxsize=64)
def _divisor_tensor(sid: int, bits: int, device: str) -> torch.Tensor:
    # A 0-d tensor, not a Python float: Inductor would turn x / constant into a multiply.
    return torch.tensor(reference.divisor_for(sid, bits), device=device)


def describe(payload: torch.Tensor) -> dict:
    """Parse a payload's header (numel, dtype, bits, scheme, ...) without decoding it."""
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
        raise TypeError(f"payload must be a uint8 tensor, got {_what(payload)}")
    return layout.decode_header(bytes(payload[:HEADER_NBYTES].cpu().tolist()))


def _what(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor(dtype={t.dtype}, shape={tuple(t.shape)}, device={t.device})"
    return type(t).__name__


def _select_impl(device: torch.device, impl: str | None) -> str:
    if impl is None:
        impl = "triton" if device.type == "cuda" else "torch"
    elif impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"impl='triton' needs CUDA tensors (got device {device}); on CPU set "
            "TRITON_INTERPRET=1 before importing triton, or use impl='torch'"
        )
    if impl == "torch" and os.environ.get("QCOMM_COMPILE", "1") == "0":
        return "eager"
    return impl


def _wrap(path: str):
    """How :mod:`qcomm.reference` runs its pieces on this path: compiled or eagerly."""
    return reference.eager if path == "eager" else compiled


def _check_config(config) -> QuantConfig:
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a qcomm.QuantConfig, got {type(config).__name__}")
    return config


def quantize(
    x: torch.Tensor,
    config: QuantConfig,
    *,
    seed: int | None = None,
    impl: str | None = None,
    out: torch.Tensor | None = None,
) -> Packed:
    """Quantize ``x`` (fp32, bf16 or fp16, any shape and size) into a :class:`Packed`.

    ``seed`` overrides ``config.seed`` (same seed, same bytes). ``out``, if given, is
    the uint8 payload buffer to write (``packed_nbytes(x.numel(), config)`` bytes,
    contiguous, on ``x``'s device): collectives quantize straight into send buffers.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a tensor, got {type(x).__name__}")
    config = _check_config(config)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"quantize supports float32, bfloat16 and float16 tensors, got {x.dtype} "
            "(integer, bool, complex and float64 tensors must be sent exact)"
        )
    seed = config.seed if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    path = _select_impl(x.device, impl)
    n = x.numel()
    nbytes = packed_nbytes(n, config)
    if out is None:
        payload = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    else:
        if (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1
                or out.numel() != nbytes or not out.is_contiguous() or out.device != x.device):
            raise ValueError(
                f"out must be a contiguous 1-D uint8 tensor of {nbytes} bytes on {x.device}, "
                f"got {_what(out)}"
            )
        if out.data_ptr() == x.data_ptr() and n:
            raise ValueError("out must not alias the input of quantize")
        _check_aligned("out", out)
        payload = out
    packed = Packed(payload, n, x.dtype, config, x.shape)
    payload[:HEADER_NBYTES].copy_(_header_tensor(n, x.dtype, config, x.device))
    used = HEADER_NBYTES + layout.meta_nbytes(n, config) + layout.codes_nbytes(n, config.bits)
    if used < nbytes:
        payload[used:].zero_()  # the alignment padding: the same bytes on the wire every time
    if n == 0:
        return packed
    flat = x if x.dim() == 1 else x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    key = reference.seed_key(seed)
    meta, codes = packed.meta(), packed.codes()
    if path == "triton":
        from .kernels import quantize as kq

        kq.quantize(flat, meta, codes, config, key)
        return packed
    sid = layout.effective_scheme_id(config.scheme, config.bits)
    divisor = _divisor_tensor(sid, config.bits, str(x.device))
    key_t = reference.index_tensor(key, x.device)  # a 0-d int64 tensor: data to the graph
    reference.quantize_reference(
        flat, bits=config.bits, bucket_size=config.bucket_size, scheme=config.scheme,
        l2=config.norm == "l2", stochastic=config.rounding == "stochastic", key=key_t,
        divisor=divisor, meta_out=meta, codes_out=codes, wrap=_wrap(path))
    return packed


def _check_aligned(name: str, p: torch.Tensor) -> None:
    # The fp32 metadata is viewed in place (torch needs the byte offset divisible by
    # 4), and the kernels store codes as whole uint16/uint32 words.
    if p.storage_offset() % 4:
        raise ValueError(f"{name} must start at a byte offset divisible by 4 within its "
                         f"storage (the fp32 metadata is read in place), got offset "
                         f"{p.storage_offset()}")


def _check_payload(packed: Packed) -> None:
    if not isinstance(packed, Packed):
        raise TypeError(f"dequantize expects a qcomm.Packed, got {type(packed).__name__}")
    config = _check_config(packed.config)
    p = packed.payload
    expected = packed_nbytes(packed.numel, config)
    if (not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() != 1
            or not p.is_contiguous()):
        raise ValueError(f"payload must be a contiguous 1-D uint8 tensor, got {_what(p)}")
    _check_aligned("payload", p)
    if p.numel() != expected:
        raise ValueError(
            f"payload has {p.numel()} bytes, but {packed.numel} elements at {config.bits} bits, "
            f"bucket {config.bucket_size}, scheme {config.scheme!r} take {expected}"
        )
    head = describe(p)
    want = {"numel": packed.numel, "dtype": packed.dtype, "bits": config.bits,
            "scheme": config.scheme, "bucket_size": config.bucket_size,
            "norm": config.norm, "rounding": config.rounding}
    diff = [f"{k}: payload {head[k]!r}, expected {v!r}" for k, v in want.items() if head[k] != v]
    if diff:
        raise ValueError("qcomm payload does not match what the receiver expects: "
                         + "; ".join(diff))


def dequantize(
    packed: Packed,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    impl: str | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Decode ``packed`` into a new tensor of its source dtype and shape, or into ``out``.

    With ``accumulate=True`` the decoded values are added into ``out`` (fp32, required):
    the reduce-scatter primitive. ``check=False`` skips the header comparison (the caller
    has already checked it; it costs a device-to-host copy of 32 bytes).
    """
    if check:
        _check_payload(packed)
    n = packed.numel
    device = packed.payload.device
    path = _select_impl(device, impl)
    if accumulate:
        if out is None:
            raise ValueError("dequantize(accumulate=True) needs out= (a float32 tensor)")
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
            raise TypeError(f"accumulate=True needs a float32 out, got {_what(out)}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise TypeError(f"out must be a floating-point tensor, got {_what(out)}")
        if out.numel() != n or out.device != device:
            raise ValueError(
                f"out must hold {n} elements on {device}, got {_what(out)}"
            )
        result = out
    else:
        shape = packed.shape if packed.shape is not None else (n,)
        result = torch.empty(shape, dtype=packed.dtype, device=device)
    if n == 0:
        return result
    config = packed.config
    if path == "triton":
        from .kernels import dequantize as kd

        def decode(into, acc):
            kd.dequantize(packed.meta(), packed.codes(), into, config, acc)
    else:
        def decode(into, acc):
            reference.dequantize_reference(
                packed.meta(), packed.codes(), into, bits=config.bits,
                bucket_size=config.bucket_size, scheme=config.scheme, accumulate=acc,
                wrap=_wrap(path))
    # The kernels store every float dtype, and so does the compiled path on CUDA (chunks
    # would be kernel launches) and on AVX2 where the word decode applies: its lane groups
    # match Inductor's 16-wide tiling of a 16-bit store (reference.lane_group). Into
    # bf16, 1 thread, 2^24 elements, Zen 3, G elements/s, staged (2^18 decoded to fp32 at
    # a time and converted; each chunk a compiled call) -> direct: 4 bits 1.08-1.14 ->
    # 3.0-4.1, 8 bits 1.06-1.09 -> 2.8-3.4; 3 bits (bytes) 0.38-0.41 staged, 0.22 direct.
    # On AVX-512 a direct 16-bit store was measured (with the older 16-lane groups) 2-9x
    # slower than staged, so it stays staged there: into bf16, 2^22 elements: minmax
    # 8-bit 0.81 -> 2.0 G elements/s, minmax 4-bit 0.53 -> 1.8, nuq 4-bit 0.16 -> 1.6.
    if path == "triton" or device.type == "cuda":
        direct = FLOAT_DTYPES
    elif (reference.vector_lanes() < 16
          and reference.lane_group(config.bits, config.bucket_size, result.dtype)):
        direct = FLOAT_DTYPES
    else:
        direct = (torch.float32,)
    if result.is_contiguous() and (accumulate or result.dtype in direct):
        decode(result.view(-1), accumulate)
    elif result.is_contiguous() and not accumulate:  # 16-bit out on the torch path
        reference.dequantize_reference(
            packed.meta(), packed.codes(), result, bits=config.bits,
            bucket_size=config.bucket_size, scheme=config.scheme, wrap=_wrap(path),
            staged=max(1, _CHUNK // config.bucket_size))
    else:  # non-contiguous out: decode, then store
        tmp = torch.empty(n, dtype=torch.float32, device=device)
        decode(tmp, False)
        reference.store(result, tmp.view(result.shape), accumulate)
    return result


# Elements the CPU path decodes at once into a 16-bit output (``staged`` buckets of
# reference.dequantize_reference): 2^18, 1 MiB of fp32 that stays in cache. A full-size
# fp32 buffer cost a fresh, page-faulting allocation per call: minmax 8-bit into bf16 at
# 2^26 elements ran at 1.4 GB/s that way, 2.6 fused.
_CHUNK = 1 << 18
