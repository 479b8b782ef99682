"""The tuned torch path (qcomm/cpu/) on its own: the pieces its speed depends on (lane
groups, word unpacking, chunked and staged loops, the paired hash) give the same bits
whichever way a machine runs them. That the path as a whole gives the oracle's bytes is
tests/test_kernels.py's three-way grid."""

import pytest
import torch

from qcomm import QuantConfig, constants, dequantize, quantize
from qcomm.cpu import common as K
from qcomm.cpu import dequantize as D
from qcomm.cpu import quantize as Q

EAGER = "eager"


def test_lane_groups_per_machine():
    """The word decode's groups: one vector of the loop Inductor writes (8 or 16 fp32
    lanes, twice that for 16-bit stores), at least one int32 word; 8 bits only on
    8-lane machines; None for widths or buckets the words cannot serve."""
    lane_group = D.lane_group
    f32, bf16 = torch.float32, torch.bfloat16
    assert [lane_group(b, 1024, f32, lanes=16) for b in (1, 2, 4, 8)] == [32, 16, 16, None]
    assert [lane_group(b, 1024, bf16, lanes=16) for b in (1, 2, 4, 8)] == [32, 32, 32, None]
    assert [lane_group(b, 1024, f32, lanes=8) for b in (1, 2, 4, 8)] == [32, 16, 8, 8]
    assert [lane_group(b, 1024, bf16, lanes=8) for b in (1, 2, 4, 8)] == [32, 16, 16, 16]
    assert lane_group(3, 1024, f32, lanes=8) is None and lane_group(4, 8, f32, lanes=16) is None
    assert lane_group(4, 24, bf16, lanes=8) is None  # not a whole number of groups


@pytest.mark.parametrize("bits, group", [(1, 32), (2, 16), (2, 32), (4, 8), (4, 16),
                                         (4, 32), (8, 8), (8, 16)])
def test_word_unpack_matches_byte_unpack(bits, group):
    """The decode's int32-word unpack reads the same codes as the byte-by-byte one, lane
    for lane, at every group any machine uses, including words with the sign bit set."""
    unpack_codes, unpack_words = K.unpack_codes, D.unpack_words
    g = torch.Generator().manual_seed(bits * group)
    packed = torch.randint(0, 256, (64 * group * bits // 8,), dtype=torch.uint8, generator=g)
    packed[3] = 0xFF  # a word whose top bit is set: arithmetic shifts must not leak
    words = unpack_words(packed, bits, group)
    assert words.shape == (64, group)
    assert torch.equal(words.reshape(-1), unpack_codes(packed, bits))


@pytest.mark.parametrize("scheme", ["minmax", "nuq"])
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_dequantize_same_at_every_group(scheme, bits):
    """Whatever group a machine picks (or bytes), the decode is the same bits, into fp32,
    bf16 and accumulated."""
    cfg = QuantConfig(bits=bits, bucket_size=64, scheme=scheme)
    x = torch.randn(64 * 5 + 9)
    p = quantize(x, cfg, seed=3, impl=EAGER)
    kw = dict(bits=bits, bucket_size=64, scheme=scheme)
    for dtype in (torch.float32, torch.bfloat16):
        want = D.dequantize_flat(p.meta(), p.codes(), torch.empty(x.numel(), dtype=dtype),
                                    group=None, **kw)
        for group in (8, 16, 32):
            if group * bits % 32 == 0:
                got = D.dequantize_flat(p.meta(), p.codes(),
                                           torch.empty(x.numel(), dtype=dtype), group=group,
                                           **kw)
                assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else
                                            torch.int32),
                                   want.view(torch.int16 if dtype != torch.float32 else
                                             torch.int32)), (dtype, group)
        for staged in (1, 2, 4):  # through an fp32 buffer, that many buckets at a time
            got = D.dequantize_flat(p.meta(), p.codes(), torch.empty(x.numel(), dtype=dtype),
                                       staged=staged, **kw)
            ints = torch.int16 if dtype != torch.float32 else torch.int32
            assert torch.equal(got.view(ints), want.view(ints)), (dtype, staged)
    acc = torch.ones(x.numel())
    D.dequantize_flat(p.meta(), p.codes(), acc, accumulate=True, group=32, **kw)
    assert torch.equal(acc, 1.0 + dequantize(p, impl=EAGER))


def test_stochastic_rounding_bias_under_a_grid_step():
    """``floor(t + u)`` over all 65536 values of u (the 2^-16 grid): the mean code is t
    to within 2^-15 everywhere up to the top level, the fp32 add's rounding included
    (positions near 255, where its ulp is 2^-16, and fractions just under 1), and every
    code is floor(t) or floor(t) + 1."""
    from qcomm.cpu.quantize import round_position

    u = torch.arange(65536, dtype=torch.float32) / 65536
    t = torch.tensor([0.0, 2.0**-20, 0.3, 1 - 2.0**-24, 3.5, 100.123456, 127.99999,
                      200.7, 254.5, 254.99998, 255.0], dtype=torch.float32)
    codes = round_position(t[:, None], u[None, :], 255)
    assert ((codes == t.floor()[:, None]) | (codes == t.floor()[:, None] + 1)).all()
    bias = (codes.double().mean(1) - t.double()).abs()
    assert (bias <= 2.0**-15).all(), bias.max()
    near = round_position(t[:, None], None, 255).view(-1)  # nearest, ties down
    assert near.tolist() == [0, 0, 0, 1, 3, 100, 128, 201, 254, 255, 255]


