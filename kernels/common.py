"""Shared ``@triton.jit`` helpers: the RNG and the bit packing of the wire format.

Each one computes what :mod:`qcomm.oracle` defines, operation for operation where the
rounding decides a code, so the Triton and torch paths produce the same bytes (tests
check it bit for bit against the oracle).
"""

import torch
import triton
import triton.language as tl

from qcomm import constants as C
from qcomm import layout
from qcomm.layout import NAN_BITS


# One program per bucket. Warps per program: one per 1024 elements, 1 to 8 (a 1024
# bucket: one warp, 32 values per thread). Fewer threads per bucket means fewer
# cross-warp reductions (shared memory and barriers) per element: compiled for sm_90,
# the 8-bit min-max quantize kernel is 31.5 SASS instructions per element at 1 warp, 58
# at 4 and 94 at 8 (static counts: `python tests/compile_for_gpu.py --sass`, triton 3.9),
# and at ~33 T instructions/s an H200 must stay under ~60 per element to quantize fp32 at
# its 4.3 TB/s copy rate. ``warps`` (a group's CommConfig.triton_warps, QCOMM_TRITON_WARPS,
# which qcomm.codec passes down; 0: this choice) overrides it.
def num_warps(bucket_size: int, warps: int = 0) -> int:
    return warps or max(1, min(8, bucket_size // 1024))


# A kernel's SCHEME: the id of a row of qcomm.layout.SCHEMES (the header's scheme byte),
# the one layout.scheme_for gives (:func:`scheme_args`).
MINMAX = tl.constexpr(layout.MINMAX.id)
MAXNORM = tl.constexpr(layout.MAXNORM.id)
NUQ = tl.constexpr(layout.NUQ.id)

# qcomm.constants as Triton constants. Globals must be constexpr *instances*: triton
# 3.6 refuses the annotated form (``X: tl.constexpr = ...``) that later versions and the
# interpreter accept.
FMIX_C1 = tl.constexpr(C.FMIX_C1)
FMIX_C2 = tl.constexpr(C.FMIX_C2)
GOLDEN = tl.constexpr(C.GOLDEN)
GOLDEN_HI = tl.constexpr(C.GOLDEN_HI)


@triton.jit
def fmix32(h):
    h = h ^ (h >> 16)
    h = h * FMIX_C1
    h = h ^ (h >> 13)
    h = h * FMIX_C2
    return h ^ (h >> 16)


@triton.jit
def pair_hash(counter, key, WIDE: tl.constexpr):
    """The oracle's pair hash (``qcomm.oracle.uniforms`` / ``fmix32``): fmix32 of a pair
    counter; no state.

    ``WIDE``: ``counter`` is int64 and may reach 2^32. Otherwise it is int32 and the high
    word, always 0, is skipped (h ^ 0 * GOLDEN_HI == h): a 64-bit shift and a multiply
    less, the same bits.
    """
    if WIDE:
        lo = (counter & 0xFFFFFFFF).to(tl.uint32)
        hi = (counter >> 32).to(tl.uint32)
        h = lo * GOLDEN + key.to(tl.uint32)
        h = h ^ (hi * GOLDEN_HI)
    else:
        h = counter.to(tl.uint32) * GOLDEN + key.to(tl.uint32)
    return fmix32(h)


@triton.jit
def half_uniform(h, HIGH: tl.constexpr):
    """The oracle's uniforms (``qcomm.oracle.uniforms``): the low or high 16 bits of uint32
    ``h`` as a uniform in [0, 1) on a 2^-16 grid."""
    if HIGH:
        b = h >> 16
    else:
        b = h & 0xFFFF
    return b.to(tl.float32) * (1.0 / 65536.0)


# qcomm.layout.NAN_BITS: the one NaN every path writes, as integer bits (a float NaN
# constant or select would leave the bits to the compiler and the hardware).
NAN32 = tl.constexpr(NAN_BITS[torch.float32])
NAN16 = tl.constexpr(NAN_BITS[torch.float16])
NAN_BF16 = tl.constexpr(NAN_BITS[torch.bfloat16])


@triton.jit
def nan_where(bad, v):
    """fp32 ``v``, or the canonical NaN (``qcomm.layout.NAN_BITS``) where ``bad``."""
    bits = tl.where(bad, NAN32, v.to(tl.uint32, bitcast=True))
    return bits.to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def plus_zero(v):
    """fp32 ``v`` with -0.0 made +0.0 (a meta word's zero, ``qcomm.layout``)."""
    return tl.where(v == 0.0, 0.0, v)


TINY = tl.constexpr(C.TINY)
BOOST = tl.constexpr(C.BOOST)


@triton.jit
def reciprocal_step(step):
    """(s, 1 / (step * s)), ``qcomm.oracle.reciprocal``: ``v / step`` is computed as
    ``(v * s) * inv``, one division per bucket, not per element; 0 where ``step`` is not
    > 0."""
    s = tl.where(step < TINY, BOOST, 1.0)
    inv = tl.where(step > 0, tl.math.div_rn(1.0, step * s), 0.0)
    return s, inv


@triton.jit
def round_position(t, u, TOP: tl.constexpr, STOCHASTIC: tl.constexpr):
    """``qcomm.oracle.round_position``: level position ``t >= 0`` to ``floor(t + u)``
    (stochastic; one fp32 add, unfused: the kernels run with fusion off) or to nearest,
    ties down (``u`` unused); clamped to [0, TOP]."""
    if STOCHASTIC:
        v = tl.floor(t + u).to(tl.int32)
    else:
        lo = tl.floor(t)
        v = lo.to(tl.int32) + ((t - lo) > 0.5).to(tl.int32)
    return tl.minimum(tl.maximum(v, 0), TOP)


def row_width(bits: int, elem_size: int) -> int:
    """R: elements per tile row. Rows span one 16-byte vector of the float side where
    that packs into whole bytes (4 fp32 elements for 2- and 4-bit codes), else 8
    elements (one group: 8 fp16/bf16 elements are 16 bytes); how a row is stored
    follows from ``bits`` and R (:func:`row_word`).

    Measured on an H200 (``bash bench/device_check.sh``): rows of 4 made fp32 2/4-bit
    quantize 5-9 points of copy bandwidth faster and bf16 4-11 points slower than rows
    of 8, hence the choice by element size.
    """
    return 4 if elem_size == 4 and bits in (2, 4) else 8


# The tile's derived sizes, computed inside the kernels from their BITS, R and a tile's
# row count: a launch cannot pass a storage or block size that disagrees with them.
# Plain arithmetic only: Triton hashes a constexpr function's source into the kernels'
# cache keys and refuses calls to functions of its own from one. Bind a result as
# ``X: tl.constexpr = f(...)``: unannotated, ``if X == ...`` compiles both branches.
@triton.constexpr_function
def row_word(bits, R):
    """How a row of R ``bits``-bit codes is stored. 8: 8-bit codes, one byte each; 1, 2
    or 4: the row is one uint8/uint16/uint32 (the codes start 4-byte aligned: qcomm.codec
    refuses payloads that are not, and the header and fp32 metadata before them are
    whole words); 0: byte by byte, a ``bits``-byte group of 8 codes (3, 5, 6 and 7
    bits, where R is 8)."""
    if bits == 8:
        return 8
    nbytes = R * bits // 8
    return nbytes if nbytes in (1, 2, 4) else 0


@triton.constexpr_function
def block_rows(rows):
    """A tile's block height: the next power of 2 >= ``rows`` (tl.arange's length)."""
    block = 1
    while block < rows:
        block *= 2
    return block


def tile_args(config, n: int, elem_size: int, halves: bool = False, warps: int = 0) -> dict:
    """The launch arguments both kernels share: tile shape, storage and index width.
    ``halves``: tiles of half a bucket where a half is whole rows (quantize: one hash
    per pair of halves, qcomm.oracle's uniforms); PAIRED says whether it is. ``warps``:
    warps per program (:func:`num_warps`; 0: by bucket size)."""
    B = config.bucket_size
    R = row_width(config.bits, elem_size)
    return dict(n_rows=-(-n // 8) * (8 // R), BITS=config.bits, B=B, R=R,
                WIDE=n + B >= 2**31, num_warps=num_warps(B, warps),
                **({"PAIRED": B % (2 * R) == 0} if halves else {}))


def scheme_args(config, prefix: str = "") -> dict:
    """A config's ``SCHEME`` and ``LEVELS`` constexprs (named ``prefix + ...``): the id
    and level count of the scheme its payload is written in (``layout.scheme_for``)."""
    scheme = layout.scheme_for(config.scheme, config.bits)
    return {prefix + "SCHEME": scheme.id, prefix + "LEVELS": scheme.levels(config.bits)}


@triton.jit
def bucket_tile(n, n_rows, B: tl.constexpr, R: tl.constexpr, WIDE: tl.constexpr,
                ROWS: tl.constexpr, FIRST: tl.constexpr):
    """Rows ``[FIRST, FIRST + ROWS)`` of this program's bucket as a [block_rows(ROWS), R]
    tile:
    (bucket, row, rmask, index, valid). The whole bucket is ``ROWS = B // R, FIRST = 0``;
    one half ``ROWS = B // (2 * R)``, ``FIRST`` 0 or that.

    A row packs into whole bytes (row_word), so packing reduces along rows, inside a
    thread, instead of across the block. Indices are int64 only when ``WIDE`` (FSDP flat
    buffers can pass 2^31 elements)."""
    bucket = tl.program_id(0)
    if WIDE:
        bucket = bucket.to(tl.int64)
    r = tl.arange(0, block_rows(ROWS))
    row = bucket * (B // R) + FIRST + r  # global row index
    rmask = (r < ROWS) & (row < n_rows)
    index = row[:, None] * R + tl.arange(0, R)[None, :]
    valid = rmask[:, None] & (index < n)
    return bucket, row, rmask, index, valid


@triton.jit
def pack_store(codes_ptr, codes, row, rmask, BITS: tl.constexpr, R: tl.constexpr):
    """Store codes int32 [rows, R] (a row = R consecutive elements) at tile rows ``row``
    where ``rmask``. The code stream's bytes: element i's code at bits [i*b, (i+1)*b).
    ``R`` as :func:`row_width` chose it, stored as :func:`row_word` says; packing a row
    is a sum along it, inside one thread when the row is one load vector."""
    k = tl.arange(0, R)
    WORD: tl.constexpr = row_word(BITS, R)
    if WORD == 8:
        tl.store(codes_ptr + row[:, None] * R + k[None, :], codes.to(tl.uint8),
                 mask=rmask[:, None])
    elif WORD == 0:  # R == 8: a BITS-byte word, byte by byte
        word = tl.sum(codes.to(tl.uint64) << (k * BITS).to(tl.uint64)[None, :], axis=1)
        bytes_ = (word[:, None] >> (k * 8).to(tl.uint64)[None, :]) & 0xFF
        tl.store(codes_ptr + row[:, None] * BITS + k[None, :], bytes_.to(tl.uint8),
                 mask=rmask[:, None] & (k[None, :] < BITS))
    else:
        word = tl.sum(codes.to(tl.uint32) << (k * BITS).to(tl.uint32)[None, :], axis=1)
        if WORD == 4:
            tl.store(codes_ptr.to(tl.pointer_type(tl.uint32)) + row, word, mask=rmask)
        elif WORD == 2:
            tl.store(codes_ptr.to(tl.pointer_type(tl.uint16)) + row, word.to(tl.uint16),
                     mask=rmask)
        else:
            tl.store(codes_ptr + row, word.to(tl.uint8), mask=rmask)


@triton.jit
def load_unpack(codes_ptr, row, rmask, BITS: tl.constexpr, R: tl.constexpr):
    """Inverse of :func:`pack_store`: int32 codes [rows, R] (0 where not ``rmask``)."""
    k = tl.arange(0, R)
    WORD: tl.constexpr = row_word(BITS, R)
    if WORD == 8:
        return tl.load(codes_ptr + row[:, None] * R + k[None, :], mask=rmask[:, None],
                       other=0).to(tl.int32)
    if WORD == 0:
        bytes_ = tl.load(codes_ptr + row[:, None] * BITS + k[None, :],
                         mask=rmask[:, None] & (k[None, :] < BITS), other=0)
        word = tl.sum(bytes_.to(tl.uint64) << (k * 8).to(tl.uint64)[None, :], axis=1)
        codes = (word[:, None] >> (k * BITS).to(tl.uint64)[None, :]) & ((1 << BITS) - 1)
        return codes.to(tl.int32)
    if WORD == 4:
        word = tl.load(codes_ptr.to(tl.pointer_type(tl.uint32)) + row, mask=rmask, other=0)
    elif WORD == 2:
        word = tl.load(codes_ptr.to(tl.pointer_type(tl.uint16)) + row, mask=rmask,
                       other=0).to(tl.uint32)
    else:
        word = tl.load(codes_ptr + row, mask=rmask, other=0).to(tl.uint32)
    codes = (word[:, None] >> (k * BITS).to(tl.uint32)[None, :]) & ((1 << BITS) - 1)
    return codes.to(tl.int32)
