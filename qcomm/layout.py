"""The qcomm wire format: one contiguous uint8 payload per quantized tensor.

::

    offset 0            32                            32 + 4 * m * nbk
    +-------------------+-----------------------------+----------------------------+-----+
    | header (32 bytes) | meta: m fp32 words a bucket | codes: ceil(n/8) * b bytes | pad |
    +-------------------+-----------------------------+----------------------------+-----+
    pad: zero bytes up to a multiple of 16, so payloads laid back to back (an all-gather's
    [world, nbytes] buffer) each start 16-byte aligned and their fp32 meta can be viewed in place.

    header (little-endian):
      [0:2]   magic  b"QC"            [8:12]  bucket_size  uint32
      [2]     version (1)             [12:16] reserved, 0
      [3]     bits b (1..8)           [16:24] numel n      uint64
      [4]     scheme id (0 minmax, 1 maxnorm, 2 nuq)
      [5]     flags: bit0 = L2 norm, bit1 = nearest rounding
      [6]     source dtype (0 float32, 1 bfloat16, 2 float16)
      [7]     reserved, 0             [24:32] reserved, 0

    meta, per bucket (nbk = ceil(n / bucket_size) buckets, m fp32 words each):
      minmax   m=2  [min, step]     x = min + k * step             k in 0 .. 2^b - 1
      maxnorm  m=1  [step]          x = (k - c) * step             k in 0 .. L - 1,
                                    L = 2^b - 1 (b >= 2) or 2 (b = 1), c = (L - 1) / 2
      nuq      m=1  [scale]         x = (-1)^sign * scale * lvl(j) k = sign << (b-1) | j,
                                    lvl(0) = 0, lvl(j) = 2^-(M-j), M = 2^(b-1) - 1
      (nuq at b = 1 has no level bits and is encoded exactly as maxnorm at b = 1)
      A bucket holding inf or NaN has NaN meta (and all-zero codes): it decodes to NaN.

    Canonical bits (every path writes them, so "the same bytes" holds for zeros and NaNs):
      - a meta word that is zero is +0.0 (00 00 00 00): minmax's min and max of a bucket
        holding 0.0 and -0.0 are +0.0 whichever of the two a reduction meets first;
      - every NaN written (the meta of a non-finite bucket; a decoded value, a sum, a cast
        to bf16 or fp16) is the positive quiet NaN without payload, :data:`NAN_BITS`:
        fp32 0x7FC00000 (bytes 00 00 C0 7F), bf16 0x7FC0, fp16 0x7E00. (Hardware picks
        its own: x86's inf * 0 is 0xFFC00000, an NVIDIA GPU's 0x7FFFFFFF, torch's CPU cast
        of any NaN to bf16 0xFFFF.) A decoded -0.0 is kept: nuq's sign bit on level 0.

    codes: element i's code sits at bits [i*b, (i+1)*b) of a little-endian bit
    stream, i.e. each group of 8 consecutive codes is one b-byte little-endian word.
      b=1: byte = k7..k0 (bit j = code j)        b=2: byte 0 = k3 k2 k1 k0 (2 bits each)
      b=4: byte 0 = k1:k0 (k0 in the low nibble)  b=8: byte i = k_i
      b=3: 8 codes in 3 bytes: byte 0 = k2[1:0] k1 k0, byte 1 = k5[0] k4 k3 k2[2], ...
    The tail group of a size that is not a multiple of 8 is padded with zero codes.

The header makes every payload self-describing: a receiver checks it against what it
expects and names any mismatch instead of decoding garbage.

The call descriptor: before a compressed call's payloads move (or with them:
qcomm/envelope.py), every rank of a CPU group sends each peer one fixed-size descriptor
and compares those it receives (qcomm/handshake.py), so ranks that disagree on the size,
dtype, config, collective, op or call index get an error instead of mismatched messages
(gloo aborts the process on those)::

    offset 0                    32     33     34     35           40                48
    +---------------------------+------+------+------+------------+-----------------+
    | the payload header above  | kind | op   | path | reserved 0 | call index      |
    | (all-reduce: whole tensor)| u8   | u8   | u8   | 5 bytes    | uint64 LE       |
    +---------------------------+------+------+------+------------+-----------------+
    kind: 1 all-gather, 2 reduce-scatter, 3 all-reduce
    op:   the reduce op's RedOpType value, 255 for an all-gather
    path: 0 compressed; under bits=auto (which agrees every call of its kinds, exact
          ones too) 1 exact, 2 not yet decided (the call that measures the model)
    dtype (header byte 6): the payload dtypes above, or for an exact call under
          bits=auto any other dtype, 16 + its index in EXACT_DTYPES (255: none of them)
    call index: the compressed calls this group has made before this one
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

HEADER_NBYTES = 32
DESC_NBYTES = 48
ALIGN = 16  # every payload's size is a multiple of this
MAGIC = b"QC"
VERSION = 1
MASK32 = 0xFFFFFFFF

DTYPE_IDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPES = {v: k for k, v in DTYPE_IDS.items()}
# The one NaN of each float dtype that any path writes (drawn above), as the bits of
# the same-size signed integer (int16 for bf16 and fp16: both values fit).
NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass(frozen=True)
class Scheme:
    """What every path knows of one quantization scheme besides its arithmetic: the
    oracle, the torch path, the Triton kernels, the header and the config all read it
    from :data:`SCHEMES` (the arithmetic, a branch on :attr:`id`, stays in each path)."""

    # QuantConfig.scheme, and what decode_header names the header's id
    name: str
    # The header's scheme byte; the torch path's ``sid`` and the kernels' SCHEME constexpr
    id: int
    # fp32 words of meta per bucket (drawn above)
    meta_words: int
    # L of ``bits``: codes 0 .. L - 1 (nuq: the magnitudes 0 .. M, M = L - 1, beside a
    # sign bit)
    levels: Callable[[int], int]
    # Of L: what the bucket's scale (minmax: max - min) is divided by to get the step
    divisor: Callable[[int], float]
    # QCOMM_SCHEME's value that names it (lower case: the environment's value is lowered)
    env: str
    # The scheme whose bytes this one writes at 1 bit, None for itself: nuq at 1 bit has
    # no level bits, only the sign: the {-s, +s} grid of maxnorm at 1 bit
    one_bit: str | None = None

    def __post_init__(self) -> None:
        for name in ("name", "env"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or value != value.strip().lower():
                raise ValueError(f"Scheme.{name} must be a non-empty lower-case str, got {value!r}")
        if isinstance(self.id, bool) or not isinstance(self.id, int) or not 0 <= self.id <= 255:
            raise ValueError(f"Scheme.id must be an int in 0..255 (the header's byte), got "
                             f"{self.id!r}")
        words = self.meta_words
        if isinstance(words, bool) or not isinstance(words, int) or words < 1:
            raise ValueError(f"Scheme.meta_words must be an int >= 1, got {words!r}")
        if not callable(self.levels) or not callable(self.divisor):
            raise TypeError(f"Scheme {self.name!r}: levels and divisor must be callables")
        if self.one_bit is not None and not isinstance(self.one_bit, str):
            raise TypeError(f"Scheme.one_bit must be a scheme's name or None, got {self.one_bit!r}")


# The schemes, in QuantConfig's order. A new one is a row here plus its arithmetic in
# each path (a branch on its id). maxnorm has 2 levels at 1 bit, {-s, +s}, where
# 2^b - 1 would leave one. nuq's divisor is not read (its step is the scale itself),
# but the torch path passes one for every scheme.
MINMAX = Scheme("minmax", id=0, meta_words=2, levels=lambda b: 1 << b,
                divisor=lambda L: float(L - 1), env="minmax")
MAXNORM = Scheme("maxnorm", id=1, meta_words=1, levels=lambda b: (1 << b) - 1 if b >= 2 else 2,
                 divisor=lambda L: (L - 1) / 2.0, env="maxnorm")
NUQ = Scheme("nuq", id=2, meta_words=1, levels=lambda b: 1 << (b - 1),
             divisor=lambda L: (L - 1) / 2.0, env="nuq", one_bit="maxnorm")
SCHEMES: tuple[Scheme, ...] = (MINMAX, MAXNORM, NUQ)


def _index(field: str) -> dict:
    """The schemes by ``field``, which must tell them apart (the header and the
    environment decode through these)."""
    by = {getattr(s, field): s for s in SCHEMES}
    if len(by) != len(SCHEMES):
        raise ValueError(f"qcomm.layout.SCHEMES: two schemes share a {field}: "
                         f"{[getattr(s, field) for s in SCHEMES]}")
    return by


SCHEME_BY_NAME: dict[str, Scheme] = _index("name")
SCHEME_BY_ID: dict[int, Scheme] = _index("id")
SCHEME_BY_ENV: dict[str, Scheme] = _index("env")
if any(s.one_bit not in (None, *SCHEME_BY_NAME) for s in SCHEMES):
    raise ValueError("qcomm.layout.SCHEMES: a one_bit names no scheme: "
                     f"{[s.one_bit for s in SCHEMES]}")


def scheme_for(name: str, bits: int) -> Scheme:
    """The scheme whose bytes scheme ``name`` writes at ``bits`` (its :attr:`Scheme.one_bit`
    at 1 bit): every path encodes and decodes by this one; the header names ``name``."""
    scheme = SCHEME_BY_NAME[name]
    if bits == 1 and scheme.one_bit is not None:
        return SCHEME_BY_NAME[scheme.one_bit]
    return scheme


def effective_scheme_id(name: str, bits: int) -> int:
    """:func:`scheme_for`'s id: what the kernels take as SCHEME and the torch path as ``sid``."""
    return scheme_for(name, bits).id