@pytest.mark.parametrize("scheme, bits", [("minmax", 8), ("minmax", 4), ("nuq", 2),
                                          ("maxnorm", 3), ("minmax", 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_out_decodes_in_chunks(scheme, bits, dtype, monkeypatch):
    """The torch path decodes into 16-bit outputs through a small fp32 buffer, a run of
    buckets at a time: chunk edges, the partial last bucket and a 2-D shape must come out
    as the fp32 decode rounded once."""
    monkeypatch.setattr(D, "_STAGED", 64)  # 16-element buckets: 4 per chunk
    cfg = QuantConfig(bits=bits, bucket_size=16, scheme=scheme)
    x = torch.randn(16 * 4 * 3 + 7, dtype=torch.float32) * 5
    p = quantize(x.to(dtype), cfg, seed=2, impl=EAGER)
    want = dequantize(p, out=torch.empty(x.numel()), impl=EAGER).to(dtype)
    got = dequantize(p, impl=EAGER)
    assert got.dtype == dtype and torch.equal(got, want)
    p2 = quantize(x.to(dtype).view(-1, 1), cfg, seed=2, impl=EAGER)
    assert torch.equal(dequantize(p2, impl=EAGER).view(-1), want)


def test_uniform_pairs_halves_against_formula():
    """The stochastic-rounding uniform, against its formula in Python ints: element p of
    bucket b and element p + B/2 hash the counter b * B/2 + p mod B/2 once, and take its
    low and high 16 bits. int64 indices past 2^32 mix in the counter's high word; int32
    indices (tensors under 2^31 elements, the kernels' WIDE=False) skip it, same bits."""
    key, B = constants.seed_key(7), 64
    idx = [0, 1, 31, 32, 33, 63, 64, 96, 5, 2**31 - 1, 123456789, 2**33 + 3,
           2**41 + 2**31 + 40]

    def want(i):
        b, p = divmod(i, B)
        c = b * (B // 2) + p % (B // 2)
        lo, hi = c & 0xFFFFFFFF, c >> 32
        h = constants.fmix32_int(((lo * constants.GOLDEN + key) & 0xFFFFFFFF)
                                 ^ ((hi * constants.GOLDEN_HI) & 0xFFFFFFFF))
        return ((h >> 16) if p >= B // 2 else (h & 0xFFFF)) / 2**16

    got = K.uniform(torch.tensor(idx, dtype=torch.int64), key, B)
    assert got.tolist() == [want(i) for i in idx]
    assert got[0] != got[3] and got[1] != got[4]  # elements 0, 32 and 1, 33: one hash each
    narrow = torch.tensor(idx[:11], dtype=torch.int32)
    assert torch.equal(K.uniform(narrow, key, B), got[:11])


def test_quantize_paths_agree_on_the_pairing():
    """The full-bucket graph (halves as views, one hash per pair), the one-bucket
    graph (the per-element formula) and int32 / int64 counters give the same codes:
    the last bucket of a tensor, quantized with the others and alone, the same bytes."""
    x = torch.randn(4 * 64)
    kw = dict(bits=4, bucket_size=64, sid=0, l2=False, stochastic=True, key=constants.seed_key(5),
              divisor=torch.tensor(15.0))
    meta = torch.empty(4, 2)
    full = torch.empty(4, 64, dtype=torch.uint8)
    for wide in (False, True):
        pos = Q.positions(32, x.device)
        Q.encode_buckets(x.view(4, 64), meta, full[:, :32], full[:, 32:], pos, wide=wide,
                         first=torch.tensor(0), **kw)
        # a chunk of the buckets: the same bytes as in the whole
        part = torch.empty(2, 64, dtype=torch.uint8)
        Q.encode_buckets(x.view(4, 64)[1:3], torch.empty(2, 2), part[:, :32], part[:, 32:],
                         pos, wide=wide, first=torch.tensor(1), **kw)
        assert torch.equal(part, full[1:3])
        codes = torch.empty(32, dtype=torch.uint8)
        tmeta = torch.empty(2)
        Q.encode_bucket(x[192:], tmeta, codes, length=torch.tensor(64),
                        start=torch.tensor(192), wide=wide, **kw)
        assert torch.equal(tmeta, meta[3])
        assert torch.equal(codes, K.pack_codes(full[3], 4))


def test_row_chunks_never_leave_one_row():
    row_chunks = K.row_chunks
    assert row_chunks(7, 3) == [(0, 3), (3, 7)]  # the lone 7th row joins the chunk before
    assert row_chunks(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert row_chunks(2, 16) == [(0, 2)]
    assert row_chunks(5, 1) == [(0, 2), (2, 5)]  # steps of one row would all be lone


@pytest.mark.parametrize("scheme", ["minmax", "nuq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4, 3])
def test_chunked_encode_gives_the_same_bytes(bits, dtype, scheme, monkeypatch):
    """Byte buffers go ENCODE_CHUNK elements at a time, nuq from bf16 through fp32
    CONVERT_CHUNK at a time; chunks of 3 buckets over 7 full ones and a tail (a lone
    last bucket goes alone) give the bytes of one pass."""
    B = 64
    cfg = QuantConfig(bits=bits, bucket_size=B, scheme=scheme)
    x = (torch.randn(7 * B + 5) * 3).to(dtype)
    whole = quantize(x, cfg, seed=3, impl="eager").payload
    monkeypatch.setattr(Q, "ENCODE_CHUNK", 3 * B)
    monkeypatch.setattr(Q, "CONVERT_CHUNK", 3 * B)
    chunked = quantize(x, cfg, seed=3, impl="eager").payload
    assert torch.equal(chunked, whole)
