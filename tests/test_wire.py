"""Every byte qcomm hands to its inner groups is counted: FSDP2 training of a model of
mixed module sizes (exact, riding, pieced calls), flat and two-level, with every inner
group qcomm makes wrapped by a recorder that counts what it is handed for peers; the
stats must equal it byte for byte."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import run_ranks

import qcomm

pytestmark = pytest.mark.slow


def _gathered(pg, out, inp, opts):
    return (pg.size() - 1) * inp.numel() * inp.element_size()


def _gathered_list(pg, outs, inps, opts):
    return sum((pg.size() - 1) * t.numel() * t.element_size() for t in inps)


def _exchanged(pg, out, inp, out_splits, in_splits, opts):
    assert not in_splits, "qcomm sends even all-to-alls"
    nbytes = inp.numel() * inp.element_size()
    return nbytes - nbytes // pg.size()


def _scattered(pg, out, inp, opts):
    return (pg.size() - 1) * out.numel() * out.element_size()


def _reduced(pg, tensors, opts):
    world = pg.size()
    return sum(2 * (world - 1) * -(-t.numel() // world) * t.element_size() for t in tensors)


# The inner group's methods that move data for qcomm, both name generations (torch 2.13
# renamed the flat forms; qcomm.inner calls whichever the group has), and the bytes each
# call hands over for peers under a direct exchange.
COUNTED = {"all_gather_single": _gathered, "_allgather_base": _gathered,
           "allgather": _gathered_list, "all_to_all_single": _exchanged,
           "alltoall_base": _exchanged, "reduce_scatter_single": _scattered,
           "_reduce_scatter_base": _scattered, "allreduce": _reduced}


class ByteCounter:
    """Forwards everything to a real inner group and counts, per call, the bytes it is
    handed for peers under a direct exchange (:data:`COUNTED`): an all-gather's input to
    each of ``world - 1`` peers, an all-to-all's rows but its own, a reduce-scatter's
    output size to each peer, an all-reduce's ``2 (world - 1)`` chunks. Anything else
    that moves data is counted apart, in ``other``. A method is here only where the real
    group has it: on torch < 2.13 (the GPU image's 2.11) there are no ``*_single``
    methods, and qcomm.inner must find the older names instead."""

    def __init__(self, real):
        self._real = real
        self.to_peers = 0
        self.calls = 0
        self.other: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._real, name)  # AttributeError where the real group lacks it
        if name in COUNTED:
            return functools.partial(self._counted, COUNTED[name], attr)
        if callable(attr) and name in ("broadcast", "send", "recv", "gather", "scatter",
                                       "reduce", "alltoall", "allreduce_coalesced"):
            self.other.append(name)
        return attr

    def _counted(self, count, method, *args):
        self.to_peers += count(self, *args)
        self.calls += 1
        return method(*args)


def test_byte_counter_has_only_the_real_groups_methods():
    """Over a group of torch < 2.13 (only the underscore names) the counter offers no
    ``*_single`` method, and qcomm.inner's calls reach the old names, counted."""
    import qcomm.inner as I

    class OldGroup:  # the methods torch 2.11's ProcessGroup has for these calls
        def size(self):
            return 4

        def _allgather_base(self, out, inp, opts):
            return "gathered"

        def _reduce_scatter_base(self, out, inp, opts):
            return "scattered"

        def alltoall_base(self, out, inp, out_splits, in_splits, opts):
            return "exchanged"

    counter = ByteCounter(OldGroup())
    for name in ("all_gather_single", "reduce_scatter_single", "all_to_all_single"):
        assert not hasattr(counter, name), name
    x = torch.zeros(8)
    assert I.all_gather(counter, torch.zeros(32), x) == "gathered"
    assert I.reduce_scatter(counter, x, torch.zeros(32), dist.ReduceOp.SUM) == "scattered"
    assert I.all_to_all(counter, x, x) == "exchanged"
    assert counter.calls == 3
    assert counter.to_peers == 3 * 32 + 3 * 32 + (32 - 8)


class Mixed(nn.Module):
    """Modules of every kind of call: a LayerNorm (its shard under min_numel: exact),
    small and medium Linears (one piece: their payloads ride in the envelope) and a
    wide one (several pieces once PIECE is lowered: never rides)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 48)
        self.norm = nn.LayerNorm(48)
        self.small = nn.Linear(48, 96)
        self.medium = nn.Linear(96, 256)
        self.wide = nn.Linear(256, 384)
        self.head = nn.Linear(384, 64)

    def forward(self, x):
        h = self.norm(self.embed(x))
        h = torch.relu(self.small(h))
        h = torch.relu(self.medium(h))
        return self.head(torch.relu(self.wide(h)))


def _steps_body(rank, world, steps):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import qcomm.inner as I
    import qcomm.pieces as P

    counters = []
    real_make = I.make_inner

    def counted(*args, **kwargs):
        counters.append(ByteCounter(real_make(*args, **kwargs)))
        return counters[-1]

    I.make_inner = counted  # every inner group qcomm makes: its own, two-level's
    P.PIECE = 8192  # the wide module's shard goes in pieces
    group = qcomm.wrap(dist.group.WORLD)
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = Mixed()
    for m in (model.norm, model.small, model.medium, model.wide, model.head):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randint(0, 64, (4, 16), generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    s = qcomm.stats(group)
    return {"counted": sum(c.to_peers for c in counters),
            "calls": sum(c.calls for c in counters),
            "other": sum((c.other for c in counters), []),
            "wire": sum(v.wire_bytes for v in s.values()),
            "control": sum(v.control_bytes for v in s.values()),
            "logical": sum(v.logical_bytes for v in s.values()),
            "compressed": sum(v.calls_compressed for v in s.values()),
            "exact": sum(v.calls_exact for v in s.values()),
            "groups": len(counters), "plan": group._qcomm_state.plan}


@pytest.mark.parametrize("layout", ["flat", "two_level"])
def test_fsdp2_bytes_handed_to_the_inner_groups_are_the_stats(layout):
    if layout == "flat":  # two ranks, each its own node
        world, env = 2, None
    else:  # two nodes of two
        world, env = 4, [{"QCOMM_NODE": f"n{r // 2}"} for r in range(4)]
    for r in run_ranks(_steps_body, world, 4, backend="gloo", env=env, timeout=240):
        assert r["plan"] == layout, r
        assert r["groups"] == (1 if layout == "flat" else 3), r  # own (+ intra, inter)
        assert r["compressed"] > 0 and r["exact"] > 0, r
        assert not r["other"], r
        assert r["counted"] == r["wire"], r
        assert r["control"] < 0.1 * r["wire"], r
        if layout == "flat":  # under the codec's 3.97x at 8 bits: control, an exact module
            assert 3.0 < r["logical"] / r["wire"] < 3.97, r


def _rooms(calls, envelope=None):
    """The room the envelope gives each of ``calls`` ((key, body) pairs), in order."""
    from qcomm.envelope import Envelope

    envelope = envelope or Envelope()
    rooms = []
    for key, body in calls:
        rooms.append(envelope.room())
        envelope.agreed(key.encode(), body)
    return rooms


def test_envelope_room_follows_the_confirmed_period():
    """Nothing rides until the history ends with a repetition of a period (a full one,
    and at least 8 calls); then each call gets exactly the body of the call one period
    back: a repeated step of calls rides with no padding."""
    same = [("a", 100)] * 10
    assert _rooms(same) == [0] * 9 + [100]
    step = [("ag", 10), ("ag", 10), ("rs", 30), ("big", 0)]
    rooms = _rooms(step * 4)
    assert rooms[:12] == [0] * 12, rooms  # 4 + the 8 that confirm it
    assert rooms[12:] == [10, 10, 30, 0], rooms


def test_envelope_room_after_a_break_and_with_repeated_blocks():
    """An FSDP2-like step (root gather, four blocks' gathers alike, then backward's
    gathers and reduce-scatters) rides from its third repetition, every call on its own
    body; an eval step in between (forward gathers only) costs a call or two's room,
    and the period is found again within the step after it."""
    train = [("R", 5)] + [("L", 7)] * 4 + [("L", 7), ("RS", 9)] * 4 + [("RSR", 3)]
    evaluation = [("R", 5)] + [("L", 7)] * 4
    calls = train * 3 + evaluation + train * 3
    rooms = _rooms(calls)
    bodies = [b for _, b in calls]
    n = len(train)
    assert rooms[2 * n + 1:3 * n] == bodies[2 * n + 1:3 * n], rooms[2 * n:3 * n]
    misses = [i for i, (r, b) in enumerate(zip(rooms, bodies, strict=True)) if r and r != b]
    # the eval step's first call, and one in the second step after it (the period that
    # spans the eval step holds for one step)
    assert len(misses) <= 3 and all(3 * n <= i < len(calls) - n for i in misses), misses
    assert rooms[-n:] == bodies[-n:], rooms[-n:]  # then rides in full


def test_envelope_history_stays_bounded():
    from qcomm.envelope import MAX_PERIOD, Envelope

    envelope = Envelope()
    for i in range(10 * MAX_PERIOD):
        envelope.agreed(str(i % 7).encode(), 16)
    assert envelope.period == 7 and envelope.room() == 16
    assert len(envelope.keys) <= 4 * MAX_PERIOD
    assert sum(len(v) for v in envelope.seen.values()) <= 4 * MAX_PERIOD


def test_envelope_period_search_is_bounded(monkeypatch):
    """Calls with no period (drawn at random from 2 to 16 keys) cost a bounded number of
    window compares a call (SEARCH_CREDIT, amortized), not one per earlier call of the
    same key (hundreds a call, 80-490 us, before); a step that repeats after them is
    still found within its second repetition."""
    import random

    import qcomm.envelope as E

    examined = []
    real = E.window
    monkeypatch.setattr(E, "window", lambda p: examined.append(p) or real(p))
    rng = random.Random(0)
    calls = 4000
    for keys in (2, 4, 16):
        examined.clear()
        envelope = E.Envelope()
        history = [(str(rng.randrange(keys)), 16) for _ in range(calls)]
        _rooms(history, envelope)
        # one candidate a search past the budget (the one that stops it)
        assert len(examined) <= E.SEARCH_CREDIT_MAX + (E.SEARCH_CREDIT + 1) * calls, keys
        step = [("R", 5)] + [("L", 7)] * 4 + [("L", 7), ("RS", 9)] * 4 + [("RSR", 3)]
        rooms = _rooms(step * 3, envelope)
        assert rooms[-len(step):] == [b for _, b in step], (keys, rooms)
