"""bits=auto (qcomm.auto): a model measured on the group decides each call exact or
compressed; every rank holds the same model and decides alike; a compressed call is
the fixed setting's, byte for byte; every probe byte is counted."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import make, run_ranks

import qcomm
from qcomm.auto import Line, Model

Q8 = qcomm.QuantConfig(bits=8)
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _model(bandwidth: float, latency: float = 1e-4, codec: float = 2e-9,
           world: int = 2) -> Model:
    """A flat model: every inner call ``latency + bytes / bandwidth``; quantize, decode and
    decode-sum alike, 50 us a call and ``codec`` seconds an element."""
    line = Line(latency, 1 / bandwidth)
    op = Line(50e-6, codec)
    return Model(world=world, exact=dict.fromkeys(KINDS, line), gather=line, exchange=line,
                 intra_gather=None, intra_exchange=None, nodes=world, codec={Q8: (op, op, op)})


@pytest.mark.parametrize("kind", KINDS)
def test_a_slow_link_compresses_large_calls_and_a_fast_one_none(kind):
    """At 100 Mbit/s (12.5 MB/s) the bytes dominate: large calls compress, a tiny one
    (latency only, two exchanges where exact has one) stays exact; at 10 GB/s the codec
    costs more than the bytes save at every size."""
    slow, fast = _model(12.5e6), _model(10e9)
    for numel in (1 << 16, 1 << 20, 1 << 24):
        compress, exact_s, compressed_s = slow.decide(kind, numel, torch.float32, Q8)
        assert compress and compressed_s < exact_s / 2, (kind, numel, exact_s, compressed_s)
        assert not fast.decide(kind, numel, torch.float32, Q8)[0], (kind, numel)
    assert not slow.decide(kind, 64, torch.float32, Q8)[0]
    # bf16 halves the bytes exact sends, not the payload's: the crossover moves up
    medium = _model(400e6)
    assert medium.decide("all_gather", 1 << 22, torch.float32, Q8)[0]
    assert not medium.decide("all_gather", 1 << 22, torch.bfloat16, Q8)[0]


def test_a_refresh_scales_a_path_by_what_was_observed():
    from qcomm.auto import size_class

    model = _model(12.5e6)
    numel = 1 << 20
    assert model.decide("all_gather", numel, torch.float32, Q8)[0]
    # compressed calls observed 8x slower than predicted: a refresh moves the prediction
    # 4x (MAX_CORRECTION) at most; two refreshes flip the decision
    model.correction[("all_gather", True, size_class(numel * 4))] = 16.0
    model.decisions.clear()
    assert not model.decide("all_gather", numel, torch.float32, Q8)[0]
    # per size class: a call 4x larger (the next class) keeps the raw model's choice
    assert model.decide("all_gather", numel * 4, torch.float32, Q8)[0]


def _refresh_alone(model: Model, monkeypatch) -> None:
    """:func:`qcomm.auto.refresh` of all_gather on one rank: the agreement returns this
    rank's sums (a world of one), nothing is sent."""
    from types import SimpleNamespace

    import qcomm.auto as A

    monkeypatch.setattr(A._Probes, "agree", lambda self, group, times: list(times))
    state = SimpleNamespace(inner=None, record_control=lambda kind, nbytes: None)
    A.refresh(state, model, "all_gather", torch.device("cpu"))


def _calls(model: Model, numel: int, calls: int, seconds) -> list[bool]:
    """``calls`` decided all-gathers of ``numel`` fp32 elements a rank, each observed
    taking ``seconds(compressed?)``; the ways they went."""
    ways = []
    for _ in range(calls):
        compress, exact_s, compressed_s = model.decide("all_gather", numel, torch.float32, Q8)
        model.observe("all_gather", compress, numel, torch.float32, seconds(compress),
                      compressed_s if compress else exact_s)
        ways.append(compress)
    return ways


