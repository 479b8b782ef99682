"""qcomm.fsdp.DeltaAllGather: FSDP2 all-gathers of quantized weight differences.

The weights each rank computes with must track the true (sharded fp32) weights far more
closely than a plain 4-bit gather does, stay identical across ranks, and cost the same
bytes on the wire; with quantization off the gather is exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import run_ranks

import qcomm
import qcomm.fsdp
from qcomm.demo import VOCAB, TinyLM, batch

pytestmark = pytest.mark.slow

# 4-bit weights, round to nearest, 128-element buckets: the README's W4 setting.
W4 = {"QCOMM_AG_BITS": "4", "QCOMM_AG_ROUNDING": "nearest", "QCOMM_AG_BUCKET": "128"}
STEPS = 6


def _sharded(mp_policy=None):
    """TinyLM, ``fully_shard`` per layer and at the root, and its Adam."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)


def _step(model, opt, rank: int, step: int) -> float:
    x, y = batch(rank, step)
    loss = nn.functional.cross_entropy(model(x).float().view(-1, VOCAB), y.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _gathered(model) -> torch.Tensor:
    """What the ranks compute with (flat fp32), through the all-gather forward uses."""
    mods = qcomm.fsdp.fsdp_modules(model)
    for m in mods:
        m.unshard()
    seen = torch.cat([p.detach().float().reshape(-1).clone() for p in model.parameters()])
    for m in mods:
        m.reshard()
    return seen


def _gathered_and_true(model):
    """(what the ranks compute with, the exact full weights) as flat fp32 vectors."""
    seen = _gathered(model)
    # full_tensor() all-gathers through gloo's functional collectives: exact
    true = torch.cat([p.detach().full_tensor().float().reshape(-1) for p in model.parameters()])
    return seen, true


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


class _PlainGather(qcomm.fsdp.DeltaAllGather):
    """The baseline: qcomm's plain quantized all-gather of the weights themselves."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return qcomm.all_gather_into_tensor(output_tensor, input_tensor, group,
                                            async_op=async_op)


def _track(rank, world, deltas: bool):
    """On plain gloo (exact full_tensor() for the truth; qcomm configured from W4)."""
    model, opt = _sharded()
    if deltas:
        comms = qcomm.fsdp.quantize_weight_deltas(model)
    else:
        comms = [_PlainGather() for _ in qcomm.fsdp.fsdp_modules(model)]
        for m, comm in zip(qcomm.fsdp.fsdp_modules(model), comms, strict=True):
            m.set_custom_all_gather(comm)
    errors = []
    seen, true = _gathered_and_true(model)
    errors.append(_rel(seen, true))
    seen, true = _gathered_and_true(model)  # unchanged weights: the residual is sent
    errors.append(_rel(seen, true))
    for step in range(STEPS):
        _step(model, opt, rank, step)
        seen, true = _gathered_and_true(model)
        errors.append(_rel(seen, true))
    group = dist.group.WORLD
    stats = qcomm.stats(group)["all_gather"]
    return {"errors": errors, "seen": seen, "calls": stats.calls_compressed,
            "wire": stats.wire_bytes, "state_nbytes": sum(c.state_nbytes() for c in comms),
            "params": sum(p.numel() for p in model.parameters())}


def test_deltas_track_weights_far_closer_than_plain_4bit():
    plain = run_ranks(_track, 2, False, backend="gloo", env=W4, timeout=240)
    delta = run_ranks(_track, 2, True, backend="gloo", env=W4, timeout=240)
    e_plain, e_delta = plain[0]["errors"], delta[0]["errors"]
    print("plain 4-bit relative error per gather:", [f"{e:.4f}" for e in e_plain])
    print("delta 4-bit relative error per gather:", [f"{e:.4f}" for e in e_delta])
    # the first gather is a plain one (the reconstruction starts at zero)
    assert abs(e_delta[0] - e_plain[0]) < 1e-6, (e_delta[0], e_plain[0])
    assert 0.03 < e_plain[0] < 0.2, e_plain  # 4-bit: a few percent, every gather
    # the second sends the first's residual: 4 more bits of it
    assert e_delta[1] < e_delta[0] / 8, e_delta
    # after every optimizer step the error stays a fraction of plain 4-bit's
    for step, (ed, ep) in enumerate(zip(e_delta[2:], e_plain[2:], strict=True)):
        assert ed < ep / 8, (step, ed, ep)
    # every rank computes with the same weights
    assert torch.equal(delta[0]["seen"], delta[1]["seen"])
    # same payloads on the wire; the price is one fp32 copy of the unsharded weights
    assert delta[0]["calls"] == plain[0]["calls"] > 0
    assert delta[0]["wire"] == plain[0]["wire"]
    assert delta[0]["state_nbytes"] >= 4 * delta[0]["params"]


def test_deltas_exact_when_all_gather_is_off():
    out = run_ranks(_track, 2, True, backend="gloo", env={"QCOMM_AG_BITS": "off"})
    assert all(e == 0.0 for e in out[0]["errors"]), out[0]["errors"]
    assert out[0]["calls"] == 0 and out[0]["state_nbytes"] == 0


def _train_on_qcomm(rank, world):
    """Through the "qcomm" backend (its config, seeds and stats), bf16 parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model, opt = _sharded(MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32))
    qcomm.fsdp.quantize_weight_deltas(model)
    losses = [_step(model, opt, rank, step) for step in range(STEPS)]
    mods = qcomm.fsdp.fsdp_modules(model)
    for m in mods:
        m.unshard()
    dtypes = {p.dtype for p in model.parameters()}  # unsharded: the compute dtype
    for m in mods:
        m.reshard()
    return {"losses": losses, "seen": _gathered(model), "dtypes": dtypes,
            "calls": qcomm.stats(dist.group.WORLD)["all_gather"].calls_compressed}