def levels(scheme_id: int, bits: int) -> int:
    """Number of representable levels (uniform schemes) or ``M + 1`` magnitudes (nuq) of
    the scheme with id ``scheme_id`` (by id: what the torch path's graphs are keyed by)."""
    return SCHEME_BY_ID[scheme_id].levels(bits)


def num_buckets(numel: int, bucket_size: int) -> int:
    return -(-numel // bucket_size)


def meta_nbytes(numel: int, config) -> int:
    words = scheme_for(config.scheme, config.bits).meta_words
    return 4 * words * num_buckets(numel, config.bucket_size)


def meta_words_of(rows: torch.Tensor, numel: int, config) -> torch.Tensor:
    """The fp32 meta words of payload rows ``rows`` ([R, nbytes] uint8, each ``numel``
    elements of ``config``), as a view: [R, buckets x meta words]."""
    return rows[:, HEADER_NBYTES:HEADER_NBYTES + meta_nbytes(numel, config)].view(torch.float32)


def codes_nbytes(numel: int, bits: int) -> int:
    return -(-numel // 8) * bits


def packed_nbytes(numel: int, config) -> int:
    """Exact wire size of ``numel`` elements under ``config``, known before quantizing."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"packed_nbytes: numel must be an int >= 0, got {numel!r}")
    raw = HEADER_NBYTES + meta_nbytes(numel, config) + codes_nbytes(numel, config.bits)
    return -(-raw // ALIGN) * ALIGN


def encode_header(numel: int, dtype: torch.dtype, config) -> bytes:
    flags = (1 if config.norm == "l2" else 0) | (2 if config.rounding == "nearest" else 0)
    scheme = SCHEME_BY_NAME[config.scheme].id  # the config's (nuq at 1 bit says nuq)
    return (
        MAGIC
        + bytes([VERSION, config.bits, scheme, flags, DTYPE_IDS[dtype], 0])
        + config.bucket_size.to_bytes(4, "little")
        + bytes(4)
        + numel.to_bytes(8, "little")
        + bytes(8)
    )


def decode_header(header: bytes) -> dict:
    """Parse the 32 header bytes; ``ValueError`` if they are not a qcomm header."""
    if len(header) < HEADER_NBYTES or header[:2] != MAGIC:
        raise ValueError(
            f"not a qcomm payload: header starts {bytes(header[:4])!r}, expected magic {MAGIC!r}"
        )
    if header[2] != VERSION:
        raise ValueError(f"qcomm payload version {header[2]}, this build reads {VERSION}")
    if header[4] not in SCHEME_BY_ID or header[6] not in DTYPES:
        raise ValueError(f"corrupt qcomm header: scheme id {header[4]}, dtype id {header[6]}")
    return {
        "bits": header[3],
        "scheme": SCHEME_BY_ID[header[4]].name,
        "norm": "l2" if header[5] & 1 else "max",
        "rounding": "nearest" if header[5] & 2 else "stochastic",
        "dtype": DTYPES[header[6]],
        "bucket_size": int.from_bytes(header[8:12], "little"),
        "numel": int.from_bytes(header[16:24], "little"),
    }


# The compressed collective kinds: every per-kind setting (CommConfig's fields, the
# environment's AG/RS/AR prefixes, stats) is keyed by these (qcomm.config takes them
# from here: this module imports nothing of qcomm's, so config can read SCHEMES).
KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce")
# The kind byte: 1, 2, 3 in KINDS' order (a wire format: KINDS only ever grows at its end).
KIND_IDS = {kind: i + 1 for i, kind in enumerate(KINDS)}
KIND_NAMES = {v: k for k, v in KIND_IDS.items()}
NO_OP = 255  # the descriptor's op byte of an all-gather


PATHS = ("compressed", "exact", "undecided")  # the descriptor's path byte, by value
PATH_COMPRESSED, PATH_EXACT, PATH_UNDECIDED = range(len(PATHS))
# The dtypes an exact call under bits=auto may carry besides the payload dtypes: its
# descriptor's dtype byte is 16 + the index here (no payload ever holds them).
EXACT_DTYPES = (torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
                torch.uint8, torch.bool, torch.complex64, torch.complex128,
                torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32,
                torch.uint64)
DESC_DTYPE_IDS = {**DTYPE_IDS, **{d: 16 + i for i, d in enumerate(EXACT_DTYPES)}}
DESC_DTYPES = {v: k for k, v in DESC_DTYPE_IDS.items()}
OTHER_DTYPE = 255


def encode_descriptor(kind: str, numel: int, dtype: torch.dtype, config, op_id: int,
                      call: int, path: int = 0) -> bytes:
    """The 48-byte descriptor of one call (drawn above)."""
    header = bytearray(encode_header(numel, torch.float32, config))
    header[6] = DESC_DTYPE_IDS.get(dtype, OTHER_DTYPE)
    return (bytes(header) + bytes([KIND_IDS[kind], op_id, path]) + bytes(5)
            + (call & ((1 << 64) - 1)).to_bytes(8, "little"))


def decode_descriptor(desc: bytes) -> dict:
    """Parse a descriptor: the header's fields plus ``kind``, ``op_id``, ``path`` and
    ``call``; ``ValueError`` if it is not one (its header or kind byte is not qcomm's)."""
    if (len(desc) != DESC_NBYTES or desc[32] not in KIND_NAMES or desc[34] >= len(PATHS)
            or (desc[6] not in DESC_DTYPES and desc[6] != OTHER_DTYPE)):
        raise ValueError(f"not a qcomm call descriptor (first bytes {bytes(desc[:8])!r})")
    header = bytearray(desc[:HEADER_NBYTES])
    header[6] = 0  # the dtype is the descriptor's own (a superset of the header's)
    return {**decode_header(bytes(header)), "dtype": DESC_DTYPES.get(desc[6], "other"),
            "kind": KIND_NAMES[desc[32]], "op_id": desc[33], "path": PATHS[desc[34]],
            "call": int.from_bytes(desc[40:48], "little")}
