"""The codec: validation, the wire payload, and the one place that picks a data path.

Paths (``impl=``):

- ``"triton"``: the fused kernels of ``qcomm.kernels`` (CUDA tensors; CPU tensors only
  under ``TRITON_INTERPRET=1``, how CI runs them). ``warps=`` (0: by bucket size) sets
  the warps per program.
- ``"torch"``: the tuned torch path, :mod:`qcomm.cpu`, compiled with ``torch.compile``
  (one compile per scheme, bits, bucket and dtype, cached; dynamic in the size;
  repeated calls of one signature skip Dynamo, :mod:`qcomm.cpu.compiled`).
- ``"eager"``: the same path uncompiled (slow per call, no compile).

A path named is the path run. ``impl=None`` picks ``"triton"`` for CUDA tensors and,
otherwise, ``"torch"`` or ``"eager"`` as the environment's config says
(``QCOMM_COMPILE``, read once per process: :func:`qcomm.config.env_config`). A
group's calls pass its own config's choice instead, read at group creation
(:func:`codec_options`), and their ``warps`` (``QCOMM_TRITON_WARPS``); a direct call's
``warps`` is its own (default 0). Every path and warp count gives the same bytes. All
paths have the same launcher signature (``quantize(x, meta, codes, config, key)``,
``dequantize(meta, codes, out, config, accumulate)``; the Triton ones' ``warps`` is
bound by :func:`_launchers`) and produce the bytes of :mod:`qcomm.oracle`, the
readable reference, for the same seed.

Every op runs under ``torch.no_grad()``: an ``nn.Parameter`` (or any tensor that
requires grad) is read like any other tensor, and nothing here builds a graph.

Non-contiguous inputs are accepted (read through a contiguous copy); inputs are never
written.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import cpu, layout
from .config import WARPS, CommConfig, QuantConfig, env_config, triton_interpreted
from .constants import seed_key
from .cpu import dequantize as cpu_dequantize
from .cpu import quantize as cpu_quantize
from .cpu import update_state as cpu_update_state
from .cpu.compiled import compiled
from .layout import DTYPE_IDS, HEADER_NBYTES, packed_nbytes

IMPLS = ("triton", "torch", "eager")
FLOAT_DTYPES = tuple(DTYPE_IDS)
REDUCE_OPS = ("sum", "avg", "premul")

# Codec calls made in this process, by entry point (what a collective's launch count
# is measured by: tests/test_collectives.py counts them at several world sizes).
calls = collections.Counter()


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


def describe(payload: torch.Tensor) -> dict:
    """Parse a payload's header (numel, dtype, bits, scheme, ...) without decoding it."""
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
        raise TypeError(f"payload must be a uint8 tensor, got {_what(payload)}")
    return layout.decode_header(bytes(payload[:HEADER_NBYTES].cpu().tolist()))


