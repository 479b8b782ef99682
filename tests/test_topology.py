"""Topology and purpose: two-level collectives across simulated nodes (node ids through
``QCOMM_NODE``, 4 ranks on one machine), exact groups inside a node, fallbacks for odd
topologies, and exact state dicts, checkpoints, non-data-parallel mesh dimensions and
``qcomm.exact()``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import make, run_ranks
from test_collectives import Q8, _compressed_body

import qcomm
import qcomm.fsdp as qcomm_fsdp
from qcomm import CommConfig, QuantConfig
from qcomm.layout import DESC_NBYTES, packed_nbytes

pytestmark = pytest.mark.slow


def _nodes(spec: str) -> list[dict]:
    return [{"QCOMM_NODE": node} for node in spec.split(",")]


def _two_level_body(rank, world, dtype, n, piece):
    qcomm.pieces.PIECE = piece  # pieces of whole buckets: the same flat bound
    res = _compressed_body(rank, world, Q8, dtype, n)  # within the flat bound, see there
    state = qcomm.driver.group_state(None)
    res["plan"] = state.plan
    # one more all-gather, its bytes per level: N - 1 = 1 payload across, and the N = 2
    # payloads of this rank's local index to the node's other rank
    qcomm.stats(reset=True)
    qcomm.all_gather_into_tensor(torch.empty(world * n, dtype=dtype), make(rank, n, dtype))
    s = qcomm.stats()["all_gather"]
    res["bytes"] = (s.inter_node_bytes, s.intra_node_bytes)
    # weight differences in two levels: each gather of the same shards refines the
    # reconstruction every rank holds alike
    gather = qcomm_fsdp.DeltaAllGather(QuantConfig(bits=4, bucket_size=128))
    shard, truth = make(rank, n, dtype, salt=7), torch.cat([make(r, n, dtype, salt=7)
                                                            for r in range(world)])
    res["delta"], res["delta_err"] = [], []
    for _ in range(3):
        out = torch.empty(world * n, dtype=dtype)
        gather(out, shard, dist.group.WORLD)
        res["delta"].append(out)
        res["delta_err"].append((out - truth).abs().max().item())
    return res


@pytest.mark.parametrize("nodes, piece", [("a,a,b,b", 1 << 19), ("a,b,b,a", 1024)],
                         ids=["node-major", "interleaved-pieces"])
def test_two_level_within_bound_and_identical(nodes, piece):
    """2 nodes x 2 ranks, ranks in node-major or any order: all-gather, reduce-scatter
    (SUM, AVG, PREMUL_SUM) and all-reduce within the codec's bound of the exact result
    (the flat bound holds: a node sum's bucket range is at most the sum of its parts'),
    every rank's all-gather and all-reduce the same bytes, 1 payload across the link
    per all-gather where flat sends 3 (2 of them across). Pieces of 1024 elements run
    the pipeline over 3 pieces (one of them partial)."""
    n = 3001
    results = run_ranks(_two_level_body, 4, torch.float32, n, piece, backend="gloo",
                        env=_nodes(nodes))
    sizes = [min(piece, n - a) for a in range(0, n, piece)]
    payloads = sum(packed_nbytes(m, Q8) for m in sizes)
    for r in results:
        assert r["plan"] == "two_level"
        assert torch.equal(r["ag"], results[0]["ag"]) and torch.equal(r["ar"], results[0]["ar"])
        # and the call's descriptor, to each of the 3 peers (1 on this node)
        assert r["bytes"] == (payloads + 2 * DESC_NBYTES, 2 * payloads + DESC_NBYTES)
        assert all(torch.equal(a, b) for a, b in zip(r["delta"], results[0]["delta"], strict=True))
        first, _, last = r["delta_err"]
        assert last < first / 8, r["delta_err"]


def _fallback_body(rank, world):
    group = dist.group.WORLD
    state = qcomm.driver.group_state(group)
    x = make(rank, 4096)
    out = torch.empty(world * 4096)
    qcomm.all_gather_into_tensor(out, x, group)
    want = torch.cat([make(r, 4096) for r in range(world)])
    steps = torch.cat([qcomm.oracle.minmax_steps(make(r, 4096), Q8) for r in range(world)])
    assert ((out - want).abs() <= steps * 1.001 + 1e-6).all()
    res = {"plan": state.plan, "why": state.plan_why,
           "compressed": qcomm.stats(group)["all_gather"].calls_compressed}
    # a group of ranks that share a node: exact (bit for bit what gloo gives), and
    # compressed when QCOMM_INTRA_NODE=compress says so
    node = [r for r in range(world) if state.topology.keys[r] == state.topology.keys[rank]]
    if len(node) > 1:
        # new_group is collective: every rank makes every node's group
        groups = {tuple(m): dist.new_group(list(m), backend="gloo")
                  for m in state.topology.members}
        inner = groups[tuple(node)]
        y = torch.empty(len(node) * 4096)
        qcomm.all_gather_into_tensor(y, x, inner)
        gloo = torch.empty_like(y)
        dist.all_gather_into_tensor(gloo, x, group=inner)
        res["intra_exact"] = torch.equal(y, gloo)
        forced = qcomm.wrap(inner, CommConfig(intra_node="compress"))
        qcomm.all_gather_into_tensor(y, x, forced)
        res["intra_forced"] = (qcomm.stats(forced)["all_gather"].calls_compressed,
                               qcomm.driver.group_state(forced).plan)
    flat = qcomm.wrap(group, CommConfig(topology="flat"))
    qcomm.all_gather_into_tensor(out, x, flat)
    res["flat"] = qcomm.driver.group_state(flat).plan
    return res


def test_fallbacks_two_nodes_of_two():
    """On 2 x 2: a group inside one node is exact (and compressed when forced), and
    QCOMM_TOPOLOGY=flat runs one level."""
    for r in run_ranks(_fallback_body, 4, backend="gloo", env=_nodes("a,a,b,b")):
        assert r["intra_exact"] and r["intra_forced"] == (1, "flat") and r["flat"] == "flat"


def test_fallbacks_uneven_nodes():
    """3 ranks on one node and 1 on another: flat, with the reason, still correct."""
    for r in run_ranks(_fallback_body, 4, backend="gloo", env=_nodes("a,a,a,b")):
        assert r["plan"] == "flat" and "unequal" in r["why"] and r["compressed"] == 1


def test_ranks_that_disagree_on_the_topology_get_a_clear_error():
    """Ranks started with different QCOMM_TOPOLOGY fail group creation naming it."""
    from test_collectives import _agree_in_threads

    errors = _agree_in_threads(dist.HashStore(), CommConfig(), CommConfig(topology="flat"))
    assert set(errors) == {0, 1} and "topology='flat'" in errors[0]


# ---------------------------------------------------------------------------------
# Purpose: what must not lose precision goes exact


def _fsdp2(seed=0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _exact_gather(world):
    """A function of a DTensor sharded on dim 0: its full value, gathered exactly
    through a plain gloo group (the truth to compare qcomm's exact paths with)."""
    gloo = dist.new_group(backend="gloo")

    def gathered(t):
        local = t.to_local().detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=gloo)
        return torch.cat(parts)[: t.shape[0]].reshape(t.shape)

    return gathered