def test_a_path_never_taken_is_tried_until_it_can_be_corrected(monkeypatch):
    """A class observed on one path only sends its next MIN_OBSERVED calls the other way
    (predictions within 2x), enough for the next refresh to correct that path: here
    exact, predicted 1.5x slower than compressed, runs 4x faster than predicted (a
    shaper's burst; its first call, set-up, and one of the next four, a scheduler tick,
    10x slower: not observed, and the median's) and the class goes exact; a class
    never observed keeps the raw model (no correction carried from one size to another)."""
    from qcomm.auto import MIN_OBSERVED, size_class

    numel = 1 << 14  # 64 KiB
    model = _model(100e6)
    compress, exact_s, compressed_s = model.decide("all_gather", numel, torch.float32, Q8)
    assert compress and 1.1 * compressed_s < exact_s < 2 * compressed_s, (exact_s, compressed_s)

    exact_calls = []

    def real(compress):  # compressed as predicted; exact 4x faster, but the first (its
        if compress:      # set-up) and one of the next four take 10x longer
            return compressed_s
        exact_calls.append(1)
        return exact_s * (10 if len(exact_calls) in (1, 3) else 0.25)

    assert _calls(model, numel, 5, real) == [True] * 5  # the first one is not observed
    _refresh_alone(model, monkeypatch)
    cls = size_class(numel * 4)
    assert model.correction == {("all_gather", True, cls): pytest.approx(1.0)}
    tried = MIN_OBSERVED + 1  # exact's first call, not observed, and the 4 observed
    assert _calls(model, numel, tried + 2, real) == [False] * tried + [True] * 2
    _refresh_alone(model, monkeypatch)
    assert model.correction[("all_gather", False, cls)] == pytest.approx(0.25)
    assert _calls(model, numel, 4, real) == [False] * 4
    assert not model.explore  # both paths known: nothing more to try
    raw = _model(100e6).decide("all_gather", numel * 16, torch.float32, Q8)
    assert model.decide("all_gather", numel * 16, torch.float32, Q8) == raw


def test_a_trial_is_skipped_where_the_predictions_are_far_apart(monkeypatch):
    """Compressed predicted far faster than exact (more than 2x): no exact call is tried,
    however long the class has gone compressed."""
    model = _model(12.5e6)
    numel = 1 << 18
    for _ in range(3):
        assert _calls(model, numel, 8, lambda compress: 1e-3) == [True] * 8
        _refresh_alone(model, monkeypatch)


def _auto_body(rank, world):
    """Two ranks, each its own node. A group measured for real, with a slow link
    simulated in the probes (every probe call takes its bytes at 100 Mbit/s on top of
    its real time; rank 1's probes run 3x slower besides): every rank holds the same
    model and commits the same decisions, whatever they are (the real times decide
    them); every byte the probes handed over is counted. A group on a fixed model
    (tests/test_adversarial.py's: decisions that follow from the calls alone, never
    from this machine's load): the calls it decides, and a call it compresses is the
    fixed 8-bit group's, byte for byte."""
    from test_adversarial import fake_clock, fixed_model
    from test_wire import ByteCounter

    import qcomm.auto as A
    import qcomm.inner as I

    real_time, real_calibrate = A._Probes._time, A.calibrate

    def slow(self, fn, group, *args, to_peers):
        got = real_time(self, fn, group, *args, to_peers=to_peers)
        return got * (3 if rank else 1) + to_peers / 12.5e6

    A._Probes._time = slow
    A.FIRST_REFRESH = 4
    A.MIN_OBSERVED = 1
    decided, real_commit = [], A.Model.commit

    def logged(self, kind, numel, dtype, q, compress):
        decided.append((numel, compress))
        return real_commit(self, kind, numel, dtype, q, compress)

    A.Model.commit = logged
    counters, real_make = [], I.make_inner

    def counted(*args, **kwargs):
        counters.append(ByteCounter(real_make(*args, **kwargs)))
        return counters[-1]

    I.make_inner = counted
    sizes = (64 * 1024, 1 << 18, 64, 1 << 18, 1 << 18, 1 << 18, 1 << 18)

    def gathers(group) -> list[torch.Tensor]:
        outs = []
        for numel in sizes:
            out = torch.empty(world * numel)
            qcomm.all_gather_into_tensor(out, make(rank, numel, salt=numel), group)
            outs.append(out)
        return outs

    res = {}
    measured = qcomm.wrap(dist.group.WORLD, qcomm.CommConfig(auto=True, min_numel=0))
    res["outs"] = gathers(measured)
    res["measured_decisions"] = list(decided)
    res["model"] = qcomm.auto_model(measured)
    res["calibration_s"] = res["model"].pop("calibration_s")  # this rank's own times
    res["link_s"] = res["model"].pop("link_calibration_s")
    # a call's own CommConfig makes it auto on a group whose config is not (DDP's hook)
    plain = dist.new_group(backend="gloo")
    t = make(rank, 1 << 16)
    qcomm.all_reduce(t, group=plain, config=qcomm.CommConfig(auto=True))
    got = qcomm.stats(plain)["all_reduce"]
    res["per_call"] = got.auto_exact + got.auto_compressed

    A.calibrate, A.clock = fixed_model, fake_clock()
    decided.clear()
    auto = qcomm.wrap(dist.group.WORLD, qcomm.CommConfig(auto=True, min_numel=0))
    fixed = qcomm.wrap(dist.group.WORLD, qcomm.CommConfig())
    res["fixed_outs"] = gathers(auto)
    res["decisions"] = list(decided)
    big = make(rank, 1 << 18, salt=1)
    a, f = torch.empty(world << 18), torch.empty(world << 18)
    s = auto._qcomm_state
    s.calls = fixed._qcomm_state.calls = 0  # the same call index on both: the same seeds
    qcomm.all_gather_into_tensor(a, big, auto)
    qcomm.all_gather_into_tensor(f, big, fixed)
    res["same_bytes"] = torch.equal(a, f)
    stats = qcomm.stats(auto)["all_gather"]
    res["stats"] = (stats.auto_exact, stats.auto_compressed, stats.calls_exact,
                    stats.calls_compressed, stats.predicted_exact_s > 0,
                    stats.predicted_compressed_s > 0)
    res["fixed_model"] = qcomm.auto_model(auto)
    A.calibrate = real_calibrate
    res["counted"] = sum(c.to_peers for c in counters)
    res["wire"] = sum(v.wire_bytes for g in (measured, auto, fixed, plain)
                      for v in qcomm.stats(g).values())
    return res


