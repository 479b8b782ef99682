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
from qcomm.layout import packed_nbytes

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


def _track(rank, world, deltas: bool, state=qcomm.fsdp.DEFAULT_STATE):
    """On plain gloo (exact full_tensor() for the truth; qcomm configured from W4)."""
    model, opt = _sharded()
    if deltas:
        comms = qcomm.fsdp.quantize_weight_deltas(model, state=state)
    else:
        comms = [_PlainGather() for _ in qcomm.fsdp.fsdp_modules(model)]
        for m, comm in zip(qcomm.fsdp.fsdp_modules(model), comms, strict=True):
            m.set_custom_all_gather(comm)
    qcomm.stats(dist.group.WORLD, reset=True)
    errors = []
    seen, true = _gathered_and_true(model)
    errors.append(_rel(seen, true))
    seen, true = _gathered_and_true(model)  # unchanged weights: the residual is sent
    errors.append(_rel(seen, true))
    for step in range(STEPS):
        _step(model, opt, rank, step)
        seen, true = _gathered_and_true(model)
        errors.append(_rel(seen, true))
    stats = qcomm.stats(dist.group.WORLD)["all_gather"]
    return {"errors": errors, "seen": seen, "calls": stats.calls_compressed,
            "payload": stats.wire_bytes - stats.control_bytes,
            "state_nbytes": sum(c.state_nbytes() for c in comms),
            "params": sum(p.numel() for p in model.parameters())}


# (state, least and most bytes of it per parameter on each rank: fp32 parameters)
STATES = {"float32": ("float32", 4.0, 4.0), "dtype": ("dtype", 4.0, 4.0),
          # 8-bit codes and 8 bytes of meta per 128-element bucket; 32-byte headers
          "8bit": (qcomm.fsdp.DEFAULT_STATE, 1.0625, 1.07)}


def _track_all(rank, world):
    """Plain 4-bit gathers, then differences with each kind of state, fresh models."""
    out = {"plain": _track(rank, world, False)}
    for name, (state, _, _) in STATES.items():
        out[name] = _track(rank, world, True, state)
    return out


def test_deltas_track_weights_far_closer_than_plain_4bit():
    runs = run_ranks(_track_all, 2, backend="gloo", env=W4, timeout=300)
    plain = runs[0]["plain"]
    e_plain = plain["errors"]
    print("plain 4-bit relative error per gather:", [f"{e:.4f}" for e in e_plain])
    for name, (_, least, most) in STATES.items():
        delta = runs[0][name]
        e_delta = delta["errors"]
        print(f"delta 4-bit relative error per gather, {name} state:",
              [f"{e:.4f}" for e in e_delta])
        # the first gather is a plain one (the reconstruction starts at zero)
        assert abs(e_delta[0] - e_plain[0]) < 1e-6, (name, e_delta[0], e_plain[0])
        assert 0.03 < e_plain[0] < 0.2, e_plain  # 4-bit: a few percent, every gather
        # the second sends the first's residual: 4 more bits of it
        assert e_delta[1] < e_delta[0] / 8, (name, e_delta)
        # after every optimizer step the error stays a fraction of plain 4-bit's
        for step, (ed, ep) in enumerate(zip(e_delta[2:], e_plain[2:], strict=True)):
            assert ed < ep / 8, (name, step, ed, ep)
        # every rank computes with the same weights
        assert torch.equal(delta["seen"], runs[1][name]["seen"]), name
        # same payloads on the wire; the price is the reconstruction, the unsharded size
        assert delta["calls"] == plain["calls"] > 0, name
        assert delta["payload"] == plain["payload"], name
        per_param = delta["state_nbytes"] / delta["params"]
        assert least <= per_param <= most, (name, per_param)
    # an 8-bit state rounds off at most half a step of its bucket, which the next
    # difference sends: the weights stay within a small factor of the fp32 state's
    # (measured 0.07% against 0.05%)
    assert max(runs[0]["8bit"]["errors"][2:]) < 3 * max(runs[0]["float32"]["errors"][2:])


def test_deltas_exact_when_all_gather_is_off():
    out = run_ranks(_track, 2, True, backend="gloo", env={"QCOMM_AG_BITS": "off"})
    assert all(e == 0.0 for e in out[0]["errors"]), out[0]["errors"]
    assert out[0]["calls"] == 0 and out[0]["state_nbytes"] == 0


