"""The "qcomm" backend through torch's own entry points (2 and 4 processes).

Every entry point that reaches an all-gather, reduce-scatter or all-reduce is called,
both method-name generations and the coalesced and list forms; exact paths are
compared bit for bit with a plain gloo group built in the same processes.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from conftest import make as make_input
from conftest import run_ranks
from torch.distributed import ReduceOp

import qcomm
from qcomm.process_group import QcommProcessGroup

pytestmark = pytest.mark.slow

N = 2048  # >= min_numel: compressed


make = functools.partial(make_input, spread=False)  # every rank's values one N(0, 1)


def _entry_points_body(rank, world):
    pg = dist.group.WORLD
    assert isinstance(pg, QcommProcessGroup) and dist.get_backend() == "qcomm"
    gloo = dist.new_group(backend="gloo")
    x = make(rank, N)
    # all-gather: flat (both generations), list, coalesced; identical across ranks
    outs = {}
    for name in ("all_gather_single", "_allgather_base"):
        out = torch.empty(world * N)
        getattr(pg, name)(out, x, dist.distributed_c10d.AllgatherOptions()).wait()
        outs[name] = out
    lst = [torch.empty(N) for _ in range(world)]
    dist.all_gather(lst, x)
    outs["list"] = torch.cat(lst)
    o1, o2 = torch.empty(world * N), torch.empty(world * N)
    for name in ("allgather_into_tensor_coalesced", "all_gather_single_coalesced"):
        getattr(pg, name)([o1, o2], [x, 2 * x], dist.distributed_c10d.AllgatherOptions()).wait()
        outs[name] = torch.cat([o1, o2])
    ref = torch.empty(world * N)
    dist.all_gather_into_tensor(ref, x, group=gloo)
    for name, out in outs.items():
        assert (out[: world * N] - ref).abs().max() < 0.1, name
    # reduce-scatter: flat (both generations), list, coalesced, AVG and PREMUL_SUM
    big = make(rank, world * N, salt=1)
    want = torch.empty(N)
    dist.reduce_scatter_tensor(want, big, group=gloo)
    for name in ("reduce_scatter_single", "_reduce_scatter_base"):
        o = torch.empty(N)
        opts = dist.distributed_c10d.ReduceScatterOptions()
        getattr(pg, name)(o, big, opts).wait()
        assert (o - want).abs().max() < 0.2, name
    o = torch.empty(N)
    dist.reduce_scatter(o, list(big.chunk(world)))
    assert (o - want).abs().max() < 0.2
    dist.reduce_scatter_tensor(o, big, op=ReduceOp.AVG)
    assert (o - want / world).abs().max() < 0.1
    dist.reduce_scatter_tensor(o, big, op=dist._make_nccl_premul_sum(0.5))
    assert (o - want / 2).abs().max() < 0.1
    oa, ob = torch.empty(N), torch.empty(N)
    pg.reduce_scatter_tensor_coalesced([oa, ob], [big, big], dist.distributed_c10d.
                                       ReduceScatterOptions()).wait()
    assert (oa - want).abs().max() < 0.2 and (ob - want).abs().max() < 0.2
    # all-reduce: plain, coalesced, async
    t = make(rank, N + 1)
    tw = t.clone()
    dist.all_reduce(tw, group=gloo)
    dist.all_reduce(t)
    assert (t - tw).abs().max() < 0.2
    ts = [make(rank, N), make(rank, N, salt=2)]
    dist.all_reduce_coalesced(ts)
    work = dist.all_reduce(ts[0], async_op=True)
    work.wait()
    # torch's coalescing manager: fast path (our *_coalesced) and the device path
    # (_start_coalescing / _end_coalescing around each op)
    with dist._coalescing_manager():
        dist.all_gather_into_tensor(o1, x)
        dist.all_gather_into_tensor(o2, x)
    assert not torch.equal(o1, o2), "seeds did not advance between coalesced calls"
    assert (o1 - ref).abs().max() < 0.1
    with dist._coalescing_manager(device=torch.device("cpu")):
        dist.all_reduce(ts[1])
    # functional collectives (DTensor.full_tensor, torch.compile'd code) reach C++ names
    import torch.distributed._functional_collectives as funcol

    gathered = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, pg))
    assert (gathered - ref).abs().max() < 0.1
    s = qcomm.stats()
    assert s["all_gather"].calls_compressed >= 9 and s["all_reduce"].calls_compressed >= 5
    return {"ag": outs["all_gather_single"], "ar": t}


@pytest.mark.parametrize("world", [2, 4])
def test_entry_points_compress_and_agree(world):
    results = run_ranks(_entry_points_body, world)
    for r in results[1:]:
        assert torch.equal(r["ag"], results[0]["ag"]) and torch.equal(r["ar"], results[0]["ar"])


def _same(rank, world, run):
    """``run(group)`` on qcomm and on a plain gloo group gives bit-identical tensors."""
    gloo = dist.new_group(backend="gloo")
    a, b = run(dist.group.WORLD), run(gloo)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), (x, y)


def _passthrough_body(rank, world):
    x = make(rank, 4096)
    xi = (x * 100).to(torch.int32)

    def collectives(group):
        res = []
        t = x.clone()
        dist.broadcast(t, src=1, group=group)
        res.append(t)
        for tensor, op in ((xi, ReduceOp.SUM), (x, ReduceOp.MAX), (x, ReduceOp.MIN),
                           (x.double(), ReduceOp.SUM), (x[:100], ReduceOp.SUM),
                           (xi, ReduceOp.BAND), (x, ReduceOp.PRODUCT)):
            t = tensor.clone()
            dist.all_reduce(t, op=op, group=group)
            res.append(t)
        for tensor in (xi, x.double(), x[:100], (x > 0).to(torch.uint8)):
            out = torch.empty(world * tensor.numel(), dtype=tensor.dtype)
            dist.all_gather_into_tensor(out, tensor, group=group)
            res.append(out)
            out = torch.empty(tensor.numel() // world, dtype=tensor.dtype)
            if tensor.dtype != torch.uint8:
                dist.reduce_scatter_tensor(out, tensor, group=group)
                res.append(out)
        t = x.clone()
        dist.reduce(t, dst=0, group=group)
        res.append(t)
        out = torch.empty(4096)
        dist.all_to_all_single(out, x, group=group)
        res.append(out)
        outs = [torch.empty(4096 // world) for _ in range(world)]
        try:
            dist.all_to_all(outs, list(x.chunk(world)), group=group)
            res.extend(outs)
        except RuntimeError as e:  # gloo before torch 2.12 has no list all_to_all
            if "does not support alltoall" not in str(e):
                raise
            res.append(torch.tensor(-1.0))  # the same marker on both sides
        gathered = [torch.empty(4096) for _ in range(world)] if rank == 0 else None
        dist.gather(x, gathered, dst=0, group=group)
        res.extend(gathered or [])
        out = torch.empty(4096)
        dist.scatter(out, [x + r for r in range(world)] if rank == 0 else None, src=0,
                     group=group)
        res.append(out)
        # unequal list forms go to the inner group as they are (gloo refuses them)
        lst = [torch.empty(1500 + 600 * r) for r in range(world)]
        with pytest.raises(RuntimeError, match="invalid tensor size"):
            dist.all_gather(lst, make(rank, lst[rank].numel(), salt=3), group=group)
        dist.barrier(group=group)
        if world >= 2:
            t = x.clone() if rank == 0 else torch.empty(4096)
            if rank == 0:
                dist.send(t, dst=1, group=group)
            elif rank == 1:
                dist.recv(t, src=0, group=group)
            res.append(t)
        return res

    _same(rank, world, collectives)
    return True


def test_passthrough_bit_equal_to_gloo():
    run_ranks(_passthrough_body, 2)


def _subgroups_body(rank, world, tmp):
    from torch.distributed.device_mesh import init_device_mesh

    sub = dist.new_group(ranks=[0, 1])
    if rank in (0, 1):
        assert isinstance(sub, QcommProcessGroup) and sub.size() == 2
        t = make(rank, N)
        dist.all_reduce(t, group=sub)
        assert qcomm.stats(sub)["all_reduce"].calls_compressed == 1
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    for dim in ("rep", "shard"):
        g = mesh.get_group(dim)
        assert isinstance(g, QcommProcessGroup), type(g)
        out = torch.empty(2 * N)
        dist.all_gather_into_tensor(out, make(rank, N), group=g)
    # wrap: a qcomm group over an existing gloo group
    gloo = dist.new_group(backend="gloo")
    wrapped = qcomm.wrap(gloo, qcomm.CommConfig(all_gather=qcomm.QuantConfig(bits=4)))
    out = torch.empty(world * N)
    dist.all_gather_into_tensor(out, make(rank, N), group=wrapped)
    assert qcomm.stats(wrapped)["all_gather"].calls_compressed == 1
    assert dist.get_process_group_ranks(wrapped) == list(range(world))
    # destroy and re-initialise the whole world
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(tmp, "store2"), world)
    dist.init_process_group("qcomm", store=store, rank=rank, world_size=world)
    t = make(rank, N)
    dist.all_reduce(t)
    return t


def test_subgroups_mesh_wrap_reinit(tmp_path):
    results = run_ranks(_subgroups_body, 4, str(tmp_path))
    assert all(torch.equal(r, results[0]) for r in results)