def _what(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor(dtype={t.dtype}, shape={tuple(t.shape)}, device={t.device})"
    return type(t).__name__


def codec_options(config: CommConfig, device: torch.device) -> dict:
    """The codec keywords of a group's calls on ``device`` (``impl``, ``warps``) from
    its config, read at group creation: on CPU the torch path compiled or eager as
    ``config.compiles()`` says (named: the config decides, not a later environment), on
    CUDA the Triton kernels with ``config.triton_warps`` warps per program."""
    if device.type == "cuda":
        return {"impl": None, "warps": config.triton_warps}
    return {"impl": "torch" if config.compiles() else "eager", "warps": config.triton_warps}


def _select_impl(device: torch.device, impl: str | None, warps: int = 0) -> str:
    if impl is None:
        if device.type == "cuda":
            impl = "triton"
        else:
            impl = "torch" if env_config().compiles() else "eager"
    elif impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    if impl == "triton" and device.type != "cuda" and not triton_interpreted():
        raise ValueError(
            f"impl='triton' needs CUDA tensors (got device {device}); on CPU set "
            "TRITON_INTERPRET=1 before importing triton, or use impl='torch'"
        )
    if isinstance(warps, bool) or not isinstance(warps, int) or (warps and warps not in WARPS):
        raise ValueError(f"warps must be 0 (by bucket size) or one of {WARPS}, got {warps!r}")
    return impl


@functools.cache
def _launchers(path: str, warps: int = 0):
    """(quantize, dequantize, dequantize_sum, update_state) of one path, with the same
    signatures; the Triton ones launch ``warps`` warps per program (0: by bucket)."""
    if path == "triton":
        from .kernels import dequantize as kd
        from .kernels import dequantize_sum as ks
        from .kernels import quantize as kq
        from .kernels import update_state as ku

        return tuple(functools.partial(f, warps=warps) for f in
                     (kq.quantize, kd.dequantize, ks.dequantize_sum, ku.update_state))
    wrap = compiled if path == "torch" else cpu.common.eager
    return (functools.partial(cpu_quantize.quantize, wrap=wrap),
            functools.partial(cpu_dequantize.dequantize, wrap=wrap),
            functools.partial(cpu_dequantize.dequantize_sum, wrap=wrap),
            functools.partial(cpu_update_state.update_state, wrap=wrap))


def _check_config(config) -> QuantConfig:
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a qcomm.QuantConfig, got {type(config).__name__}")
    return config


@torch.no_grad()
def quantize(
    x: torch.Tensor,
    config: QuantConfig,
    *,
    seed: int | None = None,
    impl: str | None = None,
    out: torch.Tensor | None = None,
    warps: int = 0,
) -> Packed:
    """Quantize ``x`` (fp32, bf16 or fp16, any shape and size) into a :class:`Packed`.

    ``seed`` overrides ``config.seed`` (same seed, same bytes). ``out``, if given, is
    the uint8 payload buffer to write (``packed_nbytes(x.numel(), config)`` bytes,
    contiguous, on ``x``'s device): collectives quantize straight into send buffers.
    ``impl`` and ``warps`` pick the path and the Triton warps per program (module
    docstring; every entry point takes both).
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
    calls["quantize"] += 1
    path = _select_impl(x.device, impl, warps)
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
    encode = _launchers(path, warps)[0]
    encode(flat, packed.meta(), packed.codes(), config, seed_key(seed))
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


@torch.no_grad()
def dequantize(
    packed: Packed,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    impl: str | None = None,
    check: bool = True,
    warps: int = 0,
) -> torch.Tensor:
    """Decode ``packed`` into a new tensor of its source dtype and shape, or into ``out``.

    With ``accumulate=True`` the decoded values are added into ``out`` (fp32, required):
    the reduce-scatter primitive. ``check=False`` skips the header comparison (the caller
    has already checked it; it costs a device-to-host copy of 32 bytes).
    """
    if check:
        _check_payload(packed)
    calls["dequantize"] += 1
    n = packed.numel
    device = packed.payload.device
    path = _select_impl(device, impl, warps)
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
    decode = _launchers(path, warps)[1]
    if result.is_contiguous():
        decode(packed.meta(), packed.codes(), result.view(-1), packed.config, accumulate)
    else:  # decode, then store
        tmp = torch.empty(n, dtype=torch.float32, device=device)
        decode(packed.meta(), packed.codes(), tmp, packed.config, False)
        cpu.common.store(result, tmp.view(result.shape), accumulate)
    return result



# ---------------------------------------------------------------------------------
# Rows: R payloads of one size in one call (what a collective sends to or gets from R
# peers). Row r of a [R, nbytes] uint8 buffer is one whole payload, the bytes
# quantize() writes for that row alone with that row's seed: batching changes the
# number of launches, not the wire.


def _payload_views(rows: torch.Tensor, numel: int, config: QuantConfig):
    """(meta [R, words * buckets] fp32, codes [R, codes bytes]) views of payload rows."""
    start = HEADER_NBYTES + layout.meta_nbytes(numel, config)
    meta = rows[:, HEADER_NBYTES:start].view(torch.float32)
    return meta, rows[:, start:start + layout.codes_nbytes(numel, config.bits)]


def _check_rows(name: str, rows, numel: int, config: QuantConfig, device) -> None:
    nbytes = packed_nbytes(numel, config)
    if (not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() != 2
            or rows.shape[1] != nbytes or rows.stride(1) != 1 or rows.device != device):
        raise ValueError(f"{name} must be a 2-D uint8 tensor of rows of {nbytes} bytes "
                         f"(contiguous within a row) on {device}, got {_what(rows)}")
    if rows.shape[0] > 1 and rows.stride(0) % 4:
        raise ValueError(f"{name}: rows must start 4-byte aligned (row stride "
                         f"{rows.stride(0)} bytes)")
    _check_aligned(name, rows)


def _check_float_rows(name: str, t, rows: int, numel: int, device) -> None:
    if (not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES or t.dim() != 2
            or tuple(t.shape) != (rows, numel) or (numel > 1 and t.stride(1) != 1)
            or t.device != device):
        raise ValueError(f"{name} must be a [{rows}, {numel}] float32/bfloat16/float16 "
                         f"tensor (contiguous within a row) on {device}, got {_what(t)}")


def _check_seeds(seeds, count: int) -> list[int]:
    seeds = list(seeds)
    if len(seeds) != count or any(isinstance(s, bool) or not isinstance(s, int)
                                  for s in seeds):
        raise TypeError(f"seeds must be {count} ints (one per row), got {seeds!r}")
    return seeds


@torch.no_grad()
def quantize_rows(x: torch.Tensor, config: QuantConfig, seeds: Sequence[int], *,
                  out: torch.Tensor, skip: int | None = None, impl: str | None = None,
                  warps: int = 0) -> None:
    """Quantize every row of ``x`` ([R, n], rows of any stride) into the same row of
    ``out`` ([R, packed_nbytes(n)] uint8), row r with ``seeds[r]``, in one call: row r's
    bytes are those of ``quantize(x[r], config, seed=seeds[r])``. ``skip``: a row left
    unread and unwritten (a reduce-scatter's own chunk). Triton: one launch over a
    (bucket, row) grid; torch path: one graph call per kind of bucket for the rows on
    each side of ``skip``."""
    config = _check_config(config)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"quantize_rows expects a 2-D float32/bfloat16/float16 tensor, got "
                        f"{_what(x)}")
    R, n = x.shape
    _check_float_rows("x", x, R, n, x.device)
    _check_rows("out", out, n, config, x.device)
    if out.shape[0] != R:
        raise ValueError(f"out has {out.shape[0]} rows, x has {R}")
    if skip is not None and not (isinstance(skip, int) and 0 <= skip < R):
        raise ValueError(f"skip must be a row index in [0, {R}) or None, got {skip!r}")
    seeds = _check_seeds(seeds, R)
    calls["quantize_rows"] += 1
    path = _select_impl(x.device, impl, warps)
    spans = [(0, R)] if skip is None else [(0, skip), (skip + 1, R)]
    header = _header_tensor(n, x.dtype, config, x.device)
    used = HEADER_NBYTES + layout.meta_nbytes(n, config) + layout.codes_nbytes(n, config.bits)
    for a, b in spans:  # the header and zero padding: one op per span
        if b > a:
            out[a:b, :HEADER_NBYTES].copy_(header.expand(b - a, -1))
            out[a:b, used:].zero_()
    if n == 0:
        return
    meta, codes = _payload_views(out, n, config)
    keys = [seed_key(s) for s in seeds]
    encode = _launchers(path, warps)[0]
    if path == "triton":
        encode(x, meta, codes, config, keys, skip)
        return
    for a, b in spans:
        if b - a == 1:
            encode(x[a], meta[a], codes[a], config, keys[a])
        elif b - a > 1:
            encode(x[a:b], meta[a:b], codes[a:b], config, keys[a:b])


def check_headers(rows: torch.Tensor, numel: int, dtype: torch.dtype, config: QuantConfig,
                  skip: int | None = None, who: str = "payload row") -> None:
    """Every row's header (``rows``: one payload a row; ``skip``: a row not to read) is
    the one expected: one ``torch.equal`` per block of rows on their device (two around
    ``skip``); a mismatch is a ``ValueError`` naming the first bad row (``who`` r) and
    the field."""
    if rows.shape[0] == 0:
        return
    want = _header_tensor(numel, dtype, config, rows.device)
    heads = rows[:, :HEADER_NBYTES]
    # The common case, every header right, as one op a block of rows; the compare,
    # reduce and read-back below (three ops) only find the row to name.
    blocks = [heads] if skip is None else [heads[:skip], heads[skip + 1:]]
    if all(torch.equal(h, want.expand(h.shape[0], -1)) for h in blocks):
        return
    same = (heads == want).all(dim=1)
    if skip is not None:
        same[skip] = True
    bad = int((~same).nonzero()[0])
    try:
        _check_payload(Packed(rows[bad], numel, dtype, config))
    except ValueError as err:
        raise ValueError(f"{who} {bad}: {err}") from None
    raise ValueError(f"{who} {bad} has an unexpected qcomm header")


@torch.no_grad()
def dequantize_rows(rows: torch.Tensor, numel: int, dtype: torch.dtype, config: QuantConfig,
                    *, out: torch.Tensor, accumulate: bool = False, subtract: bool = False,
                    impl: str | None = None, check: bool = True,
                    warps: int = 0) -> torch.Tensor:
    """Decode payload row r of ``rows`` ([R, packed_nbytes(numel)] uint8) into row r of
    ``out`` ([R, numel], rows of any stride; cast to its dtype, or with ``accumulate``
    added into it, fp32), in one call: the values of ``dequantize`` row by row.
    ``subtract`` (fp32 ``out``): ``out -= decode``, in fp32, what each payload leaves out
    of the values it was quantized from (error feedback's residual, with no buffer of
    the decode). ``check``: compare every row's header with the expected one first."""
    config = _check_config(config)
    _check_rows("rows", rows, numel, config, rows.device if isinstance(rows, torch.Tensor)
                else None)
    R = rows.shape[0]
    _check_float_rows("out", out, R, numel, rows.device)
    if accumulate and subtract:
        raise ValueError("dequantize_rows: accumulate and subtract are exclusive")
    for flag, on in (("accumulate", accumulate), ("subtract", subtract)):
        if on and out.dtype != torch.float32:
            raise TypeError(f"{flag}=True needs a float32 out, got {_what(out)}")
    accumulate = -1 if subtract else int(bool(accumulate))
    if check:
        check_headers(rows, numel, dtype, config)
    calls["dequantize_rows"] += 1
    if numel == 0 or R == 0:
        return out
    path = _select_impl(rows.device, impl, warps)
    meta, codes = _payload_views(rows, numel, config)
    decode = _launchers(path, warps)[1]
    if path == "triton" or R > 1:
        decode(meta, codes, out, config, accumulate)
    else:
        decode(meta[0], codes[0], out[0], config, accumulate)
    return out


@torch.no_grad()
def dequantize_sum(rows: torch.Tensor, numel: int, dtype: torch.dtype, config: QuantConfig, *,
                   own: torch.Tensor, out: torch.Tensor, skip: int | None = None,
                   op: str = "sum", factor: float = 1.0, impl: str | None = None,
                   check: bool = True, warps: int = 0) -> torch.Tensor:
    """The reduce-scatter's receive side in one call: ``out = op(own + decode(row r) for
    every r != skip)``, summed in fp32 in row order (``own`` first, exact), then ``op``
    ("sum"; "avg": divided by ``factor``; "premul": multiplied by it), then cast to
    ``out``'s dtype. ``rows`` [R, packed_nbytes(numel)] uint8 (payloads of ``dtype``
    sources), ``own`` and ``out`` 1-D contiguous float tensors of ``numel`` elements
    (``out`` may be ``own``). The values of :func:`qcomm.oracle.dequantize_sum`."""
    config = _check_config(config)
    device = rows.device if isinstance(rows, torch.Tensor) else None
    _check_rows("rows", rows, numel, config, device)
    for name, t in (("own", own), ("out", out)):
        if (not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES or t.dim() != 1
                or t.numel() != numel or not t.is_contiguous() or t.device != device):
            raise ValueError(f"{name} must be a contiguous 1-D float tensor of {numel} "
                             f"elements on {device}, got {_what(t)}")
    R = rows.shape[0]
    if skip is not None and not (isinstance(skip, int) and 0 <= skip < R):
        raise ValueError(f"skip must be a row index in [0, {R}) or None, got {skip!r}")
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    if check:
        check_headers(rows, numel, dtype, config, skip)
    calls["dequantize_sum"] += 1
    if numel == 0:
        return out
    path = _select_impl(device, impl, warps)
    meta, codes = _payload_views(rows, numel, config)
    _launchers(path, warps)[2](meta, codes, own, out, config, skip, op, factor)
    return out


@torch.no_grad()
def update_state_rows(state: torch.Tensor, deltas: torch.Tensor, numel: int,
                      state_config: QuantConfig, delta_config: QuantConfig, *,
                      out: torch.Tensor, scratch: torch.Tensor | None = None,
                      impl: str | None = None, check: bool = True,
                      warps: int = 0) -> torch.Tensor:
    """A weight-difference gather's receive side (:mod:`qcomm.fsdp`) in one call, row by
    row: ``y = decode(state row r) + decode(deltas row r)`` (fp32, one add), stored into
    row r of ``out`` (cast to its dtype), and ``y`` quantized back into ``state`` row r
    in place (``state_config`` rounds to nearest; a metadata word that comes out inf or
    NaN is stored as 0, so a bucket that held a non-finite value decodes to zeros next
    time). ``state`` [R, packed_nbytes(numel, state_config)] uint8, payloads of fp32
    sources; ``deltas`` [R, packed_nbytes(numel, delta_config)] (fp32 sources), any
    other bucket size, scheme and bits; ``out`` [R, numel] (rows of any stride). The
    values and bytes of :func:`qcomm.oracle.update_state`; what a decode of the state,
    an accumulating :func:`dequantize_rows` of the deltas and a :func:`quantize_rows`
    back give, in one pass over memory. ``scratch``: a contiguous fp32 buffer of at
    least R * numel elements the torch path may sum in when ``out`` is not fp32 (the
    caller's reused buffer; else it allocates one; the Triton kernel needs none).
    ``check``: compare every row's header first."""
    state_config, delta_config = _check_config(state_config), _check_config(delta_config)
    if state_config.rounding != "nearest":
        raise ValueError(f"update_state_rows: the state must round to nearest (every rank "
                         f"keeps the same bytes), got {state_config!r}")
    device = state.device if isinstance(state, torch.Tensor) else None
    _check_rows("state", state, numel, state_config, device)
    _check_rows("deltas", deltas, numel, delta_config, device)
    R = state.shape[0]
    if deltas.shape[0] != R:
        raise ValueError(f"deltas has {deltas.shape[0]} rows, state has {R}")
    _check_float_rows("out", out, R, numel, device)
    if scratch is not None and (
            not isinstance(scratch, torch.Tensor) or scratch.dtype != torch.float32
            or not scratch.is_contiguous() or scratch.numel() < R * numel
            or scratch.device != device):
        raise ValueError(f"scratch must be a contiguous float32 tensor of at least "
                         f"{R * numel} elements on {device}, got {_what(scratch)}")
    if check:
        check_headers(state, numel, torch.float32, state_config, who="state row")
        check_headers(deltas, numel, torch.float32, delta_config, who="deltas row")
    calls["update_state_rows"] += 1
    if numel == 0 or R == 0:
        return out
    path = _select_impl(device, impl, warps)
    s_meta, s_codes = _payload_views(state, numel, state_config)
    d_meta, d_codes = _payload_views(deltas, numel, delta_config)
    _launchers(path, warps)[3](s_meta, s_codes, d_meta, d_codes, out, state_config, delta_config,
                        scratch)
    return out