def test_every_rank_decides_alike_and_compresses_as_the_fixed_setting():
    r0, r1 = run_ranks(_auto_body, 2, backend="gloo", timeout=180)
    # measured: one model and the same committed decisions, whatever this machine's load
    assert r0["model"] == r1["model"], (r0["model"], r1["model"])
    assert r0["measured_decisions"] == r1["measured_decisions"], (r0, r1)
    assert [n for n, _ in r0["measured_decisions"]] == [64 * 1024, 1 << 18, 64] + [1 << 18] * 4
    assert r0["model"]["correction"], r0["model"]  # refreshed (FIRST_REFRESH = 4)
    for out0, out1 in zip(r0["outs"], r1["outs"], strict=True):
        assert torch.equal(out0, out1)  # every rank decoded the same bytes
    # fixed model: 64 elements exact, the rest compressed (no trial of exact: its
    # prediction is over 2x compressed's)
    decided = r0["decisions"]
    assert decided == [(64 * 1024, True), (1 << 18, True), (64, False)] + [(1 << 18, True)] * 4, \
        decided
    ways = [sum(1 for _, c in decided + [(1 << 18, True)] if c is way) for way in (False, True)]
    for r in (r0, r1):
        assert r["decisions"] == decided and r["fixed_model"] == r0["fixed_model"]
        auto_exact, auto_compressed, exact, compressed, pe, pc = r["stats"]
        assert [auto_exact, auto_compressed] == ways and pe and pc, (r["stats"], decided)
        assert (auto_exact, auto_compressed) == (exact, compressed), r["stats"]
        assert r["same_bytes"], "auto's compressed call differs from the fixed setting's"
        assert r["counted"] == r["wire"], (r["counted"], r["wire"])
        assert r["per_call"] == 1, r
        assert r["calibration_s"] > r["link_s"] > 0, r
    for out0, out1 in zip(r0["fixed_outs"], r1["fixed_outs"], strict=True):
        assert torch.equal(out0, out1)


def test_a_cuda_call_is_observed_once_its_events_complete():
    """A CUDA call is timed by two events on its stream and observed once the end event
    has completed (``query()``, never a wait); one still running stays pending; the
    first call of a class on a path is not timed at all (set-up)."""

    class Event:
        def __init__(self, t: float) -> None:
            self.t, self.done = t, False

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end) -> float:  # milliseconds, as torch.cuda.Event's
            return end.t - self.t

    model = _model(12.5e6)
    numel, q = 1 << 16, Q8
    for _ in range(3):
        model.commit("all_gather", numel, torch.float32, q, True)
    first = _model(12.5e6)
    first.commit("all_gather", numel, torch.float32, q, True)
    first.time_later(Event(0.0), Event(5.0), "all_gather", True, numel, torch.float32, 1e-3)
    assert first.pending == []
    ends = [Event(4.0), Event(8.0)]
    model.time_later(Event(0.0), ends[0], "all_gather", True, numel, torch.float32, 1e-3)
    model.time_later(Event(0.0), ends[1], "all_gather", True, numel, torch.float32, 1e-3)
    model.collect()
    assert model.observed == {} and len(model.pending) == 2
    ends[0].done = True
    model.collect()
    from qcomm.auto import size_class

    key = ("all_gather", True, size_class(numel * 4))
    assert model.observed == {key: [pytest.approx(4.0)]} and len(model.pending) == 1