def test_deltas_on_the_qcomm_backend_with_bf16_params():
    out = run_ranks(_train_on_qcomm, 2, env=W4, timeout=240)
    assert out[0]["dtypes"] == {torch.bfloat16}
    assert torch.equal(out[0]["seen"], out[1]["seen"])
    assert out[0]["calls"] > 0
    assert out[0]["losses"][-1] < out[0]["losses"][0], out[0]["losses"]


def test_quantize_weight_deltas_needs_fsdp_modules():
    with pytest.raises(ValueError, match="no FSDP2 module"):
        qcomm.fsdp.quantize_weight_deltas(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="QuantConfig"):
        qcomm.fsdp.DeltaAllGather(config=4)


# ------------------------------------------------------------------ error feedback

EF_CALLS = 16


def _repeat_reduce_scatter(rank, world, feedback: bool, rounding: str):
    """The same gradient reduce-scattered EF_CALLS times: the mean of the outputs."""
    from qcomm.collectives import reduce_scatter_tensor

    g = torch.Generator().manual_seed(rank)
    inp = torch.randn(world * 4096, generator=g) * torch.linspace(0.01, 1, world * 4096)
    out = torch.empty(4096)
    comm = qcomm.fsdp.ErrorFeedbackReduceScatter()
    total = torch.zeros(4096)
    for _ in range(EF_CALLS):
        if feedback:
            comm(out, inp, dist.group.WORLD, op=dist.ReduceOp.AVG)
        else:
            reduce_scatter_tensor(out, inp, dist.ReduceOp.AVG)
        total += out
    exact = torch.empty(4096)
    dist.reduce_scatter_tensor(exact, inp.clone(), dist.ReduceOp.SUM)  # gloo: exact
    return {"mean": total / EF_CALLS, "exact": exact / world,
            "state": comm.state_nbytes(), "inp": inp}


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_error_feedback_cancels_gradient_quantization_error(rounding):
    env = {"QCOMM_RS_BITS": "2", "QCOMM_RS_ROUNDING": rounding}
    plain = run_ranks(_repeat_reduce_scatter, 2, False, rounding, backend="gloo", env=env)
    fed = run_ranks(_repeat_reduce_scatter, 2, True, rounding, backend="gloo", env=env)
    for rank in range(2):
        assert torch.equal(fed[rank]["exact"], plain[rank]["exact"])
        e_plain = _rel(plain[rank]["mean"], plain[rank]["exact"])
        e_fed = _rel(fed[rank]["mean"], fed[rank]["exact"])
        print(f"{rounding} rank {rank}: mean of {EF_CALLS} 2-bit reduce-scatters, relative "
              f"error {e_plain:.4f} plain, {e_fed:.4f} with error feedback")
        # nearest: the plain error repeats every call; stochastic: it averages down as
        # 1/sqrt(K). With feedback, the sum of K outputs is off by one residual: 1/K.
        assert e_fed < e_plain / (8 if rounding == "nearest" else 2.5), (e_plain, e_fed)
        assert fed[rank]["state"] == 4 * 2 * 4096  # the unsharded size, fp32
        assert torch.equal(fed[rank]["inp"], plain[rank]["inp"])  # inputs never written