def _train_on_qcomm(rank, world):
    """Through the "qcomm" backend (its config, seeds and stats), bf16 parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model, opt = _sharded(MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32))
    comms = qcomm.fsdp.quantize_weight_deltas(model, state="dtype")
    losses = [_step(model, opt, rank, step) for step in range(STEPS)]
    mods = qcomm.fsdp.fsdp_modules(model)
    for m in mods:
        m.unshard()
    dtypes = {p.dtype for p in model.parameters()}  # unsharded: the compute dtype
    for m in mods:
        m.reshard()
    return {"losses": losses, "seen": _gathered(model), "dtypes": dtypes,
            "calls": qcomm.stats(dist.group.WORLD)["all_gather"].calls_compressed,
            "state": sum(c.state_nbytes() for c in comms),
            "params": sum(p.numel() for p in model.parameters())}


def test_deltas_on_the_qcomm_backend_with_bf16_params():
    """The reconstruction kept in the parameters' (compute) dtype: 2 bytes a parameter,
    rounded to nearest even alike on every rank, so every rank computes with the same
    bf16 weights."""
    out = run_ranks(_train_on_qcomm, 2, env=W4, timeout=240)
    assert out[0]["dtypes"] == {torch.bfloat16}
    assert torch.equal(out[0]["seen"].view(torch.int32), out[1]["seen"].view(torch.int32))
    assert 2.0 <= out[0]["state"] / out[0]["params"] < 2.1, out[0]
    assert out[0]["calls"] > 0
    assert out[0]["losses"][-1] < out[0]["losses"][0], out[0]["losses"]


def test_quantize_weight_deltas_needs_fsdp_modules():
    with pytest.raises(ValueError, match="no FSDP2 module"):
        qcomm.fsdp.quantize_weight_deltas(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="QuantConfig"):
        qcomm.fsdp.DeltaAllGather(config=4)
    with pytest.raises(TypeError, match="include must be a callable"):
        qcomm.fsdp.quantize_weight_deltas(nn.Linear(2, 2), include="layers")


@pytest.mark.parametrize("state, match", [
    ("bf16", "must be 'float32', 'dtype' or a qcomm.QuantConfig"),
    (8, "must be 'float32', 'dtype' or a qcomm.QuantConfig"),
    (qcomm.QuantConfig(bits=8), "must round to nearest")])
def test_bad_state_names_the_problem(state, match):
    with pytest.raises(ValueError, match=match):
        qcomm.fsdp.DeltaAllGather(state=state)
    with pytest.raises(ValueError, match=match):
        qcomm.fsdp.ErrorFeedbackReduceScatter(state=state)
    with pytest.raises(ValueError, match=match):  # before looking for modules
        qcomm.fsdp.quantize_weight_deltas(nn.Linear(2, 2), state=state)


# ------------------------------------------------------------------ PieceState


class _Scratch:
    """What PieceState needs of a driver call: scratch buffers by role."""

    def __init__(self):
        self.bufs = {}

    def buffer(self, role, numel, dtype, device):
        if role not in self.bufs or self.bufs[role].numel() < numel:
            self.bufs[role] = torch.empty(numel, dtype=dtype, device=device)
        return self.bufs[role][:numel]


def test_quantized_state_keeps_nearest_codes_and_drops_non_finite_buckets():
    """A quantized PieceState stores exactly quantize_rows' round-to-nearest bytes (the
    same on every rank), loads what they decode to, and zeroes the buckets of a
    non-finite value, nothing else."""
    from qcomm.codec import dequantize_rows, quantize_rows

    cfg = qcomm.fsdp.DEFAULT_STATE
    world, n, parts = 3, 1000, [(0, 512), (512, 1000)]  # two pieces, a partial bucket
    st = qcomm.fsdp.PieceState(cfg, world, n, torch.float32, torch.device("cpu"), parts)
    call = _Scratch()
    assert st.nbytes() == world * sum(packed_nbytes(b - a, cfg) for a, b in parts)
    assert torch.equal(st.subtract_row(call, 1, torch.ones(n)), torch.ones(n))  # zero at first
    x = torch.randn(world, n, generator=torch.Generator().manual_seed(0))
    x[2, 700] = float("inf")  # piece 1, local element 188: bucket 1 of that piece
    for p, (a, b) in enumerate(parts):
        rows = st.load(call, p, a, b)
        rows.copy_(x[:, a:b])
        st.store(p, rows)
    clean = x.clone()
    clean[2, 512 + 128:512 + 256] = 0.0
    for p, (a, b) in enumerate(parts):
        want = torch.empty(world, packed_nbytes(b - a, cfg), dtype=torch.uint8)
        quantize_rows(clean[:, a:b], cfg, [0] * world, out=want)
        decoded = torch.empty(world, b - a)
        dequantize_rows(want, b - a, torch.float32, cfg, out=decoded)
        assert torch.equal(st.load(call, p, a, b), decoded)
        if p == 0:
            assert torch.equal(st.data[p], want)  # byte for byte where all is finite
    got = torch.cat([st.load(call, p, a, b).clone() for p, (a, b) in enumerate(parts)], 1)
    assert torch.equal(got[2, 640:768], torch.zeros(128))
    # nearest: within half a step (1/255 of a bucket's range) of what was stored
    step = (clean.max() - clean.min()) / 255
    assert ((got - clean).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(st.subtract_row(call, 2, got[2].clone()), torch.zeros(n))


def test_dtype_state_rounds_to_nearest_even_and_zeroes_non_finite():
    world, n = 2, 300
    st = qcomm.fsdp.PieceState("dtype", world, n, torch.bfloat16, torch.device("cpu"),
                               [(0, n)])
    call = _Scratch()
    assert st.nbytes() == world * n * 2
    x = torch.randn(world, n, generator=torch.Generator().manual_seed(1))
    x[0, 5] = float("nan")
    rows = st.load(call, 0, 0, n)
    rows.copy_(x)
    st.store(0, rows)
    want = x.nan_to_num(nan=0.0).to(torch.bfloat16)  # torch's cast: round to nearest even
    assert torch.equal(st.data.view(torch.int16), want.view(torch.int16))
    assert torch.equal(st.subtract_row(call, 0, want[0].float()), torch.zeros(n))


# ------------------------------------------------------------------ error feedback

EF_CALLS = 16


def _repeat_reduce_scatter(rank, world, state):
    """The same gradient reduce-scattered EF_CALLS times (``state``: error feedback with
    that state; None: plain qcomm reduce-scatters): the mean of the outputs."""
    from qcomm.collectives import reduce_scatter_tensor

    g = torch.Generator().manual_seed(rank)
    inp = torch.randn(world * 4096, generator=g) * torch.linspace(0.01, 1, world * 4096)
    out = torch.empty(4096)
    comm = None if state is None else qcomm.fsdp.ErrorFeedbackReduceScatter(state=state)
    total = torch.zeros(4096)
    for _ in range(EF_CALLS):
        if comm is not None:
            comm(out, inp, dist.group.WORLD, op=dist.ReduceOp.AVG)
        else:
            reduce_scatter_tensor(out, inp, dist.ReduceOp.AVG)
        total += out
    exact = torch.empty(4096)
    dist.reduce_scatter_tensor(exact, inp.clone(), dist.ReduceOp.SUM)  # gloo: exact
    return {"mean": total / EF_CALLS, "exact": exact / world,
            "state": 0 if comm is None else comm.state_nbytes(), "inp": inp}


# residual state: its bytes on each rank (2 ranks, 4096-element chunks)
EF_STATES = {"float32": ("float32", 4 * 2 * 4096),
             "8bit": (qcomm.fsdp.DEFAULT_STATE,
                      2 * packed_nbytes(4096, qcomm.fsdp.DEFAULT_STATE))}


def _repeat_all(rank, world):
    return {name: _repeat_reduce_scatter(rank, world, state)
            for name, state in [("plain", None)] + [(k, v[0]) for k, v in EF_STATES.items()]}


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_error_feedback_cancels_gradient_quantization_error(rounding):
    env = {"QCOMM_RS_BITS": "2", "QCOMM_RS_ROUNDING": rounding}
    runs = run_ranks(_repeat_all, 2, backend="gloo", env=env)
    for rank in range(2):
        plain = runs[rank]["plain"]
        e_plain = _rel(plain["mean"], plain["exact"])
        for name, (_, nbytes) in EF_STATES.items():
            fed = runs[rank][name]
            assert torch.equal(fed["exact"], plain["exact"])
            e_fed = _rel(fed["mean"], fed["exact"])
            print(f"{rounding} rank {rank}: mean of {EF_CALLS} 2-bit reduce-scatters, "
                  f"relative error {e_plain:.4f} plain, {e_fed:.4f} with error feedback "
                  f"({name} residuals)")
            # nearest: the plain error repeats every call; stochastic: it averages down
            # as 1/sqrt(K). With feedback, the sum of K outputs is off by one residual:
            # 1/K (an 8-bit residual adds its own rounding, 1/255 of a residual's range)
            # (measured: nearest 0.45-0.48 plain, 0.030-0.032 fed; stochastic 0.16-0.17,
            # 0.059-0.064, either residual state)
            assert e_fed < e_plain / (8 if rounding == "nearest" else 2), (name, e_plain, e_fed)
            if name != "float32":  # the residual's own rounding costs little
                assert e_fed < 1.1 * _rel(runs[rank]["float32"]["mean"], fed["exact"]), name
            assert fed["state"] == nbytes, (name, fed["state"])  # the unsharded size
            assert torch.equal(fed["inp"], plain["inp"])  # inputs never written


def _residuals(rank, world, dtype):
    """Two error-feedback reduce-scatters (round to nearest, fp32 residuals); after each,
    the residual rows the state keeps against what the oracle says each payload left out."""
    from qcomm import oracle

    cfg = qcomm.QuantConfig(bits=4, rounding="nearest")
    comm = qcomm.fsdp.ErrorFeedbackReduceScatter(cfg, state="float32")
    n = 3000  # a partial last bucket
    g = torch.Generator().manual_seed(rank)
    owed = torch.zeros(world, n)
    bad = []
    for call in range(2):
        inp = (torch.randn(world * n, generator=g) * 2).to(dtype)
        comm(torch.empty(n, dtype=dtype), inp, dist.group.WORLD)
        (state,) = comm._states.values()
        for r, chunk in enumerate(inp.chunk(world)):
            if r == rank:  # the own chunk is never quantized: nothing owed
                continue
            owed[r] += chunk.float()
            sent = oracle.dequantize(oracle.quantize(owed[r].to(dtype), cfg, 0), cfg, n)
            owed[r] = (owed[r] - sent).nan_to_num(0.0, 0.0, 0.0)
        if not torch.equal(state.data, owed):
            bad.append((call, (state.data - owed).abs().max().item()))
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_feedback_keeps_what_each_payload_left_out(dtype):
    """Exact, on 3 ranks (rank 1's peers on both sides of its own chunk): the residual
    of peer r after a call is (residual + chunk r) minus the decode of its payload."""
    out = run_ranks(_residuals, 3, dtype, backend="gloo")
    assert out == [[], [], []], out


def _train_stateful(rank, world):
    model, opt = _sharded()
    # opted in per module: differences for the layers only, feedback for all
    picked = qcomm.fsdp.quantize_weight_deltas(
        model, include=lambda name, m: name.startswith("layers."))
    customs = [m._get_fsdp_state()._fsdp_param_group._all_gather_comm
               for m in qcomm.fsdp.fsdp_modules(model)]
    comms = qcomm.fsdp.feed_back_gradient_errors(model)
    losses = [_step(model, opt, rank, step) for step in range(STEPS)]
    return {"losses": losses, "seen": _gathered(model),
            "state": sum(c.state_nbytes() for c in comms),
            "picked": [sum(c is p for p in picked) for c in customs],
            "rs": qcomm.stats(dist.group.WORLD)["reduce_scatter"].calls_compressed}


def test_fsdp2_trains_with_deltas_and_error_feedback():
    env = {**W4, "QCOMM_RS_BITS": "4"}
    out = run_ranks(_train_stateful, 2, backend="gloo", env=env, timeout=240)
    assert torch.equal(out[0]["seen"], out[1]["seen"])
    # fsdp_modules order: the root first (left on the group's all-gather), then the layers
    assert out[0]["picked"] == [0] + [1] * (len(out[0]["picked"]) - 1), out[0]["picked"]
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pytest -m gpu)")
def test_stateful_collectives_same_bits_on_cuda_and_cpu():
    """Triton kernels on CUDA tensors and the torch path on CPU tensors give the same
    bytes, so the reconstruction and the residuals (state kept across calls) agree."""
    env = {"QCOMM_AG_BITS": "4", "QCOMM_RS_BITS": "4"}
    cpu = run_ranks(_stateful_on, 2, "cpu", backend="gloo", env=env)
    gpu = run_ranks(_stateful_on, 2, "cuda", backend="gloo", env=env)
    for rank in range(2):
        for k, (a, b) in enumerate(zip(cpu[rank], gpu[rank], strict=True)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (rank, k)