def _state_dict_body(rank, world, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    model = _fsdp2()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):  # training: compressed all-gathers and reduce-scatters
        g = torch.Generator().manual_seed(step * world + rank)
        model(torch.randn(8, 256, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    trained = qcomm.stats()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, opt, options=full)
    # the truth: each shard exactly, gathered through a plain gloo group
    gathered = _exact_gather(world)
    truth = {name: gathered(p) for name, p in model.named_parameters()}
    moments = {name: gathered(opt.state[p]["exp_avg"]) for name, p in model.named_parameters()}
    # with cpu_offload, rank 0 holds the full state dicts (the others get empty ones)
    same_sd = all(torch.equal(sd[k], truth[k]) for k in truth) if rank == 0 else True
    same_osd = (all(torch.equal(osd["state"][k]["exp_avg"], moments[k]) for k in moments)
                if rank == 0 else True)
    same_full_tensor = all(torch.equal(p.full_tensor(), truth[k])
                           for k, p in model.named_parameters())
    # DCP: save the sharded state, load it into a fresh model, compare shards exactly
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=ckpt_dir)
    fresh = _fsdp2(seed=1)
    loaded = {"model": get_model_state_dict(fresh)}
    dcp.load(loaded, checkpoint_id=ckpt_dir)
    set_model_state_dict(fresh, loaded["model"])
    same_dcp = all(torch.equal(a.to_local(), b.to_local())
                   for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    after = qcomm.stats()
    return {"sd": same_sd, "osd": same_osd, "full_tensor": same_full_tensor, "dcp": same_dcp,
            "trained": trained["all_gather"].calls_compressed,
            "rs": trained["reduce_scatter"].calls_compressed,
            "gathers_after": after["all_gather"].calls_compressed}


def test_state_dicts_and_checkpoints_are_exact(tmp_path):
    """FSDP2 over qcomm: training gathers compressed; the full model and optimizer state
    dicts, DTensor.full_tensor() and a DCP save/load round trip bit for bit exact."""
    results = run_ranks(_state_dict_body, 2, str(tmp_path / "ckpt"))
    for r in results:
        assert r["trained"] > 0 and r["rs"] > 0, "training collectives were not compressed"
        assert r["sd"], "full model state dict lost precision"
        assert r["osd"], "full optimizer state dict lost precision"
        assert r["full_tensor"], "DTensor.full_tensor() lost precision"
        assert r["dcp"], "DCP round trip lost precision"
        assert r["gathers_after"] == r["trained"], "a state-dict gather was compressed"


def _compiled_purpose_body(rank, world):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Replicate

    model = _fsdp2()
    model(torch.randn(8, 256)).square().mean().backward()  # compressed training calls
    truth = _exact_gather(world)
    before = qcomm.stats()["all_gather"].calls_compressed
    full = torch.compile(lambda p: p.full_tensor() + 0)  # Inductor
    replicate = torch.compile(lambda p: p.redistribute(p.device_mesh, [Replicate()])
                              .to_local() * 1, backend="aot_eager")
    res = {}
    for name, p in model.named_parameters():
        res[f"full_tensor {name}"] = torch.equal(full(p.data), truth(p))
        res[f"redistribute {name}"] = torch.equal(replicate(p.data), truth(p))
    res["dtensor_compressed"] = qcomm.stats()["all_gather"].calls_compressed - before
    # and compile alone sends nothing exact: a functional all-gather on the group
    # itself, compiled, still compresses
    gather = torch.compile(lambda t: funcol.all_gather_tensor(t, 0, dist.group.WORLD) + 0)
    out = gather(make(rank, 4096))
    res["funcol_compressed"] = qcomm.stats()["all_gather"].calls_compressed - before
    res["funcol_err"] = ((out - torch.cat([make(r, 4096) for r in range(world)])).norm()
                         / out.norm()).item()
    return res


def test_dtensor_redistribution_is_exact_under_compile():
    """DTensor.full_tensor() and redistribute(Replicate) inside torch.compile (no Python
    frame of DTensor is left when the collective runs) stay bit for bit exact: they
    reach the group's exact twin by name; a compiled functional all-gather on the group
    itself compresses."""
    # processes of its own: what torch.compile leaves behind (compiled graphs that
    # name this call's groups) would meet a later call's groups (tests/test_hooks.py)
    for r in run_ranks(_compiled_purpose_body, 2, timeout=240, fresh=True):
        flags = {k: v for k, v in r.items() if k.startswith(("full", "redis"))}
        assert flags and all(flags.values()), r
        assert r["dtensor_compressed"] == 0, r
        assert r["funcol_compressed"] == 1 and 0 < r["funcol_err"] < 0.02, r


def _mesh_body(rank, world):
    res = {}
    x = make(rank, 4096)
    # DeviceMesh makes each dimension's group with new_group(..., group_desc="mesh_<name>")
    # (a dimension spanning the whole world is the default group itself, whose DTensor
    # collectives go exact by their caller)
    for dim in ("dp", "tp"):
        group = dist.new_group(list(range(world)), backend="qcomm", group_desc=f"mesh_{dim}")
        t = x.clone()
        dist.all_reduce(t, group=group)
        res[dim] = qcomm.stats(group)["all_reduce"].calls_compressed
        res[dim + "_exact"] = torch.equal(t, sum(make(r, 4096) for r in range(world)))
    with qcomm.exact():  # a direct call inside the block: exact, on the default group
        out = torch.empty(world * 4096)
        qcomm.all_gather_into_tensor(out, x)
    res["exact_block"] = torch.equal(out, torch.cat([make(r, 4096) for r in range(world)]))
    return res


def test_non_data_parallel_mesh_dims_and_exact_block():
    """A DeviceMesh's "tp" dimension sends exact, its "dp" dimension compresses;
    ``with qcomm.exact():`` sends a compressible call exact."""
    for r in run_ranks(_mesh_body, 2):
        assert (r["dp"], r["tp"], r["tp_exact"], r["exact_block"]) == (1, 0, True, True), r


def test_purpose_names_the_caller():
    from qcomm import purpose

    assert purpose.exact_caller() is None
    assert purpose.mesh_dim_reason("mesh_tp") and purpose.mesh_dim_reason("mesh_cp")
    assert purpose.mesh_dim_reason("mesh_model")
    for desc in ("mesh_dp", "mesh_dp_shard_cp", "mesh_replicate", "mesh_rep", "mesh_shard",
                 "mesh_dim_0", "default_pg"):
        assert purpose.mesh_dim_reason(desc) is None, desc
    state = qcomm.driver.GroupState(CommConfig(), None)
    assert purpose.may_compress(state)
    with purpose.exact():
        assert not purpose.may_compress(state)
    assert purpose.may_compress(state)



def test_local_major_order_literal():
    """Ranks "a,b,b,a": nodes a = (0, 3), b = (1, 2). The two-level exchanges' rows go
    by (local index, node): 0 (a, local 0), 1 (b, 0), 3 (a, 1), 2 (b, 1); rank g sits at
    local_of[g] * nodes + node_of[g]."""
    from qcomm.topology import Topology

    topo = Topology(keys=("a", "b", "b", "a"), rank=2)
    assert topo.members == ((0, 3), (1, 2))
    assert topo.local_major == (0, 1, 3, 2)
    assert [topo.local_major.index(g) for g in range(4)] == [
        topo.local_of[g] * topo.nodes + topo.node_of[g] for g in range(4)] == [0, 1, 3, 2]