def _train_stateful(rank, world):
    model, opt = _sharded()
    qcomm.fsdp.quantize_weight_deltas(model)
    comms = qcomm.fsdp.feed_back_gradient_errors(model)
    losses = [_step(model, opt, rank, step) for step in range(STEPS)]
    return {"losses": losses, "seen": _gathered(model),
            "state": sum(c.state_nbytes() for c in comms),
            "rs": qcomm.stats(dist.group.WORLD)["reduce_scatter"].calls_compressed}


def test_fsdp2_trains_with_deltas_and_error_feedback():
    env = {**W4, "QCOMM_RS_BITS": "4"}
    out = run_ranks(_train_stateful, 2, backend="gloo", env=env, timeout=240)
    assert torch.equal(out[0]["seen"], out[1]["seen"])
    assert out[0]["rs"] >= STEPS and out[0]["state"] > 0
    assert out[0]["losses"][-1] < out[0]["losses"][0], out[0]["losses"]


# ------------------------------------------------------------------ non-finite values


def _poison_once(rank, world, what: str):
    """One call with an inf in rank 0's input, then clean calls: what comes out."""
    g = torch.Generator().manual_seed(rank)
    n = 4096
    finite = []
    if what == "gather":
        comm = qcomm.fsdp.DeltaAllGather()
        for call in range(4):
            out = torch.empty(world * n)
            inp = out[rank * n:(rank + 1) * n]
            inp.copy_(torch.randn(n, generator=g))
            if call == 1 and rank == 0:
                inp[7] = float("inf")
            comm(out, inp, dist.group.WORLD)
            finite.append([torch.isfinite(c).all().item() for c in out.chunk(world)])
    else:
        comm = qcomm.fsdp.ErrorFeedbackReduceScatter()
        for call in range(4):
            inp = torch.randn(world * n, generator=g)
            if call == 1 and rank == 0:
                inp[n + 7] = float("inf")  # rank 0's contribution to rank 1's chunk
            out = torch.empty(n)
            comm(out, inp, dist.group.WORLD, op=dist.ReduceOp.SUM)
            finite.append(torch.isfinite(out).all().item())
    return finite


def test_deltas_recover_after_non_finite_weights():
    out = run_ranks(_poison_once, 2, "gather", backend="gloo", env=W4)
    for rank in range(2):  # rank 0's shard is non-finite on call 1 only, on every rank
        assert out[rank] == [[True, True], [False, True], [True, True], [True, True]], out


def test_error_feedback_recovers_after_non_finite_gradients():
    out = run_ranks(_poison_once, 2, "scatter", backend="gloo", env={"QCOMM_RS_BITS": "4"})
    assert out[1] == [True, False, True, True], out  # GradScaler sees the overflow once
    assert out[0] == [True, True, True, True], out


# ------------------------------------------------------------------ CUDA (GPU machines)


def _stateful_on(rank, world, device: str):
    """Three delta gathers and three error-feedback reduce-scatters on ``device``."""
    g = torch.Generator().manual_seed(rank)
    n = 3000  # not a multiple of the bucket: the tail bucket too
    gather, scatter = qcomm.fsdp.DeltaAllGather(), qcomm.fsdp.ErrorFeedbackReduceScatter()
    outs = []
    for _ in range(3):
        full = torch.empty(world * n, device=device)
        shard = full[rank * n:(rank + 1) * n]
        shard.copy_(torch.randn(n, generator=g))
        gather(full, shard, dist.group.WORLD)
        grad = torch.randn(world * n, generator=g).to(device)
        reduced = torch.empty(n, device=device)
        scatter(reduced, grad, dist.group.WORLD, op=dist.ReduceOp.AVG)
        outs += [full.cpu(), reduced.cpu()]
    return outs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/device_check.sh)")
def test_stateful_collectives_same_bits_on_cuda_and_cpu():
    """Triton kernels on CUDA tensors and the torch path on CPU tensors give the same
    bytes, so the reconstruction and the residuals (state kept across calls) agree."""
    env = {"QCOMM_AG_BITS": "4", "QCOMM_RS_BITS": "4"}
    cpu = run_ranks(_stateful_on, 2, "cpu", backend="gloo", env=env)
    gpu = run_ranks(_stateful_on, 2, "cuda", backend="gloo", env=env)
    for rank in range(2):
        for k, (a, b) in enumerate(zip(cpu[rank], gpu[rank], strict=True)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (rank, k)
