"""qcomm's collectives called directly on plain gloo groups (2 and 4 processes).

Compressed results are judged against the exact result computed locally (every rank
regenerates every rank's input from its seed) with the codec's bound: a stochastic
min-max code is off by less than one step ``(max - min) / (2^b - 1)`` of its bucket,
so a reduce-scatter of W contributions is off by less than the sum of the W - 1
quantized contributions' steps, and an all-reduce adds one step of the reduced chunk.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import assert_within, bound, make, run_ranks
from torch.distributed import ReduceOp

import qcomm
from qcomm import CommConfig, QuantConfig
from qcomm.handshake import CONFIG_NBYTES
from qcomm.inner import method as _method
from qcomm.layout import DESC_NBYTES, packed_nbytes
from qcomm.oracle import minmax_steps

pytestmark = pytest.mark.slow

Q8 = QuantConfig(bits=8, bucket_size=1024)
Q4 = QuantConfig(bits=4, bucket_size=128, rounding="nearest")


def _compressed_body(rank, world, q, dtype, n):
    group = dist.group.WORLD
    inputs = [make(r, n, dtype) for r in range(world)]
    res = {}
    # all-gather: out may alias the input slot (FSDP2 gathers in place)
    out = torch.empty(world * n, dtype=dtype)
    out[rank * n:(rank + 1) * n].copy_(inputs[rank])
    qcomm.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n], group, config=q)
    exact = torch.cat(inputs)
    steps = torch.cat([minmax_steps(t, q) for t in inputs])
    assert_within(out, exact, bound(steps, q), "all-gather")
    res["ag"] = out
    # reduce-scatter, SUM / AVG / PREMUL_SUM
    big = [make(r, world * n, dtype, salt=1) for r in range(world)]
    total = torch.stack([t.float() for t in big]).sum(0)
    chunk_steps = torch.stack([minmax_steps(t.view(world, n)[rank], q) for t in big])
    peers = [r for r in range(world) if r != rank]
    rs_bound = bound(chunk_steps[peers].sum(0), q)
    mine = slice(rank * n, (rank + 1) * n)
    for op, scale in ((ReduceOp.SUM, 1.0), (ReduceOp.AVG, 1.0 / world),
                      (dist._make_nccl_premul_sum(0.25), 0.25)):
        o = torch.empty(n, dtype=dtype)
        snapshot = big[rank].clone()
        qcomm.reduce_scatter_tensor(o, big[rank], op, group, config=q)
        assert torch.equal(big[rank], snapshot), "reduce_scatter wrote its input"
        assert o.dtype == dtype
        assert_within(o, total[mine] * scale, rs_bound * scale, f"reduce-scatter {op}")
    # all-reduce of a size not divisible by world (padding)
    m = world * n + 3
    t = make(rank, m, dtype, salt=2)
    qcomm.all_reduce(t, ReduceOp.SUM, group, config=q)
    want = torch.stack([make(r, m, dtype, salt=2).float() for r in range(world)]).sum(0)
    err = (t.float() - want).abs()
    scale = sum(make(r, m, dtype, salt=2).float().abs().max() for r in range(world))
    # W - 1 quantized contributions and one re-quantization, each under a step of at
    # most (max - min) / (2^b - 1) <= 2 * max|x| / (2^b - 1) of its bucket
    limit = float(2 * 2 * scale / (2**q.bits - 1)) * world + 1e-3
    assert err.max() <= limit, f"all-reduce error {err.max():.4g} > {limit:.4g}"
    res["ar"] = t
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_within_bound_and_identical(world):
    results = run_ranks(_compressed_body, world, Q8, torch.float32, 3001, backend="gloo")
    for r in results[1:]:
        assert torch.equal(r["ag"], results[0]["ag"]), "all-gather differs across ranks"
        assert torch.equal(r["ar"], results[0]["ar"]), "all-reduce differs across ranks"


def test_compressed_bf16_nearest_4bit():
    results = run_ranks(_compressed_body, 2, Q4, torch.bfloat16, 1500, backend="gloo")
    assert torch.equal(results[0]["ar"], results[1]["ar"])


def _exact_body(rank, world):
    group = dist.group.WORLD
    cfg = CommConfig(min_numel=1024)
    cases = [make(rank, 4096).to(torch.int64), make(rank, 4096).to(torch.float64),
             make(rank, 100), (make(rank, 4096) > 0)]
    for x in cases:
        if x.dtype == torch.bool:
            x = x.to(torch.uint8)
        out_q, out_g = torch.empty(world * x.numel(), dtype=x.dtype), torch.empty(
            world * x.numel(), dtype=x.dtype)
        qcomm.all_gather_into_tensor(out_q, x, group, config=cfg)
        dist.all_gather_into_tensor(out_g, x, group)
        assert torch.equal(out_q, out_g), f"all-gather of {x.dtype}[{x.numel()}] not exact"
        a, b = x.clone(), x.clone()
        qcomm.all_reduce(a, ReduceOp.SUM, group, config=cfg)
        dist.all_reduce(b, ReduceOp.SUM, group)
        assert torch.equal(a, b)
    # ops the compressed path cannot do, and switched-off collectives
    x = make(rank, 8192)
    for op in (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT):
        a, b = x.clone(), x.clone()
        qcomm.all_reduce(a, op, group)
        dist.all_reduce(b, op, group)
        assert torch.equal(a, b), f"{op} not exact"
        o1, o2 = torch.empty(8192 // world), torch.empty(8192 // world)
        qcomm.reduce_scatter_tensor(o1, x, op, group)
        dist.reduce_scatter_tensor(o2, x, op, group)
        assert torch.equal(o1, o2)
    off = CommConfig(all_gather=None, reduce_scatter=None, all_reduce=None)
    a, b = x.clone(), x.clone()
    qcomm.all_reduce(a, ReduceOp.SUM, group, config=off)
    dist.all_reduce(b, ReduceOp.SUM, group)
    assert torch.equal(a, b)
    # PREMUL_SUM on the exact path (gloo rejects it; qcomm applies the factor)
    o1 = torch.empty(8192 // world, dtype=torch.float64)
    qcomm.reduce_scatter_tensor(o1, x.double(), dist._make_nccl_premul_sum(0.5), group)
    o2 = torch.empty_like(o1)
    dist.reduce_scatter_tensor(o2, x.double() * 0.5, ReduceOp.SUM, group)
    assert torch.equal(o1, o2)
    s = qcomm.stats(group)
    assert s["all_gather"].calls_exact == 4 and s["all_gather"].calls_compressed == 0
    return True


def test_exact_paths_bit_equal_to_gloo():
    run_ranks(_exact_body, 2, backend="gloo")


class Recorder:
    """A duck-typed inner group: forwards to a real group and records what it is handed:
    (op, bytes of the input) per call, the input bytes themselves, and the bytes that go
    to peers under a direct exchange (an all-gather's input to each of world - 1 peers,
    an all-to-all's rows but its own)."""

    def __init__(self, real):
        self._real = real
        self.sent: list[tuple[str, int]] = []
        self.bytes: list[torch.Tensor] = []  # what each call was handed
        self.to_peers = 0

    def rank(self):
        return self._real.rank()

    def size(self):
        return self._real.size()

    def _record(self, op, inp):
        nbytes = inp.numel() * inp.element_size()
        world = self.size()
        self.sent.append((op, nbytes))
        self.bytes.append(inp.detach().clone())
        self.to_peers += (world - 1) * nbytes if op == "all_gather" else (
            nbytes - nbytes // world)

    def shutdown(self):
        self._real.shutdown()

    def all_gather_single(self, out, inp, opts):
        self._record("all_gather", inp)
        return _method(self._real, "all_gather_single", "_allgather_base")(out, inp, opts)

    def all_to_all_single(self, out, inp, out_splits, in_splits, opts):
        self._record("all_to_all", inp)
        return _method(self._real, "all_to_all_single", "alltoall_base")(
            out, inp, out_splits, in_splits, opts)


def _three_calls(pg, rank, world, n):
    """An all-gather, a reduce-scatter and an all-reduce on ``pg``: their outputs."""
    out = torch.empty(world * n)
    qcomm.all_gather_into_tensor(out, make(rank, n), pg)
    part = torch.empty(n)
    qcomm.reduce_scatter_tensor(part, make(rank, world * n), ReduceOp.AVG, pg)
    t = make(rank, 2 * n + 1)
    qcomm.all_reduce(t, ReduceOp.SUM, pg)
    return [out, part, t]


def _wire_body(rank, world):
    import qcomm.envelope as E

    cfg = CommConfig(all_gather=QuantConfig(bits=4), reduce_scatter=QuantConfig(bits=2),
                     all_reduce=QuantConfig(bits=3))
    n = 5000
    chunk = -(-(2 * n + 1) // world)
    # the payload each peer gets: every call's is one payload a peer
    ag, rs = packed_nbytes(n, cfg.all_gather), packed_nbytes(n, cfg.reduce_scatter)
    ar = packed_nbytes(chunk, cfg.all_reduce)
    rec = Recorder(dist.group.WORLD)
    pg = qcomm.QcommProcessGroup(rec, cfg, owns_inner=False)
    rounds = 5
    got = [_three_calls(pg, rank, world, n) for _ in range(rounds)]
    # Until the agreed history ends with a repetition of a period (the 3 calls, over at
    # least 8 calls: 11 calls agreed), each descriptor goes bare (an all-to-all of
    # 48-byte rows) and the payloads follow on their own; from then on each payload
    # rides in its envelope: one exchange a call, no padding (the all-reduce's gather as
    # before).
    expected = [("all_gather", CONFIG_NBYTES)]  # a wrapped group's config agreement, once
    bodies = (("all_gather", ag), ("all_to_all", rs), ("all_to_all", ar))
    riding = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for i in range(3 * rounds):
        kind, (op, body) = ("all_gather", "reduce_scatter", "all_reduce")[i % 3], bodies[i % 3]
        if i >= 11:
            expected.append(("all_to_all", world * (DESC_NBYTES + body)))
            riding[kind] += 1
        else:
            expected += [("all_to_all", world * DESC_NBYTES),
                         (op, body if op == "all_gather" else world * body)]
        if kind == "all_reduce":
            expected.append(("all_gather", ar))
    assert rec.sent == expected, (rec.sent, expected)
    assert riding == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
    # every byte handed to the inner group for peers is counted, control included
    s = qcomm.stats(pg)
    assert sum(v.wire_bytes for v in s.values()) == rec.to_peers
    desc = rounds * DESC_NBYTES  # one descriptor a call, to each peer
    assert s["all_gather"].wire_bytes == (world - 1) * (CONFIG_NBYTES + desc + rounds * ag)
    assert s["all_gather"].control_bytes == (world - 1) * (CONFIG_NBYTES + desc)
    assert s["reduce_scatter"].wire_bytes == (world - 1) * rounds * (DESC_NBYTES + rs)
    assert s["all_reduce"].wire_bytes == (world - 1) * rounds * (DESC_NBYTES + 2 * ar)
    assert s["all_gather"].logical_bytes == rounds * (world - 1) * n * 4
    assert s["all_gather"].ratio == s["all_gather"].logical_bytes / s["all_gather"].wire_bytes
    # ...and the riding calls deliver what the two-exchange calls do, bit for bit (a
    # fresh group of the same config: the same seeds call by call), envelope shut
    rec2 = Recorder(dist.group.WORLD)
    pg2 = qcomm.QcommProcessGroup(rec2, cfg, owns_inner=False)
    cap = E.ENVELOPE_ROOM_MAX
    E.ENVELOPE_ROOM_MAX = 0
    try:
        want = [_three_calls(pg2, rank, world, n) for _ in range(rounds)]
    finally:
        E.ENVELOPE_ROOM_MAX = cap
    assert [size for op, size in rec2.sent if op == "all_to_all"].count(
        world * DESC_NBYTES) == 3 * rounds, rec2.sent
    for a, b in zip(sum(got, []), sum(want, []), strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    # the envelopes byte for byte: row j = the descriptor, then the payload for rank j
    # that the two-exchange call sent on its own (the last round, the same call indices)
    ag_env, rs_env = (rec.bytes[i].view(world, -1) for i in (-4, -3))
    desc_ag, payload_ag = rec2.bytes[-7], rec2.bytes[-6]
    desc_rs, slots_rs = rec2.bytes[-5].view(world, -1), rec2.bytes[-4].view(world, -1)
    for j in range(world):
        assert torch.equal(ag_env[j], torch.cat([desc_ag.view(world, -1)[j], payload_ag]))
        assert torch.equal(rs_env[j, :DESC_NBYTES], desc_rs[j])
        if j != rank:  # this rank's own slot never leaves it
            assert torch.equal(rs_env[j, DESC_NBYTES:], slots_rs[j])
    return rec.sent


@pytest.mark.parametrize("world", [2, 3])
def test_wire_bytes_equal_packed_nbytes(world):
    run_ranks(_wire_body, world, backend="gloo")


def _misc_body(rank, world):
    group = dist.group.WORLD
    x = make(rank, 4096)
    # async_op: a Work, like torch
    out = torch.empty(world * 4096)
    work = qcomm.all_gather_into_tensor(out, x, group, async_op=True)
    assert work is not None and work.wait()
    t = x.clone()
    work = qcomm.all_reduce(t, group=group, async_op=True)
    work.wait()
    # seeds advance: the same input twice gives different (stochastic) codes
    a, b = torch.empty(world * 4096), torch.empty(world * 4096)
    same = torch.full((4096,), 0.3) + torch.linspace(0, 1, 4096)
    qcomm.all_gather_into_tensor(a, same, group)
    qcomm.all_gather_into_tensor(b, same, group)
    assert not torch.equal(a, b), "seed did not advance between calls"
    # ...and rank contributions differ: identical inputs on both ranks, different codes
    assert not torch.equal(a[:4096], a[4096:8192]), "ranks' seeds coincide"
    # local validation, before any communication
    with pytest.raises(ValueError, match="times the elements"):
        qcomm.all_gather_into_tensor(torch.empty(4096), x, group)
    with pytest.raises(TypeError, match="dtype"):
        qcomm.all_gather_into_tensor(torch.empty(world * 4096, dtype=torch.bfloat16), x, group)
    with pytest.raises(ValueError, match="times the elements"):
        qcomm.reduce_scatter_tensor(torch.empty(4095), x, group=group)
    with pytest.raises(TypeError, match="config"):
        qcomm.all_reduce(x.clone(), group=group, config="8bit")
    # a config that differs between ranks is a clear error, not garbage
    q = QuantConfig(rounding="nearest" if rank else "stochastic")
    with pytest.raises(ValueError, match="rounding"):
        qcomm.all_gather_into_tensor(torch.empty(world * 4096), x, group, config=q)
    return True


def test_async_seeds_validation_mismatch():
    run_ranks(_misc_body, 2, backend="gloo")


def _agree_in_threads(store, cfg0, cfg1, *, late0: bool = False) -> dict:
    """Ranks 0 and 1 check their configs through ``store`` (rank 0 0.3 s late when
    ``late0``); returns {rank: error message} of the ranks that raised."""
    from qcomm.handshake import check_at_creation as _check_agreement

    errors = {}

    def run(rank, cfg):
        if rank == 0 and late0:
            time.sleep(0.3)
        try:
            _check_agreement(store, rank, 2, cfg)
        except ValueError as err:
            errors[rank] = str(err)

    threads = [threading.Thread(target=run, args=(0, cfg0)),
               threading.Thread(target=run, args=(1, cfg1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors


def test_config_agreement_checked_through_store():
    errors = _agree_in_threads(dist.HashStore(), CommConfig(), CommConfig(min_numel=7))
    assert set(errors) == {0, 1} and "min_numel=7" in errors[0]


def test_ranks_may_compute_the_same_bytes_their_own_way():
    """compile and triton_warps choose how a rank computes the bytes, not which bytes:
    ranks that differ only there agree (at creation and at a plain group's first call)."""
    from qcomm.handshake import _config_blob

    mine, theirs = CommConfig(), CommConfig(compile=False, triton_warps=4)
    assert _agree_in_threads(dist.HashStore(), mine, theirs) == {}
    assert _config_blob(mine, "n") == _config_blob(theirs, "n")
    assert _config_blob(mine, "n") != _config_blob(mine.replace(min_numel=7), "n")


def test_config_agreement_ignores_earlier_groups_on_the_same_store():
    """Groups made one after another on one store (torchrun's agent store, re-init after
    destroy) never compare against a peer's config from an earlier group."""
    store = dist.HashStore()
    a, b = CommConfig(), CommConfig(min_numel=7)
    # (rank 0's config, rank 1's, which ranks must fail); rank 0 comes late each time,
    # so rank 1 would find its previous key if keys were not numbered per group
    for cfg0, cfg1, failing in [(a, a, set()), (b, b, set()), (a, b, {0, 1})]:
        errors = _agree_in_threads(store, cfg0, cfg1, late0=True)
        assert set(errors) == failing, (cfg0, cfg1, errors)


@pytest.mark.parametrize("var,value", [("QCOMM_AG_BITS", "9"), ("QCOMM_INNER", "mpi"),
                                       ("QCOMM_MIN_NUMEL", "many")])
def test_bad_env_names_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        dist.init_process_group("qcomm", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


def test_single_rank_group_is_exact():
    dist.init_process_group("qcomm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = make(0, 4096)
        y = x.clone()
        dist.all_reduce(y)
        out = torch.empty(4096)
        dist.all_gather_into_tensor(out, x)
        assert torch.equal(y, x) and torch.equal(out, x)  # nothing leaves the rank
        assert qcomm.stats()["all_reduce"].calls_exact == 1
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------
# Pieces: a large call as a pipeline (one payload and one inner collective per piece)


class _Work:
    def __init__(self, work, log, tag):
        self._work, self._log, self._tag = work, log, tag

    def wait(self, *args):
        self._log.append(("wait", self._tag))
        return self._work.wait(*args)


class PipelineRecorder(Recorder):
    """Records when each payload collective starts and when it is waited for."""

    def __init__(self, real):
        super().__init__(real)
        self.events: list[tuple[str, int]] = []

    def _started(self, work):
        tag = len([e for e in self.events if e[0] == "start"])
        self.events.append(("start", tag))
        return _Work(work, self.events, tag)

    def all_gather_single(self, out, inp, opts):
        work = super().all_gather_single(out, inp, opts)
        return work if inp.numel() == DESC_NBYTES else self._started(work)

    def all_to_all_single(self, out, inp, out_splits, in_splits, opts):
        work = super().all_to_all_single(out, inp, out_splits, in_splits, opts)
        return work if inp.numel() == self.size() * DESC_NBYTES else self._started(work)


def test_pieces_keep_payload_bytes_across_widths():
    """A piece is PIECE elements at 8 bits and the same payload bytes at fewer (2^20 at 4
    bits, 2^21 at 2), at most a quarter of the tensor but never under PIECE elements;
    whole buckets, the last piece the rest, covering the tensor exactly."""
    from qcomm.pieces import PIECE, pieces

    def steps(n, bits, bucket=1024):
        parts = pieces(n, QuantConfig(bits=bits, bucket_size=bucket))
        assert parts[0][0] == 0 and parts[-1][1] == n
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(parts))
        assert all((b - a) % bucket == 0 for a, b in parts[:-1])
        return [b - a for a, b in parts]

    assert PIECE == 1 << 19
    assert steps(1 << 24, 8) == [1 << 19] * 32
    assert steps(1 << 24, 4) == [1 << 20] * 16
    assert steps(1 << 24, 2) == [1 << 21] * 8
    assert steps(1 << 24, 1) == [1 << 22] * 4
    assert steps(1 << 22, 2) == [1 << 20] * 4  # a quarter of the tensor
    assert steps(1 << 21, 2) == [1 << 19] * 4
    assert steps(3 << 18, 2) == [1 << 19, 1 << 18]  # never under PIECE
    assert steps(1000, 2) == [1000] and steps(0, 8) == [0]
    assert steps((1 << 22) + 5, 4, bucket=192) == [1048512] * 4 + [(1 << 22) + 5 - 4 * 1048512]
    assert steps(1 << 24, 3) == [1397760] * 12 + [4096]  # 2^19 * 8 / 3, whole buckets


def _pieces_body(rank, world, piece):
    qcomm.pieces.PIECE = piece
    res = _compressed_body(rank, world, Q8, torch.float32, 3001)  # the flat bound holds
    pg = qcomm.wrap(dist.group.WORLD, CommConfig(all_gather=Q8, reduce_scatter=Q8))
    rec = PipelineRecorder(pg.inner)
    pg.inner = rec
    qcomm.all_gather_into_tensor(torch.empty(world * 3001), make(rank, 3001), pg)
    rec.events.clear()  # the group's first call also agrees on the config
    qcomm.stats(pg, reset=True)
    qcomm.all_gather_into_tensor(torch.empty(world * 3001), make(rank, 3001), pg)
    res["ag_events"], rec.events[:] = list(rec.events), []
    qcomm.reduce_scatter_tensor(torch.empty(3001), make(rank, world * 3001), group=pg)
    res["rs_events"] = list(rec.events)
    res["wire"] = qcomm.stats(pg)["all_gather"].wire_bytes
    return res


@pytest.mark.parametrize("world", [2, 3])
def test_flat_pieces_pipeline_within_bound(world):
    """3001 elements in pieces of 1024 (3 pieces, the last partial): every piece's
    exchange starts before the first is waited for (the codec of one piece runs while
    another is on the wire), results stay within the flat bound and identical across
    ranks, and each piece is one payload on the wire."""
    results = run_ranks(_pieces_body, world, 1024, backend="gloo")
    sizes = [1024, 1024, 953]
    pipelined = [("start", 0), ("start", 1), ("start", 2),
                 ("wait", 0), ("wait", 1), ("wait", 2)]
    for r in results:
        assert torch.equal(r["ag"], results[0]["ag"]) and torch.equal(r["ar"], results[0]["ar"])
        assert r["ag_events"] == pipelined, r["ag_events"]
        assert r["rs_events"] == pipelined, r["rs_events"]
        # the payloads and the call's bare descriptor (a pipeline of pieces never rides)
        assert r["wire"] == (world - 1) * (DESC_NBYTES + sum(packed_nbytes(m, Q8)
                                                             for m in sizes))


def _launch_counts(rank, world):
    """Codec calls and torch-path piece calls (the CPU's launches) of one compressed
    call of each collective on rank ``rank`` of ``world`` simulated ranks
    (:mod:`bench.simulated`: the whole call runs, the peers' payloads copies of this
    rank's), 3001 elements per rank in pieces of 1024 (3 pieces, the last with a
    partial bucket); eager path."""
    from bench.simulated import simulated_group
    from qcomm import codec, fsdp
    from qcomm.cpu import common

    pg = simulated_group(world, bits=8, rank=rank, compile=False)
    assert pg.config.all_gather == Q8  # 8 bits in buckets of 1024 for every collective
    n = 3001
    calls = {
        "all_gather": lambda: qcomm.all_gather_into_tensor(torch.empty(world * n),
                                                          make(rank, n), pg),
        "reduce_scatter": lambda: qcomm.reduce_scatter_tensor(
            torch.empty(n), make(rank, world * n), ReduceOp.AVG, pg),
        "all_reduce": lambda: qcomm.all_reduce(make(rank, world * n), group=pg),
        "delta_gather": lambda: delta_gather(out, out[rank * n:(rank + 1) * n].copy_(
            make(rank, n)), pg),
    }
    out, delta_gather = torch.empty(world * n), fsdp.DeltaAllGather()
    res = {}
    for name, fn in calls.items():
        fn()  # the first call of a group also agrees on its config
        before, graphs = collections.Counter(codec.calls), common.calls["eager"]
        fn()
        res[name] = (dict(codec.calls - before), common.calls["eager"] - graphs)
    return res


def test_codec_calls_do_not_grow_with_world_size(monkeypatch):
    """Each compressed collective makes the same codec calls at 2, 4 and 8 ranks
    (simulated: 8 cost no more than 2; the multi-process tests above run the same code
    over real peers): per piece, an all-gather one quantize and one decode of all
    received rows, a reduce-scatter one quantize of all peer rows and one fused
    decode-sum-op-cast, an all-reduce both, qcomm.fsdp's weight-difference gather one
    state update of all rows; and the torch path's piece calls inside them stop growing
    (4 and 8 ranks alike: the peer rows on either side of a rank's own are one block
    each)."""
    monkeypatch.setattr(qcomm.pieces, "PIECE", 1024)
    # the first, a middle and the last rank: the rows on either side of a rank's own
    got = {w: [_launch_counts(r, w) for r in sorted({0, w // 2, w - 1})] for w in (2, 4, 8)}
    pieces = 3
    want = {"all_gather": {"quantize": pieces, "dequantize_rows": pieces},
            "reduce_scatter": {"quantize_rows": pieces, "dequantize_sum": pieces}}
    # weight differences: the own row's state subtracted, the differences quantized,
    # then one fused state update of all rows (decode, add, store, requantize)
    want["delta_gather"] = {"dequantize_rows": pieces, "quantize": pieces,
                            "update_state_rows": pieces}
    want["all_reduce"] = {}
    for name in ("all_gather", "reduce_scatter"):
        for k, v in want[name].items():
            want["all_reduce"][k] = want["all_reduce"].get(k, 0) + v
    for w, results in got.items():
        for rank, res in enumerate(results):
            for name, (codec_calls, _) in res.items():
                assert codec_calls == want[name], (w, rank, name, codec_calls)
    for name in want:
        most = {w: max(res[name][1] for res in got[w]) for w in got}
        assert most[4] == most[8], (name, most)
        assert 0 < most[2] <= most[4], (name, most)
