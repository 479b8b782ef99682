"""The bytes qcomm hands its inner groups, pinned: a fixed sequence of calls on each path
hashes to the digests recorded here.

What is hashed is every tensor a call hands ``qcomm.inner``'s exchanges to send (an
all-gather's input; an all-to-all's rows for its peers, this rank's own row left out:
it never leaves the rank and holds whatever the buffer held) and every output the call
writes. A refactor that moves code between modules must leave both unchanged: the
digests were recorded at fac22cb, before the control plane was
redesigned (issue 45), and a change of payload bytes is a change of the wire format
that needs a new recording and a reason in the commit.

The digests do not depend on the machine: every codec path matches the oracle bit for
bit (tests/test_cpu.py, tests/test_kernels.py), whose arithmetic is fp32 with one
rounding per operation (and an l2 norm summed in fp64).

Paths: the flat algorithms in one process over simulated peers (world 3: direct calls,
the backend's methods, the FSDP2 hooks' weight differences and error feedback, the
envelope's riding payloads once its period is found, payloads cut in pieces, every
scheme, bf16), and the two-level algorithms over 4 spawned ranks on 2 nodes.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from conftest import make, run_ranks
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions

import qcomm
import qcomm.fsdp as qcomm_fsdp
import qcomm.inner as I
from qcomm import CommConfig, QuantConfig


class Recorder:
    """Hashes what every exchange of ``qcomm.inner`` is handed to send, while installed."""

    def __init__(self, monkeypatch=None) -> None:
        self.digest = hashlib.sha256()
        self.sends = 0
        real_gather, real_exchange = I.all_gather, I.all_to_all

        def all_gather(pg, out, inp):
            self.add(inp)
            return real_gather(pg, out, inp)

        def all_to_all(pg, out, inp):
            world, rank = pg.size(), pg.rank()
            rows = inp.reshape(world, -1)
            for j in range(world):
                if j != rank:
                    self.add(rows[j])
            return real_exchange(pg, out, inp)

        if monkeypatch is not None:
            monkeypatch.setattr(I, "all_gather", all_gather)
            monkeypatch.setattr(I, "all_to_all", all_to_all)
        else:  # a spawned rank: for the rest of its life
            I.all_gather, I.all_to_all = all_gather, all_to_all

    def add(self, t: torch.Tensor) -> None:
        self.sends += 1
        self.digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())

    def output(self, t: torch.Tensor) -> None:
        self.digest.update(b"out")
        self.digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def _wait(work) -> None:
    if work is not None:  # a synchronous call returns its work done, or none
        work.wait()


def _flat_sequence(rec: Recorder, group, world: int, dtype: torch.dtype) -> None:
    """Every flat path once a step, 12 steps: the envelope finds the step's period and
    the small calls ride from then on."""
    delta = qcomm_fsdp.DeltaAllGather(QuantConfig(bits=4, bucket_size=128))
    feedback = qcomm_fsdp.ErrorFeedbackReduceScatter(QuantConfig(bits=4, rounding="nearest"))
    for step in range(12):
        for n in (600, 5000):  # 600 rides; 5000 is 3 pieces of the lowered PIECE
            x = make(0, n, dtype, salt=step)
            out = torch.empty(world * n, dtype=dtype)
            qcomm.all_gather_into_tensor(out, x, group)
            rec.output(out)
            big = make(1, world * n, dtype, salt=step)
            got = torch.empty(n, dtype=dtype)
            qcomm.reduce_scatter_tensor(got, big, dist.ReduceOp.AVG, group)
            rec.output(got)
        t = make(2, 1001, dtype, salt=step)  # not a multiple of the world: padded
        qcomm.all_reduce(t, group=group)
        rec.output(t)
        # the backend's own methods (torch's entry points)
        opts = AllgatherOptions()
        opts.asyncOp = False
        out = torch.empty(world * 700, dtype=dtype)
        _wait(group.all_gather_single(out, make(3, 700, dtype, salt=step), opts))
        rec.output(out)
        rs = ReduceScatterOptions()
        rs.reduceOp = dist.ReduceOp.SUM
        got = torch.empty(700, dtype=dtype)
        _wait(group.reduce_scatter_tensor_coalesced(
            [got], [make(4, world * 700, dtype, salt=step)], rs))
        rec.output(got)
        # FSDP2's hooks: weight differences and error feedback, 2 pieces each
        out = torch.empty(world * 3000, dtype=dtype)
        delta(out, make(5, 3000, dtype, salt=step), group)
        rec.output(out)
        got = torch.empty(3000, dtype=dtype)
        feedback(got, make(6, world * 3000, dtype, salt=step), group)
        rec.output(got)


FLAT = {  # (scheme, bits, dtype) -> sha256 of the sequence, recorded at fac22cb
    ("minmax", 8, "torch.float32"):
        "6d101b89b4aef27476a00a44b2d3fb1fd880c469d2423353a18c3be674b5febb",
    ("maxnorm", 4, "torch.bfloat16"):
        "d7cf836a002c7740a955998dffff51e0a694d6c9644c13a6ec0b6516cca1a1a4",
    ("nuq", 3, "torch.float32"):
        "cd6e46cefb571df85313498ff2cde5ef778eb36ff3cdfcca6f390ed3ab354911",
    ("maxnorm-l2", 2, "torch.float16"):
        "f15c6efc57ec3362f148c64ea2fc11fd76cf33e0cb1b33e344a850cdbd6dfcff",
}


@pytest.mark.parametrize("scheme, bits, dtype", [
    ("minmax", 8, torch.float32), ("maxnorm", 4, torch.bfloat16), ("nuq", 3, torch.float32),
    ("maxnorm-l2", 2, torch.float16)])
def test_flat_payloads_are_the_recorded_bytes(monkeypatch, scheme, bits, dtype):
    from bench.simulated import SimulatedPeers

    monkeypatch.setattr(qcomm.pieces, "PIECE", 1024)
    norm = "l2" if scheme.endswith("-l2") else "max"
    q = QuantConfig(bits=bits, scheme=scheme.removesuffix("-l2"), norm=norm, bucket_size=256)
    config = CommConfig(all_gather=q, reduce_scatter=q, all_reduce=q, topology="flat",
                        compile=False, min_numel=64)
    world = 3
    group = qcomm.QcommProcessGroup(SimulatedPeers(world, rank=1), config, owns_inner=False)
    rec = Recorder(monkeypatch)
    _flat_sequence(rec, group, world, dtype)
    s = qcomm.stats(group)
    assert s["all_gather"].calls_compressed > 0 and s["reduce_scatter"].calls_compressed > 0
    assert rec.sends > 100
    assert group._qcomm_state.agreement.history.period > 0  # the step's small calls rode
    got = rec.digest.hexdigest()
    assert FLAT.get((scheme, bits, str(dtype))) == got, (
        f"{scheme} {bits} bits {dtype}: the payloads or outputs changed: {got}")


def _two_level_body(rank, world):
    qcomm.pieces.PIECE = 1024
    rec = Recorder()
    group = dist.group.WORLD
    assert qcomm.driver.group_state(group).plan == "two_level"
    gather = qcomm_fsdp.DeltaAllGather(QuantConfig(bits=4, bucket_size=128))
    for step in range(3):
        for n in (600, 3001):
            x = make(rank, n, salt=step)
            out = torch.empty(world * n)
            qcomm.all_gather_into_tensor(out, x)
            rec.output(out)
            got = torch.empty(n)
            qcomm.reduce_scatter_tensor(got, make(rank, world * n, salt=step),
                                        dist.ReduceOp.AVG)
            rec.output(got)
        t = make(rank, 1001, salt=step)
        qcomm.all_reduce(t)
        rec.output(t)
        out = torch.empty(world * 2000)
        gather(out, make(rank, 2000, salt=step + 9), group)
        rec.output(out)
    return rec.digest.hexdigest()


TWO_LEVEL = [  # per rank, recorded at fac22cb
    "0150b3967a6748b1e62311349e02e8bb98d8fca1433a2731a4df2ceee77c79b0",
    "a804064b472ee659398e3f3e97e6b360549bf6920a3551e62b99bf1c835ac91b",
    "508c6c966968110acc6e025e3169a8a7260121321e5c319995d166d47f0611b3",
    "f729c629cc8b714a93505f2a5fa0173b445aadb0efe0b1cafd3cacbaf8e2c70d",
]


@pytest.mark.slow
def test_two_level_payloads_are_the_recorded_bytes():
    env = [{"QCOMM_NODE": node, "QCOMM_BITS": "8", "QCOMM_MIN_NUMEL": "64"} for node in "aabb"]
    got = run_ranks(_two_level_body, 4, env=env)
    assert got == TWO_LEVEL, f"the two-level payloads or outputs changed: {got}"
