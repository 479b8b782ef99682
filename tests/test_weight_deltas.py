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


def _gathered_and_true(model):
    """(what the ranks compute with, the exact full weights) as flat fp32 vectors."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.unshard()  # the all-gather the forward uses: through DeltaAllGather
    seen = torch.cat([p.detach().float().reshape(-1).clone() for p in model.parameters()])
    for m in mods:
        m.reshard()
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
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    if deltas:
        comms = qcomm.fsdp.quantize_weight_deltas(model)
    else:
        comms = [_PlainGather() for _ in qcomm.fsdp.fsdp_modules(model)]
        for m, comm in zip(qcomm.fsdp.fsdp_modules(model), comms, strict=True):
            m.set_custom_all_gather(comm)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    errors = []
    seen, true = _gathered_and_true(model)
    errors.append(_rel(seen, true))
    seen, true = _gathered_and_true(model)  # unchanged weights: the residual is sent
    errors.append(_rel(seen, true))
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen, true = _gathered_and_true(model)
        errors.append(_rel(seen, true))
    group = dist.group.WORLD
    stats = qcomm.stats(group)["all_gather"]
    return {"errors": errors, "seen": seen, "calls": stats.calls_compressed,
            "wire": stats.wire_bytes, "ref_nbytes": sum(c.ref_nbytes() for c in comms),
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
    assert delta[0]["ref_nbytes"] >= 4 * delta[0]["params"]


def test_deltas_exact_when_all_gather_is_off():
    out = run_ranks(_track, 2, True, backend="gloo", env={"QCOMM_AG_BITS": "off"})
    assert all(e == 0.0 for e in out[0]["errors"]), out[0]["errors"]
    assert out[0]["calls"] == 0 and out[0]["ref_nbytes"] == 0


def _train_on_qcomm(rank, world):
    """Through the "qcomm" backend (its config, seeds and stats), bf16 parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    qcomm.fsdp.quantize_weight_deltas(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(model(x).float().view(-1, VOCAB), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.unshard()
    seen = torch.cat([p.detach().float().reshape(-1).clone() for p in model.parameters()])
    dtypes = {p.dtype for p in model.parameters()}
    return {"losses": losses, "seen": seen, "dtypes": dtypes,
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
